"""The host lock protocol (operations/lock.py) on tier 1: in-process SSH hosts and local connections.

The lock is a flock held by a shell that an SSH channel keeps alive: it must exclude a second holder, say
who holds it, wait when asked, and be released by release(), by a closed connection and by a connection
that dies under it, never outliving its holder.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shlex
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.connectors.base import ConnectOptions
from orchestrator.connectors.connect import connect
from orchestrator.connectors.local import LocalConnection
from orchestrator.core.errors import ServiceError
from orchestrator.engine.executor import HostContext, HostResult, Recap, RunResult, Session, StepOutcome
from orchestrator.inventory.model import Host
from orchestrator.operations.layer import OperationOptions, node_operation, run_to_completion
from orchestrator.operations.lock import HostLockedError, LockOwner, acquire, lock_script
from tests.plugins.fakehosts import FakeHost

FakeHosts = Callable[..., list[FakeHost]]
FAST = ConnectOptions(connect_timeout=5.0, command_timeout=10.0)


@pytest.fixture
def ssh_host(fake_hosts: FakeHosts, tmp_path: Path) -> FakeHost:
    (fake,) = fake_hosts(1)
    return fake


def _with_dir(host: Host, install_dir: str) -> Host:
    return dataclasses.replace(host, install_dir=install_dir)


async def test_a_second_holder_is_refused_with_the_first_ones_name(ssh_host: FakeHost) -> None:
    host = _with_dir(ssh_host.host, "~/rf")
    async with await connect(host, FAST) as first, await connect(host, FAST) as second:
        lock = await acquire(first, host, "deploy")
        started = time.monotonic()
        with pytest.raises(HostLockedError) as refused:
            await acquire(second, host, "restart")
        assert time.monotonic() - started < 3.0  # fails fast without --wait-lock
        message = str(refused.value)
        assert "is being changed by" in message and "deploy" in message and "since" in message
        await lock.release()
        again = await acquire(second, host, "restart")  # free once released
        await again.release()
        await again.release()  # idempotent


async def test_waiting_for_the_lock_gets_it_when_the_holder_lets_go(ssh_host: FakeHost) -> None:
    host = _with_dir(ssh_host.host, "~/rf")
    seen: list[str] = []
    async with await connect(host, FAST) as first, await connect(host, FAST) as second:
        lock = await acquire(first, host, "deploy")
        waiter = asyncio.ensure_future(
            acquire(second, host, "restart", wait_s=10.0, on_wait=lambda _h, who: seen.append(who))
        )
        await asyncio.sleep(0.5)
        assert not waiter.done()
        await lock.release()
        second_lock = await asyncio.wait_for(waiter, 5.0)
        assert seen and "deploy" in seen[0]
        await second_lock.release()


async def test_waiting_gives_up_after_wait_lock(ssh_host: FakeHost) -> None:
    host = _with_dir(ssh_host.host, "~/rf")
    async with await connect(host, FAST) as first, await connect(host, FAST) as second:
        lock = await acquire(first, host, "deploy")
        started = time.monotonic()
        with pytest.raises(HostLockedError, match=r"after waiting 0\.6 s"):
            await acquire(second, host, "restart", wait_s=0.6)
        assert 0.5 < time.monotonic() - started < 4.0
        await lock.release()


async def test_a_closed_connection_releases_the_lock(ssh_host: FakeHost) -> None:
    host = _with_dir(ssh_host.host, "~/rf")
    first = await connect(host, FAST)
    await acquire(first, host, "deploy")  # never released explicitly
    await first.close()
    async with await connect(host, FAST) as second:
        lock = await acquire(second, host, "restart", wait_s=5.0)
        await lock.release()


async def test_a_dead_connection_releases_the_lock(ssh_host: FakeHost) -> None:
    """The controller is killed: its TCP connection drops, the lock's shell sees end of file."""
    host = _with_dir(ssh_host.host, "~/rf")
    first = await connect(host, FAST)
    await acquire(first, host, "deploy")
    ssh_host.abort_connections()
    async with await connect(host, FAST) as second:
        lock = await acquire(second, host, "restart", wait_s=5.0)
        await lock.release()
    await first.close()


async def test_locks_of_different_installs_do_not_exclude_each_other(ssh_host: FakeHost) -> None:
    a, b = _with_dir(ssh_host.host, "~/a"), _with_dir(ssh_host.host, "~/b")
    async with await connect(a, FAST) as first, await connect(b, FAST) as second:
        one = await acquire(first, a, "deploy")
        two = await acquire(second, b, "deploy")
        await one.release()
        await two.release()


async def test_the_local_connection_holds_the_lock_the_same_way(tmp_path: Path) -> None:
    host = Host(name="here", address="127.0.0.1", connection="local", install_dir=str(tmp_path / "rf"))
    first, second = LocalConnection(host), LocalConnection(host)
    lock = await acquire(first, host, "deploy")
    with pytest.raises(HostLockedError):
        await acquire(second, host, "restart")
    await lock.release()
    again = await acquire(second, host, "restart")
    await again.release()


async def test_the_lock_records_an_odd_owner_and_folder_verbatim(tmp_path: Path) -> None:
    """Quoting: a folder and an owner full of shell syntax reach the node as data, not as commands."""
    folder = tmp_path / "it's $(here); rm -rf x"
    host = Host(name="here", address="127.0.0.1", connection="local", install_dir=str(folder))
    owner = LockOwner("o'brien", "ctl; touch pwned", 1, "deploy `id`", 0.0)
    conn = LocalConnection(host, home=tmp_path)
    held = await conn.hold(f"sh -c {shlex.quote(lock_script(host.install_dir, owner, 0))}")
    assert await held.readline(5.0) == "@locked"
    assert (folder / "run" / "lock.info").read_text().split(" ", 1)[1] == owner.describe() + "\n"
    assert not (tmp_path / "pwned").exists()
    await held.release()


# --- the layer: check mode takes no lock, an interrupted caller lets the host step finish ----------------


async def test_check_mode_takes_no_lock(ssh_host: FakeHost) -> None:
    host = _with_dir(ssh_host.host, "~/rf")
    async with await connect(host, FAST) as holder:
        lock = await acquire(holder, host, "deploy")

        async def body(ctx: HostContext, conn: object) -> StepOutcome[str]:
            return StepOutcome("read", False, "read only")

        async with Session(options=FAST) as session:
            run = await session.run([host], node_operation("deploy", body, OperationOptions(check=True)))
        assert run.results[0].status == "ok"
        async with Session(options=FAST) as session:
            run = await session.run([host], node_operation("deploy", body, OperationOptions()))
        assert run.results[0].status == "failed" and isinstance(run.results[0].error, HostLockedError)
        await lock.release()


async def test_a_cancelled_caller_waits_for_the_host_step_to_finish() -> None:
    finished = asyncio.Event()

    async def two_commands() -> str:
        await asyncio.sleep(0.3)  # "switch the version"
        await asyncio.sleep(0.3)  # "start it"
        finished.set()
        return "done"

    caller = asyncio.ensure_future(run_to_completion(two_commands()))
    await asyncio.sleep(0.1)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert finished.is_set()


async def test_a_host_step_that_fails_after_its_caller_was_cancelled_is_recorded_as_failed(
    ssh_host: FakeHost,
) -> None:
    """The start fails after the version switch while the caller is being cancelled: the failure is what
    the host's result says (not swallowed), and the lock is released."""
    host = _with_dir(ssh_host.host, "~/rf")
    switched = asyncio.Event()

    async def body(ctx: HostContext, conn: object) -> StepOutcome[str]:
        switched.set()  # "switched the version"
        await asyncio.sleep(0.3)
        raise ServiceError("the server did not start: exited with status 1")

    seen: list[HostResult[str]] = []
    async with Session(options=FAST) as session:
        task = asyncio.ensure_future(
            session.run([host], node_operation("deploy", body, OperationOptions()), on_result=seen.append)
        )
        await asyncio.wait_for(switched.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    ((result,),) = (seen,)
    assert result.status == "failed" and result.error is not None, result
    assert "the server did not start" in result.error.message
    assert (
        "deploy: the server did not start" in Recap().add(RunResult("deploy", (result,))).errors[host.name][0]
    )
    async with await connect(host, FAST) as other:  # released: the next operator gets it at once
        await (await acquire(other, host, "deploy")).release()

    # run_to_completion itself: the body's error, not the cancellation.
    async def fails_later() -> str:
        await asyncio.sleep(0.2)
        raise ServiceError("start failed")

    caller = asyncio.ensure_future(run_to_completion(fails_later()))
    await asyncio.sleep(0.05)
    caller.cancel()
    with pytest.raises(ServiceError, match="start failed"):
        await caller


async def test_an_interrupt_starts_no_new_host_and_ends_a_lock_wait(fake_hosts: FakeHosts) -> None:
    fakes = fake_hosts(3)
    hosts = [_with_dir(f.host, "~/rf") for f in fakes]
    started: list[str] = []

    async def body(ctx: HostContext, conn: object) -> StepOutcome[str]:
        started.append(ctx.host.name)
        if ctx.host.name == hosts[0].name:
            ctx.session.interrupt("SIGINT")  # as the signal handler would, while this host is in flight
            await asyncio.sleep(0.3)
        return StepOutcome("changed", True, "changed")

    async with Session(forks=1, options=FAST) as session:
        run = await session.run(hosts, node_operation("deploy", body, OperationOptions()))
    assert started == [hosts[0].name]
    assert [r.status for r in run.results] == ["changed", "skipped", "skipped"]
    assert run.interrupted and not run.ok
    assert all("not started: SIGINT" in r.message for r in run.results[1:])

    # A host waiting for another operator's lock stops waiting at the interrupt: nothing was changed.
    async with await connect(hosts[1], FAST) as other:
        lock = await acquire(other, hosts[1], "deploy")
        async with Session(options=FAST) as session:
            step = node_operation("deploy", body, OperationOptions(wait_lock=30.0))
            task = asyncio.ensure_future(session.run([hosts[1]], step))
            await asyncio.sleep(0.5)
            began = time.monotonic()
            session.interrupt("SIGTERM")
            run = await asyncio.wait_for(task, 5.0)
        assert time.monotonic() - began < 3.0
        assert run.results[0].status == "skipped" and "SIGTERM" in run.results[0].message
        await lock.release()
