"""Benchmark: the plan's prediction per model family against what real servers allocate, per device.

    .venv/bin/python bench/families.py            # print the table
    .venv/bin/python bench/families.py --write    # and replace the "families" section of BENCHMARKS.md

Three real `ggml-rpc-server`s on loopback, started with GGML_RPC_DEBUG=1 so their logs record every
buffer allocation to the byte. Each family's tiny model (`rpcfleet model synth --arch FAMILY`, a few MB)
is planned on the three (8 GiB usable each) at n_ctx 1024, then loaded as planned with flash attention off
and on, and every device's allocations are read from its server's log: weights, KV cache + recurrent state
(KV and RS buffers), compute buffer. When Gemma 3 270M is fetched (`rpcfleet model fetch gemma3-270m`),
it is measured too, at n_ctx 8192.

Targets, computed: never under (on every device the plan's weights, KV + state and compute are each at
least what the server allocated: a plan under the allocation is a load that does not fit), weights and
KV + state equal to the byte, compute within 10 %.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from _common import arg_parser, free_port, load_average, server_binary, server_command, stamp, wait_listening
from _common import write_section as write_md_section

from orchestrator.core.log import configure_logging

configure_logging("text", "WARNING")  # before the modules below make their loggers

from orchestrator.llama.logs import model_allocations, parse_server_log
from orchestrator.llama.native.loader import load_llama
from orchestrator.models.catalogue import CATALOGUE, cached_path, is_fetched
from orchestrator.models.synth_arch import ARCHES, write_arch_model
from orchestrator.planning.plan import PlanDevice, PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan

SECTION = "families"
GiB = 1 << 30
N_SERVERS = 3
N_CTX = 1024
N_CTX_GEMMA = 8192


def _kib(n: int) -> str:
    return f"{n / 1024:,.1f}"


def _start(log_dir: Path) -> tuple[list[subprocess.Popen[bytes]], list[int], list[Path]]:
    env = {**os.environ, "GGML_RPC_DEBUG": "1"}
    procs, ports, logs = [], [], []
    for _ in range(N_SERVERS):
        port = free_port()
        log = log_dir / f"rpc-{port}.log"
        with log.open("wb") as out:
            # Line-buffered stdout: each load's allocations are in the log when the load returns.
            argv = ["stdbuf", "-oL", *server_command(server_binary(), port)]
            procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env))
        ports.append(port)
        logs.append(log)
    for port, proc in zip(ports, procs, strict=True):
        wait_listening(port, proc)
    return procs, ports, logs


def _measure(
    model: Path, n_ctx: int, flash_attn: bool, ports: list[int], logs: list[Path], label: str
) -> list[dict[str, Any]]:
    devices = [
        PlanDevice(f"127.0.0.1:{p}", 0, "CPU", total=8 * GiB, free=8 * GiB, usable=8 * GiB) for p in ports
    ]
    profile = profile_model(model)
    plan = make_plan(devices, profile, PlanOptions(n_ctx=n_ctx, flash_attn=flash_attn))
    offsets = [log.stat().st_size for log in logs]
    llm = load_llama(plan, model)
    try:
        allocations = []
        for log, offset in zip(logs, offsets, strict=True):
            with log.open("rb") as f:
                f.seek(offset)
                text = f.read().decode("utf-8", "replace")
            allocations.append(model_allocations(parse_server_log(text)).get(0, []))
    finally:
        llm.close()
    rows = []
    for dev, sizes in zip(plan.devices, allocations, strict=True):
        weights, *cache, compute = sizes
        m = dev.memory
        rows.append(
            {
                "model": label,
                "n_ctx": n_ctx,
                "kind": profile.rules.family,
                "fa": flash_attn,
                "layers": dev.layers_label,
                "weights": (m.weights, weights),
                "kv": (m.kv, sum(cache)),
                "compute": (m.compute, compute),
            }
        )
    return rows


def _table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| model (family) | n_ctx | flash attn | device layers | weights: plan / allocated (KiB) "
        "| KV + state: plan / allocated (KiB) | compute: plan / allocated (KiB) | compute error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = []
        for key in ("weights", "kv"):
            p, a = r[key]
            cells.append(f"{_kib(p)} / {_kib(a)}" + ("" if p == a else " (differs)"))
        p, a = r["compute"]
        err = (f"{(p - a) / a:+.1%}" if a else "-") + (" under" if p < a else "")
        out.append(
            f"| {r['model']} ({r['kind']}) | {r['n_ctx']} | {'on' if r['fa'] else 'off'} | {r['layers']} "
            f"| {cells[0]} | {cells[1]} | {_kib(p)} / {_kib(a)} | {err} |"
        )
    return out


def main() -> None:
    args = arg_parser(__doc__).parse_args()
    load = load_average()
    rows: list[dict[str, Any]] = []
    with_gemma = False
    with tempfile.TemporaryDirectory(prefix="bench-families-") as tmp:
        folder = Path(tmp)
        procs, ports, logs = _start(folder)
        try:
            for arch in ARCHES:
                model = write_arch_model(folder / f"{arch}.gguf", arch)
                for fa in (False, True):
                    rows += _measure(model, N_CTX, fa, ports, logs, f"synth {arch}")
            gemma = CATALOGUE["gemma3-270m"]
            with_gemma = is_fetched(gemma)
            if with_gemma:
                for fa in (False, True):
                    rows += _measure(cached_path(gemma), N_CTX_GEMMA, fa, ports, logs, "Gemma 3 270M Q4_K_M")
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(10)
    exact = sum(r[k][0] == r[k][1] for r in rows for k in ("weights", "kv"))
    within = sum(abs(r["compute"][0] - r["compute"][1]) <= 0.10 * r["compute"][1] for r in rows)
    # never under: per device, each part the plan predicts at least what the server allocated
    under = [
        (r, k, r[k][1] - r[k][0]) for r in rows for k in ("weights", "kv", "compute") if r[k][0] < r[k][1]
    ]
    devices_under = len({id(r) for r, _, _ in under})
    if under:
        r, k, by = max(under, key=lambda u: u[2])
        worst = (
            f", the largest {k} of {r['model']} (flash attn {'on' if r['fa'] else 'off'}) by {_kib(by)} KiB"
        )
    else:
        worst = ""
    never_under = "met" if not under else "not met"
    all_met = not under and exact == 2 * len(rows) and within == len(rows)
    lines = [
        f"## {SECTION}",
        "",
        f"{stamp()}; load average {load:.2f} at the start. `bench/families.py`: 3 `ggml-rpc-server`s on "
        f"loopback (GGML_RPC_DEBUG allocation logs), the tiny `model synth --arch` models at n_ctx {N_CTX}"
        + (f" and Gemma 3 270M (Q4_K_M) at n_ctx {N_CTX_GEMMA}" if with_gemma else "")
        + ", one sequence, planned on 8 GiB per device and loaded as planned.",
        "",
        f"Never under (per device, the plan's weights, KV + state and compute each at least what the "
        f"server allocated): **{never_under}**: {devices_under} of {len(rows)} devices under{worst}. "
        f"Weights and KV + recurrent state equal to the byte in {exact} of {2 * len(rows)} cells; compute "
        f"within 10 % on {within} of {len(rows)} devices; all three targets: "
        f"**{'met' if all_met else 'not met'}**.",
        "",
        *_table(rows),
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_md_section(args.write, SECTION, text)


if __name__ == "__main__":
    main()
