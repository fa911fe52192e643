"""Inventories: native YAML, Ansible YAML and Ansible INI -> validated, typed `Inventory`.

Formats (detected by `load_inventory`: ``.ini``/``.cfg`` or a ``[section]`` line is INI; ``.yml``/``.yaml``/
``.json`` is YAML; otherwise a document that parses as a YAML mapping is YAML, anything else INI):

Native YAML (top-level keys are only ``vars``, ``hosts`` and ``groups``)::

    vars:                      # variables for every host (the `all` group)
      ssh_user: ops
    hosts:                     # host name -> its variables (or nothing); names may hold ranges
      gpu01: {address: 10.0.0.11, backend: cuda}
      cpu[01:04]:
    groups:
      gpu:
        hosts: [gpu01]         # a list of hosts defined above, or a mapping name -> vars (defines them)
        children: [big]        # names of groups defined in this file
        vars: {rpc_devices: CUDA0}

Ansible YAML (``all:`` at the top, or top-level groups made of ``hosts:``/``children:``/``vars:``) and
Ansible INI (``[group]``, ``[group:vars]``, ``[group:children]``, ``host k=v ...``) are read as Ansible reads
them, for the variables rpcfleet understands; others are kept in `Host.vars`.

Host names may hold ranges: ``node[01:16]`` (zero padding kept), ``rack[1:9:2]`` (a step), ``n[a:c]``.

Variables are defined once, in `VARIABLES` (native name, Ansible aliases, parser, default); each becomes a
typed `Host` field. Precedence: ``all`` < parent group < child group < host; groups of the same depth apply in
alphabetical order (Ansible's rule). ``address`` defaults to the host name (``127.0.0.1`` for
``connection: local``); ``rpc_host`` defaults to ``address``. The only template understood in a value is
``{{ inventory_hostname }}`` (and ``inventory_hostname_short``).

Every error names file, line and column and quotes the offending text; all errors in a file are collected
and raised together as one `InventoryError` (its `errors` lists each). Unknown variables close to a known one
give a warning (``Inventory.warnings``), never an error.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from orchestrator.core.errors import InventoryError, SourceLocation
from orchestrator.core.paths import default_lab_inventory_file
from orchestrator.inventory.model import Group, Host, Inventory, server_hosts
from orchestrator.inventory.readers import SECTION, Builder, RawHost, RawVar, parse_ini, parse_yaml
from orchestrator.inventory.variables import (
    LOCAL_ADDRESS,
    VARIABLES,
    VARIABLES_BY_NAME,
    RpcServer,
    is_gpu_device,
    parse_address,
)


def _check_cycles(builder: Builder) -> None:
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        group = builder.groups.get(name)
        for child, location in list(group.children.items()) if group else []:
            if state.get(child) == 1:
                cycle = [*stack[stack.index(child) :], child]
                builder.error(f"group cycle: {' -> '.join(cycle)}", location)
                del group.children[child]  # type: ignore[union-attr]  # break it to report the others
            elif child not in state:
                visit(child)
        stack.pop()
        state[name] = 2

    for name in list(builder.groups):
        if name not in state:
            visit(name)


_TEMPLATE = re.compile(r"\{\{\s*(.*?)\s*\}\}")


def _render(value: Any, host: str) -> Any:
    if not isinstance(value, str) or "{{" not in value:
        return value

    def substitute(match: re.Match[str]) -> str:
        expression = match.group(1)
        if expression == "inventory_hostname":
            return host
        if expression == "inventory_hostname_short":
            return host.split(".")[0]
        raise ValueError(
            f"template {match.group(0)!r} is not supported (only {{{{ inventory_hostname }}}} is)"
        )

    return _TEMPLATE.sub(substitute, value)


def resolve(builder: Builder) -> Inventory:
    """The typed inventory of what a reader put in `builder` (groups, hosts, raw variables): every
    variable resolved by precedence and checked; InventoryError listing every error found."""
    everyone = builder.group("all", builder.groups["all"].location if "all" in builder.groups else None)
    _check_cycles(builder)
    parents: dict[str, set[str]] = {name: set() for name in builder.groups}
    for group in builder.groups.values():
        for child in group.children:
            parents.setdefault(child, set()).add(group.name)
    # Hosts listed directly under `all` and in no other group are "ungrouped", as in Ansible.
    member: dict[str, set[str]] = {name: set() for name in builder.hosts}
    for group in builder.groups.values():
        for host_name in group.hosts:
            member[host_name].add(group.name)
    ungrouped = builder.group("ungrouped", None)
    for host_name, direct in member.items():
        if not direct - {"all", "ungrouped"} and host_name not in ungrouped.hosts:
            ungrouped.hosts.append(host_name)
            direct.add("ungrouped")
    everyone.hosts = []
    for direct in member.values():
        direct.discard("all")
        if direct - {"ungrouped"}:  # a host in a real group is not "ungrouped", even if listed there
            direct.discard("ungrouped")
    for group in builder.groups.values():
        if group.name != "all" and not parents.get(group.name):
            parents[group.name] = {"all"}
            everyone.children.setdefault(group.name, None)
    ungrouped.hosts = [name for name in builder.hosts if member[name] == {"ungrouped"}]
    if not ungrouped.hosts:
        everyone.children.pop("ungrouped", None)
        del builder.groups["ungrouped"]

    depth_cache: dict[str, int] = {"all": 0}

    def depth(name: str) -> int:
        if name not in depth_cache:
            depth_cache[name] = 1 + max((depth(p) for p in parents.get(name, ())), default=0)
        return depth_cache[name]

    def ancestors(name: str) -> set[str]:
        found = {name}
        for parent in parents.get(name, ()):
            found |= ancestors(parent)
        return found

    if builder.errors:  # cycles make depth undefined; stop before resolving
        raise _collected(builder.errors)

    hosts = [
        _resolve_host(builder, raw, member[raw.name], ancestors, depth) for raw in builder.hosts.values()
    ]
    resolved = tuple(host for host in hosts if host is not None)
    _check_endpoints(builder, resolved)
    if builder.errors:
        raise _collected(builder.errors)
    groups = {
        name: Group(
            name=name,
            children=tuple(group.children),
            hosts=tuple(group.hosts),
            vars={key: var.value for key, var in group.vars.items()},
            location=group.location,
        )
        for name, group in builder.groups.items()
    }
    return Inventory(builder.path, resolved, groups, tuple(builder.warnings))


def _resolve_host(
    builder: Builder,
    raw: RawHost,
    direct: set[str],
    ancestors: Callable[[str], set[str]],
    depth: Callable[[str], int],
) -> Host | None:
    all_groups: set[str] = set()
    for name in direct:
        all_groups |= ancestors(name)
    all_groups.discard("all")
    ordered = sorted(all_groups, key=lambda name: (depth(name), name))
    merged: dict[str, RawVar] = {}
    origin: dict[str, str] = {}
    scopes = [("all", builder.groups["all"].vars)]
    scopes += [(f"group {name}", builder.groups[name].vars) for name in ordered]
    scopes.append(("host", raw.vars))
    for label, scope in scopes:
        for key, var in scope.items():
            merged[key] = var
            origin[key] = label
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    ok = True
    for variable in VARIABLES:
        found = merged.get(variable.name)
        if found is None or found.value is None:  # null means "the default", as if unset
            values[variable.name] = variable.default
            sources[variable.name] = "default"
            continue
        var = found
        sources[variable.name] = origin[variable.name]
        try:
            values[variable.name] = variable.parse(_render(var.value, raw.name))
        except ValueError as exc:
            builder.error(f"{var.key}: {exc}", var.location)
            ok = False
    if not ok:
        return None
    if values["address"] is None:
        if values["connection"] == "local":
            values["address"] = LOCAL_ADDRESS
        else:
            try:
                values["address"] = parse_address(raw.name)
            except ValueError as exc:
                builder.error(f"host {raw.name!r}: {exc}; set address (ansible_host) for it", raw.location)
                return None
        sources["address"] = "default"
    if values["rpc_host"] == "" and values["rpc_transport"] == "ssh":
        values["rpc_host"] = LOCAL_ADDRESS  # nothing listens on the node's network address
        sources["rpc_host"] = "default (rpc_transport: ssh)"
    elif values["rpc_host"] == "":
        # the bind address defaults to the address when that is an IPv4 literal; otherwise the service
        # layer resolves the name on the node (the server binds only IPv4 literals)
        values["rpc_host"] = values["address"]
        sources["rpc_host"] = "default (address)"
    gpus = [device for device in values["rpc_devices"] if is_gpu_device(device)]
    if not values["rpc_servers"] and len(gpus) > 1 and values["rpc_server_per_gpu"]:
        # llama.cpp's RPC does not pipeline the devices behind one server (llama.cpp #24675): a server
        # per device, on consecutive ports, is what lets several GPUs of one node work at once.
        values["rpc_servers"] = tuple(
            RpcServer(values["rpc_port"] + i, device.lower(), (device,))
            for i, device in enumerate(values["rpc_devices"])
        )
        sources["rpc_servers"] = "default (one server per GPU of rpc_devices)"
    sources.update((key, label) for key, label in origin.items() if key not in VARIABLES_BY_NAME)
    variables = {key: var.value for key, var in merged.items()}
    variables.update(values)
    return Host(
        name=raw.name,
        groups=tuple(ordered),
        vars=variables,
        location=raw.location,
        var_sources=sources,
        **values,
    )


def _check_endpoints(builder: Builder, hosts: Sequence[Host]) -> None:
    for host in hosts:
        inheriting = [server.name for server in host.rpc_servers if server.devices is None]
        if host.rpc_devices and len(inheriting) > 1:
            builder.error(
                f"host {host.name!r}: servers {', '.join(inheriting)} would all use rpc_devices "
                f"{','.join(host.rpc_devices)} (a device belongs to one server: give each its devices)",
                host.location,
            )
    named: dict[str, Host] = {}
    for host in server_hosts(hosts):  # `HOST/NAME` is a server's name: a host so named is ambiguous
        first = named.setdefault(host.name, host)
        if first is not host:
            plain, server = (host, first) if first.server else (first, host)
            builder.error(
                f"host {plain.name!r} has the name of a server of host {server.node_name!r} "
                f"(`-l {plain.name}` would select both): rename the host or the server",
                plain.location,
            )
    owners: dict[str, Host] = {}
    for host in server_hosts(hosts):  # each server of a host is an endpoint of its own
        first = owners.setdefault(host.endpoint, host)
        if first is not host:
            what = "servers" if host.server or first.server else "hosts"
            builder.error(
                f"{what} {first.name!r} and {host.name!r} share the rpc endpoint {host.endpoint}"
                " (give one another rpc_port or address)",
                host.location,
            )


class InventoryErrors(InventoryError):
    """Several errors found in one inventory: `errors` lists each; the message shows them all."""

    def __init__(self, errors: Sequence[InventoryError]) -> None:
        self.errors = tuple(errors)
        super().__init__("\n".join(err.message for err in self.errors))  # each message has its location

    @property
    def location(self) -> SourceLocation | None:
        return self.errors[0].location


def _collected(errors: Sequence[InventoryError]) -> InventoryError:
    if len(errors) == 1:
        return errors[0]

    def position(err: InventoryError) -> tuple[int, int]:
        location = err.location
        return (location.line or 0, location.column or 0) if location else (0, 0)

    return InventoryErrors(sorted(errors, key=position))  # in file order


InventoryFormat = Literal["yaml", "ini"]


def detect_format(text: str, path: Path | None = None) -> InventoryFormat:
    """INI or YAML, from the extension, else the content."""
    suffix = path.suffix.lower() if path else ""
    if suffix in (".yml", ".yaml", ".json"):
        return "yaml"
    if suffix in (".ini", ".cfg"):
        return "ini"
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and stripped[0] not in "#;":
            if SECTION.match(line):
                return "ini"
            break
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return "ini"
    return "yaml" if isinstance(data, dict) or data is None else "ini"


def load_inventory_text(text: str, path: Path | None = None, fmt: InventoryFormat | None = None) -> Inventory:
    """Parse and validate an inventory given as text (`path` only names it in messages and picks a format)."""
    builder = Builder(path, text.splitlines())
    if (fmt or detect_format(text, path)) == "ini":
        parse_ini(builder, text)
    else:
        parse_yaml(builder, text)
    if "all" not in builder.groups:
        builder.group("all", None)
    return resolve(builder)


def load_inventory(path: Path) -> Inventory:
    """Read, parse and validate the inventory at `path`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InventoryError(f"inventory file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InventoryError(f"cannot read inventory {path}: {exc}") from None
    return load_inventory_text(text, Path(path))


INVENTORY_ENV = "RPCFLEET_INVENTORY"


def default_inventory_path() -> Path | None:
    """The inventory a command uses when none is given: `$RPCFLEET_INVENTORY`, then `./inventory.yml`,
    then the running default lab's; None when there is none."""
    if os.environ.get(INVENTORY_ENV):
        return Path(os.environ[INVENTORY_ENV])
    if Path("inventory.yml").exists():
        return Path("inventory.yml")
    lab = default_lab_inventory_file()
    return lab if lab.exists() else None
