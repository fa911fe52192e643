"""`rpcfleet lab up|down|status|repair`: an emulated fleet on this machine (demos, benchmarks, tests)."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from orchestrator.cli import _output, _parser
from orchestrator.cli._inputs import DEFAULT_INVENTORY_ENV
from orchestrator.core import fields
from orchestrator.core.errors import UsageError
from orchestrator.core.paths import DEFAULT_LAB
from orchestrator.core.units import format_size


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "lab",
        help="an emulated fleet on this machine (network namespaces with sshd, or local connections)",
        description=(
            "As root, each node is a network namespace on a bridge with its own address, hostname, HOME "
            "and OpenSSH sshd. With --local (no privileges needed), nodes are 127.0.x.y addresses with "
            "their own HOME, reached through local connections."
        ),
    )
    commands = parser.add_subparsers(dest="lab_command", metavar="ACTION", required=True)

    up = commands.add_parser("up", help="bring a lab up and write its inventory")
    up.add_argument("-n", "--nodes", type=lab_nodes, default=3, help="number of nodes (default: 3)")
    _add_name(up)
    up.add_argument(
        "--local", action="store_true", help="local-connection nodes on 127.0.x.y (no root, no sshd)"
    )
    up.add_argument(
        "--init",
        choices=("none", "systemd"),
        default="none",
        help="systemd: every node boots systemd as PID 1 (systemd-nspawn), sshd runs as its service",
    )
    up.add_argument("-o", "--output", type=Path, default=None, help="also write the inventory to this file")
    up.add_argument(
        "--var",
        action="append",
        default=[],
        metavar="[N:]KEY=VALUE",
        help="an inventory variable for every node, e.g. rpc_cache=true or supervisor=systemd, or for node N "
        "alone, e.g. 2:rpc_servers=[50052,50053] (repeatable)",
    )
    up.add_argument(
        "--backend",
        choices=("cpu", "vulkan"),
        default=None,
        help="every node's rpc_backend; vulkan runs each server on Mesa's software Vulkan device (llvmpipe, "
        "GGML_VK_VISIBLE_DEVICES=0); a mixed lab: --var N:rpc_backend=vulkan",
    )
    up.add_argument(
        "--cpus",
        type=_parser.flag(_cpus),
        default=None,
        metavar="CPUS",
        help="each node's CPU share, a cgroup quota (cpu.max): 0.6 is 60 ms of every 100 ms for all the "
        "node's processes (sshd, the servers)",
    )
    up.add_argument(
        "--memory",
        type=_parser.flag(_memory),
        default=None,
        metavar="SIZE",
        help="each node's memory limit, a cgroup's memory.max (memory.limit_in_bytes on cgroup v1), e.g. "
        "256MiB: the node's processes (sshd, the servers) share it, and the probe counts it as the node's "
        "free memory",
    )
    _output.add_json_arg(up)
    up.set_defaults(handler=handle_up)

    down = commands.add_parser("down", help="tear a lab down completely")
    _add_name(down)
    down.add_argument("--all", action="store_true", help="every lab, and whatever dead labs left behind")
    down.set_defaults(handler=handle_down)

    status = commands.add_parser("status", help="nodes, addresses, sshd, reachability on :22")
    _add_name(status)
    _output.add_json_arg(status)
    status.set_defaults(handler=handle_status)

    repair = commands.add_parser(
        "repair", help="bring dead nodes back (sshd, the whole node), leave healthy ones alone"
    )
    _add_name(repair)
    _output.add_json_arg(repair)
    repair.set_defaults(handler=handle_repair)


def lab_nodes(text: str) -> int:
    """--nodes, checked as it is parsed (a usage error, exit status 2)."""
    from orchestrator.lab.state import MAX_NODES

    return _parser.flag(fields.integer(minimum=1, maximum=MAX_NODES))(text)


def lab_name(text: str) -> str:
    """--name, checked as it is parsed (a usage error, exit status 2)."""
    from orchestrator.core.errors import LabError
    from orchestrator.lab.state import check_name

    try:
        return check_name(text)
    except LabError as exc:
        raise argparse.ArgumentTypeError(f"{exc.message} ({exc.hint})") from None


def _add_name(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--name",
        type=lab_name,
        default=DEFAULT_LAB,
        help=f"lab name, for several labs at once (default: {DEFAULT_LAB})",
    )


def _cpus(value: Any) -> float:
    """--cpus: a number of CPUs, 0.01 or more (a quota under 1 ms per 100 ms is refused by the kernel)."""
    try:
        cpus = float(str(value).strip())
    except ValueError:
        raise ValueError(f"expected a number of CPUs such as 0.6, got {value!r}") from None
    if not 0.01 <= cpus <= 4096:
        raise ValueError(f"expected a number of CPUs from 0.01 to 4096, got {value!r}")
    return cpus


def _memory(value: Any) -> int:
    """--memory: a size, 32MiB or more (a node's sshd and a login need about 10 MiB)."""
    from orchestrator.lab.cgroups import MIN_MEMORY

    memory = fields.size(value)
    if memory < MIN_MEMORY:
        raise ValueError(
            f"expected a size of {MIN_MEMORY // 2**20}MiB or more, such as 256MiB, got {value!r}"
        )
    return memory


def _variables(items: list[str]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """`--var [N:]KEY=VALUE` items, every node's and node N's; each value read as YAML (`true`, `8GiB`,
    `[CPU]`), as in an inventory."""
    import yaml

    out: dict[str, Any] = {}
    per_node: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        node, colon, name = key.strip().partition(":")
        target = out
        if colon:
            if not node.isdigit() or not name.strip():
                raise UsageError(
                    f"--var {item!r}: expected N:KEY=VALUE with N a node number, e.g. 2:rpc_port=50060"
                )
            target, key = per_node.setdefault(node, {}), name
        if not sep or not key.strip():
            raise UsageError(f"--var {item!r}: expected KEY=VALUE, e.g. --var rpc_cache=true")
        try:
            target[key.strip()] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError as exc:
            raise UsageError(
                f"--var {item!r}: the value is not valid YAML ({exc.__class__.__name__})"
            ) from None
    return out, per_node


def handle_up(args: argparse.Namespace) -> int:
    from rich import box
    from rich.table import Table

    from orchestrator.lab.lifecycle import lab_status, lab_up, reap_stale

    if args.local and args.init != "none":
        raise UsageError("--init systemd needs a network-namespace lab, not --local")
    if args.local and args.cpus is not None:
        raise UsageError("--cpus needs a network-namespace lab, not --local (its nodes are this machine)")
    if args.local and args.memory is not None:
        raise UsageError("--memory needs a network-namespace lab, not --local (its nodes are this machine)")
    if args.init != "none" and args.memory is not None:
        raise UsageError("--memory is for nodes that boot no systemd (--init none)")
    variables, node_variables = _variables(args.var)
    if args.backend is not None:
        if "rpc_backend" in variables or "backend" in variables:
            raise UsageError("--backend and --var rpc_backend=... both set every node's backend: give one")
        variables["rpc_backend"] = args.backend
    started = time.monotonic()
    reaped = reap_stale()
    made = lab_up(
        args.nodes,
        name=args.name,
        local=args.local,
        output=args.output,
        init=args.init,
        variables=variables,
        node_variables=node_variables,
        cpus=args.cpus,
        memory=args.memory,
    )
    seconds = time.monotonic() - started
    if args.json:
        _output.print_json({**lab_status(made.name).to_dict(), "seconds": round(seconds, 3)})
        return 0
    if reaped:
        _output.err_console.print(f"reaped {len(reaped)} leftovers of dead labs", highlight=False)
    kind = "network namespaces with OpenSSH" if made.kind == "netns" else "local connections"
    if args.init == "systemd":
        kind = "network namespaces booting systemd, OpenSSH as a service"
    _output.console.print(
        f"lab [bold]{made.name}[/bold]: {len(made.nodes)} nodes ({kind})"
        + (f", {made.cpus:g} CPU each" if made.cpus is not None else "")
        + (f", {format_size(made.memory)} of memory each" if made.memory is not None else "")
        + f" up in {seconds:.2f} s",
        highlight=False,
    )
    table = Table(box=box.SIMPLE_HEAD)
    for column in ("node", "address", "home"):
        table.add_column(column)
    for node in made.nodes:
        table.add_row(node.name, node.address, str(node.home))
    _output.console.print(table)
    _output.console.print(f"inventory: {made.inventory}", highlight=False)
    for extra in made.outputs:
        _output.console.print(f"inventory copy: {extra}", highlight=False)
    if made.name != DEFAULT_LAB:  # a command given no inventory uses lab `lab`'s, never this one's
        use = f"-i {made.inventory}, or export {DEFAULT_INVENTORY_ENV}={made.inventory}"
        _output.console.print(f"use it: rpcfleet COMMAND {use}", highlight=False, soft_wrap=True)
    if made.kind == "netns":
        first = made.nodes[0]
        _output.console.print(
            f"ssh: ssh -i {made.client_key} -o UserKnownHostsFile={made.known_hosts} "
            f"{made.user}@{first.address}",
            highlight=False,
        )
    flag = "" if made.name == DEFAULT_LAB else f" --name {made.name}"
    _output.console.print(f"tear down: rpcfleet lab down{flag}", highlight=False)
    return 0


def handle_down(args: argparse.Namespace) -> int:
    from orchestrator.lab.lifecycle import lab_down, lab_down_all, list_labs

    started = time.monotonic()
    if args.all:
        removed = lab_down_all()
        for item in removed:
            _output.console.print(f"  removed {item}", highlight=False)
        _output.console.print(
            f"{len(removed)} removed in {time.monotonic() - started:.2f} s", highlight=False
        )
        for name in list_labs():
            _output.console.print(f"  kept lab {name}: owned by a running process (a test session)")
        return 0
    if not lab_down(args.name):
        _output.err_console.print(f"no lab named {args.name!r}: nothing to do", highlight=False)
        return 0
    _output.console.print(f"lab {args.name} down in {time.monotonic() - started:.2f} s", highlight=False)
    return 0


def handle_status(args: argparse.Namespace) -> int:
    from rich import box
    from rich.table import Table

    from orchestrator.core.errors import LabError, UsageError
    from orchestrator.lab.lifecycle import lab_status, load_lab

    try:
        load_lab(args.name)
    except LabError as exc:  # a lab name that names no lab that is up
        raise UsageError(exc.message, hint=exc.hint) from None
    status = lab_status(args.name)
    if args.json:
        _output.print_json(status.to_dict())
        return 0 if status.healthy else 1
    _output.console.print(
        f"lab [bold]{status.name}[/bold] ({status.kind}, 10.77.{status.slot}.0/24)"
        if status.kind == "netns"
        else f"lab [bold]{status.name}[/bold] (local connections)",
        highlight=False,
    )
    table = Table(box=box.SIMPLE_HEAD)
    for column in ("node", "address", "init", "namespace", "sshd", ":22", "home"):
        table.add_column(column)
    for node in status.nodes:
        table.add_row(
            node.name,
            node.address,
            node.init,
            _mark(node.namespace_present, node.namespace or "-"),
            _mark(
                node.sshd_alive if status.kind == "netns" else None,
                f"pid {node.sshd_pid}" if node.sshd_pid else "dead",
            ),
            _mark(node.reachable, "open" if node.reachable else "closed"),
            str(node.home),
        )
    _output.console.print(table)
    _output.console.print(f"inventory: {status.inventory}", highlight=False)
    if not status.healthy:
        _output.console.print(f"repair: rpcfleet lab repair{_flag(status.name)}", highlight=False)
    return 0 if status.healthy else 1


def handle_repair(args: argparse.Namespace) -> int:
    from rich import box
    from rich.table import Table

    from orchestrator.core.errors import LabError, UsageError
    from orchestrator.lab.lifecycle import lab_repair, load_lab

    started = time.monotonic()
    try:
        load_lab(args.name)
    except LabError as exc:  # nothing to repair: the user named the wrong lab, or none is up
        raise UsageError(exc.message, hint=exc.hint) from None
    results = lab_repair(args.name)
    seconds = time.monotonic() - started
    broken = [r for r in results if r.fault is not None]
    failed = [r for r in results if not r.ok]
    if args.json:
        _output.print_json(
            {
                "name": args.name,
                "repaired": [r.name for r in broken if r.ok],
                "failed": [r.name for r in failed],
                "nodes": [dataclasses.asdict(r) for r in results],
                "seconds": round(seconds, 3),
            }
        )
        return 1 if failed else 0
    if not broken:
        _output.console.print(
            f"lab {args.name}: all {len(results)} nodes healthy, nothing to repair", highlight=False
        )
        return 0
    table = Table(box=box.SIMPLE_HEAD)
    for column in ("node", "was", "done", "sshd"):
        table.add_column(column)
    for r in broken:
        table.add_row(
            r.name,
            r.fault,
            _mark(r.ok, r.action or "nothing"),
            f"pid {r.sshd_pid}" if r.sshd_pid else "-",
        )
    _output.console.print(table)
    for r in failed:
        _output.err_console.print(f"{r.name}: {r.error}", highlight=False)
    left = len(results) - len(broken)
    _output.console.print(
        f"lab {args.name}: {len(broken) - len(failed)} of {len(broken)} broken nodes repaired in "
        f"{seconds:.2f} s; {left} healthy left alone",
        highlight=False,
    )
    return 1 if failed else 0


def _flag(name: str) -> str:
    return "" if name == DEFAULT_LAB else f" --name {name}"


def _mark(ok: bool | None, text: str) -> str:
    if ok is None:
        return "-"
    return f"[green]{text}[/green]" if ok else f"[red]{text}[/red]"
