"""Artifact specs in the inventory (`artifact:`): reading and resolving them to an artifact."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, TypeVar

from orchestrator.artifacts.build import default_artifact
from orchestrator.artifacts.imports import import_artifact
from orchestrator.artifacts.manifest import (
    BACKENDS,
    ID_RE,
    Artifact,
    ArtifactSpec,
    ArtifactSpecError,
    host_platform,
)
from orchestrator.artifacts.store import artifacts_dir, load_artifact
from orchestrator.core import fields
from orchestrator.core.errors import ArtifactError, SourceLocation

T = TypeVar("T")

_SPEC_KEYS = {
    "url", "path", "build", "sha256", "protocol", "backend", "os", "arch", "native", "cmake_args",
    "subdir", "llama_cpp_commit", "llama_cpp_python_version", "build_timeout",
}  # fmt: skip


_SHA256 = fields.matching(r"[0-9a-f]{64}", "64 lowercase hex digits")


_PROTOCOL = fields.matching(r"\d+\.\d+\.\d+", "a protocol version major.minor.patch")


def _stripped(value: Any) -> str:
    return fields.text(value).strip()


def read_artifact_spec(path: Path) -> ArtifactSpec:
    """Parse a YAML/JSON artifact spec; errors name the file and line (`ArtifactSpecError`)."""
    import yaml

    from orchestrator.core.yamlsource import Source, compose, node_value

    try:
        text = path.read_text()
    except OSError as exc:
        raise ArtifactSpecError(
            f"cannot read the artifact spec: {exc.strerror}", SourceLocation(path)
        ) from exc
    try:
        node = compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = SourceLocation(path, mark.line + 1, mark.column + 1) if mark else SourceLocation(path)
        raise ArtifactSpecError(f"not valid YAML/JSON: {getattr(exc, 'problem', exc)}", where) from exc
    loc = Source.of_text(path, text).node
    if not isinstance(node, yaml.MappingNode):
        raise ArtifactSpecError(
            "an artifact spec must be a mapping (url/path/build + sha256)", SourceLocation(path, 1)
        )
    values: dict[str, tuple[Any, yaml.Node]] = {}
    for key_node, value_node in node.value:
        key = key_node.value
        if key not in _SPEC_KEYS:
            raise ArtifactSpecError(
                f"unknown key {key!r}", loc(key_node), hint=f"known: {', '.join(sorted(_SPEC_KEYS))}"
            )
        values[key] = (node_value(value_node), value_node)

    def field(key: str, parse: fields.Parser[T]) -> T | None:
        if key not in values:
            return None
        value, value_node = values[key]
        try:
            return parse(value)
        except ValueError as exc:
            raise ArtifactSpecError(f"{key}: {exc}", loc(value_node)) from None

    sources = [k for k in ("url", "path", "build") if k in values]
    if len(sources) != 1:
        raise ArtifactSpecError("an artifact spec needs exactly one of url, path or build", loc(node))
    kind = sources[0]
    value = field(kind, _stripped) or ""
    sha = field("sha256", _SHA256)
    if kind == "build" and value != "on_node":
        raise ArtifactSpecError(f"build must be 'on_node', not {value!r}", loc(values["build"][1]))
    if kind == "url" and not re.match(r"^(https?|file)://", value):
        raise ArtifactSpecError(f"url must be http(s):// or file://, not {value!r}", loc(values["url"][1]))
    if kind != "build" and sha is None:
        raise ArtifactSpecError(f"a {kind} source needs its sha256", loc(node))
    if kind == "path":
        value = str((path.parent / Path(value).expanduser()).resolve())
    build_timeout = field("build_timeout", fields.seconds)
    if build_timeout is not None and kind != "build":
        raise ArtifactSpecError(
            "build_timeout applies to `build: on_node` only", loc(values["build_timeout"][1])
        )
    return ArtifactSpec(
        kind=kind,
        value=value,
        sha256=sha,
        protocol=field("protocol", _PROTOCOL),
        backend=field("backend", fields.choice(BACKENDS)),
        os=field("os", _stripped),
        arch=field("arch", _stripped),
        native=field("native", fields.boolean) or False,
        cmake_args=field("cmake_args", fields.arguments) or (),
        subdir=field("subdir", _stripped),
        llama_cpp_commit=field("llama_cpp_commit", _stripped),
        llama_cpp_python_version=field("llama_cpp_python_version", _stripped),
        build_timeout=build_timeout,
        location=SourceLocation(path),
    )


def resolve_artifact(
    spec: str, *, backend: str = "cpu", os: str | None = None, arch: str | None = None
) -> Artifact:
    """An inventory's `rpc_artifact` value as an artifact for a host with this backend/os/arch.

    `spec` is an artifact id from the cache, a path to a YAML/JSON spec file, or "" / "default" for the
    locally built default. The artifact must match the host's backend, os and arch.
    """
    host_os, host_arch = host_platform()
    want_os, want_arch = os or host_os, arch or host_arch
    spec = spec.strip()
    if spec in ("", "default"):
        if (want_os, want_arch) != (host_os, host_arch):
            raise ArtifactError(
                f"the default artifact is built for {host_os}/{host_arch}, the host is {want_os}/{want_arch}",
                hint="pin rpc_artifact to a spec file (url/path, or build: on_node)",
            )
        artifact = default_artifact(backend)
    elif ID_RE.match(spec) and (artifacts_dir() / f"{spec}.json").is_file():
        artifact = load_artifact(spec)
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ArtifactError(
                f"rpc_artifact {spec!r} is neither a cached artifact id nor a spec file",
                hint="`rpcfleet artifact list` shows cached ids",
            )
        parsed = read_artifact_spec(path)
        if parsed.kind == "build":
            raise ArtifactError(f"{path}: `build: on_node` artifacts are built on the node during install")
        artifact = import_artifact(parsed, backend=backend, os_name=want_os, arch=want_arch)
    manifest = artifact.manifest
    wanted = (backend, want_os, want_arch)
    if (manifest.backend, manifest.os, manifest.arch) != wanted:
        raise ArtifactError(
            f"artifact {artifact.id} is for {manifest.backend}/{manifest.os}/{manifest.arch}, "
            f"the host needs {'/'.join(wanted)}"
        )
    return artifact


def known_cuda_release(spec: str | None) -> str | None:
    """The CUDA release a host's cuda artifact needs the driver for, where it is known without building
    or fetching anything: a cached artifact's own, the cached default build's, else the release the
    default build would have (the pinned PyPI toolkit's; a system toolkit's is read at build time only:
    None). A spec file's artifact is known at deploy (None here)."""
    from orchestrator.artifacts.build import cached_build
    from orchestrator.artifacts.cuda import pinned_release, system_toolkit

    spec = (spec or "").strip()
    if ID_RE.match(spec) and (artifacts_dir() / f"{spec}.json").is_file():
        return load_artifact(spec).manifest.cuda_version
    if spec not in ("", "default"):
        return None
    cached = cached_build("cuda")
    if cached is not None:
        return cached.manifest.cuda_version
    return pinned_release() if system_toolkit() is None else None
