"""Byte sizes as users write them ("8GiB", "512 MB", "1.5G") and as we print them."""

from __future__ import annotations

import re

MiB = 1024**2
GiB = 1024**3

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Bytes from an int or a string such as "8GiB", "512MB", "1.5G" (bare K/M/G/T are binary).

    Raises ValueError with a message suited to be shown to a user.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 8GiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value}")
        return value
    match = _SIZE.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size such as 8GiB, 512MiB or 1.5G, got {value!r}")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.lower()])


def format_size(n_bytes: int | float | None) -> str:
    """Human-readable binary size: 1536 -> "1.50 KiB"; None -> "-"."""
    if n_bytes is None:
        return "-"
    sign = "-" if n_bytes < 0 else ""
    value = float(abs(n_bytes))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
