"""`rpcfleet model push -m MODEL`: the handler (`cli.model` registers its flags)."""

from __future__ import annotations

import argparse
from typing import Any

from orchestrator.cli import _inputs, _output
from orchestrator.cli._output import escape
from orchestrator.core.errors import HostError, UsageError
from orchestrator.core.units import format_size

MIN_CHUNK = 1 << 20


def push(args: argparse.Namespace) -> int:
    from orchestrator.operations.push import Pushed
    from orchestrator.operations.push_node import CHUNK
    from orchestrator.workflows.push import push_fleet

    model = _inputs.require_model(args.model)
    chunk = CHUNK if args.chunk is None else args.chunk
    if chunk < MIN_CHUNK:
        raise UsageError(f"--chunk must be at least 1MiB, got {chunk} bytes")
    _, hosts = _inputs.load_hosts(args, servers=False)
    if not hosts:
        raise UsageError("no hosts selected")
    report = push_fleet(hosts, model, chunk=chunk, port=args.port, forks=args.forks)
    run = report.run
    rows: list[dict[str, Any]] = []
    for name, outcome in run.outcomes.items():
        if isinstance(outcome, Pushed):
            rows.append(
                {
                    "host": name,
                    "path": outcome.path,
                    "state": outcome.state,
                    "resumed_from": outcome.resumed_from,
                    "written": outcome.written,
                    "error": None,
                }
            )
        else:
            rows.append({"host": name, "path": None, "state": "failed", "error": outcome.message})
    failed = [o for o in run.outcomes.values() if isinstance(o, HostError)]
    for error in failed:
        hint = f" ({error.hint})" if error.hint else ""
        _output.err_console.print(
            f"[red]error:[/red] {escape(error.host or '?')}: {escape(error.message + hint)}",
            highlight=False,
            soft_wrap=True,
        )
    if args.json:
        _output.print_json(
            {
                "model": str(model),
                "bytes": model.stat().st_size,
                "chunk": report.chunk,
                "sent": run.sent,
                "stream_from": run.started_at,
                "seconds": round(run.seconds, 3),
                "hash_seconds": round(report.hash_seconds, 3),
                "hosts": rows,
                "same_destination_as": report.skipped,
            }
        )
        return 1 if failed else 0
    for row in rows:
        if row["error"]:
            continue
        what = (
            "already there (checked)"
            if row["state"] == "present"
            else f"pushed {format_size(row['written'])}"
            + (f" (resumed at {format_size(row['resumed_from'])})" if row["resumed_from"] else "")
        )
        _output.console.print(f"{escape(row['host'])}: {escape(row['path'])}: {what}", highlight=False)
    rate = run.sent / run.seconds / 1e6 if run.seconds else 0.0
    _output.console.print(
        f"sent {format_size(run.sent)} from this machine in {run.seconds:.2f} s ({rate:.0f} MB/s); "
        f"hashed here in {report.hash_seconds:.2f} s",
        highlight=False,
    )
    return 1 if failed else 0
