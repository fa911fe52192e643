"""The typed field parsers every front end shares: inventory variables, playbook arguments, artifact
specs and command-line flags.

A parser is a pure function from a raw value (what YAML, an INI line, `-e key=value` or argv gave) to
the typed value; it raises `ValueError` with a message written for the user, which the front end
prefixes with the file, line and key (or the flag). One rule per kind of value, so that `y` means the
same in an inventory, a playbook, a spec file and on the command line:

- booleans are Ansible's (`ansible.module_utils.parsing.convert_bool`): true, yes, on, y, t, 1 and
  false, no, off, n, f, 0, in any case, besides YAML's own true/false. rpcfleet reads Ansible
  inventories as they are, and an INI inventory's `ansible_host_key_checking=False` or a playbook's
  `force: y` must mean what Ansible makes of them;
- integers are whole numbers, as ints or digit strings (never a boolean, never 3.0);
- seconds are positive, finite numbers; sizes are bytes or "8GiB"/"512MB"/"1.5G" (`parse_size`);
- a list is a YAML list or a comma-separated string; empty items are dropped; null or "" is empty;
- `optional(p)`: null and "" are None (unset), anything else goes to `p`.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from orchestrator.core.units import parse_size

T = TypeVar("T")

Parser = Callable[[Any], T]


TRUE_WORDS = frozenset({"true", "yes", "on", "y", "t", "1"})


FALSE_WORDS = frozenset({"false", "no", "off", "n", "f", "0"})


def _got(value: Any) -> str:
    """`'abc'` for strings and numbers (the kind is clear from the quotes), `a list [1]` for others."""
    from orchestrator.core.yamlsource import type_name  # only on errors: the CLI starts without yaml

    if isinstance(value, str | int | float) and not isinstance(value, bool):
        return repr(value)
    return f"{type_name(value)} {value!r}" if value is not None else type_name(value)


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS | FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS
    raise ValueError(f"expected a boolean (true/false, yes/no, on/off), got {_got(value)}")


def text(value: Any) -> str:
    """A string; numbers are taken as written (`1.0` stays "1.0")."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"expected a string, got {_got(value)}")
    return str(value)


def integer(minimum: int | None = None, maximum: int | None = None) -> Parser[int]:
    def parse(value: Any) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
            number = int(value)
        else:
            raise ValueError(f"expected an integer, got {_got(value)}")
        if minimum is not None and number < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {number}")
        if maximum is not None and number > maximum:
            raise ValueError(f"expected an integer <= {maximum}, got {number}")
        return number

    return parse


def port(value: Any) -> int:
    number = integer()(value)
    if not 1 <= number <= 65535:
        raise ValueError(f"port {number} is out of range (1-65535)")
    return number


def seconds(value: Any) -> float:
    try:
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ValueError
        number = float(value)
    except ValueError:
        raise ValueError(f"expected a number of seconds, got {_got(value)}") from None
    if not 0 < number < math.inf:
        raise ValueError(f"expected a positive number of seconds, got {_got(value)}")
    return number


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def duration(value: Any) -> float:
    """Seconds, as a number or with a unit: `90`, `30s`, `10m`, `1.5h`."""
    if isinstance(value, str) and value.strip()[-1:].lower() in _UNITS:
        unit = _UNITS[value.strip()[-1].lower()]
        try:
            return seconds(value.strip()[:-1]) * unit
        except ValueError:
            raise ValueError(f"expected a duration (90, 30s, 10m, 1h), got {_got(value)}") from None
    try:
        return seconds(value)
    except ValueError:
        raise ValueError(f"expected a duration (90, 30s, 10m, 1h), got {_got(value)}") from None


def size(value: Any) -> int:
    """Bytes: an integer, or a size such as 8GiB, 512MB or 1.5G (bare K/M/G/T are binary)."""
    if isinstance(value, float) and not isinstance(value, bool) and 0 <= value < math.inf:
        return int(value)
    if not isinstance(value, str | int) or isinstance(value, bool):
        raise ValueError(f"expected a size such as 8GiB, 512MiB or 1.5G, got {_got(value)}")
    return parse_size(value)


def _number_and_percent(value: Any, what: str) -> tuple[float, bool]:
    """`12.5%` -> (12.5, True), `0.05` -> (0.05, False); ValueError naming `what` otherwise."""
    raw = str(value).strip() if isinstance(value, str | int | float) and not isinstance(value, bool) else "?"
    try:
        return float(raw.removesuffix("%")), raw.endswith("%")
    except ValueError:
        raise ValueError(f"expected {what}, got {_got(value)}") from None


def fraction(value: Any) -> float:
    """`5%` or `0.05` -> 0.05, from 0 to 1."""
    number, percent = _number_and_percent(value, "a fraction such as 5% or 0.05")
    number = number / 100 if percent else number
    if not 0 <= number <= 1:
        raise ValueError(f"expected a fraction between 0% and 100%, got {_got(value)}")
    return number


def percentage(value: Any) -> float:
    """`25` or `25%` -> 25.0, from 0 to 100."""
    number, _ = _number_and_percent(value, "a number from 0 to 100")
    if not 0 <= number <= 100:
        raise ValueError(f"expected a number from 0 to 100, got {_got(value)}")
    return number


def context(value: Any) -> int:
    """A context size in tokens: 4096, 32k (k = 1024) or 1m (m = 1024 k); 0 is allowed (the model's own)."""
    raw = str(value).strip().lower() if isinstance(value, str | int) and not isinstance(value, bool) else "?"
    match = re.fullmatch(r"(\d+)([km]?)", raw)
    if match is None:
        raise ValueError(f"expected a context size such as 4096 or 32k, got {_got(value)}")
    return int(match.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[match.group(2)]


def choice(allowed: Iterable[str], synonyms: Mapping[str, str] | None = None) -> Parser[str]:
    """One of `allowed` (case and surrounding blanks ignored); `synonyms` map other words onto them."""
    names = tuple(allowed)

    def parse(value: Any) -> str:
        word = value.strip().lower() if isinstance(value, str) else value
        if synonyms and isinstance(word, str) and word in synonyms:
            return synonyms[word]
        if word not in names:
            from orchestrator.core.yamlsource import did_you_mean

            hint = did_you_mean(str(value), names, cutoff=0.75)  # near misses only
            raise ValueError(f"expected one of {', '.join(names)}, got {_got(value)}{hint}")
        return str(word)

    return parse


def matching(pattern: str, what: str) -> Parser[str]:
    """A string matching `pattern` whole (blanks around it ignored); `what` describes it in errors."""
    compiled = re.compile(pattern)

    def parse(value: Any) -> str:
        word = text(value).strip()
        if not compiled.fullmatch(word):
            raise ValueError(f"expected {what}, got {_got(word)}")
        return word

    return parse


def list_of(item: Parser[T]) -> Parser[tuple[T, ...]]:
    """A list, or a comma-separated string, each item parsed by `item`; null or "" is empty."""

    def parse(value: Any) -> tuple[T, ...]:
        if value is None or value == "":
            return ()
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple):
            raise ValueError(f"expected a list (or comma-separated values), got {_got(value)}")
        stripped = [raw.strip() if isinstance(raw, str) else raw for raw in items]
        return tuple(item(raw) for raw in stripped if raw != "")

    return parse


def arguments(value: Any) -> tuple[str, ...]:
    """Command-line arguments: a list of strings, or one string split as a shell would."""
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))
        except ValueError as exc:
            raise ValueError(f"cannot split {value!r}: {exc}") from None
    if isinstance(value, list | tuple) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise ValueError(f"expected a list of arguments such as [-DGGML_CUDA=ON], got {_got(value)}")


def optional(parse: Parser[T]) -> Parser[T | None]:
    """None for null or "" (unset), else `parse(value)`."""
    return lambda value: None if value is None or value == "" else parse(value)
