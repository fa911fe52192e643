"""Typed step arguments: each parsed by one of the shared field parsers (`orchestrator.core.fields`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Arg:
    """One argument of an operation: `parse` takes the raw value and returns the typed one or raises
    ValueError with a message for the user."""

    name: str
    parse: Callable[[Any], Any]
    default: Any = None
    required: bool = False
    help: str = ""
