"""The cuda artifact's build recipe, checked as far as a machine without a GPU allows: the toolkit (this
machine's when complete, else NVIDIA's CUDA 13 wheels from PyPI), a real cmake configure of the pinned
llama.cpp with GGML_CUDA=ON for one architecture, and nvcc compiling one of ggml-cuda's real sources for
it. The whole build (about 40 minutes on 2 cores for one architecture) is left to `bench/gpu.py`, on a
machine with an NVIDIA GPU."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from orchestrator.artifacts.build import backend_environment, effective_cmake_args
from orchestrator.artifacts.cuda import check_cuda_architectures, cuda_toolkit
from orchestrator.artifacts.manifest import DEFAULT_LLAMA_CPP_PYTHON_VERSION
from orchestrator.artifacts.source import ensure_sdist, extract_source
from orchestrator.cli import main


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("89", "89"),
        ("90a", "90a"),
        ("86;89", "86;89"),
        ("86, 90", "86;90"),
        ("120f", "120f"),
        ("89-real", "89-real"),
    ],
)
def test_cuda_architectures_in_cmakes_form(given: str, expected: str) -> None:
    assert check_cuda_architectures(given) == expected


@pytest.mark.parametrize("given", ["", "8.9", "sm_89", "native", "89;", "all-major", "9"])
def test_other_cuda_architectures_are_refused(given: str) -> None:
    with pytest.raises(ValueError, match="compute capability without its dot"):
        check_cuda_architectures(given) if given != "89;" else check_cuda_architectures(";")


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


def test_the_cuda_recipe_configures_and_nvcc_compiles_a_ggml_cuda_source(tmp_path: Path) -> None:
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


def test_the_toolkit_says_its_release() -> None:
    from orchestrator.artifacts.cuda import toolkit_release

    assert toolkit_release(cuda_toolkit().nvcc) == "13.5"
