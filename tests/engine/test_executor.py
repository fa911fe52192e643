"""The executor: concurrency limit, per-host results, batches, failure threshold."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from orchestrator.core.errors import CommandError, RpcfleetError, UnreachableError, UsageError
from orchestrator.engine.executor import HostContext, Recap, Session, StepOutcome, batch_sizes
from orchestrator.inventory.model import Host
from tests.waits import until, wait_until


def hosts(n: int) -> list[Host]:
    return [Host(name=f"n{i}", address=f"10.0.0.{i}", rpc_port=50052 + i) for i in range(1, n + 1)]


@pytest.mark.parametrize(
    ("n", "serial", "expected"),
    [
        (5, None, [5]),
        (5, 1, [1, 1, 1, 1, 1]),
        (5, 2, [2, 2, 1]),
        (8, "25%", [2, 2, 2, 2]),
        (3, "10%", [1, 1, 1]),
        (10, [1, "50%"], [1, 5, 4]),
        (4, [1, 2, 10], [1, 2, 1]),
        (0, 1, []),
        (3, "100%", [3]),
        (3, "2", [2, 1]),
    ],
)
def test_batch_sizes(n: int, serial: object, expected: list[int]) -> None:
    assert batch_sizes(n, serial) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("serial", [0, -1, "0%", "150%", "abc", [], True])
def test_batch_sizes_rejects_nonsense(serial: object) -> None:
    with pytest.raises(UsageError, match="serial"):
        batch_sizes(4, serial)  # type: ignore[arg-type]


async def test_every_host_gets_its_own_result() -> None:
    async def step(ctx: HostContext) -> StepOutcome[str]:
        if ctx.host.name == "n2":
            raise UnreachableError("connection refused")
        if ctx.host.name == "n3":
            raise CommandError("boom", command="false", exit_status=1)
        if ctx.host.name == "n4":
            raise ZeroDivisionError("a bug")
        return StepOutcome(ctx.host.name.upper(), changed=ctx.host.name == "n5")

    async with Session(forks=2) as session:
        run = await session.run(hosts(5), step, name="demo")
    statuses = [(r.host.name, r.status) for r in run.results]
    assert statuses == [
        ("n1", "ok"),
        ("n2", "unreachable"),
        ("n3", "failed"),
        ("n4", "failed"),
        ("n5", "changed"),
    ]
    by_host = run.by_host()
    assert by_host["n1"].value == "N1"
    assert by_host["n2"].error is not None and by_host["n2"].error.host == "n2"
    assert isinstance(by_host["n4"].error, RpcfleetError)
    assert "ZeroDivisionError" in str(by_host["n4"].error)
    assert not run.ok and not run.aborted
    recap = Recap().add(run)
    assert recap.counts["n3"]["failed"] == 1 and recap.counts["n5"]["changed"] == 1
    assert not recap.ok


async def test_one_error_raised_on_every_host_is_named_per_host_and_left_as_it_was() -> None:
    shared = UnreachableError("the artifact server is down", hint="start it")  # e.g. a shared attempt's

    async def step(ctx: HostContext) -> StepOutcome[None]:
        raise shared

    async with Session(forks=3) as session:
        run = await session.run(hosts(3), step, name="fetch")
    assert [r.error.host for r in run.results if r.error] == ["n1", "n2", "n3"]
    assert all(r.error is not None and r.error.hint == "start it" for r in run.results)
    assert shared.host is None  # each host's result is a copy


async def test_forks_limit_concurrency() -> None:
    running = 0
    peak = 0

    async def step(ctx: HostContext) -> StepOutcome[None]:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.02)
        running -= 1
        return StepOutcome(None)

    async with Session(forks=3) as session:
        run = await session.run(hosts(10), step)
    assert run.ok and peak == 3


async def test_serial_batches_run_one_after_another() -> None:
    order: list[tuple[str, str]] = []

    async def step(ctx: HostContext) -> StepOutcome[None]:
        order.append(("start", ctx.host.name))
        await asyncio.sleep(0.01)
        order.append(("end", ctx.host.name))
        return StepOutcome(None)

    async with Session() as session:
        await session.run(hosts(4), step, serial=2)
    first_batch_ends = max(order.index(("end", "n1")), order.index(("end", "n2")))
    second_batch_starts = min(order.index(("start", "n3")), order.index(("start", "n4")))
    assert first_batch_ends < second_batch_starts


async def test_failure_threshold_stops_and_skips_the_rest() -> None:
    touched: list[str] = []

    async def step(ctx: HostContext) -> StepOutcome[None]:
        touched.append(ctx.host.name)
        if ctx.host.name == "n2":
            raise CommandError("did not come back")
        return StepOutcome(None, changed=True)

    async with Session() as session:
        run = await session.run(hosts(5), step, serial=1, max_fail_percentage=0)
    assert touched == ["n1", "n2"]
    assert [r.status for r in run.results] == ["changed", "failed", "skipped", "skipped", "skipped"]
    assert run.aborted


async def test_threshold_not_passed_goes_on() -> None:
    async def step(ctx: HostContext) -> StepOutcome[None]:
        if ctx.host.name == "n1":
            raise CommandError("flaky")
        return StepOutcome(None)

    async with Session() as session:
        run = await session.run(hosts(4), step, serial=2, max_fail_percentage=50)
    assert [r.status for r in run.results] == ["failed", "ok", "ok", "ok"]
    assert not run.aborted


def test_forks_must_be_positive() -> None:
    with pytest.raises(UsageError):
        Session(forks=0)


def test_an_interruptible_session_gives_the_signals_back_to_the_handlers_it_found() -> None:
    """Two sessions in a row, as `run` has (the cache check, then the load): after each, SIGTERM and
    SIGINT reach the handler from before (rpcfleet's interrupt), never the default action (death by
    SIGTERM, status 143). The signal is really sent, each time."""
    heard: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        heard.append(signum)

    def send(sig: int) -> None:
        count = len(heard)
        os.kill(os.getpid(), sig)
        wait_until(lambda: len(heard) > count, what="the handler")

    async def one_session() -> None:
        async with Session(interruptible=True) as session:
            assert signal.getsignal(signal.SIGTERM) is not handler  # the session's own, meanwhile
            os.kill(os.getpid(), signal.SIGTERM)
            await until(lambda: session.interrupted is not None, what="the session's handler")
            assert session.interrupted == "SIGTERM"

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for _ in range(2):
            asyncio.run(one_session())
            assert signal.getsignal(signal.SIGTERM) is handler
            assert signal.getsignal(signal.SIGINT) is handler
            for sig in (signal.SIGTERM, signal.SIGINT):
                send(sig)
        assert heard == [signal.SIGTERM, signal.SIGINT] * 2
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)
