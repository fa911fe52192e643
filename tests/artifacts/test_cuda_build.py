"""The cuda artifact's build recipe, checked as far as a machine without a GPU allows: the toolkit (this
machine's when complete, else NVIDIA's CUDA 13 wheels from PyPI, pinned by sha256), a real cmake configure
of the pinned llama.cpp with GGML_CUDA=ON for one architecture, and nvcc compiling one of ggml-cuda's real
sources for it. The whole build (about 40 minutes on 2 cores for one architecture) is left to
`bench/gpu.py`, on a machine with an NVIDIA GPU.

The real toolkit is a 600 MB download on a fresh machine: the tests that install it are `slow`
(tests/plugins/slow.py; `-m slow`). The installer itself runs in the fast suite against wheels made
here with the toolkit's layout (`test_the_pinned_toolkit_installs_only_its_hashed_wheels`), and the pins
against PyPI itself for the smallest wheel (`test_pypi_serves_the_pinned_bytes`)."""

from __future__ import annotations

import base64
import hashlib
import platform
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from orchestrator.artifacts import cuda
from orchestrator.artifacts.build import backend_environment, effective_cmake_args
from orchestrator.artifacts.cuda import (
    CUDA_REQUIREMENTS,
    check_cuda_architectures,
    cuda_toolkit,
    pinned_release,
    pypi_toolkit_dir,
    toolkit_pins,
    toolkit_release,
)
from orchestrator.artifacts.manifest import DEFAULT_LLAMA_CPP_PYTHON_VERSION
from orchestrator.artifacts.source import ensure_sdist, extract_source
from orchestrator.cli import main
from orchestrator.core.errors import ArtifactError


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("89", "89"),
        ("90a", "90a"),
        ("86;89", "86;89"),
        ("86, 90", "86;90"),
        ("120f", "120f"),
        ("89-real", "89-real"),
        ("89;", "89"),  # an empty item (a trailing separator) is dropped, as cmake's lists drop it
    ],
)
def test_cuda_architectures_in_cmakes_form(given: str, expected: str) -> None:
    assert check_cuda_architectures(given) == expected


@pytest.mark.parametrize("given", ["", ";", " , ", "8.9", "sm_89", "native", "89;8.9", "all-major", "9"])
def test_other_cuda_architectures_are_refused(given: str) -> None:
    with pytest.raises(ValueError, match="compute capability without its dot"):
        check_cuda_architectures(given)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cuda-arch", "89"], "--cuda-arch is for --backend cuda"),
        (["--backend", "cuda", "--cuda-arch", "8.9"], "--cuda-arch: '8.9' is not a CUDA architecture list"),
        (["--backend", "cuda"], "a cuda build needs its GPU architectures"),
    ],
)
def test_bad_cuda_build_requests_are_refused_before_building(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["artifact", "build", *argv]) == 2
    assert message in " ".join(capsys.readouterr().err.split())


@pytest.mark.slow
def test_the_cuda_recipe_configures_and_nvcc_compiles_a_ggml_cuda_source(tmp_path: Path) -> None:
    """Slow: the real toolkit (600 MB from PyPI on a fresh machine). Fast coverage: the installer with
    wheels of the toolkit's layout, the pins against PyPI, `effective_cmake_args`' CUDA defines and the
    refusals above; the whole build is bench/gpu.py's."""
    source = extract_source(ensure_sdist(DEFAULT_LLAMA_CPP_PYTHON_VERSION, print), tmp_path / "src", print)
    llama = source / "vendor" / "llama.cpp"
    args = effective_cmake_args("cuda", ["-DCMAKE_CUDA_ARCHITECTURES=90"])
    env = backend_environment("cuda", args, print)
    assert env is not None
    toolkit = cuda_toolkit()
    build = tmp_path / "build"
    configured = subprocess.run(
        ["cmake", "-S", str(llama), "-B", str(build), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert configured.returncode == 0, configured.stdout[-2000:] + configured.stderr[-3000:]
    cache = (build / "CMakeCache.txt").read_text()
    assert "GGML_CUDA:BOOL=ON" in cache and "CMAKE_CUDA_ARCHITECTURES:UNINITIALIZED=90" in cache
    assert f"CMAKE_CUDA_COMPILER:FILEPATH={toolkit.nvcc}" in cache
    compiled = subprocess.run(
        ["make", "VERBOSE=1", "acc.cu.o"],
        cwd=build / "ggml" / "src" / "ggml-cuda",
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert compiled.returncode == 0, compiled.stdout[-2000:] + compiled.stderr[-2000:]
    objects = list((build / "ggml" / "src" / "ggml-cuda").rglob("acc.cu.o"))
    assert objects and objects[0].stat().st_size > 0
    # nvcc was asked for that architecture's code, with the toolkit's own compiler
    assert "sm_90" in compiled.stdout and str(toolkit.nvcc) in compiled.stdout, compiled.stdout[-2000:]


@pytest.mark.parametrize(
    ("cuda", "driver", "refused"),
    [
        ("13.5", "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024",
         "the NVIDIA driver 550.54.14 is too old for a CUDA 13.5 build (it needs 580.65.06 or newer)"),
        ("13.5", "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build", None),
        ("12.9", "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 2024", None),
        ("12.9", "NVRM version: NVIDIA UNIX x86_64 Kernel Module  470.256.02  Thu May  2 14:37:44 UTC 2024",
         "the NVIDIA driver 470.256.02 is too old for a CUDA 12.9 build (it needs 525.60.13 or newer)"),
        (None, "NVRM version: NVIDIA UNIX x86_64 Kernel Module  470.256.02", None),  # not known: imported
    ],
)  # fmt: skip
def test_a_driver_too_old_for_the_builds_cuda_is_named(
    cuda: str | None, driver: str, refused: str | None
) -> None:
    from orchestrator.artifacts.cuda import driver_too_old

    assert driver_too_old(cuda, driver) == refused


@pytest.mark.slow
def test_the_toolkit_says_its_release() -> None:
    """Slow: the real toolkit. The release is the pinned wheels' when it is PyPI's, any when it is this
    machine's own (fast coverage: the same check on the installer's toolkit made of local wheels)."""
    toolkit = cuda_toolkit()
    release = toolkit_release(toolkit.nvcc)
    if toolkit.source.startswith("pypi:"):
        assert release == pinned_release()
    else:
        assert release is not None and re.fullmatch(r"\d+\.\d+", release), release


# ---------------------------------------------------------------- the pinned wheels, installed for real


def _wheel(
    folder: Path, name: str, version: str, files: dict[str, tuple[bytes, int]], requires: str = ""
) -> Path:
    """A wheel of `files` (path -> bytes, mode) with the toolkit's layout (nvidia/cu13/...)."""
    dist = f"{name.replace('-', '_')}-{version}"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + (
        f"Requires-Dist: {requires}\n" if requires else ""
    )
    contents = {
        **files,
        f"{dist}.dist-info/METADATA": (meta.encode(), 0o644),
        f"{dist}.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
            0o644,
        ),
    }
    record = []
    for path, (data, _mode) in contents.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}.dist-info/RECORD,,")
    contents[f"{dist}.dist-info/RECORD"] = ("\n".join(record).encode() + b"\n", 0o644)
    wheel = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, (data, mode) in contents.items():
            info = zipfile.ZipInfo(path)
            info.external_attr = (0o100000 | mode) << 16
            archive.writestr(info, data)
    return wheel


def _pin(wheel: Path, name: str, version: str) -> str:
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    marker = f'platform_machine == "{platform.machine()}"'
    return f"{name}=={version} ; {marker} --hash=sha256:{sha}  # {wheel.name}\n"


NVCC = b"#!/bin/sh\necho 'Cuda compilation tools, release 13.5, V13.5.37'\n"


def test_the_pinned_toolkit_installs_only_its_hashed_wheels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The PyPI toolkit's installer for real (venv, pip, layout, links, release) on wheels made here with
    the toolkit's layout: only the pinned files, checked by sha256, no dependency and no sdist; a wheel
    whose bytes are not the pinned ones installs nothing."""
    index = tmp_path / "index"
    index.mkdir()
    nvcc = _wheel(
        index,
        "nvidia-cuda-nvcc",
        "13.5.37",
        {"nvidia/cu13/bin/nvcc": (NVCC, 0o755)},
        requires="nvidia-nvvm",  # the real wheel's dependency: not offered here, never fetched (--no-deps)
    )
    cublas = _wheel(
        index, "nvidia-cublas", "13.10.0.20", {"nvidia/cu13/lib/libcublas.so.13": (b"\x7fELF", 0o644)}
    )
    # An sdist of a pinned name beside the wheels is never taken (--only-binary :all:).
    (index / "nvidia-cuda-runtime-13.5.37.tar.gz").write_bytes(b"not a wheel")
    requirements = tmp_path / "cuda-requirements.txt"
    requirements.write_text(
        "# pins\n" + _pin(nvcc, "nvidia-cuda-nvcc", "13.5.37") + _pin(cublas, "nvidia-cublas", "13.10.0.20")
    )
    monkeypatch.setenv("RPCFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setattr(cuda, "system_toolkit", lambda: None)  # this machine's nvcc, if any, is not PyPI's
    assert toolkit_pins(requirements) == ("nvidia-cuda-nvcc==13.5.37", "nvidia-cublas==13.10.0.20")

    toolkit = cuda_toolkit(requirements=requirements)
    assert toolkit.source == "pypi:nvidia-cuda-nvcc==13.5.37,nvidia-cublas==13.10.0.20"
    assert toolkit.root.parts[-2:] == ("nvidia", "cu13") and toolkit.root.is_relative_to(
        pypi_toolkit_dir(requirements)
    )
    assert toolkit_release(toolkit.nvcc) == pinned_release(requirements) == "13.5"
    assert (toolkit.root / "lib" / "libcublas.so").readlink().as_posix() == "libcublas.so.13"
    site = toolkit.root.parent.parent
    installed = sorted(p.name.split("-")[0] for p in site.glob("*.dist-info"))
    pinned = [n for n in installed if n not in ("pip", "setuptools")]  # less the environment's own
    assert pinned == ["nvidia_cublas", "nvidia_cuda_nvcc"]  # no nvvm, no runtime: no dependency
    assert cuda_toolkit(requirements=requirements) == toolkit  # once: the next call finds it

    # Other bytes under a pinned name: pip refuses them, nothing is installed, the error names the file.
    _wheel(index, "nvidia-cuda-nvcc", "13.5.37", {"nvidia/cu13/bin/nvcc": (NVCC + b"# changed\n", 0o755)})
    changed = tmp_path / "changed.txt"
    changed.write_text(requirements.read_text() + "# the same pins: a toolkit folder of its own\n")
    with pytest.raises(ArtifactError) as refused:
        cuda_toolkit(requirements=changed)
    assert "do not match the hashes" in (refused.value.stderr_tail or "").lower()
    assert not (pypi_toolkit_dir(changed) / ".complete").exists()


def test_every_wheel_is_pinned_by_sha256_for_each_linux_platform() -> None:
    lines = [line for line in CUDA_REQUIREMENTS.read_text().splitlines() if line and not line.startswith("#")]
    pins = toolkit_pins()
    assert pins[0].startswith("nvidia-cuda-nvcc==") and "nvidia-cublas==13.10.0.20" in pins
    assert "nvidia-cuda-nvrtc==13.5.37" in pins  # cublas's dependency, pinned since --no-deps skips it
    for pin in pins:
        name = pin.split("==")[0].replace("-", "_")
        for machine in ("x86_64", "aarch64"):
            [line] = [ln for ln in lines if ln.startswith(pin + " ") and f'"{machine}"' in ln]
            assert re.search(r" --hash=sha256:[0-9a-f]{64}  # ", line), line
            wheel = line.rsplit("# ", 1)[1]
            assert wheel.startswith(f"{name}-{pin.split('==')[1]}-") and wheel.endswith(f"_{machine}.whl"), (
                line
            )
    assert len(lines) == 2 * len(pins)


def test_pypi_serves_the_pinned_bytes(tmp_path: Path) -> None:
    """The smallest pinned wheel (nvidia-cuda-crt, 166 kB) downloaded by pip from the registry with this
    file's own line for this machine: its hash, marker and comment are what pip takes."""
    [line] = [
        ln
        for ln in CUDA_REQUIREMENTS.read_text().splitlines()
        if ln.startswith("nvidia-cuda-crt==") and f'"{platform.machine()}"' in ln
    ]
    requirements = tmp_path / "crt.txt"
    requirements.write_text(line + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
         "--require-hashes", "-r", str(requirements), "-d", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    [wheel] = tmp_path.glob("*.whl")
    assert wheel.name == line.rsplit("# ", 1)[1]
