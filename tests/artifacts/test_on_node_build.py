"""`build: on_node` artifacts: planned and parsed (pure), then built for real on a lab node (tier 2).

The real build compiles ggml-rpc-server from the real llama-cpp-python sdist on one node of a lab of
this module (45-90 s on 2 cores, once per session); the other lab tests reuse its result: a second
deploy changes nothing, a build that cannot configure leaves the built version serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.artifacts.manifest import ArtifactSpec, FileEntry, Manifest, llama_cpp_python_version
from orchestrator.artifacts.node_build import NodeBuild, node_build, patch_lines, source_edit
from orchestrator.artifacts.patches import apply_patches, patches_for
from orchestrator.artifacts.source import extract_source, read_sdist_info, sdist_path
from orchestrator.core.errors import ArtifactError, InstallError
from orchestrator.engine.executor import RunResult, Session
from orchestrator.inventory.model import Host
from orchestrator.lab.state import Lab
from orchestrator.operations.install.ensure import ArtifactChooser
from orchestrator.operations.install.plan import InstallChange, InstallState, plan_node_build
from orchestrator.operations.node_build import build_command, parse_build_output
from orchestrator.operations.server.steps import DeployResult, make_deploy_step
from orchestrator.rpc.client import probe_endpoint
from orchestrator.rpc.records import Outcome
from tests.plugins.lab import lab_hosts_of, own_lab

SDIST = sdist_path(llama_cpp_python_version())


def _build(**spec: Any) -> NodeBuild:
    return node_build(ArtifactSpec("build", "on_node", **spec), backend="cpu", os_name="linux", arch="x86_64")


def _state(current: str | None, versions: tuple[str, ...], free: int | None = 1 << 40) -> InstallState:
    manifest = Manifest("7.0.0", "cpu", "linux", "x86_64", False, ()) if current else None
    return InstallState("n1", "/home/lab/rf", "linux", "x86_64", current, versions, versions, free, manifest)


# ---------------------------------------------------------------- pure


def test_the_build_id_follows_the_source_and_the_cmake_arguments() -> None:
    info = read_sdist_info(SDIST)
    plain = _build()
    assert plain.protocol == info.protocol == "7.0.0"
    assert plain.id.startswith(f"rpc-server-7.0.0-cpu-linux-x86_64-node-{plain.key[:8]}")
    assert _build().id == plain.id  # deterministic: a second deploy can find it
    assert _build(sha256=info.sha256).id == plain.id  # pinning the sdist it is built from changes nothing
    assert _build(cmake_args=("-DGGML_AVX2=OFF",)).id != plain.id
    host_args = node_build(
        ArtifactSpec("build", "on_node", cmake_args=("-DGGML_AVX2=ON",)),
        backend="cpu",
        os_name="linux",
        arch="x86_64",
        extra_cmake_args=("-DGGML_AVX2=OFF",),
    )
    assert "-DGGML_AVX2=OFF" in host_args.cmake_args and "-DGGML_AVX2=ON" not in host_args.cmake_args
    assert host_args.id == _build(cmake_args=("-DGGML_AVX2=OFF",)).id
    cuda = node_build(ArtifactSpec("build", "on_node"), backend="cuda", os_name="linux", arch="x86_64")
    assert "-DGGML_CUDA=ON" in cuda.cmake_args and "-cuda-" in cuda.id
    assert "-DGGML_CUDA=ON" in cuda.script("/w", "/s.tar.gz")
    with pytest.raises(ArtifactError, match="the spec pins"):
        _build(sha256="0" * 64)


def test_plan_node_build() -> None:
    build = _build()
    fresh = plan_node_build(_state(None, ()), build)
    assert (fresh.action, fresh.build, fresh.artifact) == ("install", build, None)
    assert fresh.describe() == f"build on the node and install {build.id}"
    assert plan_node_build(_state(build.id, (build.id,)), build).action == "none"
    assert plan_node_build(_state(build.id, (build.id,)), build, force=True).action == "install"
    switch = plan_node_build(_state("old", ("old", build.id)), build)
    assert (switch.action, switch.previous) == ("switch", "old")
    pruned = plan_node_build(_state("c", ("a", "b", "c")), build, keep_versions=2)
    assert pruned.prune == ("a", "b")  # `c` still runs: kept until the next change
    with pytest.raises(InstallError, match="not enough disk space"):
        plan_node_build(_state("old", ("old",), free=10 << 20), build)


def test_parse_build_output() -> None:
    change = InstallChange("n1", "install", "v1", None, "/rf", "v0", build=_build())
    ok = (
        "@status 0\n@protocol 7.0.0\n@file bin/ggml-rpc-server 100 755 " + "a" * 64 + "\n"
        "@file bin/libggml.so.0.9 50 644 " + "b" * 64 + "\n@link bin/libggml.so libggml.so.0.9\n"
    )
    protocol, files = parse_build_output(ok, change)
    assert protocol == "7.0.0"
    assert files == (
        FileEntry("bin/ggml-rpc-server", "a" * 64, 100, 0o755),
        FileEntry("bin/libggml.so.0.9", "b" * 64, 50, 0o644),
        FileEntry("bin/libggml.so", None, 0, 0o777, "libggml.so.0.9"),
    )
    failed = (
        "@status 1\n@log -- Configuring incomplete\n@log CMake Error at CMakeLists.txt:3 (x):\n@log   bad\n"
    )
    with pytest.raises(InstallError) as caught:
        parse_build_output(failed, change)
    assert (
        "failed (exit status 1): CMake Error at CMakeLists.txt:3 (x): bad; v0 stays installed"
        in caught.value.message
    )
    assert caught.value.stderr_tail is not None and "Configuring incomplete" in caught.value.stderr_tail
    assert caught.value.hint is not None and "build.log" in caught.value.hint
    with pytest.raises(InstallError, match="within 1800 s"):
        parse_build_output("@status 124\n", change)
    with pytest.raises(InstallError, match="another build"):
        parse_build_output("@status busy\n", change)
    with pytest.raises(InstallError, match="no bin/ggml-rpc-server"):
        parse_build_output("@status 0\n@protocol 7.0.0\n", change)
    assert "timeout -k 10 1800 bash" in build_command("/rf", _build())


def test_the_node_applies_the_same_source_patches_as_a_build_here(tmp_path: Path) -> None:
    """The edits the node's script applies with coreutils turn the sdist's files into exactly what
    `apply_patches` makes of them here; a rerun in the same tree changes nothing; a file that is not the
    sdist's is refused, named. The manifest lists the patches, and they are part of the build's id."""
    build = _build()
    assert [label.split("@")[0] for label in build.patches] == [
        "keepalive",
        "exit-status",
        "warm-wait",
        "hash-manifest",
        "hash-manifest-set-tensor",
        "hash-manifest-set-tensor-async",
        "cache-read-declare",
        "cache-read-define",
        "cache-read",
    ]
    assert build.patches == tuple(p.label for p in patches_for("cpu"))
    assert build.manifest(()).patches == build.patches
    assert {e.path for e in build.edits} == {p.path for p in patches_for("cpu")}
    here = extract_source(SDIST, tmp_path / "here", lambda _line: None) / "vendor" / "llama.cpp"
    node = tmp_path / "node"
    for edit in build.edits:  # the node's tree: the sdist's files as they come
        (node / edit.path).parent.mkdir(parents=True, exist_ok=True)
        (node / edit.path).write_bytes((here / edit.path).read_bytes())
    apply_patches(here, patches_for("cpu", build.version))
    script = "set -euo pipefail\nllama=" + str(node) + "\n" + "\n".join(patch_lines(build.edits))

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)

    first = run()
    assert first.returncode == 0, first.stderr
    assert sorted(first.stdout.split("\n")[:-1]) == sorted(f"rpcfleet: patched {e.path}" for e in build.edits)
    for edit in build.edits:
        assert (node / edit.path).read_bytes() == (here / edit.path).read_bytes(), edit.path
    assert run().stdout == ""  # already patched: left alone
    transport = node / "ggml/src/ggml-rpc/transport.cpp"
    transport.write_text(transport.read_text() + "// another source\n")
    refused = run()
    assert refused.returncode == 1
    assert f"{transport} is not the file its source patch was made for" in refused.stderr
    # In the build script: after the extraction, before cmake.
    text = build.script("/w", "/s.tar.gz")
    assert text.index("edit ggml/src/ggml-rpc/transport.cpp ") < text.index("cmake -S")
    assert build.key != _key_without_patches(build)  # a node built without them builds again


def _key_without_patches(build: NodeBuild) -> str:
    """The id's key as it was made before the node applied the patches (a node built then rebuilds)."""
    data = [
        "node-build",
        build.info.sha256,
        build.version,
        build.backend,
        list(build.cmake_args),
        "linux",
        "x86_64",
    ]
    return hashlib.sha256(json.dumps(data).encode()).hexdigest()[:16]


def test_the_edit_is_the_span_that_differs() -> None:
    edit = source_edit("a.cpp", b"head anchor tail", b"head new text tail")
    assert (edit.offset, edit.cut, edit.insert) == (5, 6, b"new text")
    assert edit.before == hashlib.sha256(b"head anchor tail").hexdigest()
    grown = source_edit("a", b"abc", b"abcabc")
    assert (grown.offset, grown.cut, grown.insert) == (3, 0, b"abc")


# ---------------------------------------------------------------- real builds on a lab node


@pytest.fixture(scope="module")
def build_lab() -> Iterator[Lab]:
    with own_lab(1, "nb") as made:
        yield made


def _spec(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


async def _deploy(host: Host, lines: list[str] | None = None) -> RunResult[DeployResult]:
    def follow(_host: Host, _change: InstallChange) -> Any:
        return None if lines is None else lines.append

    step = make_deploy_step(ArtifactChooser(), build_log=follow)
    async with Session(forks=4) as session:
        return await session.run([host], step, name="deploy")


@dataclasses.dataclass
class Built:
    lab: Lab
    host: Host
    result: DeployResult
    seconds: float
    lines: list[str]

    def node_path(self, relative: str) -> Path:
        return self.lab.node(self.host.name).home / relative


@pytest.fixture(scope="module")
def built(build_lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The one real on-node build of this session: the real sdist, pinned by its sha256."""
    folder = tmp_path_factory.mktemp("specs")
    sha = read_sdist_info(SDIST).sha256
    spec = _spec(folder, "node.yml", f"build: on_node\nsha256: {sha}\nbuild_timeout: 900\n")
    host = dataclasses.replace(lab_hosts_of(build_lab)[0], rpc_artifact=str(spec), install_dir="~/rf")
    lines: list[str] = []
    started = time.monotonic()
    run = asyncio.run(_deploy(host, lines))
    seconds = time.monotonic() - started
    assert run.ok, [str(r.error) for r in run.failed]
    result = run.results[0].value
    assert isinstance(result, DeployResult)
    print(f"on-node build and deploy: {seconds:.1f} s")
    return Built(build_lab, host, result, seconds, lines)


@pytest.mark.lab
async def test_a_real_on_node_build_serves_and_records_its_manifest(built: Built) -> None:
    change = built.result.install
    assert change.action == "install" and change.build is not None and change.artifact is None
    assert built.result.service.action == "start"
    hello = await probe_endpoint(built.host.endpoint, hello_only=True)
    assert hello.outcome is Outcome.OK and str(hello.version) == "7.0.0"
    # The build log was followed while it ran: cmake's progress lines reached the callback.
    assert any(line.startswith("[") and "%]" in line for line in built.lines), built.lines[-5:]

    rf = built.node_path("rf")
    assert (rf / "current").readlink().as_posix() == f"versions/{change.version}"
    assert (rf / "history").read_text().split() == [change.version]
    manifest = Manifest.from_dict(json.loads((rf / "current" / "manifest.json").read_text()))
    assert manifest == change.built
    assert manifest.source == f"build-on-node:llama-cpp-python=={llama_cpp_python_version()}"
    assert (manifest.protocol, manifest.backend, manifest.os, manifest.arch) == (
        "7.0.0",
        "cpu",
        "linux",
        "x86_64",
    )
    assert manifest.native is False and "-DGGML_RPC=ON" in manifest.cmake_args
    assert manifest.llama_cpp_commit and manifest.ggml_version
    # The source patches, as a build here applies them: listed, and in the binary. exit-status: a
    # server that cannot bind (an address the node does not have) exits 1, where the stock one exits 0.
    assert [label.split("@")[0] for label in manifest.patches] == [
        "keepalive",
        "exit-status",
        "warm-wait",
        "hash-manifest",
        "hash-manifest-set-tensor",
        "hash-manifest-set-tensor-async",
        "cache-read-declare",
        "cache-read-define",
        "cache-read",
    ]
    assert (
        "rpcfleet: patched tools/rpc/rpc-server.cpp"
        in (rf / "build" / change.build.key / "build.log").read_text()
    )
    bind = subprocess.run(  # noqa: ASYNC221 (the fixture's build is done; this binary exits at once)
        [str(rf / "current" / "bin" / "ggml-rpc-server"), "-H", "192.0.2.1", "-p", "50999"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bind.returncode == 1, bind.stdout[-1000:] + bind.stderr[-1000:]
    # Every file hashed on the node is what is installed.
    paths = {e.path for e in manifest.files}
    assert "bin/ggml-rpc-server" in paths and any("libggml" in p for p in paths)
    for entry in manifest.files:
        installed = rf / "current" / entry.path
        if entry.link is not None:
            assert installed.readlink().as_posix() == entry.link
        else:
            assert hashlib.sha256(installed.read_bytes()).hexdigest() == entry.sha256, entry.path
    # The sdist was uploaded once and the build tree kept for the next (incremental) build.
    assert (rf / "src" / SDIST.name).stat().st_size == SDIST.stat().st_size
    assert (rf / "build" / change.build.key / "build" / "CMakeCache.txt").is_file()
    assert not list((rf / "tmp").iterdir())


@pytest.mark.lab
async def test_a_second_deploy_of_the_same_build_changes_nothing(built: Built) -> None:
    pid = (built.node_path("rf") / "run" / "rpc-server.pid").read_text().strip()
    started = time.monotonic()
    run = await _deploy(built.host)
    seconds = time.monotonic() - started
    assert run.ok, [str(r.error) for r in run.failed]
    result = run.results[0].value
    assert isinstance(result, DeployResult) and not result.changed
    assert result.install.action == "none" and result.install.version == built.result.install.version
    assert seconds < 10, seconds  # no upload, no build: one state read and a HELLO
    assert (built.node_path("rf") / "run" / "rpc-server.pid").read_text().strip() == pid


@pytest.mark.lab
async def test_a_failing_build_names_the_problem_and_the_built_version_keeps_serving(
    built: Built, tmp_path: Path
) -> None:
    rf = built.node_path("rf")
    pid = (rf / "run" / "rpc-server.pid").read_text().strip()
    # A C compiler that does not exist: cmake's configure step fails, on any machine (with or without a
    # CUDA toolkit).
    spec = _spec(
        tmp_path,
        "broken.yml",
        "build: on_node\ncmake_args: [-DCMAKE_C_COMPILER=/nonexistent/rpcfleet-cc]\nbuild_timeout: 300\n",
    )
    host = dataclasses.replace(built.host, rpc_artifact=str(spec))
    run = await _deploy(host)
    assert not run.ok
    error = run.results[0].error
    assert isinstance(error, InstallError)
    version = built.result.install.version
    assert "failed (exit status" in error.message and "CMake Error" in error.message, error.message
    assert error.message.endswith(f"{version} stays installed")
    assert "CMAKE_C_COMPILER" in error.message, error.message  # the cause, not a missing toolkit
    assert error.stderr_tail and "CMakeError.log" in error.stderr_tail
    assert error.hint and "build.log" in error.hint
    # Nothing changed: the same version current, the same process serving.
    assert (rf / "current").readlink().as_posix() == f"versions/{version}"
    assert (rf / "run" / "rpc-server.pid").read_text().strip() == pid
    hello = await probe_endpoint(built.host.endpoint, hello_only=True)
    assert hello.outcome is Outcome.OK
