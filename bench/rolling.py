"""Benchmark: a rolling restart (`serial: 1`) of 8 lab nodes, per node from stop to ready (needs root).

    .venv/bin/python bench/rolling.py            # print the results section
    .venv/bin/python bench/rolling.py --write    # and replace the "rolling restart" section of BENCHMARKS.md

Brings up a lab of `--nodes` network-namespace nodes with real OpenSSH, deploys the pinned CPU artifact
with `playbooks/deploy.yml`, then runs `playbooks/rolling-restart.yml` `--rounds` times. Per node and
round, from the step's `RestartReport`:

* stop to ready: the stop command begins -> the new server answers HELLO and its memory is back
  (the node's downtime; target: under 2 s on the lab);
* start to HELLO: the launch command begins -> HELLO answers (our launch over SSH plus polling);
* the floor: the server's own start time, measured without rpcfleet: the same binary started locally
  (`trap '' PIPE; exec ggml-rpc-server`) and probed every 2 ms until HELLO answers.
"""

from __future__ import annotations

import asyncio
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from _common import (
    ROOT,
    arg_parser,
    free_port,
    load_average,
    median,
    server_command,
    stamp,
    write_section,
)

from orchestrator.core.log import configure_logging

configure_logging("text", "WARNING")

from orchestrator.artifacts.build import default_artifact
from orchestrator.artifacts.store import unpack_artifact
from orchestrator.engine.executor import Session
from orchestrator.inventory.load import load_inventory
from orchestrator.lab.lifecycle import lab_down, lab_up, reap_stale
from orchestrator.lab.netns import privileged
from orchestrator.operations.restart import RestartReport
from orchestrator.playbooks.reader import load_playbook
from orchestrator.playbooks.runner import run_playbook
from orchestrator.rpc.client import probe_endpoint

SECTION = "rolling restart"
LAB_NAME = "brolling"
PLAYBOOKS = ROOT / "playbooks"


async def server_floor(binary: Path, repeat: int) -> list[float]:
    """Seconds from exec to the first HELLO answered, for the bare binary on loopback."""
    times = []
    for _ in range(repeat):
        port = free_port()
        started = time.monotonic()
        process = await asyncio.create_subprocess_exec(
            *server_command(binary, port),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            while True:
                result = await probe_endpoint(
                    f"127.0.0.1:{port}", connect_timeout=0.2, read_timeout=0.5, deadline=1, hello_only=True
                )
                if result.ok:
                    times.append(time.monotonic() - started)
                    break
                if time.monotonic() - started > 10:
                    raise RuntimeError("the server did not answer within 10 s")
                await asyncio.sleep(0.002)
        finally:
            process.terminate()
            await asyncio.wait_for(process.wait(), 5)
    return times


async def rolling(inventory: Path, rounds: int) -> tuple[list[RestartReport], list[float]]:
    hosts = list(load_inventory(inventory).hosts)
    reports: list[RestartReport] = []
    walls: list[float] = []
    async with Session(forks=16) as session:
        deploy = await run_playbook(load_playbook(PLAYBOOKS / "deploy.yml"), hosts, session=session)
        if not deploy.ok:
            raise RuntimeError(f"deploy failed: {[str(r.error) for s in deploy.steps for r in s.run.failed]}")
        playbook = load_playbook(PLAYBOOKS / "rolling-restart.yml")
        for _ in range(rounds):
            started = time.monotonic()
            result = await run_playbook(playbook, hosts, session=session)
            walls.append(time.monotonic() - started)
            if not result.ok:
                raise RuntimeError(
                    f"rolling restart failed: {[str(r.error) for r in result.steps[0].run.failed]}"
                )
            reports += [r.value for r in result.steps[0].run.results if isinstance(r.value, RestartReport)]
    return reports, walls


def stats(xs: list[float]) -> str:
    return f"{median(xs):.2f} s (min {min(xs):.2f}, max {max(xs):.2f})"


def render(
    nodes: int,
    rounds: int,
    reports: list[RestartReport],
    walls: list[float],
    floor: list[float],
    load: float,
) -> str:
    down = [r.stop_to_ready for r in reports]
    start = [r.start_to_ready for r in reports]
    stop = [r.stop_seconds for r in reports]
    under = sum(d < 2.0 for d in down)
    return "\n".join(
        [
            f"## {SECTION}",
            "",
            "`bench/rolling.py`: `playbooks/rolling-restart.yml` (`serial: 1`, `max_fail_percentage: 0`) "
            f"on a lab of {nodes} network-namespace nodes with real OpenSSH and CPU `ggml-rpc-server`s, "
            f"{rounds} round(s), {len(reports)} node restarts. {stamp()}, Python "
            f"{platform.python_version()}; 1-min load average {load:.1f} at the start. Median (min, max).",
            "",
            "| per node | time |",
            "|---|---|",
            f"| stop to ready (stop begins -> HELLO answers, memory back) | {stats(down)} |",
            f"| of which: the stop command (SIGTERM, wait for exit) | {stats(stop)} |",
            f"| of which: start to HELLO (launch over SSH, readiness polling) | {stats(start)} |",
            f"| floor: the server's own start, exec -> HELLO, no rpcfleet | {stats(floor)} |",
            f"| whole rolling restart of {nodes} nodes | {stats(walls)} |",
            "",
            f"Target under 2 s per node on the lab: {under} of {len(down)} restarts met it. The floor is "
            "what any orchestrator pays; the rest is SSH round trips (state read, stop, launch) and the "
            "readiness poll (HELLO every 50 ms, the node's state every 0.5 s).",
            "",
        ]
    )


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="rolling restarts to time (default 3)")
    parser.add_argument("--floor-repeat", type=int, default=15)
    args = parser.parse_args()
    if not privileged():
        print("bench/rolling.py needs root (network namespaces)", file=sys.stderr)
        return 2
    artifact = default_artifact("cpu")
    reap_stale()
    load = load_average()
    lab = lab_up(args.nodes, name=LAB_NAME, owner_pid=os.getpid())
    try:
        reports, walls = asyncio.run(rolling(lab.inventory, args.rounds))
    finally:
        lab_down(LAB_NAME)
    with tempfile.TemporaryDirectory() as scratch:
        binary = unpack_artifact(artifact, Path(scratch) / "artifact")
        floor = asyncio.run(server_floor(binary, args.floor_repeat))
    section = render(args.nodes, args.rounds, reports, walls, floor, load)
    print(section)
    if args.write is not None:
        write_section(args.write, SECTION, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
