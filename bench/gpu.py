"""The GPU check: rpcfleet on one real NVIDIA GPU, unattended, in a few minutes.

    .venv/bin/python bench/gpu.py                    # print the report
    .venv/bin/python bench/gpu.py --write            # and replace the "gpu" section of BENCHMARKS.md
    .venv/bin/python bench/gpu.py --cuda-arch 90     # build for this architecture (default: the GPU's)

On a Linux machine with an NVIDIA GPU and its driver (nvidia-smi), it:
1. builds the cuda artifact for that GPU's architecture only (`rpcfleet artifact build --backend cuda
   --cuda-arch ARCH`; the toolkit from PyPI unless the machine has a complete one), or takes it cached;
2. deploys it to a `connection: local` host (rpc_backend cuda, GGML_RPC_DEBUG on, the process supervisor);
3. probes it and compares the free VRAM the server reports with `nvidia-smi --query-gpu=memory.free`;
4. plans and loads the real Gemma 3 270M through `rpcfleet run`, and compares the plan's weights, KV and
   compute with the buffers the server allocated (its GGML_RPC_DEBUG log, to the byte);
5. generates, and reports tokens/s beside llama-server run by hand (`--rpc` to the same server, the same
   context, -ngl, --flash-attn, -b/-ub and greedy sampling).

Without an NVIDIA GPU it says so and exits with status 2, having changed nothing. Its only network is
PyPI (the toolkit wheels) and loopback.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from _common import ROOT, arg_parser, free_port, load_average, stamp, wait_listening, write_section

PROMPT = "The capital of France is the city of"
CTX = 2048
BATCH = 512
MiB = 1 << 20


class Refused(Exception):
    """A reason to stop before anything is changed (exit status 2)."""


@dataclass(frozen=True)
class Gpu:
    name: str
    compute_cap: str  # "9.0"
    free: int  # bytes
    total: int

    @property
    def arch(self) -> str:
        return self.compute_cap.replace(".", "")


def read_gpus(nvidia_smi: str | None = None) -> list[Gpu]:
    """The machine's NVIDIA GPUs from nvidia-smi; Refused when there is none or no driver answers."""
    tool = nvidia_smi or shutil.which("nvidia-smi")
    if tool is None:
        raise Refused(
            "no NVIDIA GPU here: nvidia-smi is not installed (this check runs on a machine with one)"
        )
    query = "--query-gpu=name,compute_cap,memory.free,memory.total"
    done = subprocess.run(
        [tool, query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30
    )
    if done.returncode != 0:
        said = (done.stdout + done.stderr).strip().splitlines()
        raise Refused(
            f"no NVIDIA GPU answers: nvidia-smi exited {done.returncode}: {said[-1] if said else ''}"
        )
    gpus = []
    for line in done.stdout.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) >= 4 and fields[-1].isdigit() and fields[-2].isdigit():
            gpus.append(Gpu(", ".join(fields[:-3]), fields[-3], int(fields[-2]) * MiB, int(fields[-1]) * MiB))
    if not gpus:
        raise Refused("no NVIDIA GPU here: nvidia-smi lists none")
    return gpus


def rpcfleet(*argv: str, timeout: float = 3600) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise RuntimeError(f"rpcfleet {' '.join(argv)} failed ({done.returncode}): {done.stderr[-3000:]}")
    return done


def llama_server_by_hand(endpoint: str, model: Path, tokens: int) -> float:
    """Tokens/s of llama-server (this source's) with `--rpc endpoint`, the same flags as rpcfleet's run."""
    from orchestrator.artifacts.build import llama_server_binary

    port = free_port()
    argv = [
        str(llama_server_binary()), "-m", str(model), "--rpc", endpoint, "-ngl", "99", "-c", str(CTX),
        "-b", str(BATCH), "-ub", str(BATCH), "-fa", "off", "-np", "1",
        "--port", str(port), "--host", "127.0.0.1",
    ]  # fmt: skip
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                        if reply.status == 200:
                            break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(
                        f"llama-server did not start: {log.read()[-2000:].decode(errors='replace')}"
                    )
                time.sleep(0.5)
            body = {"prompt": PROMPT, "n_predict": tokens, "temperature": 0, "top_k": 1, "ignore_eos": True}
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/completion",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=600) as reply:
                timings = json.loads(reply.read())["timings"]
            return float(timings["predicted_per_second"])
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def main() -> int:
    # no wait for a quiet CPU by default: the GPU machine's time is scarce, and its load average after
    # the CUDA build would hold the wait to its bound; the block says the load it measured under
    parser = arg_parser(__doc__, quiet_wait=0)
    parser.add_argument(
        "--cuda-arch", default=None, metavar="ARCH", help="build for this (default: the GPU's)"
    )
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per run (default 64)")
    parser.add_argument(
        "--model", type=Path, default=None, help="GGUF model (default: the cached Gemma 3 270M)"
    )
    parser.add_argument("--nvidia-smi", default=None, help=argparse_suppress())
    args = parser.parse_args()
    from orchestrator.artifacts.cuda import check_cuda_architectures

    try:
        if args.tokens < 1:
            raise Refused("--tokens must be at least 1")
        if args.cuda_arch is not None:
            try:
                check_cuda_architectures(args.cuda_arch)
            except ValueError as exc:
                raise Refused(f"--cuda-arch: {exc}") from None
        if args.model is not None and not args.model.is_file():
            raise Refused(f"--model {args.model}: no such file")
        gpus = read_gpus(args.nvidia_smi)
    except Refused as why:
        print(f"bench/gpu.py: {why}", file=sys.stderr)
        return 2
    return run_check(gpus[0], args.cuda_arch or gpus[0].arch, args.tokens, args.model, args.write)


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS  # a test's stand-in for nvidia-smi


def run_check(gpu: Gpu, arch: str, tokens: int, model: Path | None, write: Path | None) -> int:
    from orchestrator.llama.logs import model_allocations, parse_server_log
    from orchestrator.models.catalogue import CATALOGUE, cached_path

    load = load_average()
    model = model or cached_path(CATALOGUE["gemma3-270m"])
    started = time.monotonic()
    built = json.loads(
        rpcfleet("artifact", "build", "--backend", "cuda", "--cuda-arch", arch, "--json").stdout
    )
    build_s = time.monotonic() - started
    with tempfile.TemporaryDirectory(prefix="rpcfleet-gpu-") as tmp:
        port = free_port()
        inventory = Path(tmp) / "gpu.yml"
        inventory.write_text(
            "hosts:\n  gpu:\n"
            f"    connection: local\n    address: 127.0.0.1\n    rpc_port: {port}\n    rpc_backend: cuda\n"
            f"    rpc_devices: [CUDA0]\n    rpc_artifact: {built['id']}\n    rpc_debug: true\n"
            f"    supervisor: process\n    install_dir: {tmp}/node\n"
        )
        try:
            rpcfleet("deploy", "-i", str(inventory))
            wait_listening(port)
            smi_free = read_gpus()[0].free
            probe = json.loads(rpcfleet("probe", "-i", str(inventory), "--json").stdout)
            device = probe["nodes"][0]["devices"][0]
            log = next(Path(tmp, "node", "log").glob("*.log"))
            offset = log.stat().st_size
            run = json.loads(
                rpcfleet(
                    "run", "-i", str(inventory), "-m", str(model), "-p", PROMPT, "-n", str(tokens),
                    "--ctx", str(CTX), "--flash-attn", "off", "--temp", "0", "--json",
                ).stdout
            )  # fmt: skip
            allocated = model_allocations(
                parse_server_log(log.read_bytes()[offset:].decode(errors="replace"))
            )
            by_hand = llama_server_by_hand(f"127.0.0.1:{port}", model, tokens)
        finally:
            subprocess.run(
                [sys.executable, "-m", "orchestrator", "stop", "-i", str(inventory)], cwd=ROOT, check=False
            )
    placed = run["placement"]["devices"][0]["predicted"]
    weights, *kv, compute = allocated.get(0, [0, 0])
    compute_error = (placed["compute"] - compute) / compute if compute else float("nan")
    lines = [
        "## gpu",
        "",
        f"{stamp()}, load {load:.1f}; GPU: {gpu.name} (compute capability {gpu.compute_cap}), "
        f"artifact `{built['id']}` for sm_{arch} (build or cache: {build_s:.0f} s)",
        "",
        "| what | rpcfleet | reference | verdict |",
        "|---|---:|---:|---|",
        f"| free VRAM | {device['free'] / MiB:,.0f} MiB (probe, rule {device['memory_rule']}) | "
        f"{smi_free / MiB:,.0f} MiB (nvidia-smi) | "
        f"{'agrees' if abs(device['free'] - smi_free) <= 0.02 * gpu.total else 'differs'} (2% of total) |",
        f"| weights | {placed['weights']:,} B (plan) | {weights:,} B (allocated) | "
        f"{'exact' if placed['weights'] == weights else 'differs'} |",
        f"| KV | {placed['kv']:,} B (plan) | {sum(kv):,} B (allocated) | "
        f"{'exact' if placed['kv'] == sum(kv) else 'differs'} |",
        f"| compute | {placed['compute']:,} B (plan) | {compute:,} B (allocated) | {compute_error:+.1%}, "
        f"{'within 10%, not under' if 0 <= compute_error <= 0.10 else 'outside the target'} |",
        f"| decode | {run['tokens_per_second']:.1f} tokens/s (rpcfleet run) | {by_hand:.1f} tokens/s "
        f"(llama-server by hand) | {run['tokens_per_second'] / by_hand:.2f}x |",
        "",
        f"Text: {run['text'][:80]!r}",
    ]
    body = "\n".join(lines)
    print(body)
    if write is not None:
        write_section(write, "gpu", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
