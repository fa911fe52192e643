"""Slurm's hostlist syntax (`node[01-04,07],gpu-[1-2]`) expanded in pure Python, as `scontrol show
hostnames` does (checked against Slurm 22.05's answers: tests/data/slurm/hostnames.json).

The grammar: items separated by commas or whitespace (a comma inside brackets separates numbers);
an item is text with bracket groups, each a comma-separated list of numbers `N` or ranges `N-M` (M >= N),
zero-padded to the width of the range's first number (`[08-11]` -> 08 09 10 11, `[8-11]` -> 8 9 10 11);
several groups in one item multiply, the first varying slowest (`rack[1-2]-n[1-3]` -> rack1-n1,
rack1-n2, ...). Text after an item's last bracket (`n[1-3]x`) is refused, as Slurm 22.05 refuses it.
Names come out in order, repeats kept (Slurm keeps them too).
"""

from __future__ import annotations

import math
import re

MAX_HOSTLIST_HOSTS = 65_536  # Slurm's own cap on one range (hostlist.c's MAX_RANGE)

_NUMBERS = re.compile(r"(\d+)(?:-(\d+))?")


class HostlistError(ValueError):
    """A node list that is not Slurm hostlist syntax; the message names the list and what is wrong."""


def expand_hostlist(text: str) -> list[str]:
    """Every host name of a Slurm hostlist, in order; HostlistError on a malformed one."""
    names: list[str] = []
    for item in _items(text):
        names.extend(_expand_item(item, text))
        if len(names) > MAX_HOSTLIST_HOSTS:
            raise HostlistError(f"node list {text!r} names more than {MAX_HOSTLIST_HOSTS} hosts")
    return names


def _items(text: str) -> list[str]:
    """The top-level items: split on commas and whitespace outside brackets."""
    items, current, depth = [], "", 0
    for char in text:
        if char == "[":
            if depth:
                raise HostlistError(f"node list {text!r}: a bracket inside a bracket")
            depth = 1
        elif char == "]":
            if not depth:
                raise HostlistError(f"node list {text!r}: ']' without '['")
            depth = 0
        if not depth and (char == "," or char.isspace()):
            items.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise HostlistError(f"node list {text!r}: '[' is never closed")
    items.append(current)
    return [item for item in items if item]


def _expand_item(item: str, text: str) -> list[str]:
    parts = re.split(r"\[([^\]]*)\]", item)  # text, group, text, group, ..., text
    literals, groups = parts[0::2], parts[1::2]
    if groups and literals[-1]:
        raise HostlistError(
            f"node list {text!r}: text {literals[-1]!r} after the last bracket of {item!r}"
            " (Slurm's syntax allows only another bracket group there)"
        )
    expanded = [_expand_group(group, item, text) for group in groups]
    count = math.prod(len(numbers) for numbers in expanded)
    if count > MAX_HOSTLIST_HOSTS:
        raise HostlistError(
            f"node list {text!r}: {item!r} names {count} hosts (at most {MAX_HOSTLIST_HOSTS})"
        )
    names = [literals[0]]
    for numbers, after in zip(expanded, literals[1:], strict=True):
        names = [name + number + after for name in names for number in numbers]
    return names


def _expand_group(group: str, item: str, text: str) -> list[str]:
    """`01-04,07` -> 01 02 03 04 07."""
    numbers: list[str] = []
    for part in group.split(","):
        match = _NUMBERS.fullmatch(part.strip())
        if match is None:
            raise HostlistError(
                f"node list {text!r}: [{group}] in {item!r} is not numbers or ranges N-M"
                + (f" ({part.strip()!r})" if part.strip() != group else "")
            )
        first_text, last_text = match.group(1), match.group(2) or match.group(1)
        first, last = int(first_text), int(last_text)
        if last < first:
            raise HostlistError(
                f"node list {text!r}: range {part.strip()!r} in {item!r} ends before it starts"
            )
        if last - first >= MAX_HOSTLIST_HOSTS:
            raise HostlistError(f"node list {text!r}: range {part.strip()!r} names {last - first + 1} hosts")
        width = len(first_text)
        numbers.extend(str(number).zfill(width) for number in range(first, last + 1))
    return numbers
