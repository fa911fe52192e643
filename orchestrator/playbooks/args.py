"""Typed step arguments: each parsed by one of the shared field parsers (`orchestrator.core.fields`); a
planning or probe option's argument is made from its one declaration (`option_arg`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orchestrator.core import fields
from orchestrator.workflows.options import Option


@dataclass(frozen=True)
class Arg:
    """One argument of an operation: `parse` takes the raw value and returns the typed one or raises
    ValueError with a message for the user. `option`: the declared option it was made from."""

    name: str
    parse: Callable[[Any], Any]
    default: Any = None
    required: bool = False
    help: str = ""
    option: Option | None = None


def option_arg(option: Option, *, many: bool = False) -> Arg:
    """The argument of a declared option (`orchestrator.workflows.options`): the flag's name, parser,
    default and help; null is the default where that is None (`margin: null`). `many`: a list of values
    (a YAML list, or comma-separated), by default the option's one default (`report`'s contexts)."""
    parse: Callable[[Any], Any]
    if many:
        parse, default = fields.list_of(option.parse), (option.default,)
    else:
        parse = fields.optional(option.parse) if option.default is None else option.parse
        default = option.default
    return Arg(option.name, parse, default, help=option.help, option=option)
