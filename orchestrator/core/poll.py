"""Fixed-interval polls (tenacity): wait until a check gives an answer, or a time limit passes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def poll(check: Callable[[], T | None], *, timeout: float, interval: float) -> T | None:
    """Call `check` every `interval` seconds until it returns something other than None, and return that;
    None once `timeout` seconds have passed (`check` runs at least once). An exception from `check`
    ends the wait at once and goes on unchanged."""
    import tenacity  # here, not at import: the command line starts without it

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_delay(timeout),
        wait=tenacity.wait_fixed(interval),
        retry=tenacity.retry_if_result(lambda answer: answer is None),
        retry_error_callback=lambda state: None,
    )
    answer: T | None = retrying(check)
    return answer


async def poll_async(check: Callable[[], Awaitable[T | None]], *, limit: float, interval: float) -> T | None:
    """`poll` for async code: await `check()` every `interval` seconds until it gives something other
    than None, and return that; None once `limit` seconds have passed (`check` runs at least once)."""
    import tenacity

    retrying = tenacity.AsyncRetrying(
        stop=tenacity.stop_after_delay(limit),
        wait=tenacity.wait_fixed(interval),
        retry=tenacity.retry_if_result(lambda answer: answer is None),
        retry_error_callback=lambda state: None,
    )
    answer: T | None = await retrying(check)
    return answer
