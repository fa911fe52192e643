"""Benchmark: load and warm as the fleet grows: 1, 3 and 6 nodes, a 250 MB model and a 2 GB one, at
1 Gbit/s and 10 Gbit/s links.

    .venv/bin/python bench/load_scaling.py            # print the curves (needs root: network namespaces)
    .venv/bin/python bench/load_scaling.py --write    # and replace its section of BENCHMARKS.md

For each node count, one lab (real OpenSSH, CPU `ggml-rpc-server`s); the models: the real Gemma 3 270M
(Q4_K_M, fetched by set-up) and a generated f16 llama of about 2 GB. For each model and link rate (`tc
tbf` on both ends of every node's link, as bench/load.py):
- **wire limits**, measured in the same run by plain TCP over the same path (bench/load.py's
  `wire_limits`): the plan's bytes one node after the other, and to all nodes at once;
- **load without a cache** (servers without `-c`): a fresh worker's load phase;
- **warm**: `cache warm` of the emptied caches, all nodes in parallel (servers with `-c`), then the
  **warm load** (every big tensor a hit).
Each figure is one measurement (a lab per node count; the rates alternate inside it). `--controller-rate
RATE` shapes the lab bridge's side too (the controller's own link; default unshaped). Every figure names
its conditions (the controller's rate, the GGUF's page cache, the caches, the transport) and the
controller's bytes into the lab (the bridge's tx_bytes).

Verdicts, computed per curve (time over nodes, log-log slope from 1 to 6 nodes): flat within +-0.3,
falls below (more nodes, less time: each node's share shrinks), grows above; and each point against its
measured limit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

from _common import (
    CONDITIONS_RULE,
    FLAT,
    LoadConditions,
    arg_parser,
    bridge_tx,
    controller_rate_arg,
    load_average,
    loglog_slope,
    page_cache_resident,
    stamp,
    write_section,
)
from load import cache_op, deploy, make_lab_plan, timed_load, wire_limits
from load import shape as shape_links

from orchestrator.caches.plan import plan_cache
from orchestrator.caches.prep import warm_items
from orchestrator.inventory.load import load_inventory
from orchestrator.lab.lifecycle import lab_down, lab_up, reap_stale
from orchestrator.lab.netns import privileged
from orchestrator.llama.worker.load_progress import planned_bytes
from orchestrator.models.catalogue import CATALOGUE, cached_path, is_fetched
from orchestrator.models.synth import write_tiny_llama
from orchestrator.operations.cache import cache_step, warm_step
from orchestrator.operations.layer import OperationOptions

SECTION = "load scaling"
LAB_NAME = "bscale"
NODES = (1, 3, 6)
RATES = ("1gbit", "10gbit")
BIG: dict[str, Any] = {"n_layer": 8, "n_embd": 3072, "n_head": 24, "n_head_kv": 24, "n_ff": 8192, "seed": 9}


@dataclasses.dataclass
class Point:
    wire: float  # one node after the other
    wire_parallel: float  # all at once
    no_cache: float = 0.0
    warm: float = 0.0
    warm_load: float = 0.0
    # the controller's bytes into the lab (the bridge's tx_bytes) during each
    sent: dict[str, int] = dataclasses.field(default_factory=dict)
    resident: float = 1.0  # the least share of the GGUF in this machine's page cache before a load


def in_page_cache(path: Path) -> float:
    """Read `path` through, so that every load of it finds it in the page cache (the conditions say
    "page cache warm"); returns the share resident after."""
    with path.open("rb", buffering=0) as fh:
        while fh.read(64 << 20):
            pass
    return page_cache_resident(path)


def trend(slope: float) -> str:
    if slope < -FLAT:
        return "falls"
    return "flat" if slope <= FLAT else "grows"


def measure(
    nodes: int, models: dict[str, Path], rates: tuple[str, ...], controller_rate: str | None
) -> dict[tuple[str, str], Point]:
    lab = lab_up(nodes, name=LAB_NAME, owner_pid=os.getpid())
    points: dict[tuple[str, str], Point] = {}
    options = OperationOptions()
    try:
        base = list(load_inventory(lab.inventory).hosts)
        plain = [dataclasses.replace(h, rpc_cache=False) for h in base]
        cached = [dataclasses.replace(h, rpc_cache=True) for h in base]
        asyncio.run(deploy(plain))
        plans = {name: asyncio.run(make_lab_plan(plain, path)) for name, path in models.items()}
        for name, path in models.items():
            for rate in rates:
                shape_links(lab, rate, controller_rate)
                wire, parallel, _cpu = wire_limits(lab, planned_bytes(plans[name]))
                point = points[(name, rate)] = Point(wire, parallel, resident=in_page_cache(path))
                tx = bridge_tx(lab.bridge)
                point.no_cache = timed_load(plans[name], path)
                point.sent["no_cache"] = bridge_tx(lab.bridge) - tx
        asyncio.run(deploy(cached))
        for name, path in models.items():
            items = warm_items(plan_cache(plans[name], [path]), cached)
            for rate in rates:
                shape_links(lab, rate, controller_rate)
                point = points[(name, rate)]
                asyncio.run(cache_op(cached, cache_step("clear", options)))
                point.resident = min(point.resident, in_page_cache(path))
                tx = bridge_tx(lab.bridge)
                started = time.monotonic()
                asyncio.run(cache_op(cached, warm_step(items, options)))
                point.warm = time.monotonic() - started
                point.sent["warm"], tx = bridge_tx(lab.bridge) - tx, bridge_tx(lab.bridge)
                point.warm_load = timed_load(plans[name], path)
                point.sent["warm_load"] = bridge_tx(lab.bridge) - tx
    finally:
        lab_down(LAB_NAME)
    return points


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--big", type=Path, default=Path("/tmp/rpcfleet-bench-load/big.gguf"))
    parser.add_argument("--nodes", default=",".join(map(str, NODES)), help="node counts (default 1,3,6)")
    controller_rate_arg(parser)
    args = parser.parse_args()
    if not privileged():
        print("bench/load_scaling.py needs root (network namespaces)", file=sys.stderr)
        return 2
    gemma = CATALOGUE["gemma3-270m"]
    if not is_fetched(gemma):
        print("the real Gemma is not fetched: rpcfleet model fetch gemma3-270m", file=sys.stderr)
        return 2
    if not args.big.exists():
        args.big.parent.mkdir(parents=True, exist_ok=True)
        write_tiny_llama(args.big, **BIG)
    models = {"Gemma 3 270M": cached_path(gemma), "f16 llama": args.big}
    sizes = {name: path.stat().st_size for name, path in models.items()}
    counts = tuple(int(n) for n in args.nodes.split(","))
    reap_stale()
    load = load_average()
    results = {n: measure(n, models, RATES, args.controller_rate) for n in counts}
    side = args.controller_rate or "unshaped"
    resident = min(p.resident for r in results.values() for p in r.values())

    lines = [
        f"## {SECTION}",
        "",
        f"`bench/load_scaling.py`, {stamp()}; load average {load:.2f} at the start. One lab per node count "
        f"(CPU servers, real sshd), links shaped with tbf; models: "
        + ", ".join(f"{name} ({size / 1e6:.0f} MB)" for name, size in sizes.items())
        + ". Seconds; in brackets the time over the wire limit measured in the same run (plain TCP, the "
        "same bytes and path: one node after the other for a load, all at once for a warm). Conditions of "
        f"every figure: the controller's side {side}, the GGUF in the page cache (read through before "
        f"each; at least {resident:.0%} of its pages resident), transport tcp; the load without a cache on "
        "servers without `-c` (caches none), the warm on emptied caches (caches empty), the warm load "
        "after it (caches full, the client taking its hashes from the manifest). Under each time the "
        "controller's bytes into the lab (the bridge's tx_bytes).",
        "",
        "| model | link | nodes | wire limit (one at a time / all at once) | load without a cache | warm, "
        "all nodes in parallel | warm load |",
        "|---|---|---|---|---|---|---|",
    ]
    conditions = " / ".join(
        f"{what}: {LoadConditions(side, 'warm', caches).text()}"
        for what, caches in (("load", "none"), ("warm", "empty"), ("warm load", "full"))
    )
    verdicts = []
    for name in models:
        for rate in RATES:
            for n in counts:
                p = results[n][(name, rate)]
                lines.append(
                    f"| {name} | {rate} | {n} | {p.wire:.2f} / {p.wire_parallel:.2f} | {p.no_cache:.2f} "
                    f"({p.no_cache / p.wire:.2f}x; {p.sent['no_cache'] / 1e6:.0f} MB sent) | {p.warm:.2f} "
                    f"({p.warm / p.wire_parallel:.2f}x; {p.sent['warm'] / 1e6:.0f} MB sent) | "
                    f"{p.warm_load:.2f} ({p.sent['warm_load'] / 1e6:.0f} MB sent) |"
                )
            if len(counts) > 1:
                curve = [results[n][(name, rate)] for n in counts]
                shapes = {
                    what: trend(loglog_slope(counts, [getattr(p, what) for p in curve]))
                    for what in ("no_cache", "warm", "warm_load")
                }
                verdicts.append(
                    f"{name} at {rate}: load without a cache {shapes['no_cache']}, warm {shapes['warm']}, "
                    f"warm load {shapes['warm_load']}"
                )
    lines += [
        "",
        f"Shapes from {counts[0]} to {counts[-1]} nodes (log-log slope; flat within +-{FLAT}): "
        + "; ".join(verdicts)
        + ". A load sends one node after the other, so its wire limit stays the model's bytes over one "
        "link; a warm fills every link at once, so its limit falls with the largest node's share.",
        "",
        f"The conditions in full: {conditions}. {CONDITIONS_RULE}",
    ]
    section = "\n".join(lines)
    print(section)
    if args.write is not None:
        write_section(args.write, SECTION, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
