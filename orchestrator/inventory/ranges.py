"""Host ranges: `web[01:10]` in inventories and patterns."""

from __future__ import annotations

import math
import re
import string

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
