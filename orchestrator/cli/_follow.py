"""`rpcfleet logs` options: --follow (new lines as they come, until Ctrl-C) and --noise (keep the lines
the server writes for every connection, which probes and readiness checks make in pairs)."""

from __future__ import annotations

import argparse
from datetime import datetime
from typing import TYPE_CHECKING

from orchestrator.cli import _output, _running

if TYPE_CHECKING:
    from orchestrator.inventory.model import Host


def add_follow_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-f", "--follow", action="store_true", help="then print new lines as they come, until Ctrl-C"
    )
    parser.add_argument(
        "--noise", action="store_true", help="keep the server's 'Accepted/closed client connection' lines"
    )


def follow(args: argparse.Namespace, hosts: list[Host]) -> int:
    """Follow every host's log: each new line as `HH:MM:SS host | line` (the time it was read here)."""
    from orchestrator.engine.executor import Session
    from orchestrator.operations.follow import make_follow_step

    width = max((len(h.name) for h in hosts), default=0)

    def show(host: str, lines: list[str]) -> None:
        now = datetime.now().strftime("%H:%M:%S")
        for line in lines:
            _output.console.print(f"{now} {host:<{width}} | {line}", highlight=False, markup=False)

    async def go() -> None:
        async with Session(forks=max(args.forks, len(hosts))) as session:
            await session.run(hosts, make_follow_step(show, noise=args.noise), name="follow")

    try:
        _running.run_async(go())
    except KeyboardInterrupt:  # the way a follow ends
        return 0
    return 0
