"""YAML read with source positions, shared by the inventory, playbook and artifact-spec readers.

Documents are composed into nodes (which keep their line and column) rather than loaded, so each
reader can point an error at the offending line; `node_value` builds a node's Python value when
needed. Also the wording helpers their messages share (`type_name`, `did_you_mean`).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from orchestrator.core.errors import SourceLocation


def compose(text: str) -> yaml.Node | None:
    """The document's node tree (None for an empty document); raises `yaml.YAMLError`."""
    return yaml.compose(text, Loader=yaml.SafeLoader)


_CONSTRUCTOR = yaml.SafeLoader("")


def node_value(node: yaml.Node) -> Any:
    """The Python value of `node` (safe types only)."""
    try:
        return _CONSTRUCTOR.construct_object(node, deep=True)
    finally:
        _CONSTRUCTOR.constructed_objects.clear()  # keep no reference to old documents


def flatten_merge_keys(node: yaml.MappingNode) -> None:
    """Resolve YAML merge keys (`<<: *anchor`) in place."""
    _CONSTRUCTOR.flatten_mapping(node)


def is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null"


def type_name(value: Any) -> str:
    """ "a string", "an integer"... for messages such as `expected a list, got a string 'x'`."""
    if value is None:
        return "nothing (null)"
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list"}
    return names.get(type(value), f"a {type(value).__name__}")


def node_kind(node: yaml.Node) -> str:
    """What `node` holds, in `type_name`'s words."""
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return type_name(node_value(node))


def did_you_mean(word: Any, candidates: Iterable[str], *, cutoff: float = 0.6) -> str:
    """` (did you mean 'x'?)` for the closest candidate, or "" when none is close enough."""
    close = difflib.get_close_matches(str(word), list(candidates), n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclass(frozen=True)
class Source:
    """A file's text, to turn positions in it into `SourceLocation`s quoting the line."""

    path: Path | None
    lines: Sequence[str]

    @classmethod
    def of_text(cls, path: Path | None, text: str) -> Source:
        return cls(path, text.splitlines())

    def at(self, line: int | None, column: int | None = None) -> SourceLocation:
        """A location with 1-based line/column; the snippet is the whole source line."""
        snippet = None
        if line is not None and 1 <= line <= len(self.lines):
            snippet = self.lines[line - 1].strip() or None
        return SourceLocation(self.path, line, column, snippet)

    def mark(self, mark: yaml.Mark | None) -> SourceLocation:
        """Where a YAML mark (0-based) points; no line when there is no mark."""
        return self.at(mark.line + 1, mark.column + 1) if mark is not None else self.at(None)

    def node(self, node: yaml.Node) -> SourceLocation:
        """Where `node` starts."""
        return self.mark(node.start_mark)
