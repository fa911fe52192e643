"""The GPU check: rpcfleet's plans against one real GPU, unattended, in a few minutes.

    bash .gpu-kit/run.sh                             # on a lent GPU machine (the kit: bench/gpu_kit.py)
    .venv/bin/python bench/gpu.py --kit .gpu-kit     # the same check, from a kit, on this Python
    .venv/bin/python bench/gpu.py                    # without a kit: build the cuda artifact here first
    .venv/bin/python bench/gpu.py --write            # and replace the "gpu" section of BENCHMARKS.md

For each backend asked (default: cuda, then vulkan) it:
1. takes the artifact from the kit (`--kit`) or builds it (cuda: `artifact build --backend cuda
   --cuda-arch ARCH` for the GPU's architecture);
2. makes its model with `rpcfleet model synth`: a dense llama of several GB (f16), so that the weights
   dominate (`--model` takes another, such as the cached Gemma for the dry run);
3. deploys to a `connection: local` host (rpc_backend, rpc_env: the machine's cuBLAS through
   LD_LIBRARY_PATH for cuda, VK_DRIVER_FILES for vulkan; GGML_RPC_DEBUG on, the process supervisor);
4. compares the free memory the probe reports with `nvidia-smi --query-gpu=memory.free`, read while the
   server holds its context;
5. plans, and loads through llama-server with the plan's engine arguments (no llama-cpp-python needed);
   compares the plan's weights, KV and compute with the buffers the server allocated (its GGML_RPC_DEBUG
   log, to the byte), and `memory.used` after the load less before it with the plan's total plus the CUDA
   runtime the planner predicts (`planning.memory.cuda_runtime_bytes`: cuBLAS's workspace, ggml's pool);
6. generates, and reports tokens/s beside llama-server run by hand (`--rpc` to the same server, -ngl 99,
   the same context, batch and flash attention), the two alternated `--rounds` times.

Without a GPU (no nvidia-smi) a cuda check is refused, exit status 2, having changed nothing; the vulkan
check runs on any Vulkan device, Mesa's llvmpipe included (the suite's dry run: `--backends vulkan
--model GEMMA`), and says what it could not compare. Its only network is PyPI (the toolkit wheels, when
it builds) and loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from _common import (
    ROOT,
    arg_parser,
    free_port,
    load_average,
    stamp,
    wait_healthy,
    wait_listening,
    write_section,
)

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


STARTED = time.monotonic()


def say(line: str) -> None:
    """Progress on stderr, with the seconds since the start: where a short lease's time goes."""
    print(f"[{time.monotonic() - STARTED:6.1f} s] {line}", file=sys.stderr, flush=True)


def rpcfleet(*argv: str, timeout: float = 3600) -> subprocess.CompletedProcess[str]:
    say(f"rpcfleet {' '.join(argv[:3])}")
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


# The dense llama the check makes on the GPU: 16 blocks of 3072 (24 heads, 8 KV heads), FFN 8192, a
# 32000-token vocabulary, f16: 3.6 GB of weights, most of them in 2-D matrices cuBLAS multiplies.
GPU_MODEL = ("--layers", "16", "--embd", "3072", "--heads", "24", "--kv-heads", "8", "--ff", "8192",
             "--vocab", "32000", "--type", "f16")  # fmt: skip
# Where NVIDIA's Vulkan ICD is: the lent machines' driver mount first, then the driver's packages.
NVIDIA_ICDS = (
    "/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json",
    "/usr/share/vulkan/icd.d/nvidia_icd.json",
    "/etc/vulkan/icd.d/nvidia_icd.json",
)


@dataclass
class Kit:
    """What the check runs: artifact ids per backend and the machine's cuBLAS folder (cuda)."""

    artifacts: dict[str, str]
    cuda_libs: Path | None = None
    vk_icd: str | None = None
    needs_cuda_libs: bool = False  # the kit's cuda artifact leaves cuBLAS to the machine
    commit: str | None = None  # the kit's (a machine without .git cannot say its own)


@dataclass
class Result:
    backend: str
    device: str = ""
    lines: list[str] = field(default_factory=list)  # the table's rows
    text: str = ""


def serve_completion(port: int, tokens: int) -> tuple[float, str]:
    """(tokens/s, text) of one greedy /completion of `tokens` tokens from llama-server on `port`."""
    body = {"prompt": PROMPT, "n_predict": tokens, "temperature": 0, "top_k": 1, "ignore_eos": True}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=900) as reply:
        answer = json.loads(reply.read())
    return float(answer["timings"]["predicted_per_second"]), str(answer.get("content", ""))


class LlamaServer:
    """llama-server (this source's, CPU: its model goes to the RPC servers) with `args`, until closed."""

    def __init__(self, args: list[str], log: Path | None = None) -> None:
        from orchestrator.artifacts.build import llama_server_binary

        self.port = free_port()
        # its log: kept where asked (the check's --logs), else a temporary file; closed in close()
        self.log = log.open("w+b") if log is not None else tempfile.TemporaryFile()  # noqa: SIM115
        argv = [str(llama_server_binary()), *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        if not wait_healthy(self.port, self.proc, 600):
            self.log.seek(0)
            tail = self.log.read()[-2000:].decode(errors="replace")
            self.close()
            raise RuntimeError(f"llama-server did not start: {tail}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
        self.log.close()


def memory_used(gpu_ok: bool) -> int | None:
    """The first GPU's memory.used (bytes) from nvidia-smi, None without one."""
    if not gpu_ok:
        return None
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return int(done.stdout.split()[0]) * MiB


def make_model(folder: Path, model: Path | None) -> Path:
    if model is not None:
        return model
    path = folder / "dense.gguf"
    rpcfleet("model", "synth", str(path), *GPU_MODEL, timeout=1800)
    return path


def split_allocations(sizes: list[int], weights: int) -> tuple[int, list[int], int]:
    """(weights, KV buffers, compute) from a load's allocations in order: the weights come in as many
    buffers as the device's largest buffer needs (1 GiB on ggml-vulkan: a 3.6 GB model in 4 or more),
    the leading ones up to the plan's weights; the compute buffer is the last."""
    if len(sizes) < 2:
        return 0, [], 0
    total, count = 0, 0
    while count < len(sizes) - 1 and total < weights:
        total += sizes[count]
        count += 1
    return total, sizes[count:-1], sizes[-1]


def check_backend(backend: str, kit: Kit, model: Path, gpu: Gpu | None, tokens: int, rounds: int,
                  tmp: Path, logs: Path | None = None) -> Result:  # fmt: skip
    from orchestrator.llama.logs import model_allocations, parse_server_log
    from orchestrator.planning.formats import llama_cli_args
    from orchestrator.planning.memory import cuda_runtime_bytes
    from orchestrator.planning.plan import Plan
    from orchestrator.planning.profile import profile_model

    result = Result(backend)
    port = free_port()
    node = tmp / f"node-{backend}"
    env: dict[str, str] = {}
    if backend == "cuda" and kit.cuda_libs is not None:
        env["LD_LIBRARY_PATH"] = str(kit.cuda_libs)
    elif backend == "cuda" and kit.needs_cuda_libs:
        raise RuntimeError(
            "no cuBLAS on this machine (nvidia/cu13/lib): the kit's cuda artifact carries none"
        )
    if backend == "vulkan":
        env["GGML_VK_VISIBLE_DEVICES"] = "0"  # ggml-vulkan skips a CPU device (llvmpipe) unless named
        if kit.vk_icd:
            env["VK_DRIVER_FILES"] = kit.vk_icd
    device_name = "CUDA0" if backend == "cuda" else "Vulkan0"
    inventory = tmp / f"{backend}.yml"
    inventory.write_text(
        "hosts:\n  gpu:\n"
        f"    connection: local\n    address: 127.0.0.1\n    rpc_port: {port}\n    rpc_backend: {backend}\n"
        f"    rpc_devices: [{device_name}]\n    rpc_artifact: {kit.artifacts[backend]}\n    rpc_debug: true\n"
        f"    rpc_env: {json.dumps(env)}\n    supervisor: process\n    install_dir: {node}\n"
        # root, as the check runs: the server reaches the machine's cuBLAS wherever its Python keeps it
        "    rpc_run_as: root\n"
    )
    try:
        rpcfleet("deploy", "-i", str(inventory))
        wait_listening(port, limit=60)
        probe = json.loads(rpcfleet("probe", "-i", str(inventory), "--json").stdout)
        smi = read_gpus()[0] if gpu is not None else None
        device = probe["nodes"][0]["devices"][0]
        result.device = str(device.get("description") or device.get("name"))
        plan_path = tmp / f"plan-{backend}.json"
        # the llama-cli format: a plan for llama-server (its logits rows), which loads it below
        rpcfleet("plan", "-i", str(inventory), "-m", str(model), "--ctx", str(CTX), "--flash-attn", "on",
                 "--format", "llama-cli", "-o", str(plan_path))  # fmt: skip
        plan = Plan.from_path(plan_path)
        planned = plan.devices[0].memory
        args = [*llama_cli_args(plan, model), "-b", str(plan.options.n_batch)]
        endpoint = f"127.0.0.1:{port}"
        # what a user types: every layer on the server, the same context, batch, flash attention, slots
        by_hand = ["-m", str(model), "--rpc", endpoint, "-ngl", "99", "-c", str(CTX), "-b", str(BATCH),
                   "-ub", str(BATCH), "-fa", "on", "-np", str(plan.options.parallel)]  # fmt: skip
        log = next(node.joinpath("log").glob("*.log"))
        rates: dict[str, list[float]] = {"plan": [], "hand": []}
        allocated: dict[int, list[int]] = {}
        used_delta: int | None = None
        for _ in range(rounds):
            for which, argv in (("plan", args), ("hand", by_hand)):
                # a fresh server for each load: its memory before is its context alone, and llvmpipe's
                # Vulkan server can corrupt its heap on a second client's graphs (docs/gpu.md)
                rpcfleet("restart", "-i", str(inventory))
                wait_listening(port, limit=60)
                before = memory_used(gpu is not None)
                offset = log.stat().st_size
                say(f"llama-server ({which})")
                if logs is not None:
                    logs.mkdir(parents=True, exist_ok=True)
                kept = logs / f"{backend}-llama-server-{which}-{len(rates[which])}.log" if logs else None
                server = LlamaServer(argv, kept)
                say("loaded")
                try:
                    after = memory_used(gpu is not None)
                    if which == "plan" and not allocated:
                        text = log.read_bytes()[offset:].decode(errors="replace")
                        allocated = model_allocations(parse_server_log(text))
                        if before is not None and after is not None:
                            used_delta = after - before
                    rate, said = serve_completion(server.port, tokens)
                    say(f"generated: {rate:.1f} tokens/s")
                    rates[which].append(rate)
                    result.text = result.text or said
                finally:
                    server.close()
    finally:
        subprocess.run([sys.executable, "-m", "orchestrator", "stop", "-i", str(inventory)], cwd=ROOT,
                       check=False, capture_output=True)  # fmt: skip
        if logs is not None:  # what the servers said comes back even when the check did not finish
            logs.mkdir(parents=True, exist_ok=True)
            for found in node.glob("log/*.log"):
                shutil.copy(found, logs / f"{backend}-{found.name}")
    weights, kv, compute = split_allocations(allocated.get(0, []), planned.weights)
    compute_error = (planned.compute - compute) / compute if compute else float("nan")
    rows = result.lines
    probed = f"{device['free'] / MiB:,.0f} MiB (probe, rule {device['memory_rule']})"
    if smi is not None:
        near = abs(device["free"] - smi.free) <= 64 * MiB
        verdict = f"{'within' if near else 'outside'} 64 MiB"
        rows.append(row("free memory", probed, f"{smi.free / MiB:,.0f} MiB (nvidia-smi)", verdict))
    else:
        rows.append(row("free memory", probed, "no nvidia-smi", "not compared"))
    kv_allocated = sum(kv)
    rows += [
        row("weights", f"{planned.weights:,} B (plan)", f"{weights:,} B (allocated)",
            "exact" if planned.weights == weights else "differs"),
        row("KV", f"{planned.kv:,} B (plan)", f"{kv_allocated:,} B (allocated)",
            "exact" if planned.kv == kv_allocated else "differs"),
        row("compute", f"{planned.compute:,} B (plan)", f"{compute:,} B (allocated)",
            f"{compute_error:+.1%}, "
            + ("within 10%, not under" if 0 <= compute_error <= 0.10 else "outside the target")),
    ]  # fmt: skip
    total = planned.weights + planned.kv + planned.compute
    what = "plan"
    if backend == "cuda":
        major = int(smi.compute_cap.split(".")[0]) if smi is not None else 9
        total += cuda_runtime_bytes(profile_model(model), plan.options, major)
        what = "plan + CUDA runtime"
    predicted = f"{total / MiB:,.0f} MiB ({what})"
    if used_delta is not None:
        error = (used_delta - total) / total
        measured = f"{used_delta / MiB:,.0f} MiB (nvidia-smi, after less before)"
        verdict = f"{error:+.1%}, {'within 5%' if abs(error) <= 0.05 else 'outside 5%'}"
        rows.append(row("memory.used by the load", predicted, measured, verdict))
    else:
        rows.append(row("memory.used by the load", predicted, "no nvidia-smi", "not compared"))
    plan_rate, hand_rate = statistics.median(rates["plan"]), statistics.median(rates["hand"])
    spread = f" ({min(rates['plan']):.1f}..{max(rates['plan']):.1f})" if rounds > 1 else ""
    ours = f"{plan_rate:.1f} tokens/s{spread} (llama-server, the plan's arguments)"
    reference = f"{hand_rate:.1f} tokens/s (llama-server by hand)"
    rows.append(row("decode", ours, reference, f"{plan_rate / hand_rate:.2f}x"))
    return result


def row(what: str, ours: str, reference: str, verdict: str) -> str:
    return f"| {what} | {ours} | {reference} | {verdict} |"


def read_kit(folder: Path) -> dict[str, object]:
    try:
        info = json.loads((folder / "kit.json").read_text())
    except (OSError, ValueError) as exc:
        raise Refused(
            f"--kit {folder}: no readable kit.json ({exc.__class__.__name__}); make it with bench/gpu_kit.py"
        ) from None
    return dict(info)


def main() -> int:
    # no wait for a quiet CPU by default: the GPU machine's time is scarce, and its load average after
    # the CUDA build would hold the wait to its bound; the block says the load it measured under
    parser = arg_parser(__doc__, quiet_wait=0)
    parser.add_argument(
        "--kit", type=Path, default=None, help="take the artifacts from this kit (bench/gpu_kit.py)"
    )
    parser.add_argument(
        "--backends", default="cuda,vulkan", help="what to check, in order (default cuda,vulkan)"
    )
    parser.add_argument(
        "--cuda-libs",
        type=Path,
        default=None,
        metavar="DIR",
        help="the machine's cuBLAS, for the cuda server's LD_LIBRARY_PATH (the kit's run.sh finds it)",
    )
    parser.add_argument(
        "--vk-icd",
        default=None,
        metavar="JSON",
        help="the Vulkan ICD for VK_DRIVER_FILES (default: NVIDIA's, where it is installed)",
    )
    parser.add_argument(
        "--cuda-arch", default=None, metavar="ARCH", help="build for this (default: the GPU's)"
    )
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per run (default 64)")
    parser.add_argument("--rounds", type=int, default=2, help="plan and by-hand loads alternated (default 2)")
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="GGUF model (default: a dense llama of 3.6 GB made on the machine)",
    )
    parser.add_argument(
        "--logs",
        type=Path,
        default=None,
        metavar="DIR",
        help="copy the servers' logs here (run.sh: $OUT/logs)",
    )
    parser.add_argument("--nvidia-smi", default=None, help=argparse_suppress())
    args = parser.parse_args()
    from orchestrator.artifacts.cuda import check_cuda_architectures

    try:
        if args.tokens < 1:
            raise Refused("--tokens must be at least 1")
        if args.rounds < 1:
            raise Refused("--rounds must be at least 1")
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        unknown = [b for b in backends if b not in ("cuda", "vulkan")]
        if unknown or not backends:
            raise Refused(f"--backends {args.backends}: cuda and vulkan only")
        if args.cuda_arch is not None:
            try:
                check_cuda_architectures(args.cuda_arch)
            except ValueError as exc:
                raise Refused(f"--cuda-arch: {exc}") from None
        if args.model is not None and not args.model.is_file():
            raise Refused(f"--model {args.model}: no such file")
        kit_info = read_kit(args.kit) if args.kit is not None else None
        gpus = read_gpus(args.nvidia_smi) if "cuda" in backends or shutil.which("nvidia-smi") else []
    except Refused as why:
        print(f"bench/gpu.py: {why}", file=sys.stderr)
        return 2
    gpu = gpus[0] if gpus else None
    artifacts: dict[str, str] = {}
    build_s = 0.0
    if kit_info is not None:
        artifacts = {b: str(kit_info[b]) for b in ("cuda", "vulkan")}
        needs_cuda_libs, kit_commit = bool(kit_info.get("left_to_the_machine")), str(kit_info.get("commit"))
    else:
        from orchestrator.artifacts.build import default_artifact

        needs_cuda_libs, kit_commit = False, None
        started = time.monotonic()
        if "cuda" in backends and gpu is not None:
            arch = args.cuda_arch or gpu.arch
            built = rpcfleet("artifact", "build", "--backend", "cuda", "--cuda-arch", arch, "--json").stdout
            artifacts["cuda"] = json.loads(built)["id"]
        if "vulkan" in backends:
            artifacts["vulkan"] = default_artifact("vulkan").id
        build_s = time.monotonic() - started
    icd = (
        args.vk_icd
        or os.environ.get("VK_DRIVER_FILES")
        or next((p for p in NVIDIA_ICDS if Path(p).is_file()), None)
    )
    kit = Kit(artifacts, args.cuda_libs, icd, needs_cuda_libs, kit_commit)
    return run_check(kit, backends, gpu, args, build_s)


def argparse_suppress() -> str:
    return argparse.SUPPRESS  # a test's stand-in for nvidia-smi


def run_check(
    kit: Kit, backends: list[str], gpu: Gpu | None, args: argparse.Namespace, build_s: float
) -> int:
    load = load_average()
    started = time.monotonic()
    results: list[Result] = []
    failures: list[str] = []
    made = ""
    with tempfile.TemporaryDirectory(prefix="rpcfleet-gpu-") as folder:
        tmp = Path(folder)
        tmp.chmod(0o755)  # the node's install_dir is in there
        try:
            model = make_model(tmp, args.model)
            made = f"{model.stat().st_size / 1e9:.2f} GB, made in {time.monotonic() - started:.0f} s"
        except Exception as exc:  # reported in the section, as a backend's failure is
            failures.append(f"the model: {last_line(exc)}")
            backends = []
        for backend in backends:
            try:
                results.append(check_backend(backend, kit, model, gpu, args.tokens,
                                             args.rounds, tmp, args.logs))  # fmt: skip
            except Exception as exc:  # a short lease: the next backend still runs, this one is reported
                failures.append(f"{backend}: {last_line(exc)}")
                say(f"{backend} failed: {str(exc)[-3000:]}")
            # written after each backend: a lease cut short still brings back what finished
            report(kit, backends, gpu, args, build_s, load, started, made, results, failures)
        if not backends:
            report(kit, backends, gpu, args, build_s, load, started, made, results, failures)
    return 1 if failures else 0


def last_line(exc: BaseException) -> str:
    said = str(exc).strip().splitlines()
    return said[-1] if said else exc.__class__.__name__


def report(
    kit: Kit, backends: list[str], gpu: Gpu | None, args: argparse.Namespace, build_s: float,
    load: float, started: float, made: str, results: list[Result], failures: list[str],
) -> None:  # fmt: skip
    where = (
        f"GPU: {gpu.name} (compute capability {gpu.compute_cap}, {gpu.total / MiB:,.0f} MiB)"
        if gpu
        else "no NVIDIA GPU"
    )
    lines = [
        "## gpu",
        "",
        f"{stamp()}{f' (the kit: {kit.commit})' if kit.commit else ''}, load {load:.1f}; {where}; "
        f"driver {nvidia_driver() or 'none'}; model {args.model or 'synth (dense llama, f16)'} ({made}); "
        f"artifacts {', '.join(f'{b} `{a}`' for b, a in kit.artifacts.items() if b in backends)}"
        + (f" (build or cache {build_s:.0f} s)" if build_s else " (from the kit)")
        + f"; {time.monotonic() - started:.0f} s so far",
    ]
    header = ["| what | rpcfleet | reference | verdict |", "|---|---:|---:|---|"]
    for result in results:
        lines += ["", f"**{result.backend}** ({result.device}):", "", *header, *result.lines]
        lines += ["", f"Text (greedy): {result.text[:80]!r}"]
    for failure in failures:
        lines += ["", f"**{failure}**"]
    body = "\n".join(lines)
    print(body, flush=True)
    if args.write is not None:
        write_section(args.write, "gpu", body)


def nvidia_driver() -> str | None:
    """The driver's version: nvidia-smi's, else /proc's (a sandboxed runtime may have either)."""
    if shutil.which("nvidia-smi"):
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.split()[0]
    try:
        line = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    found = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)*)", line)
    return found.group(1) if found else line.strip()


if __name__ == "__main__":
    sys.exit(main())
