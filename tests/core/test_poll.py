"""`poll`, the fixed-interval wait behind the lab's and the artifact import's readiness checks."""

from __future__ import annotations

import time

import pytest

from orchestrator.core.poll import poll


def test_poll_returns_the_first_answer() -> None:
    calls: list[float] = []

    def third_time() -> str | None:
        calls.append(time.monotonic())
        return "ready" if len(calls) == 3 else None

    assert poll(third_time, timeout=5.0, interval=0.02) == "ready"
    assert len(calls) == 3 and calls[2] - calls[0] >= 0.04  # the interval is kept between checks


def test_poll_gives_none_after_the_timeout_and_checks_at_least_once() -> None:
    calls = 0

    def never() -> None:
        nonlocal calls
        calls += 1

    started = time.monotonic()
    assert poll(never, timeout=0.1, interval=0.01) is None
    assert 0.1 <= time.monotonic() - started < 3.0 and calls >= 5  # ends (headroom for a busy machine)
    calls = 0
    assert poll(never, timeout=0.0, interval=0.01) is None and calls == 1


def test_an_error_ends_the_wait_at_once() -> None:
    calls = 0

    def broken() -> None:
        nonlocal calls
        calls += 1
        raise OSError("node died")

    with pytest.raises(OSError, match="node died"):
        poll(broken, timeout=5.0, interval=0.01)
    assert calls == 1


def test_poll_async_answers_gives_up_and_ends_on_an_error() -> None:
    import asyncio

    from orchestrator.core.poll import poll_async

    calls: list[float] = []

    async def third_time() -> str | None:
        calls.append(time.monotonic())
        return "ready" if len(calls) == 3 else None

    async def never() -> None:
        calls.append(time.monotonic())

    async def broken() -> None:
        calls.append(time.monotonic())
        raise ValueError("broken")

    assert asyncio.run(poll_async(third_time, limit=5.0, interval=0.02)) == "ready"
    assert len(calls) == 3 and calls[2] - calls[0] >= 0.04
    calls.clear()
    started = time.monotonic()
    assert asyncio.run(poll_async(never, limit=0.1, interval=0.01)) is None
    assert 0.1 <= time.monotonic() - started < 3.0 and len(calls) >= 5
    calls.clear()
    with pytest.raises(ValueError, match="broken"):
        asyncio.run(poll_async(broken, limit=5.0, interval=0.01))
    assert len(calls) == 1
