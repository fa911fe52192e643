"""bench/gpu.py, the GPU check, on a machine without a GPU: its arguments are checked, and it refuses
(exit status 2, nothing built, deployed or written) when no NVIDIA GPU answers. What it does on a GPU
machine is its own run (BENCHMARKS.md's gpu section, when one was lent)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu.py"


def gpu_check(*argv: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    import os

    env = dict(os.environ)
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cuda-arch", "8.9"], "--cuda-arch: '8.9' is not a CUDA architecture list"),
        (["--tokens", "0"], "--tokens must be at least 1"),
        (["--model", "/nonexistent.gguf"], "--model /nonexistent.gguf: no such file"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(argv: list[str], message: str) -> None:
    done = gpu_check(*argv)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_without_nvidia_smi_it_refuses_and_writes_nothing(tmp_path: Path) -> None:
    bench = tmp_path / "BENCHMARKS.md"
    bench.write_text("# Benchmarks\n")
    done = gpu_check("--write", str(bench), path="/usr/bin:/bin")  # no nvidia-smi on this PATH
    assert done.returncode == 2, done.stderr
    assert "no NVIDIA GPU here: nvidia-smi is not installed" in done.stderr
    assert bench.read_text() == "# Benchmarks\n"


@pytest.mark.parametrize(
    ("script", "message"),
    [
        # what nvidia-smi prints when the driver is not loaded
        ("echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'; exit 9",
         "no NVIDIA GPU answers: nvidia-smi exited 9: NVIDIA-SMI has failed"),
        ("exit 0", "no NVIDIA GPU here: nvidia-smi lists none"),
    ],
)  # fmt: skip
def test_a_driver_that_does_not_answer_is_refused(tmp_path: Path, script: str, message: str) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    done = gpu_check("--nvidia-smi", str(fake))
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_the_gpu_is_read_from_nvidia_smi() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(ROOT / "bench"))
    fake = ROOT / "tests" / "data" / "bench" / "nvidia-smi-h100"
    (h100,) = gpu.read_gpus(str(fake))
    assert (h100.name, h100.arch, h100.free, h100.total) == (
        "NVIDIA H100 80GB HBM3",
        "90",
        81_004 << 20,
        81_559 << 20,
    )
