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

import ast
import fnmatch
import ipaddress
import math
import re
import shlex
import string
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from orchestrator.errors import InventoryError, SourceLocation
from orchestrator.units import parse_size
from orchestrator.yamlsource import (
    Source,
    compose,
    did_you_mean,
    flatten_merge_keys,
    is_null,
    node_kind,
    node_value,
    type_name,
)

DEFAULT_RPC_PORT = 50052
DEFAULT_INSTALL_DIR = "~/.local/lib/rpcfleet"
LOCAL_ADDRESS = "127.0.0.1"
Backend = Literal["cpu", "cuda", "rocm", "vulkan", "metal"]
ConnectionKind = Literal["ssh", "local"]
BACKENDS: tuple[str, ...] = ("cpu", "cuda", "rocm", "vulkan", "metal")
CONNECTIONS: tuple[str, ...] = ("ssh", "local")
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
    rpc_devices: tuple[str, ...] = ()
    rpc_threads: int | None = None
    rpc_cache: bool = False
    backend: Backend = "cpu"
    install_dir: str = DEFAULT_INSTALL_DIR
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
    groups: tuple[str, ...] = ()  # every group the host belongs to (not `all`), shallowest first
    vars: Mapping[str, Any] = field(default_factory=dict, hash=False)  # all merged variables, unknown too
    location: SourceLocation | None = field(default=None, compare=False)  # where the host is declared
    # variable name -> where its value comes from: "host", "group NAME", "all" or "default"
    var_sources: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)

    @property
    def endpoint(self) -> str:
        """The rpc endpoint clients connect to, "host:port" (a wildcard bind is reached at `address`)."""
        target = self.address if self.rpc_host in _WILDCARD_BINDS else self.rpc_host
        if ":" in target:
            return f"[{target}]:{self.rpc_port}"
        return f"{target}:{self.rpc_port}"

    @property
    def binds_own_loopback(self) -> bool:
        """Whether the server binds a remote node's loopback: reachable only from that node, so the
        controller must not probe the address (it would reach its own loopback instead)."""
        return self.connection == "ssh" and not is_loopback(self.address) and is_loopback(self.rpc_host)


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
        raise InventoryError(f"no host {name!r} in the inventory{_did_you_mean(name, self.host_names())}")

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


# ---------------------------------------------------------------------------------------------------------
# Known variables: one table. Each parser takes the raw value and returns the typed one or raises ValueError
# with a message for the user.


def _parse_str(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"expected a string, got {type_name(value)} {value!r}")
    return str(value)


def _parse_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    raise ValueError(f"expected an integer, got {value!r}")


def _int_at_least(minimum: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        number = _parse_int(value)
        if number < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {number}")
        return number

    return parse


def _parse_port(value: Any) -> int:
    port = _parse_int(value)
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is out of range (1-65535)")
    return port


def _parse_seconds(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number of seconds, got {value!r}") from None
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"expected a positive number of seconds, got {value!r}")
    return seconds


_TRUE = frozenset({"true", "yes", "on", "1", "y"})
_FALSE = frozenset({"false", "no", "off", "0", "n"})


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"expected a boolean (true/false), got {value!r}")


def _parse_size(value: Any) -> int:
    if isinstance(value, float) and value >= 0:
        return int(value)
    try:
        return parse_size(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(str(exc)) from None


def _choice(allowed: Sequence[str], synonyms: Mapping[str, str] | None = None) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).strip().lower() if isinstance(value, str) else value
        if isinstance(text, str) and synonyms and text in synonyms:
            return synonyms[text]
        if text not in allowed:
            hint = _did_you_mean(str(value), allowed)
            raise ValueError(f"expected one of {', '.join(allowed)}, got {value!r}{hint}")
        return str(text)

    return parse


def _parse_devices(value: Any) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise ValueError(f"expected a device list such as CUDA0,CUDA1, got {value!r}")
    devices = tuple(str(item).strip() for item in items if str(item).strip())
    for device in devices:
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", device):
            raise ValueError(f"invalid device name {device!r} (expected names such as CUDA0, Vulkan1, CPU)")
    return devices


def _parse_cmake_args(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(shlex.split(value))
    if isinstance(value, list | tuple) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise ValueError(f"expected cmake arguments such as [-DGGML_CUDA=ON], got {value!r}")


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _parse_address(value: Any) -> str:
    text = _parse_str(value).strip()
    if _is_ip(text):
        return text
    labels = text.rstrip(".").split(".")
    # all-numeric dotted text is an IPv4 literal or nothing (hostnames would resolve it anyway, wrongly)
    numeric = all(label.isdigit() for label in labels)
    if numeric or len(text) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"invalid address {text!r} (expected an IPv4/IPv6 address or a hostname)")
    return text


def _parse_bind(value: Any) -> str:
    text = _parse_str(value).strip()
    if text == "":
        return text
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is not an IPv4 address (ggml-rpc-server binds only IPv4 literals such as 0.0.0.0)"
        ) from None
    return text


def _optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else parse(value)


@dataclass(frozen=True)
class Variable:
    """A variable rpcfleet understands: its `Host` field, Ansible aliases, parser and default."""

    name: str
    aliases: tuple[str, ...]
    parse: Callable[[Any], Any]
    default: Any
    doc: str


VARIABLES: tuple[Variable, ...] = (
    Variable("address", ("ansible_host", "ansible_ssh_host"), _parse_address, None, "address to reach"),
    Variable("ssh_user", ("ansible_user", "ansible_ssh_user"), _optional(_parse_str), None, "SSH login"),
    Variable("ssh_port", ("ansible_port", "ansible_ssh_port"), _parse_port, 22, "SSH port"),
    Variable(
        "ssh_key",
        ("ansible_ssh_private_key_file", "ansible_private_key_file"),
        _optional(_parse_str),
        None,
        "SSH private key file",
    ),
    Variable(
        "connection",
        ("ansible_connection",),
        _choice(CONNECTIONS, {"smart": "ssh", "paramiko": "ssh", "paramiko_ssh": "ssh"}),
        "ssh",
        "ssh or local",
    ),
    Variable("rpc_host", (), _parse_bind, "", "rpc-server bind address (default: address)"),
    Variable("rpc_port", (), _parse_port, DEFAULT_RPC_PORT, "rpc-server port"),
    Variable("rpc_devices", (), _parse_devices, (), "rpc-server devices (-d)"),
    Variable("rpc_threads", (), _optional(_int_at_least(1)), None, "rpc-server CPU threads (-t)"),
    Variable("rpc_cache", (), _parse_bool, False, "rpc-server tensor cache (-c)"),
    Variable("backend", (), _choice(BACKENDS), "cpu", "ggml backend of the artifact"),
    Variable("install_dir", (), _parse_str, DEFAULT_INSTALL_DIR, "where artifacts are installed"),
    Variable("memory_reserve", (), _parse_size, 0, "memory kept free per device"),
    Variable("memory_limit", (), _optional(_parse_size), None, "most memory used per device"),
    Variable("ssh_known_hosts", (), _optional(_parse_str), None, "known_hosts file"),
    Variable(
        "ssh_host_key_checking", ("ansible_host_key_checking",), _parse_bool, True, "check SSH host keys"
    ),
    Variable("ssh_connect_timeout", ("ansible_ssh_timeout",), _parse_seconds, 10.0, "SSH connect timeout"),
    Variable("rpc_artifact", (), _optional(_parse_str), None, "pinned artifact name/id"),
    Variable("allow_public_bind", (), _parse_bool, False, "allow rpc_host on a public address"),
    Variable("rpc_debug", (), _parse_bool, False, "rpc-server debug output"),
    Variable("keep_versions", (), _int_at_least(1), 3, "installed versions kept"),
    Variable("rpc_cmake_args", (), _parse_cmake_args, (), "extra cmake args for on-node builds"),
)
VARIABLES_BY_NAME: Mapping[str, Variable] = {var.name: var for var in VARIABLES}
_CANONICAL: Mapping[str, str] = {alias: var.name for var in VARIABLES for alias in (var.name, *var.aliases)}
# Ansible's own variables that look like ours: never flagged as typos.
_ANSIBLE_VARS = frozenset(
    {
        "ansible_password",
        "ansible_ssh_pass",
        "ansible_timeout",
        "ansible_become",
        "ansible_become_user",
        "ansible_become_pass",
        "ansible_become_password",
        "ansible_become_method",
        "ansible_python_interpreter",
        "ansible_shell_type",
        "ansible_ssh_common_args",
        "ansible_ssh_extra_args",
        "ansible_connection_timeout",
    }
)


def _did_you_mean(word: str, candidates: Iterable[str]) -> str:
    return did_you_mean(word, candidates, cutoff=0.75)  # variable and group names: only near misses


# ---------------------------------------------------------------------------------------------------------
# Host ranges


_RANGE = re.compile(r"\[([^\[\]:]*):([^\[\]:]*)(?::([^\[\]:]*))?\]")


MAX_RANGE_HOSTS = 10_000  # more names in one pattern is a typo (node[0:99999999]), not a fleet


def expand_host_range(pattern: str) -> list[str]:
    """``node[01:03]`` -> node01, node02, node03; also ``[a:c]``, ``[1:9:2]``, several ranges.

    Raises ValueError (a message for the user) on a malformed range, or on one that names more than
    `MAX_RANGE_HOSTS` hosts (counted before any name is made).
    """
    ranges: list[tuple[str, range | str, int]] = []  # (text before, numbers or letters, zero-pad width)
    rest = pattern
    while (match := _RANGE.search(rest)) is not None:
        ranges.append((rest[: match.start()], *_range_segment(match, pattern)))
        rest = rest[match.end() :]
    if "[" in rest or "]" in rest:
        raise ValueError(f"invalid host range in {pattern!r} (expected [start:end] or [start:end:step])")
    count = math.prod(len(items) for _, items, _ in ranges)
    if count > MAX_RANGE_HOSTS:
        raise ValueError(f"host range {pattern!r} names {count} hosts (at most {MAX_RANGE_HOSTS})")
    names = [""]
    for before, items, width in ranges:
        texts = [str(item).zfill(width) for item in items]
        names = [name + before + text for name in names for text in texts]
    return [name + rest for name in names]


def _range_segment(match: re.Match[str], pattern: str) -> tuple[range | str, int]:
    """One `[start:end:step]`: (the numbers, their zero-padded width) or (the letters, 0)."""
    begin, end, step_text = match.group(1) or "0", match.group(2), match.group(3)
    if not end:
        raise ValueError(f"host range in {pattern!r} has no end")
    try:
        step = int(step_text) if step_text else 1
    except ValueError:
        raise ValueError(f"host range step {step_text!r} in {pattern!r} is not an integer") from None
    if step < 1:
        raise ValueError(f"host range step in {pattern!r} must be >= 1")
    if begin.isdigit() and end.isdigit():
        padded = len(begin) > 1 and begin.startswith("0")
        if padded and len(begin) != len(end):
            raise ValueError(f"zero-padded host range in {pattern!r} needs start and end of equal length")
        first, last = int(begin), int(end)
        if first > last:
            raise ValueError(f"host range in {pattern!r} ends before it starts")
        return range(first, last + 1, step), len(begin) if padded else 0
    if len(begin) == 1 and len(end) == 1 and begin in string.ascii_letters and end in string.ascii_letters:
        first, last = string.ascii_letters.index(begin), string.ascii_letters.index(end)
        if first > last:
            raise ValueError(f"host range in {pattern!r} ends before it starts")
        return string.ascii_letters[first : last + 1 : step], 0
    raise ValueError(f"invalid host range [{match.group(0)[1:-1]}] in {pattern!r}")


# ---------------------------------------------------------------------------------------------------------
# The format-independent model every parser fills, then resolution into `Inventory`.


@dataclass
class _RawVar:
    key: str  # as written (an alias maybe)
    value: Any
    location: SourceLocation


@dataclass
class _RawGroup:
    name: str
    location: SourceLocation | None
    vars: dict[str, _RawVar] = field(default_factory=dict)
    children: dict[str, SourceLocation | None] = field(default_factory=dict)
    hosts: list[str] = field(default_factory=list)
    defined: bool = True  # INI: False while only referenced by [x:children] / [x:vars]


@dataclass
class _RawHost:
    name: str
    location: SourceLocation
    vars: dict[str, _RawVar] = field(default_factory=dict)


class _Builder:
    def __init__(self, path: Path | None, lines: Sequence[str]) -> None:
        self.path = path
        self.source = Source(path, lines)
        self.hosts: dict[str, _RawHost] = {}
        self.groups: dict[str, _RawGroup] = {}
        self.errors: list[InventoryError] = []
        self.warnings: list[str] = []
        self._seen_errors: set[str] = set()

    def loc(self, line: int | None, column: int | None = None) -> SourceLocation:
        """A location with 1-based line/column; the snippet is the whole source line."""
        return self.source.at(line, column)

    def error(self, message: str, location: SourceLocation | None) -> None:
        err = InventoryError(message, location)
        if str(err) not in self._seen_errors:  # a bad group variable shows once, not once per host
            self._seen_errors.add(str(err))
            self.errors.append(err)

    def warn(self, message: str, location: SourceLocation | None) -> None:
        text = f"{location}: {message}" if location else message
        if text not in self.warnings:
            self.warnings.append(text)

    def group(self, name: str, location: SourceLocation | None, *, define: bool = True) -> _RawGroup:
        group = self.groups.get(name)
        if group is None:
            group = self.groups[name] = _RawGroup(name, location, defined=define)
        elif define and not group.defined:
            group.defined, group.location = True, location
        return group

    def add_child(self, parent: _RawGroup, child: str, location: SourceLocation | None) -> None:
        if child == "all":
            self.error("group 'all' cannot be a child of another group", location)
        elif child == parent.name:
            self.error(f"group {child!r} lists itself as a child (cycle: {child} -> {child})", location)
        else:
            parent.children.setdefault(child, location)

    def add_hosts(self, pattern: str, location: SourceLocation, group: _RawGroup | None) -> list[_RawHost]:
        """Declare the host(s) a name or range names, as members of `group`."""
        try:
            names = expand_host_range(pattern)
        except ValueError as exc:
            self.error(str(exc), location)
            return []
        result = []
        for name in names:
            host = self.hosts.get(name)
            if host is None:
                host = self.hosts[name] = _RawHost(name, location)
            if group is not None and name not in group.hosts:
                group.hosts.append(name)
            result.append(host)
        return result

    def set_var(self, scope: dict[str, _RawVar], key: str, value: Any, location: SourceLocation) -> None:
        canonical = _CANONICAL.get(key, key)
        previous = scope.get(canonical)
        if previous is not None and previous.key != key and previous.location != location:
            self.error(f"{key!r} and {previous.key!r} both set {canonical!r} here; keep one", location)
            return
        if canonical == key and key not in VARIABLES_BY_NAME and key not in _ANSIBLE_VARS:
            hint = _did_you_mean(key, _CANONICAL)
            if hint:
                self.warn(f"unknown variable {key!r} is kept as is{hint}", location)
        scope[canonical] = _RawVar(key, value, location)


# ------------------------------------------------------------------------------------------------- YAML


def _yaml_items(builder: _Builder, node: yaml.Node, what: str) -> Iterator[tuple[str, yaml.Node, yaml.Node]]:
    """(key, key node, value node) of a mapping node, in document order; null is an empty mapping."""
    if is_null(node):
        return
    if not isinstance(node, yaml.MappingNode):
        builder.error(f"{what} must be a mapping, got {_node_kind(node)}", builder.source.node(node))
        return
    flatten_merge_keys(node)  # resolves YAML merge keys (<<: *anchor)
    seen: dict[str, yaml.Node] = {}
    for key_node, value_node in node.value:
        key = node_value(key_node) if isinstance(key_node, yaml.ScalarNode) else None
        if key is None or isinstance(key, bool):
            builder.error(f"invalid key in {what}", builder.source.node(key_node))
            continue
        key = str(key)
        if key in seen:
            builder.warn(f"duplicate key {key!r} in {what}; the last one wins", builder.source.node(key_node))
        seen[key] = key_node
        yield key, key_node, value_node


def _node_kind(node: yaml.Node) -> str:
    """`node_kind`, quoting a scalar's value."""
    kind = node_kind(node)
    return f"{kind} {node_value(node)!r}" if isinstance(node, yaml.ScalarNode) else kind


def _yaml_vars(builder: _Builder, scope: dict[str, _RawVar], node: yaml.Node, what: str) -> None:
    for key, _key_node, value_node in _yaml_items(builder, node, what):
        builder.set_var(scope, key, node_value(value_node), builder.source.node(value_node))


def _yaml_names(builder: _Builder, node: yaml.Node, what: str) -> Iterator[tuple[str, yaml.Node]]:
    """Names from a list (or a mapping whose values are ignored by the caller)."""
    if is_null(node):
        return
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            value = node_value(item) if isinstance(item, yaml.ScalarNode) else None
            if value is None or isinstance(value, bool):
                builder.error(f"{what} must list names", builder.source.node(item))
            else:
                yield str(value), item
    else:
        builder.error(f"{what} must be a list of names, got {_node_kind(node)}", builder.source.node(node))


def _yaml_group_hosts(builder: _Builder, group: _RawGroup | None, node: yaml.Node, what: str) -> None:
    """`hosts:` as a mapping name -> vars (declares hosts)."""
    for name, key_node, value_node in _yaml_items(builder, node, what):
        for host in builder.add_hosts(name, builder.source.node(key_node), group):
            _yaml_vars(builder, host.vars, value_node, f"variables of host {host.name!r}")


_GROUP_KEYS = ("hosts", "children", "vars")


def _ansible_group(
    builder: _Builder, name: str, node: yaml.Node, key_node: yaml.Node, parent: _RawGroup | None
) -> None:
    location = builder.source.node(key_node)
    group = builder.group(name, location)
    if parent is not None:
        builder.add_child(parent, name, location)
    if not is_null(node) and not isinstance(node, yaml.MappingNode):
        builder.error(
            f"group {name!r} must be a mapping of hosts/children/vars, got {_node_kind(node)}",
            builder.source.node(node),
        )
        return
    for key, sub_key, value in _yaml_items(builder, node, f"group {name!r}"):
        if key == "hosts":
            if isinstance(value, yaml.SequenceNode):
                for host_name, item in _yaml_names(builder, value, f"hosts of group {name!r}"):
                    builder.add_hosts(host_name, builder.source.node(item), group)
            else:
                _yaml_group_hosts(builder, group, value, f"hosts of group {name!r}")
        elif key == "children":
            for child, child_key, child_node in _yaml_items(builder, value, f"children of group {name!r}"):
                _ansible_group(builder, child, child_node, child_key, group)
        elif key == "vars":
            _yaml_vars(builder, group.vars, value, f"vars of group {name!r}")
        else:
            builder.warn(
                f"unexpected key {key!r} in group {name!r} is ignored (only hosts, children and vars)"
                + _did_you_mean(key, _GROUP_KEYS),
                builder.source.node(sub_key),
            )


_NATIVE_KEYS = ("vars", "hosts", "groups")


def _native(builder: _Builder, root: yaml.MappingNode) -> None:
    everyone = builder.group("all", None)
    group_refs: list[tuple[_RawGroup, str, SourceLocation]] = []
    host_refs: list[tuple[_RawGroup, str, SourceLocation]] = []
    for key, key_node, value in _yaml_items(builder, root, "the inventory"):
        if key == "vars":
            _yaml_vars(builder, everyone.vars, value, "vars")
        elif key == "hosts":
            _yaml_group_hosts(builder, None, value, "hosts")
        elif key == "groups":
            for name, name_node, body in _yaml_items(builder, value, "groups"):
                if name in ("all", "ungrouped"):
                    builder.error(
                        f"group {name!r} is implicit; use top-level vars/hosts",
                        builder.source.node(name_node),
                    )
                    continue
                group = builder.group(name, builder.source.node(name_node))
                for gkey, gkey_node, gvalue in _yaml_items(builder, body, f"group {name!r}"):
                    what = f"{gkey} of group {name!r}"
                    if gkey == "hosts" and isinstance(gvalue, yaml.MappingNode):
                        _yaml_group_hosts(builder, group, gvalue, what)
                    elif gkey == "hosts":
                        for host, item in _yaml_names(builder, gvalue, what):
                            host_refs.append((group, host, builder.source.node(item)))
                    elif gkey == "children":
                        for child, item in _yaml_names(builder, gvalue, what):
                            group_refs.append((group, child, builder.source.node(item)))
                    elif gkey == "vars":
                        _yaml_vars(builder, group.vars, gvalue, what)
                    else:
                        builder.error(
                            f"unknown key {gkey!r} in group {name!r}{_did_you_mean(gkey, _GROUP_KEYS)}",
                            builder.source.node(gkey_node),
                        )
        else:
            builder.error(
                f"unknown top-level key {key!r}{_did_you_mean(key, _NATIVE_KEYS)}"
                " (a native inventory has vars, hosts and groups)",
                builder.source.node(key_node),
            )
    for group, pattern, location in host_refs:
        try:
            names = expand_host_range(pattern)
        except ValueError as exc:
            builder.error(str(exc), location)
            continue
        for name in names:
            if name not in builder.hosts:
                hint = _did_you_mean(name, builder.hosts)
                builder.error(f"group {group.name!r} lists undefined host {name!r}{hint}", location)
            elif name not in group.hosts:
                group.hosts.append(name)
    for group, child, location in group_refs:
        if child not in builder.groups or child in ("all", "ungrouped"):
            hint = _did_you_mean(child, builder.groups)
            builder.error(f"group {group.name!r} has undefined child group {child!r}{hint}", location)
        else:
            builder.add_child(group, child, location)


def _is_native(root: yaml.MappingNode) -> bool:
    keys = [str(node_value(k)) for k, _ in root.value if isinstance(k, yaml.ScalarNode)]
    if "all" in keys:
        return False
    if "groups" in keys or (keys and set(keys) <= set(_NATIVE_KEYS)):
        return True
    # Ansible without `all:`: every top-level value is a group body (hosts/children/vars) or empty.
    for _key, value in root.value:
        if is_null(value):
            continue
        if not isinstance(value, yaml.MappingNode):
            return True
        body_keys = {str(node_value(k)) for k, _ in value.value if isinstance(k, yaml.ScalarNode)}
        if not body_keys & set(_GROUP_KEYS):
            return True
    return not keys


def _parse_yaml(builder: _Builder, text: str) -> None:
    try:
        root = compose(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or "cannot be parsed"
        if exc.context:  # PyYAML's order: "while parsing X" / "expected Y", then the problem
            problem = f"{exc.context}{', ' if problem.startswith('but ') else ': '}{problem}"
        raise InventoryError(f"invalid YAML: {problem}", builder.source.mark(mark)) from None
    except yaml.YAMLError as exc:
        raise InventoryError(f"invalid YAML: {exc}", builder.loc(None)) from None
    if root is None or is_null(root):
        builder.warn("the inventory is empty", builder.loc(None))
        return
    if not isinstance(root, yaml.MappingNode):
        raise InventoryError(
            f"an inventory must be a mapping (vars/hosts/groups, or Ansible's all:), got {_node_kind(root)}",
            builder.source.node(root),
        )
    if _is_native(root):
        _native(builder, root)
        return
    for name, key_node, body in _yaml_items(builder, root, "the inventory"):
        _ansible_group(builder, name, body, key_node, None)


# -------------------------------------------------------------------------------------------------- INI

_SECTION = re.compile(r"^\s*\[([^\]]*)\]\s*(?:[#;].*)?$")
_INLINE_COMMENT = re.compile(r"\s+[#;].*$")


def _ini_value(text: str) -> Any:
    """A value as Ansible's INI reader sees it: Python literals (1, True, 'x', [..]) or else the string."""
    text = text.strip()
    if text[:1] not in ("'", '"'):
        text = _INLINE_COMMENT.sub("", text)
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text
    return value if isinstance(value, str | int | float | bool | list | dict) else text


def _parse_ini(builder: _Builder, text: str) -> None:
    group = builder.group("ungrouped", None)
    kind = "hosts"
    vars_sections: list[tuple[str, SourceLocation]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped[0] in "#;":
            continue
        column = len(line) - len(line.lstrip()) + 1
        section = _SECTION.match(line)
        if section:
            header = section.group(1).strip()
            name, _, kind = header.partition(":")
            kind = kind or "hosts"
            location = builder.loc(number, column)
            if not name or kind not in ("hosts", "vars", "children"):
                builder.error(
                    f"invalid section [{header}] (expected [group], [group:vars] or [group:children])",
                    location,
                )
                kind = "skip"
                continue
            if kind == "vars":
                vars_sections.append((name, location))
            group = builder.group(name, location, define=kind != "vars")
            continue
        if kind == "skip":
            continue
        if kind == "vars":
            key, equals, raw = stripped.partition("=")
            if not equals or not key.strip():
                builder.error(f"expected key=value in [{group.name}:vars]", builder.loc(number, column))
                continue
            value_column = line.index("=") + 2 + len(raw) - len(raw.lstrip())
            builder.set_var(group.vars, key.strip(), _ini_value(raw), builder.loc(number, value_column))
        elif kind == "children":
            child = _INLINE_COMMENT.sub("", stripped)
            location = builder.loc(number, column)
            if " " in child or "=" in child:
                builder.error(f"expected one group name per line in [{group.name}:children]", location)
                continue
            builder.group(child, location, define=False)
            builder.add_child(group, child, location)
        else:
            _ini_host_line(builder, group, line, number)
    for name, location in vars_sections:
        if not builder.groups[name].defined and name not in ("all", "ungrouped"):
            builder.error(f"[{name}:vars] is for a group that is not defined", location)
    for parent in list(builder.groups.values()):
        for child, child_location in parent.children.items():
            if not builder.groups[child].defined:
                defined = [g.name for g in builder.groups.values() if g.defined]
                hint = _did_you_mean(child, defined)
                message = f"group {parent.name!r} has undefined child group {child!r}{hint}"
                builder.error(message, child_location)


def _ini_host_line(builder: _Builder, group: _RawGroup, line: str, number: int) -> None:
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError as exc:
        builder.error(f"cannot split host line: {exc}", builder.loc(number, 1))
        return
    if not tokens:
        return
    pattern, *assignments = tokens
    position = line.find(pattern)
    location = builder.loc(number, position + 1)
    port = None
    head, colon, tail = pattern.rpartition(":")
    if colon and tail.isdigit() and "]" not in tail and ":" not in head.replace("[", "").split("]")[-1]:
        pattern, port = head, tail
    hosts = builder.add_hosts(pattern, location, group)
    cursor = position + len(pattern)
    for token in assignments:
        at = line.find(token.split("=", 1)[0], cursor)
        cursor = max(at, cursor)
        key, equals, raw = token.partition("=")
        token_location = builder.loc(number, (at if at >= 0 else position) + 1)
        if not equals or not key:
            builder.error(f"expected key=value after the host name, got {token!r}", token_location)
            continue
        value_location = builder.loc(number, (at + len(key) + 2) if at >= 0 else position + 1)
        for host in hosts:
            builder.set_var(host.vars, key, _ini_value(raw) if raw else "", value_location)
    if port is not None:
        for host in hosts:
            builder.set_var(host.vars, "ansible_port", int(port), location)


# ------------------------------------------------------------------------------------------- resolution


def _check_cycles(builder: _Builder) -> None:
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


def _resolve(builder: _Builder) -> Inventory:
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
    builder: _Builder,
    raw: _RawHost,
    direct: set[str],
    ancestors: Callable[[str], set[str]],
    depth: Callable[[str], int],
) -> Host | None:
    all_groups: set[str] = set()
    for name in direct:
        all_groups |= ancestors(name)
    all_groups.discard("all")
    ordered = sorted(all_groups, key=lambda name: (depth(name), name))
    merged: dict[str, _RawVar] = {}
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
                values["address"] = _parse_address(raw.name)
            except ValueError as exc:
                builder.error(f"host {raw.name!r}: {exc}; set address (ansible_host) for it", raw.location)
                return None
        sources["address"] = "default"
    if values["rpc_host"] == "":
        # the bind address defaults to the address when that is an IPv4 literal; otherwise the service
        # layer resolves the name on the node (the server binds only IPv4 literals)
        values["rpc_host"] = values["address"]
        sources["rpc_host"] = "default (address)"
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


def _check_endpoints(builder: _Builder, hosts: Sequence[Host]) -> None:
    owners: dict[str, Host] = {}
    for host in hosts:
        first = owners.setdefault(host.endpoint, host)
        if first is not host:
            builder.error(
                f"hosts {first.name!r} and {host.name!r} share the rpc endpoint {host.endpoint}"
                " (give one another rpc_port or address)",
                host.location,
            )


class InventoryErrors(InventoryError):
    """Several errors found in one inventory: `errors` lists each; the message shows them all."""

    def __init__(self, errors: Sequence[InventoryError]) -> None:
        self.errors = tuple(errors)
        super().__init__("\n".join(err.message for err in self.errors))  # each message has its location
        self.location = self.errors[0].location


def _collected(errors: Sequence[InventoryError]) -> InventoryError:
    if len(errors) == 1:
        return errors[0]

    def position(err: InventoryError) -> tuple[int, int]:
        location = err.location
        return (location.line or 0, location.column or 0) if location else (0, 0)

    return InventoryErrors(sorted(errors, key=position))  # in file order


# --------------------------------------------------------------------------------------------- loading

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
            if _SECTION.match(line):
                return "ini"
            break
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return "ini"
    return "yaml" if isinstance(data, dict) or data is None else "ini"


def load_inventory_text(text: str, path: Path | None = None, fmt: InventoryFormat | None = None) -> Inventory:
    """Parse and validate an inventory given as text (`path` only names it in messages and picks a format)."""
    builder = _Builder(path, text.splitlines())
    if (fmt or detect_format(text, path)) == "ini":
        _parse_ini(builder, text)
    else:
        _parse_yaml(builder, text)
    if "all" not in builder.groups:
        builder.group("all", None)
    return _resolve(builder)


def load_inventory(path: Path) -> Inventory:
    """Read, parse and validate the inventory at `path`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InventoryError(f"inventory file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InventoryError(f"cannot read inventory {path}: {exc}") from None
    return load_inventory_text(text, Path(path))


# ------------------------------------------------------------------------------------------ selection


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
            hint = _did_you_mean(name, [*inventory.host_names(), *inventory.groups])
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


# ------------------------------------------------------------------------------------------- output


def host_to_dict(host: Host) -> dict[str, Any]:
    """A host as plain JSON-able data: name, every known variable, groups, endpoint, extra variables."""
    data: dict[str, Any] = {"name": host.name}
    for variable in VARIABLES:
        value = getattr(host, variable.name)
        data[variable.name] = list(value) if isinstance(value, tuple) else value
    data["endpoint"] = host.endpoint
    data["groups"] = list(host.groups)
    data["extra_vars"] = {key: value for key, value in host.vars.items() if key not in VARIABLES_BY_NAME}
    return data
