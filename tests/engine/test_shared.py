"""`Shared`: one attempt per key, its outcome kept, one immutable error for every caller."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.core.errors import InstallError, UnreachableError
from orchestrator.engine.executor import Session
from orchestrator.engine.shared import Shared, SharedCall
from orchestrator.inventory.model import Host


async def _share_one_round() -> None:
    calls: list[str] = []
    shared: Shared[str, str] = Shared()

    async def make(key: str) -> str:
        calls.append(key)
        await asyncio.sleep(0.001)
        return key.upper()

    keys = ["a", "b", "a", "b", "a"]
    got = await asyncio.gather(*(shared.get(k, lambda k=k: make(k)) for k in keys))  # type: ignore[misc]
    assert got == ["A", "B", "A", "B", "A"]
    assert sorted(calls) == ["a", "b"]
    assert await shared.get("a", lambda: make("never")) == "A"  # a value is kept
    assert "never" not in calls


async def test_concurrent_callers_share_one_attempt_per_key() -> None:
    for _ in range(20):
        await _share_one_round()


async def test_a_failure_is_kept_and_every_caller_gets_the_same_immutable_error() -> None:
    calls = 0

    async def fail() -> None:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.001)
        raise UnreachableError("gone", hint="check the network")

    shared: SharedCall[None] = SharedCall(fail)
    first = await asyncio.gather(shared.get(), shared.get(), return_exceptions=True)
    with pytest.raises(UnreachableError) as later:
        await shared.get()
    errors = [*first, later.value]
    assert calls == 1  # not retried by the later caller
    assert all(e is later.value for e in errors)
    with pytest.raises(AttributeError):
        later.value.host = "n0"  # type: ignore[misc]
    named = later.value.with_host("n0")  # what a caller that knows its host does
    assert named.host == "n0" and later.value.host is None and named.hint == "check the network"


async def _cancel_one_round() -> None:
    started = asyncio.Event()
    calls = 0

    async def slow() -> int:
        nonlocal calls
        calls += 1
        started.set()
        await asyncio.sleep(0.005)
        return 7

    shared: SharedCall[int] = SharedCall(slow)
    impatient = asyncio.ensure_future(shared.get())
    patient = asyncio.ensure_future(shared.get())
    await started.wait()
    impatient.cancel()
    assert await patient == 7 and impatient.cancelled() and calls == 1


async def test_a_cancelled_caller_leaves_the_attempt_to_the_others() -> None:
    for _ in range(20):
        await _cancel_one_round()


async def test_clear_cancels_running_attempts_returns_values_and_forgets() -> None:
    shared: Shared[str, str] = Shared()
    release, running = asyncio.Event(), asyncio.Event()

    async def stuck() -> str:
        running.set()
        await release.wait()
        return "late"

    async def broken() -> str:
        raise InstallError("no")

    assert await shared.get("done", lambda: asyncio.sleep(0, "value")) == "value"
    with pytest.raises(InstallError):
        await shared.get("failed", broken)
    waiter = asyncio.ensure_future(shared.get("running", stuck))
    await running.wait()
    assert await shared.clear() == ["value"]
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert await shared.get("done", lambda: asyncio.sleep(0, "again")) == "again"  # forgotten


async def test_a_session_opens_one_connection_per_host() -> None:
    hosts = [Host(name=f"n{i}", address="127.0.0.1", connection="local") for i in range(3)]
    async with Session() as session:
        for _ in range(20):
            conns = await asyncio.gather(*(session.connection(h) for h in hosts * 3))
            assert len({id(c) for c in conns}) == 3
            assert [c.host.name for c in conns[:3]] == ["n0", "n1", "n2"]


async def test_a_failed_fleet_step_runs_once_when_forks_split_the_hosts() -> None:
    # forks=1: each host's step starts after the previous one failed; none of them tries again.
    from orchestrator.engine.executor import HostContext, StepOutcome

    calls = 0

    async def plan() -> None:
        nonlocal calls
        calls += 1
        raise UnreachableError("the fleet is gone")

    shared: SharedCall[None] = SharedCall(plan)

    async def step(ctx: HostContext) -> StepOutcome[None]:
        await shared.get()
        return StepOutcome(None)

    hosts = [Host(name=f"n{i}", address="127.0.0.1", connection="local") for i in range(3)]
    async with Session(forks=1) as session:
        run = await session.run(hosts, step, name="fleet")
    assert calls == 1
    assert [r.status for r in run.results] == ["unreachable"] * 3
    assert [r.error.host for r in run.results if r.error] == ["n0", "n1", "n2"]
