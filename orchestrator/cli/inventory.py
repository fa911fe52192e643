"""`rpcfleet inventory list|graph|show`: what the inventory resolves to, before anything touches a host."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from orchestrator.cli import _inputs, _output
from orchestrator.cli._output import escape

if TYPE_CHECKING:  # the stages are imported by the handlers: registering stays cheap
    from orchestrator.inventory.model import Host, Inventory

_SIZE_VARS = frozenset({"memory_reserve", "memory_limit", "rpc_cache_max"})


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("inventory", help="show the hosts, groups and variables of an inventory")
    commands = parser.add_subparsers(dest="inventory_command", metavar="ACTION", required=True)

    listing = commands.add_parser("list", help="one line per host: address, connection, endpoint, groups")
    _inputs.add_inventory_args(listing, forks=False)  # reads the inventory only: nothing to fork
    _output.add_json_arg(listing)
    listing.set_defaults(handler=handle_list)

    graph = commands.add_parser("graph", help="the group tree, like ansible-inventory --graph")
    _inputs.add_inventory_args(graph, limit=False, forks=False)
    _output.add_json_arg(graph)
    graph.add_argument("group", nargs="?", default="all", help="the group to start from (default: all)")
    graph.set_defaults(handler=handle_graph)

    show = commands.add_parser("show", help="every resolved variable of one host and where it comes from")
    _inputs.add_inventory_args(show, limit=False, forks=False)
    _output.add_json_arg(show)
    show.add_argument("host", help="host name")
    show.set_defaults(handler=handle_show)


def _load(args: argparse.Namespace) -> tuple[Inventory, list[Host]]:
    return _inputs.load_hosts(args, servers=False)  # machines; each shows its servers


def handle_list(args: argparse.Namespace) -> int:
    from rich import box
    from rich.table import Table

    from orchestrator.inventory.model import host_to_dict, servers_of

    _, hosts = _load(args)
    if args.json:
        _output.print_json([host_to_dict(host) for host in hosts])
        return 0
    table = Table(box=box.SIMPLE_HEAD)
    for column in ("host", "address", "connection", "endpoint", "backend", "groups"):
        table.add_column(column, overflow="fold")  # a narrow terminal wraps cells, never cuts them
    for host in hosts:
        table.add_row(
            *(
                escape(text)
                for text in (
                    host.name,
                    host.address,
                    host.connection,
                    ", ".join(server_label(server) for server in servers_of(host)),
                    host.rpc_backend,
                    ", ".join(host.groups),
                )
            )
        )
    _output.console.print(table)
    return 0


def server_label(server: Host) -> str:
    """One endpoint as `inventory list` shows it: `10.0.0.1:50053 (h1/gpu1: CUDA1)` for one of several
    servers, the endpoint alone for a host's only server."""
    if not server.server:
        return server.endpoint
    devices = ",".join(server.rpc_devices)
    return f"{server.endpoint} ({server.name}{': ' + devices if devices else ''})"


def graph_tree(inventory: Inventory, group: str) -> dict[str, Any]:
    """{"name", "hosts", "children"} of `group`, recursively; sorted by name, as ansible-inventory does.
    A host with several rpc-servers has them under "servers" (host -> endpoints)."""
    from orchestrator.inventory.model import servers_of

    node = inventory.groups[group]
    tree: dict[str, Any] = {
        "name": group,
        "hosts": sorted(node.hosts),
        "children": [graph_tree(inventory, child) for child in sorted(node.children)],
    }
    servers = {
        name: [server_label(server) for server in servers_of(inventory.host(name))]
        for name in node.hosts
        if inventory.host(name).rpc_servers
    }
    if servers:
        tree["servers"] = servers
    return tree


def graph_lines(tree: dict[str, Any], depth: int = 0) -> list[str]:
    """The tree as ansible-inventory --graph prints it (``@group:`` and ``|--`` rungs); a host's several
    rpc-servers one rung below it."""
    indent = "  " + "|  " * (depth - 1) + "|--" if depth else ""
    lines = [f"{indent}@{tree['name']}:"]
    rung = "  " + "|  " * depth + "|--"
    for child in tree["children"]:
        lines.extend(graph_lines(child, depth + 1))
    servers = tree.get("servers", {})
    for host in tree["hosts"]:
        lines.append(f"{rung}{host}")
        lines.extend(f"  {'|  ' * (depth + 1)}|--{label}" for label in servers.get(host, ()))
    return lines


def handle_graph(args: argparse.Namespace) -> int:
    from orchestrator.core.errors import InventoryError

    inventory, _ = _load(args)
    if args.group not in inventory.groups:
        raise InventoryError(f"no group {args.group!r} in the inventory")
    tree = graph_tree(inventory, args.group)
    if args.json:
        _output.print_json(tree)
    else:
        _output.console.print("\n".join(graph_lines(tree)), highlight=False, markup=False)
    return 0


def _display(name: str, value: Any) -> str:
    from orchestrator.core.units import format_size

    if name in _SIZE_VARS and isinstance(value, int):
        return f"{format_size(value)} ({value} B)"
    if name == "rpc_env":  # (name, value) pairs; a value named like a secret (HF_TOKEN) is masked
        from orchestrator.inventory.variables import mask_secrets

        return ",".join(f"{key}={item}" for key, item in mask_secrets(dict(value)).items()) or "-"
    if isinstance(value, tuple | list):
        return ",".join(_item(item) for item in value) or "-"
    return "-" if value is None else str(value)


def _item(item: Any) -> str:
    from orchestrator.inventory.variables import RpcServer

    if not isinstance(item, RpcServer):
        return str(item)
    devices = ",".join(item.devices) if item.devices is not None else "host's"
    threads = f" -t {item.threads}" if item.threads is not None else ""
    return f"[{item.name}: port {item.port}, devices {devices}{threads}]"


def handle_show(args: argparse.Namespace) -> int:
    from rich import box
    from rich.table import Table

    from orchestrator.inventory.model import host_to_dict, servers_of
    from orchestrator.inventory.variables import VARIABLES, VARIABLES_BY_NAME, mask_secrets

    inventory, _ = _load(args)
    host = inventory.host(args.host)
    extra = mask_secrets({key: value for key, value in host.vars.items() if key not in VARIABLES_BY_NAME})
    if args.json:
        data = host_to_dict(host)
        data["sources"] = dict(host.var_sources)
        data["location"] = str(host.location) if host.location else None
        _output.print_json(data)
        return 0
    where = f" ({host.location})" if host.location else ""
    _output.console.print(
        f"{host.name}{where}  groups: {', '.join(host.groups) or '-'}  "
        + (
            f"endpoints: {', '.join(server_label(server) for server in servers_of(host))}"
            if host.rpc_servers
            else f"endpoint: {host.endpoint}"
        ),
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    table = Table(box=box.SIMPLE_HEAD)
    for column in ("variable", "value", "from"):
        table.add_column(column)
    for variable in VARIABLES:
        value = getattr(host, variable.name)
        table.add_row(
            variable.name,
            escape(_display(variable.name, value)),
            escape(host.var_sources.get(variable.name, "default")),
        )
    for key, value in extra.items():
        table.add_row(escape(key), escape(_display(key, value)), escape(host.var_sources.get(key, "-")))
    _output.console.print(table)
    return 0
