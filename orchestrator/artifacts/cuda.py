"""The CUDA toolkit for building the `cuda` artifact, from PyPI: NVIDIA's CUDA 13 wheels lay out one
toolkit under `site-packages/nvidia/cu13` (bin/nvcc, nvvm/bin/cicc, include, lib), which cmake takes as
`CUDAToolkit_ROOT`. It is installed once into a virtual environment of its own under
`$RPCFLEET_HOME/toolchains/`, keyed by the pins: every wheel pinned by sha256 in `cuda-requirements.txt`
beside this file and installed with `--require-hashes --no-deps --only-binary :all:` (as the build
backend's environment, `artifacts.buildenv`): no other file, no sdist, no unpinned dependency. A system
nvcc on PATH is used instead when there is one. Debian's main archive has no CUDA toolkit, and the
registries are this project's only network.

The wheels hold no driver stub (`lib/stubs/libcuda.so`), so the build links no driver library
(GGML_CUDA_NO_VMM=ON: ggml's legacy memory pool instead of the virtual-memory one); the node's driver is
loaded by libcudart at run time. CUDA 13 needs a driver of the 580 series or newer on the node.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from orchestrator.core.errors import ArtifactError
from orchestrator.core.paths import rpcfleet_home
from orchestrator.engine.children import run_child

# The CUDA 13.5 toolkit's wheels, each pinned by sha256 per platform (cublas and cccl version on their own;
# all share nvidia/cu13).
CUDA_REQUIREMENTS = Path(__file__).with_name("cuda-requirements.txt")

# Defines a build with the PyPI toolkit needs: no driver stub to link (see the module's text).
PYPI_TOOLKIT_DEFINES: dict[str, str] = {"GGML_CUDA_NO_VMM": "ON"}

_ARCH_RE = re.compile(r"^(\d{2,3}[af]?)(-(real|virtual))?$")


def check_cuda_architectures(value: str) -> str:
    """`89`, `90a`, `86;89` or `86,89`: CMAKE_CUDA_ARCHITECTURES' form; raises ValueError otherwise."""
    parts = [p.strip() for p in re.split(r"[;,]", value) if p.strip()]
    bad = [p for p in parts if not _ARCH_RE.match(p)]
    if not parts or bad:
        raise ValueError(
            f"{value!r} is not a CUDA architecture list such as 89 or 86;90 (the compute capability "
            "without its dot: `nvidia-smi --query-gpu=compute_cap --format=csv` prints 8.9 for 89)"
        )
    return ";".join(parts)


@dataclass(frozen=True)
class CudaToolkit:
    root: Path  # CUDAToolkit_ROOT: bin/nvcc, include, lib
    source: str  # "system" or "pypi:<pins>"

    @property
    def nvcc(self) -> Path:
        return self.root / "bin" / "nvcc"

    def environment(self) -> dict[str, str]:
        """What cmake needs to find this toolkit (the compiler and its root), on top of os.environ."""
        path = f"{self.root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
        # The server's link resolves libggml-cuda's libcublas.so.13 through ld's LD_LIBRARY_PATH (its
        # RUNPATH is $ORIGIN, where the runtime libraries are copied only after the build)
        libraries = os.pathsep.join(p for p in (str(self.lib_dir), os.environ.get("LD_LIBRARY_PATH")) if p)
        return {**os.environ, "CUDACXX": str(self.nvcc), "CUDAToolkit_ROOT": str(self.root), "PATH": path,
                "LD_LIBRARY_PATH": libraries}  # fmt: skip

    @property
    def lib_dir(self) -> Path:
        """Where its runtime libraries are: lib (PyPI's), lib64 or targets/<arch>/lib (a system one)."""
        for candidate in (self.root / "lib", self.root / "lib64", *sorted(self.root.glob("targets/*/lib"))):
            if any(candidate.glob("libcudart.so*")):
                return candidate
        raise ArtifactError(f"the CUDA toolkit at {self.root} has no libcudart")

    @property
    def defines(self) -> dict[str, str]:
        return dict(PYPI_TOOLKIT_DEFINES) if self.source.startswith("pypi") else {}


# The oldest Linux driver each CUDA major release runs on (NVIDIA's CUDA Toolkit release notes, table 3).
MIN_DRIVER: dict[int, str] = {12: "525.60.13", 13: "580.65.06"}


def toolkit_release(nvcc: Path) -> str | None:
    """`13.5` from `nvcc --version` ("Cuda compilation tools, release 13.5, V13.5.37"), None if unknown."""
    done = run_child([str(nvcc), "--version"], capture_output=True, text=True, timeout=60, check=False)
    found = re.search(r"release (\d+\.\d+)", done.stdout)
    return found.group(1) if found else None


DRIVER_FIX = "update the node's NVIDIA driver, or pin an artifact of an older CUDA (rpc_artifact)"


def driver_too_old(cuda_version: str | None, driver_line: str | None) -> str | None:
    """Why a driver (/proc/driver/nvidia/version's first line) cannot run a build of `cuda_version`, or
    None (also when either is not known)."""
    if not cuda_version or not driver_line:
        return None
    driver = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)*)", driver_line)
    needed = MIN_DRIVER.get(int(cuda_version.split(".")[0]))
    if driver is None or needed is None:
        return None
    if _numbers(driver.group(1)) >= _numbers(needed):
        return None
    have = driver.group(1)
    return f"the NVIDIA driver {have} is too old for a CUDA {cuda_version} build (it needs {needed} or newer)"


def _numbers(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def toolkit_key(requirements: Path = CUDA_REQUIREMENTS) -> str:
    """Names the toolkit's folder and goes into the cuda build key: a change of any pin is a new one."""
    return hashlib.sha256(requirements.read_bytes()).hexdigest()[:12]


def toolkit_pins(requirements: Path = CUDA_REQUIREMENTS) -> tuple[str, ...]:
    """`name==version` of each pinned wheel, once each, in the file's order."""
    pins: dict[str, None] = {}
    for line in requirements.read_text().splitlines():
        requirement = line.split("#", 1)[0].split(";", 1)[0].split(" --", 1)[0].strip()
        if requirement:
            pins[requirement] = None
    return tuple(pins)


def pinned_release(requirements: Path = CUDA_REQUIREMENTS) -> str:
    """`13.5` from the pinned nvcc wheel (nvidia-cuda-nvcc==13.5.37): the release its nvcc says."""
    for pin in toolkit_pins(requirements):
        name, _, version = pin.partition("==")
        if name == "nvidia-cuda-nvcc":
            return ".".join(version.split(".")[:2])
    raise ArtifactError(f"{requirements} pins no nvidia-cuda-nvcc")


def system_toolkit() -> CudaToolkit | None:
    """A complete toolkit installed on this machine: nvcc on PATH, with cuBLAS beside it (ggml-cuda links
    it; a toolkit of the compiler alone, such as this project's machine image has, is not enough)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    for real in (Path(nvcc).resolve(), *_wrapped(Path(nvcc))):
        root = real.parent.parent
        if any(root.glob("lib*/libcublas.so*")) or any(root.glob("targets/*/lib/libcublas.so*")):
            return CudaToolkit(root, "system")
    return None


def _wrapped(path: Path) -> list[Path]:
    """The nvcc a wrapper script execs (`exec /usr/local/cuda-13.0/bin/nvcc "$@"`), if it is one."""
    try:
        head = path.read_bytes()[:512]
    except OSError:
        return []
    return [Path(m.decode()) for m in re.findall(rb"exec\s+(/\S+/nvcc)\b", head)]


def pypi_toolkit_dir(requirements: Path = CUDA_REQUIREMENTS) -> Path:
    return rpcfleet_home() / "toolchains" / f"cuda-{toolkit_key(requirements)}"


def install_command(python: Path, requirements: Path = CUDA_REQUIREMENTS) -> list[str]:
    """pip's command for the toolkit: the pinned wheels and nothing else (each checked by sha256)."""
    return [
        str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--require-hashes",
        "--no-deps", "--only-binary", ":all:", "-r", str(requirements),
    ]  # fmt: skip


def cuda_toolkit(
    progress: Callable[[str], None] | None = None, *, requirements: Path = CUDA_REQUIREMENTS
) -> CudaToolkit:
    """The system's CUDA toolkit, else the PyPI one (installed on first use, about 600 MB)."""
    found = system_toolkit()
    if found is not None:
        return found
    say = progress or (lambda _line: None)
    folder = pypi_toolkit_dir(requirements)
    pins = toolkit_pins(requirements)
    source = "pypi:" + ",".join(pins)
    if (folder / ".complete").is_file():
        return CudaToolkit(Path((folder / ".complete").read_text().strip()), source)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        say(f"installing the CUDA toolkit from PyPI into {folder} (about 600 MB, once)")
        _run([sys.executable, "-m", "venv", str(staging)], "making the CUDA toolkit's environment")
        python = staging / "bin" / "python"
        _run(install_command(python, requirements), f"installing the wheels pinned in {requirements}")
        roots = list(staging.glob("lib/python*/site-packages/nvidia/cu13"))
        if not roots or not (roots[0] / "bin" / "nvcc").is_file():
            raise ArtifactError(
                "the CUDA wheels installed no nvidia/cu13/bin/nvcc", hint=f"pins: {requirements}"
            )
        _link_unversioned(roots[0] / "lib")
        relative = roots[0].relative_to(staging)
        shutil.rmtree(folder, ignore_errors=True)
        staging.replace(folder)
        root = folder / relative
        (folder / ".complete").write_text(f"{root}\n")
        return CudaToolkit(root, source)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _link_unversioned(lib: Path) -> None:
    """`libcudart.so` -> `libcudart.so.13` and so on: cmake's FindCUDAToolkit looks for the plain names,
    which the wheels do not ship."""
    for path in lib.glob("lib*.so.*"):
        plain = lib / (path.name.split(".so.")[0] + ".so")
        if not plain.exists():
            plain.symlink_to(path.name)


def linked_libraries(path: Path) -> list[str]:
    """The sonames an ELF file names as NEEDED (readelf -d), in its order; [] when it is not one."""
    done = run_child(["readelf", "-d", str(path)], capture_output=True, text=True, timeout=30, check=False)
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", done.stdout)


def bundle_runtime(bin_dir: Path, toolkit_lib: Path) -> dict[str, int]:
    """Copy into `bin_dir` every library of the toolkit that its binaries link, and what those link in
    turn (libcudart, libcublas, libcublasLt), as plain files under their sonames, found there through the
    artifact's RUNPATH=$ORIGIN: a node then needs only the NVIDIA driver. NVIDIA's EULA lets applications
    redistribute these runtime libraries. Returns {soname: bytes} of what was copied."""
    copied: dict[str, int] = {}
    queue = [p for p in sorted(bin_dir.iterdir()) if p.is_file() and not p.is_symlink()]
    while queue:
        for name in linked_libraries(queue.pop()):
            source = toolkit_lib / name
            target = bin_dir / name
            if name in copied or not source.exists() or target.exists() or target.is_symlink():
                continue
            shutil.copyfile(source.resolve(), target)
            target.chmod(0o755)
            copied[name] = target.stat().st_size
            queue.append(target)
    return copied


def _run(command: list[str], what: str) -> None:
    done = run_child(command, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise ArtifactError(
            f"{what} failed",
            command=" ".join(command),
            exit_status=done.returncode,
            stderr=done.stderr or done.stdout,
            hint="the CUDA wheels come from PyPI: check that it is reachable",
        )
