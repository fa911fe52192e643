"""Waiting for a condition in a test, not for a guessed delay: a busy machine makes any delay too short."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from orchestrator.core.poll import poll

T = TypeVar("T")


def wait_until(check: Callable[[], object], limit: float = 10.0, what: str = "the condition") -> None:
    """Return once `check()` is true; fail the test after `limit` seconds."""
    if poll(lambda: True if check() else None, timeout=limit, interval=0.01) is None:
        raise AssertionError(f"{what} did not hold within {limit:g} s")


async def until(check: Callable[[], object], limit: float = 10.0, what: str = "the condition") -> None:
    """`wait_until` inside an event loop: the loop runs on while it waits."""
    deadline = time.monotonic() + limit
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {limit:g} s")
        await asyncio.sleep(0.01)


async def until_value(
    read: Callable[[], Awaitable[T]], holds: Callable[[T], bool], limit: float = 10.0, what: str = "the state"
) -> T:
    """Await `read()` again and again (a status read over SSH) until `holds` its value; returns that value.
    Fails the test after `limit` seconds, naming the last value read."""
    deadline = time.monotonic() + limit
    while not holds(value := await read()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {limit:g} s: {value!r}")
        await asyncio.sleep(0.01)
    return value
