"""`rpcfleet probe`: every selected server's protocol, devices and usable memory, probed at once."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from orchestrator.cli import _inputs, _output, _planning, _running
from orchestrator.cli._output import escape
from orchestrator.workflows.options import FACTS, TIMEOUT

if TYPE_CHECKING:  # imported by the handler: registering stays cheap
    from orchestrator.probe.fleet import FleetProbe

FAIL_ON = ("any", "none", "all")  # orchestrator.probe.fleet.FAIL_ON (tests/cli/test_cli.py checks they agree)

_STATE_STYLE = {"ok": "green", "busy": "yellow"}
_PIPE_WIDTH = 160


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "probe",
        help="probe every selected rpc-server: protocol, devices, free and usable memory",
        description=(
            "Probe every selected host at once: RPC (HELLO, devices, memory) from here and host facts "
            "(MemAvailable, GPUs, connected clients) over SSH, each bounded by --timeout. "
            "Exit status 1 when nodes are not ok (see --fail-on)."
        ),
    )
    _inputs.add_inventory_args(parser)
    _output.add_json_arg(parser)
    _planning.add_options(parser, [TIMEOUT, FACTS])
    parser.add_argument(
        "--fail-on",
        choices=FAIL_ON,
        default="any",
        help="exit 1 when any node (default), all nodes, or none is not ok",
    )
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from orchestrator.probe.fleet import fleet_failed, probe_fleet

    _, hosts = _inputs.load_hosts(args)
    fleet = _running.run_async(probe_fleet(hosts, timeout=args.timeout, facts=args.facts, forks=args.forks))
    if args.json:
        _output.print_json(fleet.to_json())
    else:
        _print_table(fleet)
    return 1 if fleet_failed(fleet, args.fail_on) else 0


def _state_cell(state: str, clients: tuple[str, ...] | None) -> str:
    style = _STATE_STYLE.get(state, "red")
    text = f"[{style}]{escape(state)}[/{style}]"
    if state != "ok" and clients:
        text += f" ({escape(', '.join(clients))})"
    return text


def _backend_label(backend: str) -> str:
    return "" if backend == "cpu" else f"{backend}: "


def _print_table(fleet: FleetProbe) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from orchestrator.core.units import format_size

    table = Table(box=box.SIMPLE_HEAD)
    # memory: the rule that gave `free` (device: the GPU's own figure; meminfo: the host's MemAvailable
    # share; uma: a GPU sharing the host's RAM, inside that share)
    for column in ("host", "endpoint", "protocol", "device", "total", "free", "memory", "usable", "state"):
        numeric = column in ("total", "free", "usable")
        table.add_column(column, justify="right" if numeric else "left", no_wrap=column != "device")
    notes: list[str] = []
    for node in fleet.nodes:
        protocol = str(node.rpc.version) if node.rpc.version is not None else "-"
        state = _state_cell(node.state, node.clients)
        if not node.devices:
            table.add_row(
                escape(node.host),
                escape(f"{node.endpoint} ({node.transport})"),
                protocol,
                "-",
                "-",
                "-",
                "-",
                "-",
                state,
            )
        for device in node.devices:
            free = format_size(device.free) + ("" if device.source_of_free == "rpc" else "*")
            table.add_row(
                escape(node.host),
                escape(f"{node.endpoint} ({node.transport})"),
                protocol,
                escape(f"#{device.index} {_backend_label(device.backend)}{device.description}"),
                format_size(device.total),
                free,
                device.memory_rule,
                format_size(device.usable),
                state,
            )
            notes += [f"{node.host} #{device.index}: {w}" for w in device.warnings]
        if not node.ok:
            notes.append(f"{node.host}: {node.state}: {node.rpc.message}")
        notes += [f"{node.host}: {w}" for w in node.warnings]
    totals = fleet.totals
    table.add_section()
    table.add_row(
        "total",
        f"{totals.ok_endpoints}/{totals.endpoints} ok",
        "",
        f"{totals.devices} device(s)",
        format_size(totals.total),
        format_size(totals.free),
        "",
        format_size(totals.usable),
        "",
    )
    # Piped output has no terminal width to fit: print the table whole rather than folded into 80 columns.
    out = _output.console if _output.console.is_terminal else Console(width=_PIPE_WIDTH)
    out.print(table)
    footnote = free_footnote(fleet)
    if footnote:
        out.print(footnote, highlight=False, markup=False)
    for note in notes:
        _output.err_console.print(f"[yellow]warning:[/yellow] {escape(note)}", highlight=False)


def free_footnote(fleet: FleetProbe) -> str:
    """What the starred free figures are: MemAvailable, and where one machine runs several CPU servers,
    the share of it each one shows (the total row counts that machine's RAM once)."""
    machines: dict[str, list[str]] = {}
    meminfo = False
    for node in fleet.nodes:
        if node.duplicate_of is not None or not any(d.source_of_free == "meminfo" for d in node.devices):
            continue
        meminfo = True
        if node.facts is not None and node.facts.machine_id is not None:
            machines.setdefault(node.facts.machine_id, []).append(node.host)
    if not meminfo:
        return ""
    limited = any(d.memory_rule == "cgroup" for node in fleet.nodes for d in node.devices)
    # memory rule `cgroup`: the host's memory cgroup leaves less than MemAvailable
    cgroup = "; less where the host's memory cgroup leaves less (rule cgroup)" if limited else ""
    shared = [hosts for hosts in machines.values() if len(hosts) > 1]
    if not shared:
        return f"* free = MemAvailable on the host (CPU devices){cgroup}"
    groups = "; ".join(f"{', '.join(hosts)} on one machine" for hosts in shared)
    return (
        "* free = MemAvailable on the host (CPU devices), divided evenly among the CPU servers of one "
        f"machine ({groups}){cgroup}; the total counts each machine's RAM once"
    )
