"""YAML playbooks: named sequences of rpcfleet's operations over a host selection, run by the executor.

A playbook (one play per file)::

    name: rolling restart            # required
    hosts: all                       # an inventory pattern (default: all); --limit narrows it further
    serial: 1                        # hosts per batch: N, "N%", or a list such as [1, "50%"] (last repeats)
    max_fail_percentage: 0           # stop after a batch with more failures than this (default: a batch
                                     # whose hosts all failed stops the run, as in Ansible)
    vars:                            # variables for {{ name }} templates in step arguments and `hosts`
      model: /models/m.gguf          # (-e key=value on the command line wins)
    steps:
      - restart: {force: false}      # an operation and its arguments
      - name: wait for the servers   # an optional name, shown in the output
        wait_ready: {timeout: 20}
      - probe                        # an operation without arguments

Operations come from `REGISTRY`; each validates its own arguments through a small schema (`Arg`).
Host operations (install, deploy, start, stop, restart, wait_ready) run per host in batches of
`serial`; fleet operations (probe, plan, load_check, report) run once over the hosts still in the play
and give every host its own result. A host that fails leaves the play; a run stopped by the failure
threshold ends the play (the hosts it did not reach are `skipped`). A rolling restart is nothing more
than the `restart` step with `serial: 1`.

Every validation error names the file, line and column, quotes the line, and says which step; all
errors of a file are reported together (`PlaybookErrors`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import yaml

from orchestrator.core import fields
from orchestrator.core.errors import (
    PlaybookError,
    SourceLocation,
    UsageError,
)
from orchestrator.core.yamlsource import (
    Source,
    compose,
    did_you_mean,
    is_null,
    node_kind,
    node_value,
    type_name,
)
from orchestrator.engine.executor import batch_sizes
from orchestrator.playbooks.model import Playbook, PlaybookErrors, PlaybookStep, Serial
from orchestrator.playbooks.ops import REGISTRY

T = TypeVar("T")


_TEMPLATE = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


_TOP_KEYS = ("name", "hosts", "serial", "max_fail_percentage", "vars", "steps")


class _Reader:
    """Walks the composed YAML, collecting errors with their location."""

    def __init__(self, path: Path | None, text: str, variables: Mapping[str, Any]) -> None:
        self.source = Source.of_text(path, text)
        self.vars = variables
        self.errors: list[PlaybookError] = []

    def loc(self, node: yaml.Node | None) -> SourceLocation:
        return self.source.at(None) if node is None else self.source.node(node)

    def error(self, message: str, node: yaml.Node | None) -> None:
        self.errors.append(PlaybookError(message, self.loc(node)))

    def items(self, node: yaml.MappingNode) -> list[tuple[str, yaml.Node, yaml.Node]]:
        out = []
        for key_node, value_node in node.value:
            key = node_value(key_node)
            if not isinstance(key, str):
                self.error(f"keys must be strings, got {key!r}", key_node)
                continue
            out.append((key, key_node, value_node))
        return out

    def render(self, value: Any, node: yaml.Node, where: str) -> Any:
        """Fill `{{ name }}` templates from the variables; a value that is one template keeps its type."""
        if isinstance(value, list):
            return [self.render(v, node, where) for v in value]
        if isinstance(value, dict):
            return {k: self.render(v, node, where) for k, v in value.items()}
        if not isinstance(value, str) or "{{" not in value:
            return value
        missing = [name for name in _TEMPLATE.findall(value) if name not in self.vars]
        if missing:
            raise ValueError(
                f"undefined variable {missing[0]!r}{did_you_mean(missing[0], self.vars)} "
                f"(define it under vars:, or pass -e {missing[0]}=...)"
            )
        whole = _TEMPLATE.fullmatch(value.strip())
        if whole:
            return self.vars[whole.group(1)]
        return _TEMPLATE.sub(lambda m: str(self.vars[m.group(1)]), value)


def parse_extra_vars(items: Sequence[str]) -> dict[str, Any]:
    """`-e key=value` items -> variables; each value is read as a YAML scalar (`3` an int, `true` a bool)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise UsageError(f"-e: expected key=value with a name such as model, got {item!r}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        out[key] = raw if isinstance(value, dict | list) or value is None else value
    return out


def _top_value(reader: _Reader, node: yaml.Node, key: str, parse: Callable[[Any], T]) -> T | None:
    """A top-level value, its templates filled, parsed; an error is recorded against `key` (None)."""
    try:
        return parse(reader.render(node_value(node), node, key))
    except ValueError as exc:
        reader.error(f"{key}: {exc}", node)
        return None


def _serial(raw: Any) -> Serial:
    """Ansible's `serial`: a number, a percentage or a list of them (also given as -e serial=[1,50%])."""
    if isinstance(raw, str) and raw.strip().startswith("["):
        raw = yaml.safe_load(raw)
    if isinstance(raw, list) and all(isinstance(v, int | str) and not isinstance(v, bool) for v in raw):
        values: Serial = tuple(raw)
    elif isinstance(raw, int | str) and not isinstance(raw, bool):
        values = raw
    else:
        raise ValueError(f"expected a number, a percentage or a list of them, got {type_name(raw)} {raw!r}")
    try:
        batch_sizes(100, list(values) if isinstance(values, tuple) else values)
    except UsageError as exc:
        raise ValueError(exc.message.removeprefix("serial: ")) from None
    return values


def _step(reader: _Reader, node: yaml.Node, index: int) -> PlaybookStep | None:
    label = f"step {index}"
    name: str | None = None
    op_node: yaml.Node
    args_node: yaml.Node | None
    if isinstance(node, yaml.ScalarNode) and isinstance(node_value(node), str):
        op_name, op_node, args_node = str(node_value(node)), node, None
    elif isinstance(node, yaml.MappingNode):
        found: list[tuple[str, yaml.Node, yaml.Node]] = []
        for key, key_node, value_node in reader.items(node):
            if key == "name":
                name = node_value(value_node) if isinstance(value_node, yaml.ScalarNode) else None
                if not isinstance(name, str):
                    reader.error(f"{label}: name must be a string", value_node)
                    name = None
            else:
                found.append((key, key_node, value_node))
        if name:
            label = f'step {index} "{name}"'
        if len(found) != 1:
            what = (
                "no operation"
                if not found
                else f"{len(found)} operations ({', '.join(k for k, _, _ in found)})"
            )
            reader.error(f"{label}: a step is one operation with its arguments; found {what}", node)
            return None
        op_name, op_node, args_node = found[0]
    else:
        reader.error(f"{label}: expected an operation name or `op: {{args}}`, got {node_kind(node)}", node)
        return None
    op = REGISTRY.get(op_name)
    if op is None:
        reader.error(
            f"{label}: unknown operation {op_name!r}{did_you_mean(op_name, REGISTRY)} "
            f"(known: {', '.join(REGISTRY)})",
            op_node,
        )
        return None
    label = f"{label} ({op_name})"
    raw: dict[str, tuple[yaml.Node, Any]] = {}
    if args_node is not None and not is_null(args_node):
        if not isinstance(args_node, yaml.MappingNode):
            reader.error(
                f"{label}: arguments must be a mapping (name: value), got {node_kind(args_node)}", args_node
            )
            return None
        for key, key_node, value_node in reader.items(args_node):
            if op.arg(key) is None:
                known = ", ".join(a.name for a in op.args) or "none"
                reader.error(
                    f"{label}: unknown argument {key!r}{did_you_mean(key, [a.name for a in op.args])} "
                    f"(arguments of {op_name}: {known})",
                    key_node,
                )
                continue
            raw[key] = (value_node, node_value(value_node))
    args: dict[str, Any] = {}
    ok = True
    for arg in op.args:
        if arg.name not in raw:
            if arg.required:
                reader.error(
                    f"{label}: missing required argument {arg.name!r} ({arg.help})", args_node or op_node
                )
                ok = False
            args[arg.name] = arg.default
            continue
        value_node, value = raw[arg.name]
        try:
            args[arg.name] = arg.parse(reader.render(value, value_node, label))
        except ValueError as exc:
            reader.error(f"{label}: {arg.name}: {exc}", value_node)
            ok = False
    if not ok:
        return None
    return PlaybookStep(op_name, MappingProxyType(args), reader.loc(node), name, index)


def load_playbook_text(
    text: str, path: Path | None = None, extra_vars: Mapping[str, Any] | None = None
) -> Playbook:
    """Parse and validate a playbook given as text (`path` only names it in messages)."""
    reader = _Reader(path, text, {})
    try:
        root = compose(text)
    except yaml.MarkedYAMLError as exc:
        where = reader.source.mark(exc.problem_mark or exc.context_mark)
        raise PlaybookError(f"invalid YAML: {exc.problem or exc}", where) from None
    except yaml.YAMLError as exc:
        raise PlaybookError(f"invalid YAML: {exc}", reader.source.at(None)) from None
    if root is None or not isinstance(root, yaml.MappingNode):
        got = "an empty file" if root is None else node_kind(root)
        raise PlaybookError(
            f"a playbook is a mapping with name, hosts and steps; got {got}", reader.loc(root)
        )
    found = {key: (key_node, value_node) for key, key_node, value_node in reader.items(root)}
    for key, (key_node, _) in found.items():
        if key not in _TOP_KEYS:
            reader.error(
                f"unknown key {key!r}{did_you_mean(key, _TOP_KEYS)} (keys: {', '.join(_TOP_KEYS)})", key_node
            )
    variables: dict[str, Any] = {}
    if "vars" in found and not is_null(found["vars"][1]):
        vars_node = found["vars"][1]
        if isinstance(vars_node, yaml.MappingNode):
            variables = {key: node_value(value_node) for key, _, value_node in reader.items(vars_node)}
        else:
            reader.error(f"vars must be a mapping, got {node_kind(vars_node)}", vars_node)
    variables.update(extra_vars or {})
    reader.vars = variables
    name = ""
    if "name" not in found:
        reader.error("missing required key 'name'", root)
    else:
        raw_name = node_value(found["name"][1]) if isinstance(found["name"][1], yaml.ScalarNode) else None
        if not isinstance(raw_name, str) or not raw_name.strip():
            reader.error("name must be a non-empty string", found["name"][1])
        else:
            name = raw_name
    hosts = "all"
    if "hosts" in found:
        node = found["hosts"][1]
        raw_hosts = node_value(node) if isinstance(node, yaml.ScalarNode) else None
        try:
            hosts = fields.text(reader.render(raw_hosts, node, "hosts")).strip()
            if not hosts:
                raise ValueError("an empty pattern")
        except ValueError as exc:
            reader.error(f"hosts: expected a host pattern such as all or gpu:!gpu03 ({exc})", node)
    serial = _top_value(reader, found["serial"][1], "serial", _serial) if "serial" in found else None
    max_fail = (
        _top_value(reader, found["max_fail_percentage"][1], "max_fail_percentage", fields.percentage)
        if "max_fail_percentage" in found
        else None
    )
    steps: list[PlaybookStep] = []
    if "steps" not in found:
        reader.error("missing required key 'steps' (a list of operations)", root)
    else:
        steps_node = found["steps"][1]
        if not isinstance(steps_node, yaml.SequenceNode) or not steps_node.value:
            reader.error(f"steps must be a non-empty list, got {node_kind(steps_node)}", steps_node)
        else:
            for index, step_node in enumerate(steps_node.value, start=1):
                step = _step(reader, step_node, index)
                if step is not None:
                    steps.append(step)
    if reader.errors:
        errors = sorted(
            reader.errors,
            key=lambda e: (e.location.line or 0, e.location.column or 0) if e.location else (0, 0),
        )
        raise errors[0] if len(errors) == 1 else PlaybookErrors(errors)
    return Playbook(name, tuple(steps), hosts, serial, max_fail, MappingProxyType(variables), path)


def load_playbook(path: Path | str, extra_vars: Mapping[str, Any] | None = None) -> Playbook:
    """Read, parse and validate the playbook at `path`; `extra_vars` (-e) override its vars."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlaybookError(f"playbook not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlaybookError(f"cannot read playbook {path}: {exc}") from None
    return load_playbook_text(text, path, extra_vars)


def rolling_restart_playbook(
    *,
    serial: Serial = 1,
    max_fail_percentage: float | None = 0,
    force: bool = False,
    hosts: str = "all",
) -> Playbook:
    """The playbook `rpcfleet rolling-restart` runs: one `restart` step in batches of `serial`."""
    op = REGISTRY["restart"]
    args = {a.name: a.default for a in op.args}
    args["force"] = force
    step = PlaybookStep("restart", MappingProxyType(args), None, None, 1)
    return Playbook("rolling restart", (step,), hosts, serial, max_fail_percentage)
