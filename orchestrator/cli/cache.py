"""`rpcfleet cache status|verify|prune|clear|warm`: the servers' tensor cache (`rpc_cache: true`).

`status` only reads. The others change nodes through the operations layer (the host lock, `--check`):
`verify` re-hashes every file on the node and removes truncated or corrupt ones; `prune` evicts the least
recently used files above `rpc_cache_max`; `clear` removes every file; `warm -m MODEL` plans as `run` does and
puts into each node's cache exactly the tensors the plan gives it, all nodes in parallel, so the first load is
a warm load.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.cli import _inputs, _output, _planning, _running
from orchestrator.cli._output import escape
from orchestrator.core.errors import UsageError
from orchestrator.core.units import format_size

if TYPE_CHECKING:
    from collections.abc import Sequence

    from orchestrator.engine.executor import RunResult
    from orchestrator.inventory.model import Host
    from orchestrator.workflows.options import ModelPlanning


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "cache", help="the servers' tensor cache: status, verify, prune, clear, warm"
    )
    sub = parser.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    for action, text in (
        ("status", "size, files and quota of each node's cache (read-only)"),
        ("verify", "re-hash every cache file on the node, remove truncated or corrupt ones"),
        ("prune", "remove the least recently used files above rpc_cache_max"),
        ("clear", "remove every cache file"),
        ("warm", "plan MODEL, then put each node's share of its tensors into that node's cache"),
    ):
        p = sub.add_parser(action, help=text, description=text)
        _inputs.add_inventory_args(p)
        _output.add_json_arg(p)
        if action != "status":
            p.add_argument("--check", action="store_true", help="print what would change, change nothing")
            _running.add_operation_args(p)
        if action == "warm":
            p.add_argument("--model", "-m", type=Path, required=True, help="the GGUF model (first shard)")
            _planning.add_plan_option_args(p)
        if action == "prune":
            p.add_argument(
                "--model",
                "-m",
                type=Path,
                default=None,
                help="keep every file this model's plan needs, even over the quota",
            )
            _planning.add_plan_option_args(p)
        p.set_defaults(handler=handle, cache_action=action)


def handle(args: argparse.Namespace) -> int:
    from orchestrator.workflows.cache import cache_fleet, warm_fleet

    _, hosts = _inputs.load_hosts(args)
    if not hosts:
        raise UsageError("no hosts selected")
    action = args.cache_action
    options, batches = _running.operation_options(args), _running.batches(args)
    if action != "warm":
        keep_for = _model_planning(args) if action == "prune" and args.model is not None else None
        run = cache_fleet(hosts, action, options, batches, keep_for=keep_for).run
        _report(args, run, action)
        return _running.exit_status([run])
    if not any(h.rpc_cache for h in hosts):
        raise UsageError(
            "no selected host has rpc_cache: true (its server would not read the cache)",
            hint="set rpc_cache: true in the inventory, then deploy",
        )
    warmed = warm_fleet(hosts, _model_planning(args), options, batches)
    _report(args, warmed.change.run, "warm", phases=warmed.phases)
    if not args.json and not any(warmed.items.values()):
        from orchestrator.caches.plan import HASH_THRESHOLD

        _output.err_console.print(
            f"nothing to warm: no tensor of {escape(str(args.model))} planned for these nodes is larger than "
            f"{format_size(HASH_THRESHOLD)}, and llama.cpp sends smaller ones as they are (never cached)",
            highlight=False,
        )
    return _running.exit_status([warmed.change.run])


def _model_planning(args: argparse.Namespace) -> ModelPlanning:
    from orchestrator.workflows.options import ModelPlanning

    request = _planning.planning_args(args)
    return ModelPlanning(
        _inputs.require_model(args.model), request.options, request.probe, request.local_devices
    )


def _report(
    args: argparse.Namespace, run: RunResult[Any], action: str, phases: dict[str, float] | None = None
) -> None:
    from orchestrator.operations.cache import CacheChange, CacheState

    rows: list[tuple[Host, dict[str, Any]]] = []
    for r in run.results:
        value = r.value
        state = (
            value
            if isinstance(value, CacheState)
            else value.after
            if isinstance(value, CacheChange)
            else None
        )
        row: dict[str, Any] = {
            "host": r.host.name,
            "status": r.status,
            "error": str(r.error) if r.error else None,
        }
        if state is not None:
            row |= {"files": len(state.files), "bytes": state.size, "max_bytes": state.max_bytes}
            row |= {"hits_since_start": state.hits} if action == "status" else {}
        if isinstance(value, CacheChange):
            row |= {
                "removed": list(value.removed),
                "corrupt": list(value.corrupt),
                "added": list(value.added),
                "hits": list(value.hits),
                "bytes_sent": value.bytes_sent,
                "bytes_local": value.bytes_local,
                "seconds": round(value.seconds, 3),
                "via": value.via,
                "warnings": list(value.warnings),
                "kept_over_quota": value.kept_over_quota,
            }
        rows.append((r.host, row))
    merged = rows_by_install(rows)
    print_warnings(run)
    if args.json:
        _output.print_json({"action": action, "hosts": merged, "phases": phases or {}})
        return
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD)
    for column in ("host", "status", "files", "size", "quota", "what"):
        table.add_column(column)
    for row in merged:
        if row["error"]:
            what = row["error"]
        elif action == "warm":
            moved = row["bytes_sent"] + row.get("bytes_local", 0)
            mbps = moved / row["seconds"] / 1e6 if row.get("seconds") else 0.0
            sent = format_size(moved)
            via = f" via {row['via']}" if row.get("via") else ""
            what = f"{len(row['added'])} added ({sent}{via}, {mbps:.0f} MB/s), {len(row['hits'])} hits"
        elif action == "status":
            hits = row.get("hits_since_start")
            what = f"{hits} hits since the server started" if hits is not None else ""
        else:
            what = f"{len(row.get('removed', []))} removed" + (
                f" ({len(row['corrupt'])} corrupt)" if row.get("corrupt") else ""
            )
        if row.get("kept_over_quota"):
            what += f"; {format_size(row['kept_over_quota'])} over quota kept (the plan needs it)"
        shared = f" ({', '.join(row['servers'])})" if row["servers"] != [row["host"]] else ""
        table.add_row(
            escape(row["host"] + shared),
            row["status"],
            str(row.get("files", "-")),
            format_size(row["bytes"]) if "bytes" in row else "-",
            format_size(row["max_bytes"]) if row.get("max_bytes") else "-",
            escape(what),
        )
    _output.console.print(table, highlight=False)
    if phases:
        _output.console.print(" · ".join(f"{k} {v:.2f} s" for k, v in phases.items()), highlight=False)
    _running.print_interrupted([run])


def print_warnings(run: RunResult[Any]) -> None:
    """A warm's warnings (a node-local copy of the model not used: each names its host and path), to
    stderr even with --json: the warm went on, from this machine."""
    from orchestrator.operations.cache import CacheChange

    for r in run.results:
        if isinstance(r.value, CacheChange):
            for warning in r.value.warnings:
                _output.err_console.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False)


_WORST = ("failed", "unreachable", "changed", "ok", "skipped")  # the status a merged row shows, first found


def rows_by_install(rows: Sequence[tuple[Host, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per install: the servers of one host (`rpc_servers`) share its cache folder, so their
    rows (each server's step read or changed the same files) make one, named by the machine, its files
    and size counted once, with `servers` the servers it stands for; what each server's step did
    (removed, added, hits...) is added up."""
    merged: dict[tuple[str, int, str], dict[str, Any]] = {}
    for host, row in rows:
        first = merged.get(host.install_key)
        if first is None:
            merged[host.install_key] = {**row, "host": host.node_name, "servers": [host.name]}
            continue
        first["servers"].append(host.name)
        if _WORST.index(row["status"]) < _WORST.index(first["status"]):
            first["status"] = row["status"]
        first["error"] = first["error"] or row["error"]
        for key in ("files", "bytes", "max_bytes"):  # the folder as the later step left it
            if key in row:
                first[key] = row[key]
        for key in ("removed", "corrupt", "added", "hits", "warnings"):
            if key in row:
                first[key] = [*first.get(key, []), *row[key]]
        for key in ("bytes_sent", "bytes_local", "seconds"):
            if key in row:
                first[key] = first.get(key, 0) + row[key]
        first["via"] = first.get("via") or row.get("via")
        if row.get("hits_since_start") is not None:  # each server's own log
            first["hits_since_start"] = (first.get("hits_since_start") or 0) + row["hits_since_start"]
        if "kept_over_quota" in row:
            first["kept_over_quota"] = max(first.get("kept_over_quota", 0), row["kept_over_quota"])
    return list(merged.values())
