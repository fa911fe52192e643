"""A cuda artifact carries the CUDA runtime libraries it links (libcudart, libcublas, libcublasLt), so a
node with only the NVIDIA driver starts it; and `ping` says, before deploy, what deploy refuses: a driver
too old for the artifact's CUDA release. The libraries here are real ELF files built with the C compiler
under NVIDIA's sonames (the real ones are 610 MB; the real artifact is bench/gpu_kit.py's)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from orchestrator.artifacts.cuda import bundle_runtime, driver_too_old, linked_libraries, pinned_release
from orchestrator.artifacts.spec import known_cuda_release
from orchestrator.facts.gpus import GpuRuntime


def shared_library(folder: Path, soname: str, *needed: str, search: Path | None = None) -> Path:
    """A real shared library named `soname` that links each of `needed` (found in `search`)."""
    source = folder / f"{soname}.c"
    source.write_text(f"int {soname.split('.')[0].replace('-', '_')}_entry(void) {{ return 0; }}\n")
    links = [f"-l:{name}" for name in needed]
    path = folder / soname
    subprocess.run(
        ["cc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(path), str(source),
         *([f"-L{search}"] if search else []), "-Wl,--no-as-needed", *links],
        check=True,
    )  # fmt: skip
    return path


def test_the_runtime_a_build_links_is_carried_beside_it(tmp_path: Path) -> None:
    """libggml-cuda links libcudart and libcublas, libcublas links libcublasLt: all three are copied
    beside it, as plain files under their sonames (found there through RUNPATH=$ORIGIN); what the
    toolkit holds and nothing links (nvrtc here) and the system's libraries (libc) are not."""
    toolkit, bin_dir = tmp_path / "toolkit" / "lib", tmp_path / "bin"
    toolkit.mkdir(parents=True)
    bin_dir.mkdir()
    shared_library(toolkit, "libcublasLt.so.13")
    shared_library(toolkit, "libcublas.so.13", "libcublasLt.so.13", search=toolkit)
    shared_library(toolkit, "libcudart.so.13")
    shared_library(toolkit, "libnvrtc.so.13")
    (toolkit / "libcudart.so").symlink_to("libcudart.so.13")  # the installer's unversioned links
    shared_library(bin_dir, "libggml-cuda.so", "libcudart.so.13", "libcublas.so.13", search=toolkit)
    assert linked_libraries(bin_dir / "libggml-cuda.so")[:2] == ["libcudart.so.13", "libcublas.so.13"]

    copied = bundle_runtime(bin_dir, toolkit)

    assert set(copied) == {"libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13"}
    for name, size in copied.items():
        path = bin_dir / name
        assert path.is_file() and not path.is_symlink() and path.stat().st_size == size
        assert path.read_bytes() == (toolkit / name).read_bytes()
    assert not (bin_dir / "libnvrtc.so.13").exists() and not (bin_dir / "libc.so.6").exists()
    assert bundle_runtime(bin_dir, toolkit) == {}  # once there, nothing is copied again


@pytest.mark.parametrize(
    ("driver", "refused"),
    [
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024", True),
        ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build", False),
    ],
)
def test_ping_knows_the_release_a_default_cuda_build_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, driver: str, refused: bool
) -> None:
    """With no cuda artifact cached, the default one would be built with the pinned toolkit: its release
    is what a node's driver must run, so `ping` refuses a 550 driver before any build or deploy; an id
    or spec file nothing knows yet is left to deploy."""
    monkeypatch.setenv("RPCFLEET_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no system nvcc: the PyPI toolkit's pins decide
    release = known_cuda_release(None)
    assert release == pinned_release() == "13.5"
    runtime = GpuRuntime(nvidia_device_nodes=1, nvidia_driver=driver)
    assert (driver_too_old(release, runtime.nvidia_driver) is not None) is refused
    assert known_cuda_release("rpc-server-7.0.0-cuda-linux-x86_64-0123abcd") is None
    assert known_cuda_release(str(tmp_path / "spec.yml")) is None


async def test_deploy_refuses_an_old_driver_before_it_builds_the_artifact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cuda host with a 550 driver and no cuda artifact cached: deploy refuses it, naming the driver,
    before asking for the artifact (whose default is a half-hour build): the chooser is never called."""
    from orchestrator.core.errors import NodeMismatchError
    from orchestrator.inventory.model import Host
    from orchestrator.operations.install.ensure import ensure_installed
    from orchestrator.operations.install.plan import InstallState

    monkeypatch.setenv("RPCFLEET_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    old = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024"
    state = InstallState("gpu", "/opt/rpcfleet", "linux", "x86_64", None, (), (), None, None,
                         gpu_runtime=GpuRuntime(nvidia_device_nodes=1, nvidia_driver=old))  # fmt: skip
    asked: list[str] = []

    async def choose(host: Host, _state: InstallState) -> object:
        asked.append(host.name)
        raise AssertionError("the artifact was asked for")

    host = Host(name="gpu", address="10.0.0.1", rpc_backend="cuda")
    with pytest.raises(NodeMismatchError, match=r"the NVIDIA driver 550\.54\.14 is too old for a CUDA 13\.5"):
        await ensure_installed(None, host, choose, state=state)  # type: ignore[arg-type]
    assert asked == []
