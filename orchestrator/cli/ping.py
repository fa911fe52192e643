"""`rpcfleet ping`: reach every selected host and report OS, architecture, user and latency."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from orchestrator.cli import _inputs, _output, _running
from orchestrator.cli._output import escape

if TYPE_CHECKING:  # imported by the handler: registering stays cheap
    from orchestrator.probe.ping import PingResult


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "ping",
        help="connect to every selected host and report what it is",
        description="Connect to every selected host over its connection (SSH or local) and report its OS, "
        "architecture, distribution, user, connect time and round-trip latency. Changes nothing.",
    )
    _inputs.add_inventory_args(parser)
    _output.add_json_arg(parser)
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from rich import box
    from rich.table import Table

    from orchestrator.engine.executor import Recap, Session
    from orchestrator.probe.ping import PingResult, ping_step

    _, hosts = _inputs.load_hosts(args, servers=False)  # a machine answers once, whatever it serves

    async def go() -> Any:
        async with Session(forks=args.forks) as session:
            return await session.run(hosts, ping_step, name="ping")

    run = _running.run_async(go())
    if args.json:
        _output.print_json(
            [
                {
                    "host": r.host.name,
                    "status": r.status,
                    **(_ping_json(r.value) if isinstance(r.value, PingResult) else {}),
                    "error": str(r.error) if r.error else None,
                }
                for r in run.results
            ]
        )
        return 0 if run.ok else 1
    table = Table(box=box.SIMPLE_HEAD)
    columns = ("host", "address", "status", "os", "arch", "distribution", "user", "backend", "gpus")
    for column in (*columns, "connect", "latency"):
        table.add_column(column)
    for r in run.results:
        p = r.value if isinstance(r.value, PingResult) else None
        table.add_row(
            escape(r.host.name),
            escape(r.host.address),
            r.status,
            p.os if p else "-",
            p.arch if p else "-",
            (p.distribution or "-") if p else "-",
            p.user if p else "-",
            p.backend if p else "-",
            escape(p.gpus or "-") if p else "-",
            f"{p.connect_seconds * 1000:.0f} ms" if p else "-",
            f"{p.latency_seconds * 1000:.1f} ms" if p else "-",
        )
    _output.console.print(table)
    _running.print_recap(Recap().add(run))
    return 0 if run.ok else 1


def _ping_json(p: PingResult) -> dict[str, Any]:
    return {
        "os": p.os,
        "arch": p.arch,
        "distribution": p.distribution,
        "user": p.user,
        "backend": p.backend,
        "gpus": p.gpus,
        "connect_seconds": round(p.connect_seconds, 4),
        "latency_seconds": round(p.latency_seconds, 4),
    }
