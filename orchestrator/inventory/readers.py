"""Readers of the three inventory formats (native YAML, Ansible YAML, Ansible INI) into raw hosts."""

from __future__ import annotations

import ast
import re
import shlex
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from orchestrator.core.errors import InventoryError, SourceLocation
from orchestrator.core.yamlsource import (
    Source,
    compose,
    flatten_merge_keys,
    is_null,
    node_kind,
    node_value,
)
from orchestrator.inventory.ranges import expand_host_range
from orchestrator.inventory.variables import (
    ANSIBLE_VARS,
    CANONICAL,
    VARIABLES_BY_NAME,
    near_miss,
    variable_hint,
)


@dataclass
class RawVar:
    key: str  # as written (an alias maybe)
    value: Any
    location: SourceLocation


@dataclass
class _RawGroup:
    name: str
    location: SourceLocation | None
    vars: dict[str, RawVar] = field(default_factory=dict)
    children: dict[str, SourceLocation | None] = field(default_factory=dict)
    hosts: list[str] = field(default_factory=list)
    defined: bool = True  # INI: False while only referenced by [x:children] / [x:vars]


@dataclass
class RawHost:
    name: str
    location: SourceLocation
    vars: dict[str, RawVar] = field(default_factory=dict)


class Builder:
    def __init__(self, path: Path | None, lines: Sequence[str]) -> None:
        self.path = path
        self.source = Source(path, lines)
        self.hosts: dict[str, RawHost] = {}
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

    def add_hosts(self, pattern: str, location: SourceLocation, group: _RawGroup | None) -> list[RawHost]:
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
                host = self.hosts[name] = RawHost(name, location)
            if group is not None and name not in group.hosts:
                group.hosts.append(name)
            result.append(host)
        return result

    def set_var(self, scope: dict[str, RawVar], key: str, value: Any, location: SourceLocation) -> None:
        canonical = CANONICAL.get(key, key)
        previous = scope.get(canonical)
        if previous is not None and previous.key != key and previous.location != location:
            self.error(f"{key!r} and {previous.key!r} both set {canonical!r} here; keep one", location)
            return
        if key == "ansible_become" and str(value).strip().lower() in ("true", "yes", "1", "on"):
            # Refused, not ignored: the steps would run as the login user while the inventory says root.
            self.error(
                "ansible_become: rpcfleet does not escalate with sudo; connect as root (ansible_user: root) "
                "for system units and the dedicated server user, or drop it to install and supervise as "
                "the login user",
                location,
            )
            return
        if canonical == key and key not in VARIABLES_BY_NAME and key not in ANSIBLE_VARS:
            hint = variable_hint(key)
            if hint:
                self.warn(f"unknown variable {key!r} is kept as is{hint}", location)
        scope[canonical] = RawVar(key, value, location)


def yaml_items(builder: Builder, node: yaml.Node, what: str) -> Iterator[tuple[str, yaml.Node, yaml.Node]]:
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


def yaml_vars(builder: Builder, scope: dict[str, RawVar], node: yaml.Node, what: str) -> None:
    for key, _key_node, value_node in yaml_items(builder, node, what):
        builder.set_var(scope, key, node_value(value_node), builder.source.node(value_node))


def yaml_names(builder: Builder, node: yaml.Node, what: str) -> Iterator[tuple[str, yaml.Node]]:
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


def _yaml_group_hosts(builder: Builder, group: _RawGroup | None, node: yaml.Node, what: str) -> None:
    """`hosts:` as a mapping name -> vars (declares hosts)."""
    for name, key_node, value_node in yaml_items(builder, node, what):
        for host in builder.add_hosts(name, builder.source.node(key_node), group):
            yaml_vars(builder, host.vars, value_node, f"variables of host {host.name!r}")


_GROUP_KEYS = ("hosts", "children", "vars")


def _ansible_group(
    builder: Builder, name: str, node: yaml.Node, key_node: yaml.Node, parent: _RawGroup | None
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
    for key, sub_key, value in yaml_items(builder, node, f"group {name!r}"):
        if key == "hosts":
            if isinstance(value, yaml.SequenceNode):
                for host_name, item in yaml_names(builder, value, f"hosts of group {name!r}"):
                    builder.add_hosts(host_name, builder.source.node(item), group)
            else:
                _yaml_group_hosts(builder, group, value, f"hosts of group {name!r}")
        elif key == "children":
            for child, child_key, child_node in yaml_items(builder, value, f"children of group {name!r}"):
                _ansible_group(builder, child, child_node, child_key, group)
        elif key == "vars":
            yaml_vars(builder, group.vars, value, f"vars of group {name!r}")
        else:
            builder.warn(
                f"unexpected key {key!r} in group {name!r} is ignored (only hosts, children and vars)"
                + near_miss(key, _GROUP_KEYS),
                builder.source.node(sub_key),
            )


_NATIVE_KEYS = ("vars", "hosts", "groups")


def _native(builder: Builder, root: yaml.MappingNode) -> None:
    everyone = builder.group("all", None)
    group_refs: list[tuple[_RawGroup, str, SourceLocation]] = []
    host_refs: list[tuple[_RawGroup, str, SourceLocation]] = []
    for key, key_node, value in yaml_items(builder, root, "the inventory"):
        if key == "vars":
            yaml_vars(builder, everyone.vars, value, "vars")
        elif key == "hosts":
            _yaml_group_hosts(builder, None, value, "hosts")
        elif key == "groups":
            for name, name_node, body in yaml_items(builder, value, "groups"):
                if name in ("all", "ungrouped"):
                    builder.error(
                        f"group {name!r} is implicit; use top-level vars/hosts",
                        builder.source.node(name_node),
                    )
                    continue
                group = builder.group(name, builder.source.node(name_node))
                for gkey, gkey_node, gvalue in yaml_items(builder, body, f"group {name!r}"):
                    what = f"{gkey} of group {name!r}"
                    if gkey == "hosts" and isinstance(gvalue, yaml.MappingNode):
                        _yaml_group_hosts(builder, group, gvalue, what)
                    elif gkey == "hosts":
                        for host, item in yaml_names(builder, gvalue, what):
                            host_refs.append((group, host, builder.source.node(item)))
                    elif gkey == "children":
                        for child, item in yaml_names(builder, gvalue, what):
                            group_refs.append((group, child, builder.source.node(item)))
                    elif gkey == "vars":
                        yaml_vars(builder, group.vars, gvalue, what)
                    else:
                        builder.error(
                            f"unknown key {gkey!r} in group {name!r}{near_miss(gkey, _GROUP_KEYS)}",
                            builder.source.node(gkey_node),
                        )
        elif key == "slurm":
            builder.error(
                "a `slurm:` section makes this a Slurm inventory (the nodes of a job): rpcfleet's command "
                "line reads it (`-i FILE`), Python with orchestrator.inventory.slurm.read_slurm_inventory",
                builder.source.node(key_node),
            )
        else:
            builder.error(
                f"unknown top-level key {key!r}{near_miss(key, _NATIVE_KEYS)}"
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
                hint = near_miss(name, builder.hosts)
                builder.error(f"group {group.name!r} lists undefined host {name!r}{hint}", location)
            elif name not in group.hosts:
                group.hosts.append(name)
    for group, child, location in group_refs:
        if child not in builder.groups or child in ("all", "ungrouped"):
            hint = near_miss(child, builder.groups)
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


def compose_document(builder: Builder, text: str) -> yaml.Node | None:
    """The YAML document's root node; InventoryError (file, line, column) when it is not YAML."""
    try:
        return compose(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or "cannot be parsed"
        if exc.context:  # PyYAML's order: "while parsing X" / "expected Y", then the problem
            problem = f"{exc.context}{', ' if problem.startswith('but ') else ': '}{problem}"
        raise InventoryError(f"invalid YAML: {problem}", builder.source.mark(mark)) from None
    except yaml.YAMLError as exc:
        raise InventoryError(f"invalid YAML: {exc}", builder.loc(None)) from None


def parse_yaml(builder: Builder, text: str) -> None:
    root = compose_document(builder, text)
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
    for name, key_node, body in yaml_items(builder, root, "the inventory"):
        _ansible_group(builder, name, body, key_node, None)


SECTION = re.compile(r"^\s*\[([^\]]*)\]\s*(?:[#;].*)?$")


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


def parse_ini(builder: Builder, text: str) -> None:
    group = builder.group("ungrouped", None)
    kind = "hosts"
    vars_sections: list[tuple[str, SourceLocation]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped[0] in "#;":
            continue
        column = len(line) - len(line.lstrip()) + 1
        section = SECTION.match(line)
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
                hint = near_miss(child, defined)
                message = f"group {parent.name!r} has undefined child group {child!r}{hint}"
                builder.error(message, child_location)


def _ini_host_line(builder: Builder, group: _RawGroup, line: str, number: int) -> None:
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
