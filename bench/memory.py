"""Benchmark: the plan's memory per device against what the servers allocate.

    .venv/bin/python bench/memory.py              # print the table
    .venv/bin/python bench/memory.py --write      # and replace the "memory" section of BENCHMARKS.md
    .venv/bin/python bench/memory.py --backend vulkan --write   # the same on Vulkan devices (its section)

Three real `ggml-rpc-server`s on loopback with GGML_RPC_DEBUG=1, whose logs record every buffer to the
byte. For each configuration the model is planned on the three servers (8 GiB usable each) and loaded
through `load_llama`; each device's predicted weights, KV and compute buffer are printed beside the
sizes its server allocated, and the host's compute and output buffers beside llama.cpp's load log
(0.01 MiB precision). Models: Gemma 3 270M (Q4_K_M, sliding-window attention on 15 of 18 layers) and a
generated llama (8 layers, n_embd 1024). Configurations: several contexts, flash attention off and on,
--swa-full off and on (Gemma only: a llama has no sliding window), and Gemma with 4 parallel sequences.

`--backend vulkan`: the Vulkan artifact's servers on Mesa's llvmpipe (GGML_VK_VISIBLE_DEVICES=0), each
offered as what it reports over RPC (its 2 GiB heap, alignment 16); fresh servers for every
configuration (an llvmpipe server that ran one model's graphs can corrupt its heap on the next's).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from _common import (
    arg_parser,
    free_port,
    load_average,
    server_binary,
    stamp,
    wait_listening,
    write_section,
)

from orchestrator.core.log import configure_logging

configure_logging("text", "WARNING")  # before the modules below make their loggers

from orchestrator.llama.logs import model_allocations, parse_server_log
from orchestrator.llama.native.loader import load_llama
from orchestrator.llama.observed_placement import placement_of
from orchestrator.models.catalogue import CATALOGUE, cached_path
from orchestrator.models.synth import write_tiny_llama
from orchestrator.planning.plan import PlanDevice, PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan

SECTION = "memory: predicted vs allocated"
VULKAN_SECTION = "memory on Vulkan devices: predicted vs allocated"
MiB = 1 << 20
GiB = 1 << 30
N_SERVERS = 3
GEMMA_CONTEXTS = (4096, 16384, 32768)
LLAMA_CONTEXTS = (1024, 4096, 8192)
LLAMA = {"n_layer": 8, "n_embd": 1024, "n_head": 8, "n_head_kv": 8, "n_ff": 2816}


@dataclass(frozen=True)
class Row:
    model: str
    options: str
    device: str
    layers: str
    predicted: tuple[int, int, int]  # weights, KV, compute
    allocated: tuple[int, int, int]


def _mib(n: int) -> str:
    return f"{n / MiB:.2f}"


def _configs() -> list[tuple[str, PlanOptions]]:
    out = []
    for fa in (False, True):
        for swa_full in (False, True):
            for n_ctx in GEMMA_CONTEXTS:
                out.append(("gemma", PlanOptions(n_ctx=n_ctx, flash_attn=fa, swa_full=swa_full)))
        out.append(("gemma", PlanOptions(n_ctx=8192, flash_attn=fa, parallel=4)))
        for n_ctx in LLAMA_CONTEXTS:
            out.append(("llama", PlanOptions(n_ctx=n_ctx, flash_attn=fa)))
    return out


def _vulkan_configs() -> list[tuple[str, PlanOptions]]:
    """Fewer than on CPU devices: llvmpipe compiles each fresh server's shaders on first use (seconds)."""
    out = []
    for fa in (False, True):
        out.append(("gemma", PlanOptions(n_ctx=4096, flash_attn=fa)))
        out.append(("gemma", PlanOptions(n_ctx=16384, flash_attn=fa, swa_full=True)))
        out.append(("llama", PlanOptions(n_ctx=4096, flash_attn=fa)))
    return out


def _label(name: str, o: PlanOptions) -> str:
    parts = [f"ctx {o.n_ctx}", f"fa {'on' if o.flash_attn else 'off'}"]
    if name == "gemma":
        parts.append("swa-full" if o.swa_full else "small SWA")
    if o.parallel > 1:
        parts.append(f"parallel {o.parallel}")
    return ", ".join(parts)


def _start(
    binary: Path, log: Path, port: int | None = None, env_extra: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], int, Path]:
    port = port or free_port()
    env = {**os.environ, **(env_extra or {}), "GGML_RPC_DEBUG": "1"}
    line = f"trap '' PIPE; exec stdbuf -oL {binary} -H 127.0.0.1 -p {port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(["bash", "-c", line], stdout=out, stderr=subprocess.STDOUT, env=env)
    wait_listening(port, proc)
    return proc, port, log


def _vulkan_devices(endpoints: list[str]) -> list[PlanDevice]:
    """The planner's devices as a probe reports the Vulkan servers: memory, alignment, largest buffer."""
    import asyncio

    from orchestrator.rpc.client import probe_endpoint

    out = []
    for ep in endpoints:
        (dev,) = asyncio.run(probe_endpoint(ep)).devices
        out.append(
            PlanDevice(
                endpoint=ep, index=0, name="Vulkan0", description=ep, total=dev.total, free=dev.free,
                usable=dev.free, alignment=dev.alignment or 32, max_size=dev.max_size, backend="vulkan",
            )
        )  # fmt: skip
    return out


def measure(
    models: dict[str, Path], backend: str = "cpu"
) -> tuple[list[Row], list[tuple[str, str, int, int, int, int]]]:
    from orchestrator.artifacts.build import local_server_binary

    rows: list[Row] = []
    hosts: list[tuple[str, str, int, int, int, int]] = []
    binary = server_binary() if backend == "cpu" else local_server_binary(backend="vulkan")
    env = {"GGML_VK_VISIBLE_DEVICES": "0"} if backend == "vulkan" else {}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        started = [_start(binary, Path(tmp) / f"rpc-{i}.log", env_extra=env) for i in range(N_SERVERS)]
        try:
            endpoints = [f"127.0.0.1:{port}" for _, port, _ in started]
            devices = [
                PlanDevice(
                    endpoint=ep,
                    index=0,
                    name="CPU",
                    description=ep,
                    total=8 * GiB,
                    free=8 * GiB,
                    usable=8 * GiB,
                )
                for ep in endpoints
            ]
            if backend == "vulkan":
                devices = _vulkan_devices(endpoints)
            logs = {ep: log for ep, (_, _, log) in zip(endpoints, started, strict=True)}
            for name, opts in _configs() if backend == "cpu" else _vulkan_configs():
                path = models[name]
                if backend == "vulkan":  # fresh servers on the same ports (one process registers 16)
                    for i, (proc, port, log) in enumerate(started):
                        proc.terminate()
                        proc.wait(10)
                        started[i] = _start(binary, log, port, env)
                plan = make_plan(devices, profile_model(path), opts)
                offsets = {ep: logs[ep].stat().st_size for ep in endpoints}
                llm = load_llama(plan, path)
                try:
                    placement = placement_of(llm)
                finally:
                    llm.close()
                for number, dev in enumerate(placement.devices, 1):
                    assert dev.endpoint is not None
                    with logs[dev.endpoint].open("rb") as f:
                        f.seek(offsets[dev.endpoint])
                        sizes = model_allocations(parse_server_log(f.read().decode("utf-8", "replace")))[0]
                    weights, kv, compute = sizes[0], sum(sizes[1:-1]), sizes[-1]
                    p = dev.predicted
                    rows.append(
                        Row(
                            name,
                            _label(name, opts),
                            str(number),
                            f"{dev.planned_layers[0]}-{dev.planned_layers[-1]}",
                            (p.weights, p.kv, p.compute),
                            (weights, kv, compute),
                        )
                    )
                h = placement.host
                hosts.append(
                    (
                        name,
                        _label(name, opts),
                        h.predicted_compute,
                        h.actual_compute,
                        h.predicted_output,
                        h.actual_output,
                    )
                )
        finally:
            for proc, _, _ in started:
                proc.terminate()
                proc.wait(10)
    return rows, hosts


def render(
    rows: list[Row], hosts: list[tuple[str, str, int, int, int, int]], header: str, section: str = SECTION
) -> str:
    out = [f"## {section}", "", header, ""]
    out += [
        "Per device (MiB): predicted / allocated by the server (GGML_RPC_DEBUG, to the byte). Weights and KV",
        "must be equal; compute within 10 % and never under.",
        "",
        "| model | options | server | layers | weights | KV | compute | compute error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    under = 0
    under_count = 0
    for r in rows:
        error = (r.predicted[2] - r.allocated[2]) / r.allocated[2]
        worst = max(worst, abs(error))
        under = max(under, r.allocated[2] - r.predicted[2])
        under_count += r.predicted[2] < r.allocated[2]
        cells = [f"{_mib(p)} / {_mib(a)}" for p, a in zip(r.predicted, r.allocated, strict=True)]
        row = [r.model, r.options, r.device, r.layers, *cells, f"{error * 100:+.1f} %"]
        out.append("| " + " | ".join(row) + " |")
    exact = all(r.predicted[:2] == r.allocated[:2] for r in rows)
    verdict = "met" if exact and worst <= 0.10 and under_count == 0 else "NOT met"
    out += [
        "",
        f"{len(rows)} device loads: weights and KV {'exact on every one' if exact else 'NOT exact'}; "
        f"largest compute error {worst * 100:.1f} %; {under_count} under-predicted "
        f"(largest by {max(under, 0)} bytes). Target (exact; compute within 10 %, never under): {verdict}.",
        "",
        "Host (MiB, from llama.cpp's load log): compute and output buffer, predicted / logged.",
        "",
        "| model | options | compute | output |",
        "|---|---|---|---|",
    ]
    for name, label, pc, ac, po, ao in hosts:
        out.append(f"| {name} | {label} | {_mib(pc)} / {_mib(ac)} | {_mib(po)} / {_mib(ao)} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--backend", choices=("cpu", "vulkan"), default="cpu", help="the servers' backend")
    args = parser.parse_args()
    load = load_average()
    gemma = cached_path(CATALOGUE["gemma3-270m"])
    if not gemma.is_file():
        raise SystemExit(
            f"Gemma 3 270M is not in the cache ({gemma}): run `rpcfleet model fetch gemma3-270m`"
        )
    with tempfile.TemporaryDirectory(prefix="bench-memory-model-") as tmp:
        llama = write_tiny_llama(Path(tmp) / "llama.gguf", **LLAMA)  # type: ignore[arg-type]
        rows, hosts = measure({"gemma": gemma, "llama": llama}, args.backend)
    servers = (
        "CPU `ggml-rpc-server`s on loopback (GGML_RPC_DEBUG=1), each offered as 8 GiB"
        if args.backend == "cpu"
        else "Vulkan `ggml-rpc-server`s on Mesa's llvmpipe on loopback (GGML_RPC_DEBUG=1), each offered as "
        "its probe reports it (2 GiB heap, alignment 16), fresh for every configuration"
    )
    header = (
        f"`bench/memory.py{' --backend vulkan' if args.backend == 'vulkan' else ''}`, {stamp()}; 1-min load "
        f"average {load:.1f} at the start. {N_SERVERS} {servers}; n_ubatch 512; "
        f"Gemma 3 270M Q4_K_M and a generated f16 llama ({', '.join(f'{k} {v}' for k, v in LLAMA.items())})."
    )
    section = SECTION if args.backend == "cpu" else VULKAN_SECTION
    text = render(rows, hosts, header, section)
    print(text)
    if args.write is not None:
        write_section(args.write, section, text)
        print(f"wrote section {section!r} of {args.write}")


if __name__ == "__main__":
    main()
