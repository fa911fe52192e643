"""Hosts, groups and the inventory: the typed result of reading one."""

from __future__ import annotations

import fnmatch
import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from orchestrator.core.errors import InventoryError, SourceLocation
from orchestrator.inventory.variables import (
    DEFAULT_INSTALL_DIR,
    DEFAULT_RPC_PORT,
    VARIABLES,
    VARIABLES_BY_NAME,
    BackendChoice,
    ConnectionKind,
    RpcServer,
    RpcTransport,
    Supervisor,
    mask_secrets,
    near_miss,
)

_WILDCARD_BINDS = frozenset({"", "0.0.0.0"})


@dataclass(frozen=True)
class Host:
    """One machine of the fleet, with every variable resolved (all < parent group < child group < host)."""

    name: str
    address: str
    ssh_user: str | None = None
    ssh_port: int = 22
    ssh_key: str | None = None
    connection: ConnectionKind = "ssh"
    rpc_host: str = ""  # bind address of the rpc-server; "" is resolved to `address` while loading
    rpc_port: int = DEFAULT_RPC_PORT
    rpc_transport: RpcTransport = "tcp"  # ssh: bound to the node's loopback, dialed through a forward
    rpc_allow_from: tuple[str, ...] | None = None  # tcp: firewall allowlist (None: no rule)
    rpc_devices: tuple[str, ...] = ()
    rpc_servers: tuple[RpcServer, ...] = ()  # several servers on this host; `servers_of` gives each
    # A server of several (`rpc_servers`): its name; the host is then that server's view (its own port,
    # devices, files and unit on the node), named `HOST/SERVER`. "": the host's only server.
    server: str = ""
    rpc_threads: int | None = None
    rpc_server_per_gpu: bool = True  # several GPUs in rpc_devices: `load` makes one server of each
    rpc_env: tuple[tuple[str, str], ...] = ()  # the server's extra environment, sorted by name
    rpc_cache: bool = False
    rpc_cache_max: int | None = None  # bytes; None: no quota (LRU eviction above it)
    rpc_backend: BackendChoice = "cpu"  # auto: decided at deploy from the node's facts
    install_dir: str = DEFAULT_INSTALL_DIR
    # A folder on the node with the model's GGUF files under their own names (a cache warm reads them there)
    model_path_on_nodes: str | None = None
    memory_reserve: int = 0  # bytes
    memory_limit: int | None = None  # bytes
    ssh_known_hosts: str | None = None  # None: ~/.ssh/known_hosts
    ssh_host_key_checking: bool = True
    ssh_connect_timeout: float = 10.0  # seconds
    rpc_artifact: str | None = None  # name/id of the pinned artifact; None: the default one
    allow_public_bind: bool = False
    rpc_debug: bool = False
    keep_versions: int = 3  # installed versions kept on the host (>= 1)
    rpc_cmake_args: tuple[str, ...] = ()  # extra cmake args for `build: on_node` artifacts
    supervisor: Supervisor = "auto"  # systemd unit, detached process, or auto (systemd where usable)
    rpc_run_as: str | None = None  # process supervisor's server user; None: `launch.run_as_user` decides
    groups: tuple[str, ...] = ()  # every group the host belongs to (not `all`), shallowest first
    vars: Mapping[str, Any] = field(default_factory=dict, hash=False)  # all merged variables, unknown too
    location: SourceLocation | None = field(default=None, compare=False)  # where the host is declared
    # variable name -> where its value comes from: "host", "group NAME", "all" or "default"
    var_sources: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)

    @property
    def endpoint(self) -> str:
        """The rpc endpoint clients connect to, "host:port" (a wildcard bind is reached at `address`).

        With `rpc_transport: ssh` it is the node's address and port, the name plans and reports use;
        the controller dials a local forward instead (`orchestrator.connectors.tunnel.target_of`)."""
        wildcard = self.rpc_host in _WILDCARD_BINDS or self.tunneled
        target = self.address if wildcard else self.rpc_host
        if ":" in target:
            return f"[{target}]:{self.rpc_port}"
        return f"{target}:{self.rpc_port}"

    @property
    def node_name(self) -> str:
        """The inventory's name of the machine (a server's view is named `HOST/SERVER`)."""
        return self.name[: -len(self.server) - 1] if self.server else self.name

    @property
    def install_key(self) -> tuple[str, int, str]:
        """What identifies the install on its node, shared by every server of a host: its lock, its files."""
        return (self.address, self.ssh_port, self.install_dir)

    @property
    def binds_own_loopback(self) -> bool:
        """Whether the server binds a remote node's loopback: reachable only from that node, so the
        controller must not probe the address (it would reach its own loopback instead)."""
        return (
            self.connection == "ssh"
            and not self.tunneled
            and not is_loopback(self.address)
            and is_loopback(self.rpc_host)
        )

    @property
    def firewalled(self) -> bool:
        """Whether rpcfleet keeps iptables rules for the server's port (`rpc_allow_from`, tcp only)."""
        return self.rpc_transport == "tcp" and self.rpc_allow_from is not None

    @property
    def tunneled(self) -> bool:
        """Whether the controller reaches the server through an SSH local forward."""
        return self.rpc_transport == "ssh" and self.connection == "ssh"


SERVER_SEPARATOR = "/"


def servers_of(host: Host) -> tuple[Host, ...]:
    """Each rpc-server of a host as a host of its own (an endpoint every stage treats alone): its port,
    devices and threads (the host's when the server sets none), named `HOST/SERVER`. A host without
    `rpc_servers` is its only server."""
    if not host.rpc_servers or host.server:
        return (host,)
    return tuple(
        replace(
            host,
            name=f"{host.name}{SERVER_SEPARATOR}{server.name}",
            server=server.name,
            rpc_port=server.port,
            rpc_devices=host.rpc_devices if server.devices is None else server.devices,
            rpc_threads=host.rpc_threads if server.threads is None else server.threads,
        )
        for server in host.rpc_servers
    )


def server_hosts(hosts: Iterable[Host]) -> list[Host]:
    """Every server of `hosts`, in order (`servers_of`)."""
    return [server for host in hosts for server in servers_of(host)]


def select_servers(inventory: Inventory, pattern: str | None) -> list[Host]:
    """The servers a pattern selects: a host, group, glob... selects every server of its hosts
    (`select_hosts`); a term `HOST/SERVER` selects that server alone, `!HOST/SERVER` leaves it out."""
    everyone = server_hosts(inventory.hosts)
    if pattern is None or not pattern.strip():
        return everyone
    names = {server.name for server in everyone if server.server}
    terms = _split_pattern(pattern)
    server_terms = [term for term in terms if term.lstrip("!&").strip() in names]
    if not server_terms:
        return server_hosts(select_hosts(inventory, pattern))
    if any(term.startswith("&") for term in server_terms):
        raise HostPatternError(f"host pattern {pattern!r}: `&` takes a host or a group, not a server")
    named = {term for term in server_terms if not term.startswith("!")}
    excluded = {term[1:].strip() for term in server_terms if term.startswith("!")}
    host_terms = [term for term in terms if term not in server_terms]
    plus = [term for term in host_terms if term[0] not in "!&"]
    minus = [term for term in host_terms if term[0] in "!&"]
    hosts = {host.name for host in select_hosts(inventory, ",".join(plus))} if plus else set()
    # `!h1/a` alone: every server but that one, as `!h1` is every host but h1
    picked = [s for s in everyone if s.node_name in hosts or s.name in named] if plus or named else everyone
    if minus:
        allowed = {host.name for host in select_hosts(inventory, ",".join(minus))}
        picked = [s for s in picked if s.node_name in allowed]
    picked = [s for s in picked if s.name not in excluded]
    if not picked:
        raise HostPatternError(f"host pattern {pattern!r} selects no server")
    return picked


def is_loopback(address: str) -> bool:
    """Whether an address (IPv4/IPv6 literal, brackets allowed, or `localhost`) is a loopback one."""
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return address == "localhost"


@dataclass(frozen=True)
class Group:
    """A group as declared: direct children and direct hosts (names), its own variables."""

    name: str
    children: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()
    vars: Mapping[str, Any] = field(default_factory=dict, hash=False)
    location: SourceLocation | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Inventory:
    """Every host (in inventory order) and group of one inventory file, plus non-fatal warnings."""

    path: Path | None
    hosts: tuple[Host, ...]
    groups: Mapping[str, Group] = field(default_factory=dict, hash=False)
    warnings: tuple[str, ...] = ()

    def host(self, name: str) -> Host:
        """The host called `name`; InventoryError (with a suggestion) if there is none."""
        for host in self.hosts:
            if host.name == name:
                return host
        for server in server_hosts(self.hosts):
            if server.name == name:  # `gpu1/second`: a server, shown with its host
                raise InventoryError(
                    f"{name!r} is a server of host {server.node_name!r}, not a host",
                    hint=f"`rpcfleet inventory show {server.node_name}` shows it",
                )
        raise InventoryError(f"no host {name!r} in the inventory{near_miss(name, self.host_names())}")

    def host_names(self) -> tuple[str, ...]:
        return tuple(host.name for host in self.hosts)

    def hosts_of(self, group: str) -> tuple[Host, ...]:
        """Hosts in `group`, directly or through its children, in inventory order."""
        if group == "all":
            return self.hosts
        return tuple(host for host in self.hosts if group in host.groups)

    def select(self, pattern: str | None) -> list[Host]:
        return select_hosts(self, pattern)


class HostPatternError(InventoryError):
    """A --limit / hosts pattern is malformed or matches nothing."""


def _split_pattern(pattern: str) -> list[str]:
    """Ansible's splitting: on commas if there are any, else on colons outside brackets."""
    if "," in pattern:
        return [term.strip() for term in pattern.split(",") if term.strip()]
    terms, depth, current = [], 0, ""
    for char in pattern:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == ":" and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    return [term.strip() for term in terms if term.strip()]


def _match_term(inventory: Inventory, term: str) -> set[str] | None:
    """Host names a term selects; None when it names nothing at all (no host, no group)."""
    if term in ("all", "*"):
        return set(inventory.host_names())
    if term in inventory.groups:
        return {host.name for host in inventory.hosts_of(term)}
    if any(host.name == term for host in inventory.hosts):
        return {term}
    if term.startswith("~"):
        try:
            regex = re.compile(term[1:])
        except re.error as exc:
            raise HostPatternError(f"invalid regular expression in host pattern {term!r}: {exc}") from None
        names = [name for name in [*inventory.host_names(), *inventory.groups] if regex.search(name)]
    elif any(char in term for char in "*?["):
        names = fnmatch.filter([*inventory.host_names(), *inventory.groups], term)
    else:
        return None
    selected: set[str] = set()
    for name in names:
        selected |= {host.name for host in inventory.hosts_of(name)} if name in inventory.groups else {name}
    return selected if names else None


def select_hosts(inventory: Inventory, pattern: str | None) -> list[Host]:
    """Hosts matching an Ansible-style pattern, in inventory order; None or "" selects every host.

    Terms are separated by commas (or colons): a host name, a group, a glob (``node*``), ``~regex``;
    ``!term`` excludes, ``&term`` intersects. A term naming nothing, or a pattern that selects no host, is
    a `HostPatternError`.
    """
    if pattern is None or not pattern.strip():
        return list(inventory.hosts)
    union: set[str] = set()
    intersections: list[set[str]] = []
    exclusions: set[str] = set()
    has_union = False
    for term in _split_pattern(pattern):
        operator, name = (term[0], term[1:].strip()) if term[0] in "!&" else ("", term)
        if not name:
            raise HostPatternError(f"empty term {term!r} in host pattern {pattern!r}")
        matched = _match_term(inventory, name)
        if matched is None:
            hint = near_miss(name, [*inventory.host_names(), *inventory.groups])
            raise HostPatternError(f"host pattern {name!r} matches no host or group{hint}")
        if operator == "!":
            exclusions |= matched
        elif operator == "&":
            intersections.append(matched)
        else:
            union |= matched
            has_union = True
    if not has_union:  # "!gpu" alone means every host but the GPU ones, as in Ansible
        union = set(inventory.host_names())
    for matched in intersections:
        union &= matched
    union -= exclusions
    if not union:
        raise HostPatternError(f"host pattern {pattern!r} selects no host")
    return [host for host in inventory.hosts if host.name in union]


def host_to_dict(host: Host) -> dict[str, Any]:
    """A host as plain JSON-able data: name, every known variable, groups, endpoint, extra variables
    (those named like a secret masked: `is_secret`, as are such names of rpc_env)."""
    data: dict[str, Any] = {"name": host.name}
    for variable in VARIABLES:
        value = getattr(host, variable.name)
        data[variable.name] = list(value) if isinstance(value, tuple) else value
    data["rpc_env"] = mask_secrets(dict(host.rpc_env))  # HF_TOKEN=... is a secret as an extra var is
    data["rpc_servers"] = [server.to_dict() for server in host.rpc_servers]
    data["endpoint"] = host.endpoint
    data["endpoints"] = [server.endpoint for server in servers_of(host)]
    data["groups"] = list(host.groups)
    data["extra_vars"] = mask_secrets({k: v for k, v in host.vars.items() if k not in VARIABLES_BY_NAME})
    return data
