"""The one place for concurrency: run a step on many hosts.

A step is an async function of a `HostContext` (the host plus a lazily opened, cached connection).
Hosts run concurrently up to `forks`, in batches when `serial` is given (Ansible semantics: `serial`
is a number, a percentage or a list of them whose last entry repeats), and the run stops after a
batch whose failures pass `max_fail_percentage`; hosts not reached are reported `skipped`.
Partial failure is data: every host gets a `HostResult`; one bad host never hides the others.

Interrupts: `Session.interrupt()` (SIGINT/SIGTERM when the session is `interruptible`) lets the hosts in
flight finish and starts no new one; those are reported `skipped` ("not started: interrupted") and the
run result says `interrupted`.

Run gates: a step may offer `run_gate()`, returning a `RunGate` that is entered with all the run's hosts
before any of them starts and left as each host ends (the operations layer's host locks, which must be
taken in one order over the whole run so that two runs never split a fleet between them).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

from orchestrator.connectors.base import Connection, ConnectOptions
from orchestrator.connectors.connect import connect
from orchestrator.core import signals
from orchestrator.core.errors import NotStartedError, RpcfleetError, UnreachableError, UsageError
from orchestrator.core.log import get_logger
from orchestrator.engine.shared import Shared
from orchestrator.inventory.model import Host

T = TypeVar("T")


DEFAULT_FORKS = 16  # hosts worked on at once (the CLI's -f/--forks default)


Status = Literal["ok", "changed", "failed", "unreachable", "skipped"]


STATUSES: tuple[Status, ...] = ("ok", "changed", "failed", "unreachable", "skipped")


@dataclass(frozen=True)
class StepOutcome(Generic[T]):
    """What a step returns for one host: whether it changed something, a value, a one-line summary."""

    value: T
    changed: bool = False
    message: str = ""


@dataclass(frozen=True)
class HostResult(Generic[T]):
    host: Host
    status: Status
    value: T | None = None
    error: RpcfleetError | None = None
    message: str = ""
    duration: float = 0.0

    @property
    def succeeded(self) -> bool:
        return self.status in ("ok", "changed")


@dataclass(frozen=True)
class RunResult(Generic[T]):
    """Per-host results in the order the hosts were given; `aborted` when the failure threshold stopped it."""

    step: str
    results: tuple[HostResult[T], ...]
    aborted: bool = False
    interrupted: bool = False  # an interrupt stopped it: hosts not started are `skipped`

    @property
    def succeeded(self) -> tuple[HostResult[T], ...]:
        return tuple(r for r in self.results if r.succeeded)

    @property
    def failed(self) -> tuple[HostResult[T], ...]:
        return tuple(r for r in self.results if r.status in ("failed", "unreachable"))

    @property
    def ok(self) -> bool:
        return not self.failed and not self.aborted and not self.interrupted

    @property
    def not_started(self) -> tuple[HostResult[T], ...]:
        return tuple(r for r in self.results if r.status == "skipped")

    def by_host(self) -> dict[str, HostResult[T]]:
        return {r.host.name: r for r in self.results}


@dataclass
class Recap:
    """Counts per host and status over one or more runs (the end-of-run summary)."""

    counts: dict[str, dict[Status, int]] = field(default_factory=dict)
    errors: dict[str, list[str]] = field(default_factory=dict)

    def add(self, run: RunResult[Any]) -> Recap:
        for result in run.results:
            per_host = self.counts.setdefault(result.host.name, dict.fromkeys(STATUSES, 0))
            per_host[result.status] += 1
            if result.error is not None:
                error = result.error.describe(with_host=False)  # the recap's row names the host
                self.errors.setdefault(result.host.name, []).append(f"{run.step}: {error}")
        return self

    @property
    def ok(self) -> bool:
        return all(c["failed"] == 0 and c["unreachable"] == 0 for c in self.counts.values())

    def to_json(self) -> dict[str, Any]:
        return {host: {**counts, "errors": self.errors.get(host, [])} for host, counts in self.counts.items()}


def batch_sizes(n_hosts: int, serial: int | str | Sequence[int | str] | None) -> list[int]:
    """Split `n_hosts` into batch sizes following Ansible's `serial` (numbers, "N%", lists)."""
    if n_hosts == 0:
        return []
    if serial is None:
        return [n_hosts]
    steps = [serial] if isinstance(serial, int | str) else list(serial)
    if not steps:
        raise UsageError("serial: an empty list is not a batch size")
    sizes: list[int] = []
    remaining = n_hosts
    index = 0
    while remaining > 0:
        size = _one_batch_size(steps[min(index, len(steps) - 1)], n_hosts)
        sizes.append(min(size, remaining))
        remaining -= sizes[-1]
        index += 1
    return sizes


def _one_batch_size(value: int | str, n_hosts: int) -> int:
    if isinstance(value, bool):
        raise UsageError(f"serial: expected a number or a percentage, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise UsageError(f"serial: a batch needs at least one host, got {value}")
        return value
    text = value.strip()
    try:
        if text.endswith("%"):
            percent = float(text[:-1])
            if not 0 < percent <= 100:
                raise ValueError
            return max(1, math.floor(n_hosts * percent / 100))
        return _one_batch_size(int(text), n_hosts)
    except ValueError:
        raise UsageError(f"serial: expected a number or a percentage such as 25%, got {value!r}") from None


class RunGate(Protocol):
    """What a step needs on every host of a run before any host starts (see the module docstring)."""

    async def enter(self, session: Session, hosts: Sequence[Host]) -> Mapping[str, RpcfleetError]:
        """Take it for `hosts`; the errors of the hosts that must not start (each one's result)."""
        ...

    async def leave(self, host: Host) -> None:
        """`host`'s step ended: give back what `enter` took for it."""
        ...

    async def close(self) -> None:
        """The run ended: give back whatever is still held (hosts that never started)."""
        ...


class HostContext:
    """What a step sees for one host: the host, its (cached) connection, a bound logger, the run's gate."""

    def __init__(self, host: Host, session: Session, gate: RunGate | None = None) -> None:
        self.host = host
        self.session = session
        self.gate = gate
        self.log = get_logger(host=host.name, run_id=session.run_id)

    async def connection(self) -> Connection:
        return await self.session.connection(self.host)


Step = Callable[[HostContext], Awaitable[StepOutcome[T]]]


def run_gate_of(step: Step[Any]) -> RunGate | None:
    """A new gate for one run of `step`, if the step has one."""
    make = getattr(step, "run_gate", None)
    gate: RunGate | None = make() if callable(make) else None
    return gate


class Session:
    """One run of rpcfleet against a fleet: connection cache, concurrency limit, run id.

    Use as `async with Session() as session: result = await session.run(hosts, step)`.
    """

    def __init__(
        self,
        *,
        forks: int = DEFAULT_FORKS,
        options: ConnectOptions | None = None,
        interruptible: bool = False,
        on_interrupt: Callable[[str, int], None] | None = None,
    ) -> None:
        if forks < 1:
            raise UsageError(f"--forks must be at least 1, got {forks}")
        self.forks = forks
        self.options = options
        self.run_id = f"{int(time.time() * 1000) % 10**10:010d}"
        self._connections: Shared[str, Connection] = Shared()
        self.interruptible = interruptible
        self.on_interrupt = on_interrupt
        self.interrupted: str | None = None  # what interrupted the run ("SIGINT", ...), once it happened
        self._interrupt_count = 0
        self._interrupted_event: asyncio.Event | None = None
        self._give_back: Callable[[], None] | None = None  # hands SIGINT/SIGTERM back (`core.signals`)

    async def __aenter__(self) -> Session:
        if self.interruptible:
            self._take_signals()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._give_back_signals()
        await self.close()

    @contextlib.asynccontextmanager
    async def catching_signals(self) -> AsyncIterator[Session]:
        """Interruptible for this block only (a phase of a longer-lived session, `engine.runtime`):
        SIGINT/SIGTERM call `interrupt`, then go back to the handlers from before."""
        self._take_signals()
        try:
            yield self
        finally:
            self._give_back_signals()

    def _take_signals(self) -> None:
        if self._give_back is not None or threading.current_thread() is not threading.main_thread():
            return
        self._give_back = signals.loop_handlers(asyncio.get_running_loop(), self.interrupt)

    def _give_back_signals(self) -> None:
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back()

    def interrupt(self, why: str = "interrupted") -> None:
        """Start no new host from now on; the hosts in flight finish (see the module docstring)."""
        self._interrupt_count += 1
        if self.interrupted is None:
            self.interrupted = why
            get_logger(run_id=self.run_id).warning("run_interrupted", why=why)
            if self._interrupted_event is not None:
                self._interrupted_event.set()
        if self.on_interrupt is not None:
            self.on_interrupt(why, self._interrupt_count)

    async def unless_interrupted(self, work: Awaitable[T]) -> T:
        """`work`'s result, or NotStartedError if the run is interrupted first (`work` is cancelled):
        for waits that change nothing, such as waiting for another operator's lock."""
        if self.interrupted is not None:
            if asyncio.iscoroutine(work):
                work.close()  # never started: nothing to wait for, and no "never awaited" warning
            raise NotStartedError(f"not started: {self.interrupted}")
        if self._interrupted_event is None:
            self._interrupted_event = asyncio.Event()
        task = asyncio.ensure_future(work)
        waiter = asyncio.ensure_future(self._interrupted_event.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise NotStartedError(f"not started: {self.interrupted}")
        return task.result()

    async def connection(self, host: Host) -> Connection:
        """The host's connection, opened once per session: concurrent callers share the attempt, and a
        failed connect fails every later step on the host alike (`Shared`'s rule)."""
        return await self._connections.get(host.name, lambda: connect(host, self.options))

    async def unshared_connection(self, host: Host) -> Connection:
        """A connection of the caller's own to `host` (the session's options; the caller closes it)."""
        return await connect(host, self.options)

    async def drop(self, host: Host) -> None:
        """Forget the host's connection (closed, or its failed connect): the next step connects anew (a
        long-lived session's way back to a host that was lost)."""
        attempt = self._connections.forget(host.name)
        if attempt is None:
            return
        if not attempt.done():
            attempt.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await (await attempt).close()

    async def close(self) -> None:
        for conn in await self._connections.clear():
            await conn.close()

    async def run(
        self,
        hosts: Iterable[Host],
        step: Step[T],
        *,
        name: str | None = None,
        serial: int | str | Sequence[int | str] | None = None,
        max_fail_percentage: float | None = None,
        on_result: Callable[[HostResult[T]], None] | None = None,
    ) -> RunResult[T]:
        """Run `step` on every host; return a result per host, in the order given."""
        hosts = list(hosts)
        step_name: str = name or str(getattr(step, "__name__", "step"))
        gate = run_gate_of(step)
        try:
            refused = dict(await gate.enter(self, hosts)) if gate is not None and hosts else {}
            if hosts and all(h.name in refused for h in hosts):
                # Refused as a whole (another operator's lock, an interrupt): no batch, no threshold.
                return self._refused_run(hosts, step_name, refused, on_result)
            return await self._run_batches(
                hosts, step, step_name, gate, refused, serial, max_fail_percentage, on_result
            )
        finally:
            if gate is not None:
                await gate.close()

    def _refused_run(
        self,
        hosts: list[Host],
        step_name: str,
        refused: Mapping[str, RpcfleetError],
        on_result: Callable[[HostResult[T]], None] | None,
    ) -> RunResult[T]:
        results: list[HostResult[T]] = []
        for host in hosts:
            error = refused[host.name]
            error = error if error.host else error.with_host(host.name)
            result: HostResult[T] = HostResult(host, _status_of(error), error=error, message=error.message)
            results.append(result)
            if on_result:
                on_result(result)
        interrupted = self.interrupted is not None and any(r.status == "skipped" for r in results)
        return RunResult(step_name, tuple(results), False, interrupted)

    async def _run_batches(
        self,
        hosts: list[Host],
        step: Step[T],
        step_name: str,
        gate: RunGate | None,
        refused: Mapping[str, RpcfleetError],
        serial: int | str | Sequence[int | str] | None,
        max_fail_percentage: float | None,
        on_result: Callable[[HostResult[T]], None] | None,
    ) -> RunResult[T]:
        limiter = asyncio.Semaphore(self.forks)
        results: dict[str, HostResult[T]] = {}
        aborted = False
        offset = 0
        for size in batch_sizes(len(hosts), serial):
            if self.interrupted is not None:
                break
            batch = hosts[offset : offset + size]
            offset += size
            batch_results = await asyncio.gather(
                *(
                    self._run_one(host, step, step_name, limiter, on_result, gate, refused.get(host.name))
                    for host in batch
                )
            )
            results.update((r.host.name, r) for r in batch_results)
            n_failed = sum(not r.succeeded for r in batch_results)
            if n_failed and _threshold_passed(n_failed, len(batch), max_fail_percentage):
                aborted = offset < len(hosts)
                break
        why = f"not started: {self.interrupted}" if self.interrupted else "not run: failure threshold reached"
        for host in hosts[offset:]:
            skipped: HostResult[T] = HostResult(host, "skipped", message=why)
            results[host.name] = skipped
            if on_result:
                on_result(skipped)
        interrupted = self.interrupted is not None and any(r.status == "skipped" for r in results.values())
        return RunResult(step_name, tuple(results[h.name] for h in hosts), aborted, interrupted)

    async def _run_one(
        self,
        host: Host,
        step: Step[T],
        step_name: str,
        limiter: asyncio.Semaphore,
        on_result: Callable[[HostResult[T]], None] | None,
        gate: RunGate | None = None,
        refused: RpcfleetError | None = None,
    ) -> HostResult[T]:
        context = HostContext(host, self, gate)
        async with limiter:
            started = time.monotonic()
            status: Status
            value: T | None = None
            error: RpcfleetError | None = None
            try:
                if refused is not None:
                    raise refused
                if self.interrupted is not None:
                    raise NotStartedError(f"not started: {self.interrupted}")
                try:
                    outcome = await step(context)
                finally:
                    if gate is not None:
                        await gate.leave(host)
                status, value, message = (
                    ("changed" if outcome.changed else "ok"),
                    outcome.value,
                    outcome.message,
                )
            except RpcfleetError as exc:
                status, error = _status_of(exc), exc
            except Exception as exc:  # a bug on one host must not hide the others' results
                context.log.exception("step_crashed", step=step_name)
                status, error = "failed", RpcfleetError(f"{step_name} crashed: {type(exc).__name__}: {exc}")
            if error is not None:
                error = error if error.host else error.with_host(host.name)
                message = error.message
            result = HostResult(host, status, value, error, message, time.monotonic() - started)
        context.log.info("step_done", step=step_name, status=status, duration=round(result.duration, 3))
        if on_result:
            on_result(result)
        return result


def _status_of(error: RpcfleetError) -> Status:
    if isinstance(error, NotStartedError):
        return "skipped"
    if isinstance(error, UnreachableError):
        return "unreachable"
    return "failed"


def _threshold_passed(n_failed: int, batch: int, max_fail_percentage: float | None) -> bool:
    """Ansible: without a percentage, a batch whose hosts all failed stops the run; with one, more than it."""
    if max_fail_percentage is None:
        return n_failed == batch
    return 100.0 * n_failed / batch > max_fail_percentage
