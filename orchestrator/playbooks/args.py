"""Typed step arguments."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrator.core.yamlsource import (
    did_you_mean,
    type_name,
)

if TYPE_CHECKING:  # imported lazily at run time: planning pulls in numpy
    pass


@dataclass(frozen=True)
class Arg:
    """One argument of an operation: `parse` takes the raw value and returns the typed one or raises
    ValueError with a message for the user."""

    name: str
    parse: Callable[[Any], Any]
    default: Any = None
    required: bool = False
    help: str = ""


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "false", "no", "off"):
        return value.strip().lower() in ("true", "yes", "on")
    raise ValueError(f"expected true or false, got {type_name(value)} {value!r}")


def _int(minimum: int | None = None) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError(f"expected an integer, got {type_name(value)} {value!r}")
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"expected an integer, got {value!r}") from None
        if minimum is not None and number < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {number}")
        return number

    return parse


def _seconds(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number of seconds, got {type_name(value)} {value!r}") from None
    if not 0 < seconds < float("inf"):
        raise ValueError(f"expected a positive number of seconds, got {value!r}")
    return seconds


def _text(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"expected a string, got {type_name(value)} {value!r}")
    return str(value)


def _optional_text(value: Any) -> str | None:
    return None if value is None or value == "" else _text(value)


def _choice(*allowed: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value not in allowed:
            raise ValueError(
                f"expected one of {', '.join(allowed)}, got {value!r}{did_you_mean(value, allowed)}"
            )
        return str(value)

    return parse


def _size(value: Any) -> int:
    from orchestrator.core.units import parse_size

    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 256MiB, got {value!r}")
    try:
        return parse_size(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(str(exc)) from None


def _fraction(value: Any) -> float:
    """`5%` or `0.05` -> 0.05."""
    text = str(value).strip() if not isinstance(value, bool) else ""
    try:
        number = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ValueError(f"expected a fraction such as 5% or 0.05, got {value!r}") from None
    if not 0 <= number <= 1:
        raise ValueError(f"expected a fraction between 0% and 100%, got {value!r}")
    return number


def _list_of(parse_one: Callable[[Any], Any]) -> Callable[[Any], tuple[Any, ...]]:
    """A list, or a comma-separated string; empty or null is an empty tuple."""

    def parse(value: Any) -> tuple[Any, ...]:
        if value is None or value == "":
            return ()
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple):
            raise ValueError(f"expected a list, got {type_name(value)} {value!r}")
        return tuple(parse_one(item.strip() if isinstance(item, str) else item) for item in items)

    return parse


def _context(value: Any) -> int:
    """4096, or 32k (k = 1024)."""
    text = str(value).strip().lower() if not isinstance(value, bool) else "?"
    match = re.fullmatch(r"(\d+)(k?)", text)
    if match is None:
        raise ValueError(f"expected a context size such as 4096 or 32k, got {value!r}")
    return int(match.group(1)) * (1024 if match.group(2) else 1)
