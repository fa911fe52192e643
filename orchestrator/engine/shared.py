"""One shared attempt per key: the helper behind every "compute this once for everyone" in a run
(a host's connection, a fleet step's probe or plan, an artifact chosen for many hosts); and
`gather_bounded`, the one bound on work started at once outside a session's host steps (the probe's and
the exporter's RPC rounds, the lock layer's connects).

The failure rule, the same for every user:

* Callers of one key share one attempt, started by the first; a caller that is cancelled leaves the
  attempt running for the others.
* The outcome is kept for the life of the `Shared`: a value, or an error. A failed attempt is not
  retried by later callers: in one run, what failed for one host fails alike for the next instead of
  being tried again (a fleet probe or a plan is not repeated per batch of hosts, a download that
  timed out does not time out once per host).
* Every caller gets the same error: rpcfleet's errors are immutable (a caller that names a host on it
  makes a copy, `with_host`), so one caller cannot change it for another.
* Only an attempt that was itself cancelled (by `clear`) is forgotten: the next caller starts anew.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class Shared(Generic[K, T]):
    """`await shared.get(key, make)`: `make()` runs once per key; every caller awaits its outcome."""

    def __init__(self) -> None:
        self._attempts: dict[K, asyncio.Future[T]] = {}

    async def get(self, key: K, make: Callable[[], Awaitable[T]]) -> T:
        attempt = self._attempts.get(key)
        if attempt is None or attempt.cancelled():
            attempt = asyncio.ensure_future(make())
            self._attempts[key] = attempt
        return await asyncio.shield(attempt)

    def forget(self, key: K) -> asyncio.Future[T] | None:
        """Forget one key (the next caller starts anew); its attempt, for the owner to release."""
        return self._attempts.pop(key, None)

    async def clear(self) -> list[T]:
        """Forget every key: cancel the attempts still running, wait for them, and return the values of
        those that succeeded (for the owner to release, e.g. connections to close)."""
        attempts = list(self._attempts.values())
        self._attempts.clear()
        for attempt in attempts:
            attempt.cancel()
        values = []
        for attempt in attempts:
            try:
                values.append(await attempt)
            except (Exception, asyncio.CancelledError):  # a failed attempt has nothing to release
                continue
        return values


class SharedCall(Generic[T]):
    """`Shared` for one computation without a key: `await call.get()`."""

    def __init__(self, make: Callable[[], Awaitable[T]]) -> None:
        self._make = make
        self._shared: Shared[None, T] = Shared()

    async def get(self) -> T:
        return await self._shared.get(None, self._make)


async def gather_bounded(calls: Iterable[Callable[[], Awaitable[T]]], limit: int) -> list[T]:
    """Await every call's result, at most `limit` running at once; results in the calls' order (an
    exception of one is raised once all have ended, as `asyncio.gather` would: the first)."""
    slots = asyncio.Semaphore(limit)

    async def one(call: Callable[[], Awaitable[T]]) -> T:
        async with slots:
            return await call()

    return list(await asyncio.gather(*(one(c) for c in calls)))


class Pulse:
    """A condition variable for one loop: `notify()` (from the loop's code) wakes every `wait`; a waiter
    checks its condition, then waits (nothing runs in between on one loop, so no wake-up is missed)."""

    def __init__(self) -> None:
        self._waiters: set[asyncio.Future[None]] = set()

    def notify(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def wait(self, limit: float | None = None) -> None:
        """Until the next `notify`, or `limit` seconds (None: no limit)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            await asyncio.wait_for(waiter, limit)
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(waiter)
