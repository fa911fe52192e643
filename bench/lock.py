"""The cost of the host lock: one deploy of 8 lab nodes with and without it, in the same run.

With: `make_deploy_step` (the operations layer: lock, busy check, interrupt safety). Without: the same
`deploy()` body called from a plain executor step, which is what a deploy cost before the layer existed.
Each is timed as a no-op deploy (everything current, the common case) and as a real one (a launch-line
change restarts every server), alternating, so both see the same machine load.

    python bench/lock.py [--nodes 8] [--repeat 5] [--write BENCHMARKS.md]

Target, computed: with the lock, each kind of deploy within 10 % of the same deploy without it; each
difference is also set against the spread (min-max) of the unlocked runs. The anchor: layers that only
forward llama.cpp's work are held to 5 % (the loader, serve, the transport, the worker); the lock does
work of its own on every host (an SSH connection, a shell, a `flock`, a round trip per host to take
it), so it gets twice that: a tenth of the deploy it guards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from time import monotonic
from typing import Any

from _common import arg_parser, busy_cpu_seconds, load_average, median, ms, stamp, write_section

from orchestrator.artifacts.build import default_artifact
from orchestrator.connectors.base import ConnectOptions
from orchestrator.engine.executor import HostContext, Session, StepOutcome
from orchestrator.inventory.load import load_inventory
from orchestrator.inventory.model import Host
from orchestrator.lab.lifecycle import lab_down, lab_up, reap_stale
from orchestrator.lab.netns import privileged
from orchestrator.operations.install.ensure import ArtifactChooser
from orchestrator.operations.server.steps import deploy, make_deploy_step

SECTION = "lock"
TARGET = 0.10  # the deploy with the lock within 10 % of it without: twice the 5 % of forwarding layers
LAB_NAME = "benchlock"


CPU: dict[str, list[float]] = {}  # busy CPU-seconds of the whole machine per kind of deploy


async def timed(hosts: list[Host], step: Any, kind: str | None = None) -> float:
    started, busy = monotonic(), busy_cpu_seconds()
    async with Session(forks=16, options=ConnectOptions(connect_timeout=10)) as session:
        run = await session.run(hosts, step, name="deploy")
    if not run.ok:
        raise SystemExit(f"deploy failed: {[str(r.error) for r in run.failed]}")
    if kind is not None:
        CPU.setdefault(kind, []).append(busy_cpu_seconds() - busy)
    return monotonic() - started


def unlocked_step(chooser: ArtifactChooser) -> Any:
    async def step(ctx: HostContext) -> StepOutcome[Any]:
        result = await deploy(await ctx.connection(), ctx.host, chooser)
        return StepOutcome(result, result.changed, result.describe())

    return step


async def measure(hosts: list[Host], repeat: int) -> dict[str, list[float]]:
    chooser = ArtifactChooser(default_artifact("cpu").id)
    await timed(hosts, make_deploy_step(chooser))  # install everywhere first
    times: dict[str, list[float]] = {
        k: [] for k in ("noop-locked", "noop-unlocked", "real-locked", "real-unlocked")
    }
    two_threads = [dataclasses.replace(h, rpc_threads=2) for h in hosts]
    for round_no in range(repeat):
        # which of the two no-op deploys goes first alternates too
        noop: list[tuple[str, Callable[[ArtifactChooser], Any]]] = [
            ("locked", make_deploy_step),
            ("unlocked", unlocked_step),
        ]
        for mode, make in noop if round_no % 2 == 0 else noop[::-1]:
            times[f"noop-{mode}"].append(await timed(hosts, make(chooser), f"noop-{mode}"))
        # A launch-line change (-t 2 added, then removed again), so every server restarts; which mode
        # goes first alternates. The fleet ends each round as it began, so the no-op deploys stay no-ops.
        modes = ("locked", "unlocked") if round_no % 2 == 0 else ("unlocked", "locked")
        for mode, target in zip(modes, (two_threads, hosts), strict=True):
            step = make_deploy_step(chooser) if mode == "locked" else unlocked_step(chooser)
            times[f"real-{mode}"].append(await timed(target, step, f"real-{mode}"))
    return times


def render(nodes: int, repeat: int, times: dict[str, list[float]], load: float) -> str:
    met: dict[str, bool] = {}

    def row(kind: str) -> str:
        locked, unlocked = median(times[f"{kind}-locked"]), median(times[f"{kind}-unlocked"])
        low, high = min(times[f"{kind}-unlocked"]), max(times[f"{kind}-unlocked"])
        met[kind] = locked <= unlocked * (1 + TARGET)
        where = "within" if low <= locked <= high else "outside"
        return (
            f"| {kind} deploy | {ms(unlocked)} ({ms(low)}-{ms(high)}) | {ms(locked)} "
            f"| {ms(locked - unlocked)} "
            f"({(locked / unlocked - 1) * 100:+.0f}%), {where} the unlocked spread "
            f"| **{'met' if met[kind] else 'not met'}** |"
        )

    rows = [row("noop"), row("real")]
    cores = os.cpu_count() or 1

    def cpu(kind: str) -> str:
        locked, unlocked = median(CPU[f"{kind}-locked"]), median(CPU[f"{kind}-unlocked"])
        return (
            f"{kind} {unlocked:.2f} without, {locked:.2f} with the lock: {locked - unlocked:+.2f} CPU-s, "
            f"at least {ms((locked - unlocked) / cores)} of wall time on {cores} cores"
        )

    return "\n".join(
        [
            f"## {SECTION}",
            "",
            f"{stamp()}; load before: {load:.2f}. "
            f"`python bench/lock.py --nodes {nodes} --repeat {repeat}`: one "
            f"deploy of {nodes} lab nodes (real sshd in network namespaces) through the operations layer "
            "(host lock, busy check, interrupt safety) and the same deploy body without it, alternating "
            "(the first of each pair swapped every round); "
            "medians. A real deploy changes the launch line, so every server restarts.",
            "",
            f"| | without the lock (min-max) | with the lock | cost | target: within {TARGET * 100:.0f}% |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"Target (the lock within {TARGET * 100:.0f}% of the deploy without it, no-op and real; twice "
            "the 5 % held by the layers that only forward llama.cpp's work, since the lock does work of its "
            f"own on every host): **{'met' if all(met.values()) else 'not met'}**.",
            "",
            "Busy CPU of the whole machine (controller, sshd and nodes alike, from /proc/stat), medians: "
            f"{cpu('noop')}; {cpu('real')}.",
            "",
            "The lock is a shell that takes a `flock` and holds it while its channel lives, on an SSH "
            "connection of its own per host (on the deploy's connection its heartbeats would queue behind an "
            "upload): the connections open and the shells get ready on every host at once, then the locks "
            "are taken one host after the other, a round trip each.",
            "",
        ]
    )


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if not privileged():
        print("bench/lock.py needs root (network namespaces)", file=sys.stderr)
        return 2
    reap_stale()
    load = load_average()
    lab = lab_up(args.nodes, name=LAB_NAME, owner_pid=os.getpid())
    try:
        hosts = list(load_inventory(Path(lab.inventory)).hosts)
        times = asyncio.run(measure(hosts, args.repeat))
    finally:
        lab_down(LAB_NAME)
    section = render(args.nodes, args.repeat, times, load)
    print(section)
    if args.write is not None:
        write_section(args.write, SECTION, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
