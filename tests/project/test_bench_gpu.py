"""bench/gpu.py, the GPU check, on a machine without a GPU: its arguments are checked, and it refuses
(exit status 2, nothing built, deployed or written) when no NVIDIA GPU answers. What it does on a GPU
machine is its own run (BENCHMARKS.md's gpu section, when one was lent)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu.py"


def gpu_check(*argv: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
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


@pytest.mark.llama
def test_the_check_runs_here_on_vulkan_over_llvmpipe(gemma_model: Path, tmp_path: Path) -> None:
    """The dry run: the same script as on a GPU machine, on the Vulkan artifact over Mesa's llvmpipe with
    the real Gemma as its model: it deploys a local host, probes it, plans for llama-server and loads
    through it (the plan's arguments, then by hand, a fresh server each), and writes its section. Weights
    and KV are the server's allocations to the byte and compute is never under them; what needs
    nvidia-smi says it was not compared."""
    bench = tmp_path / "BENCHMARKS.md"
    bench.write_text("# Benchmarks\n")
    argv = ["--backends", "vulkan", "--model", str(gemma_model), "--tokens", "2", "--rounds", "1"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv, "--write", str(bench)],
        capture_output=True, text=True, timeout=900, cwd=ROOT, env={**os.environ, "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    section = bench.read_text()
    assert "## gpu" in section and "no NVIDIA GPU" in section and "**vulkan** (llvmpipe" in section
    rows = {line.split("|")[1].strip(): line for line in section.splitlines() if line.startswith("| ")}
    assert rows["weights"].endswith("| exact |") and rows["KV"].endswith("| exact |"), section
    planned, allocated = (int(x.split(" B")[0].replace(",", "")) for x in rows["compute"].split("|")[2:4])
    assert allocated > 0 and planned >= allocated, rows["compute"]
    assert rows["free memory"].endswith("| no nvidia-smi | not compared |")
    assert "tokens/s (llama-server by hand)" in rows["decode"]


def test_the_kit_checks_the_binaries_against_older_cublas(tmp_path: Path) -> None:
    """bench/gpu_kit.py's check of the image's cuBLAS: a symbol the binaries take from libcublas.so.13
    that the older library does not define is named; one it defines is not. Real ELF files: a library
    and a program built here with the C compiler, each symbol versioned as NVIDIA's are."""
    kit = _bench_module("gpu_kit")
    version = tmp_path / "v.map"
    version.write_text("libcublas.so.13 { global: *; };\n")
    old, new, bins = tmp_path / "old", tmp_path / "new", tmp_path / "bin"
    for folder, symbols in (
        (old, ["cublasCreate_v2"]),
        (new, ["cublasCreate_v2", "cublasGemmGroupedBatchedEx"]),
    ):
        folder.mkdir()
        source = folder / "lib.c"
        source.write_text("".join(f"int {name}(void) {{ return 0; }}\n" for name in symbols))
        for soname in kit.MACHINE_LIBS:
            subprocess.run(
                ["cc", "-shared", "-fPIC", f"-Wl,--version-script={version}", f"-Wl,-soname,{soname}",
                 "-o", str(folder / soname), str(source)], check=True,
            )  # fmt: skip
    bins.mkdir()
    main = tmp_path / "main.c"
    declared = "int cublasCreate_v2(void); int cublasGemmGroupedBatchedEx(void);\n"
    main.write_text(
        declared + "int main(void) { return cublasCreate_v2() + cublasGemmGroupedBatchedEx(); }\n"
    )
    subprocess.run(
        ["cc", "-o", str(bins / "ggml-rpc-server"), str(main), f"-L{new}", "-l:libcublas.so.13"], check=True
    )
    assert kit.check_machine_libs(bins, new) == []
    assert kit.check_machine_libs(bins, old) == ["cublasGemmGroupedBatchedEx@libcublas.so.13"]


def _bench_module(name: str) -> Any:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_a_loads_allocations_are_split_into_weights_kv_and_compute() -> None:
    """The weights come in as many buffers as the device's largest buffer needs (1 GiB on ggml-vulkan):
    the leading ones up to the plan's weights; then the KV buffers; the compute buffer last."""
    gpu = _bench_module("gpu")
    gib = 1 << 30
    sizes = [gib, gib, gib, 500, 64, 32, 7]
    assert gpu.split_allocations(sizes, 3 * gib + 500) == (3 * gib + 500, [64, 32], 7)
    assert gpu.split_allocations([100, 20, 5], 100) == (100, [20], 5)
    assert gpu.split_allocations([], 100) == (0, [], 0)
