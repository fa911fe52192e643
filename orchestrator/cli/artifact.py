"""`rpcfleet artifact build|list|show|verify|add`: the pinned rpc-server artifacts in the local cache."""

from __future__ import annotations

import argparse
from typing import Any

from orchestrator.cli import _output


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("artifact", help="build, list, show and verify rpc-server artifacts")
    sub = parser.add_subparsers(dest="artifact_command", metavar="ACTION", required=True)

    build = sub.add_parser(
        "build", help="build ggml-rpc-server from the same llama.cpp source as the installed llama-cpp-python"
    )
    build.add_argument("--backend", default="cpu", help="cpu, cuda, rocm, vulkan or metal (default: cpu)")
    build.add_argument(
        "--cmake-arg",
        dest="cmake_args",
        action="append",
        default=[],
        metavar="ARG",
        help="extra cmake argument, e.g. --cmake-arg=-DGGML_NATIVE=ON (repeatable)",
    )
    build.add_argument(
        "--cuda-arch",
        default=None,
        metavar="ARCH",
        help="cuda: the GPU architectures to build for, e.g. 89 or 86;90 (CMAKE_CUDA_ARCHITECTURES)",
    )
    build.add_argument(
        "--quiet-if-cached", action="store_true", help="print nothing when the artifact is already cached"
    )
    _output.add_json_arg(build)
    build.set_defaults(handler=handle_build)

    listing = sub.add_parser("list", help="the artifacts in the cache")
    _output.add_json_arg(listing)
    listing.set_defaults(handler=handle_list)

    show = sub.add_parser("show", help="print an artifact's manifest")
    show.add_argument("id", metavar="ID")
    _output.add_json_arg(show)
    show.set_defaults(handler=handle_show)

    verify = sub.add_parser("verify", help="re-hash artifacts and every file in them (default: all)")
    verify.add_argument("ids", nargs="*", metavar="ID")
    verify.set_defaults(handler=handle_verify)

    add = sub.add_parser("add", help="add an artifact from a spec file (url/path + sha256) to the cache")
    add.add_argument("spec", metavar="SPEC", help="YAML/JSON spec file")
    add.add_argument("--backend", default="cpu")
    _output.add_json_arg(add)
    add.set_defaults(handler=handle_add)


def handle_build(args: argparse.Namespace) -> int:
    from orchestrator.artifacts.build import build_artifact, cached_build
    from orchestrator.artifacts.cuda import check_cuda_architectures
    from orchestrator.artifacts.manifest import llama_cpp_python_version
    from orchestrator.core.errors import UsageError

    if args.cuda_arch is not None:
        if args.backend != "cuda":
            raise UsageError("--cuda-arch is for --backend cuda")
        try:
            arches = check_cuda_architectures(args.cuda_arch)
        except ValueError as exc:
            raise UsageError(f"--cuda-arch: {exc}") from None
        args.cmake_args = [*args.cmake_args, f"-DCMAKE_CUDA_ARCHITECTURES={arches}"]
    cached = cached_build(args.backend, args.cmake_args)
    if cached is not None and args.quiet_if_cached:
        return 0
    if cached is None:
        _output.err_console.print(
            f"building ggml-rpc-server ({args.backend}) for llama-cpp-python "
            f"{llama_cpp_python_version()}: a few minutes, once",
            highlight=False,
        )

    def progress(line: str) -> None:
        _output.err_console.print(f"  {line}", style="dim", highlight=False, markup=False, soft_wrap=True)

    artifact = cached or build_artifact(args.backend, args.cmake_args, progress=progress)
    if args.json:
        _output.print_json(artifact.to_dict())
    else:
        _output.console.print(f"{artifact.id}  {artifact.archive}", highlight=False, soft_wrap=True)
    return 0


def handle_list(args: argparse.Namespace) -> int:
    from rich import box
    from rich.table import Table

    from orchestrator.artifacts.store import artifacts_dir, list_artifacts
    from orchestrator.core.units import format_size

    found = list_artifacts()
    if args.json:
        _output.print_json([a.to_dict() for a in found])
        return 0
    if not found:
        _output.err_console.print(f"no artifacts in {artifacts_dir()}")
        return 0
    # The id already names protocol, backend, os and arch; `show` has the rest.
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("id", no_wrap=True)
    for column in ("llama.cpp", "native", "size"):
        table.add_column(column, no_wrap=True)
    for a in found:
        m = a.manifest
        table.add_row(a.id, m.llama_cpp_commit or "-", "yes" if m.native else "no", format_size(a.size))
    _output.console.print(table)
    return 0


def handle_show(args: argparse.Namespace) -> int:
    from orchestrator.artifacts.store import load_artifact

    artifact = load_artifact(args.id)
    if args.json:
        _output.print_json(artifact.to_dict())
        return 0
    m = artifact.manifest
    rows = [
        ("id", artifact.id),
        ("archive", str(artifact.archive)),
        ("archive sha256", artifact.archive_sha256),
        ("protocol", m.protocol),
        ("backend", m.backend),
        ("os/arch", f"{m.os}/{m.arch}"),
        ("native", "yes" if m.native else "no"),
        ("llama.cpp commit", m.llama_cpp_commit or "-"),
        ("ggml version", m.ggml_version or "-"),
        ("llama-cpp-python", m.llama_cpp_python_version or "-"),
        ("source", m.source),
        ("cmake args", " ".join(m.cmake_args) or "-"),
        ("patches", ", ".join(m.patches) or "-"),
        *([("cuda archs", ";".join(m.cuda_architectures) or "-")] if m.backend == "cuda" else []),
    ]
    out = _output.console
    for name, value in rows:
        out.print(f"{name + ':':<18}{value}", highlight=False, markup=False, soft_wrap=True)
    out.print("files:")
    for f in m.files:
        detail = f"-> {f.link}" if f.link is not None else f"{f.size:>9}  {f.mode:04o}  {f.sha256}"
        out.print(f"  {f.path:<34}{detail}", highlight=False, markup=False, soft_wrap=True)
    return 0


def handle_verify(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from orchestrator.artifacts.store import artifacts_dir, list_artifacts, load_artifact, verify_artifact
    from orchestrator.core.errors import ArtifactError

    targets = [load_artifact(i) for i in args.ids] if args.ids else list_artifacts()
    failed = 0
    for artifact in targets:
        try:
            verify_artifact(artifact)
        except ArtifactError as exc:
            failed += 1
            _output.console.print(f"[red]FAILED[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        else:
            _output.console.print(f"[green]ok[/green]     {artifact.id}", highlight=False, soft_wrap=True)
    if not targets:
        _output.err_console.print(f"no artifacts in {artifacts_dir()}")
    return 1 if failed else 0


def handle_add(args: argparse.Namespace) -> int:
    from pathlib import Path

    from orchestrator.artifacts.imports import import_artifact
    from orchestrator.artifacts.spec import read_artifact_spec

    spec = read_artifact_spec(Path(args.spec))
    artifact = import_artifact(spec, backend=args.backend)
    if args.json:
        _output.print_json(artifact.to_dict())
    else:
        _output.console.print(f"{artifact.id}  {artifact.archive}", highlight=False, soft_wrap=True)
    return 0
