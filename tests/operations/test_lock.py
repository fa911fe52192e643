"""The host lock protocol (operations/lock.py) on tier 1: in-process SSH hosts and local connections.

The lock is a flock held by a shell that an SSH channel keeps alive: it must exclude a second holder, say
who holds it, wait when asked, and be released by release(), by a closed connection and by a controller
that falls silent, never outliving its holder. A run takes its hosts' locks in one order before changing
any, so two runs at once never split the hosts.

What only a real sshd can show (a killed controller, a cut link, a waiter given up) is in
test_safe_ops_lab.py: the fake hosts kill a dropped command's process group, which sshd does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path

import psutil
import pytest
from structlog.testing import capture_logs

from orchestrator.connectors.base import ConnectOptions
from orchestrator.connectors.connect import connect
from orchestrator.connectors.local import LocalConnection
from orchestrator.core.errors import NotStartedError, ServiceError
from orchestrator.engine.executor import HostContext, HostResult, Recap, RunResult, Session, StepOutcome
from orchestrator.inventory.model import Host
from orchestrator.operations.layer import Body, OperationOptions, node_operation, run_to_completion
from orchestrator.operations.lock import (
    HostLockedError,
    LockLostError,
    LockOwner,
    acquire,
    lock_script,
    ready,
    take,
)
from tests.plugins.fakehosts import FakeHost

FakeHosts = Callable[..., list[FakeHost]]
FAST = ConnectOptions(connect_timeout=5.0, command_timeout=10.0)


async def until(check: Callable[[], bool], limit: float = 5.0) -> None:
    """Wait until `check()` holds (the condition, not a guessed delay); fail after `limit` seconds."""
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, f"not true within {limit:g} s"
        await asyncio.sleep(0.01)


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
        await until(lambda: bool(seen))  # it was told who holds it, and waits
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


async def test_a_silent_controller_loses_the_lock(tmp_path: Path) -> None:
    """No heartbeat for `silence_s` (a controller whose link was cut): the holder gives the lock up by
    itself, although its stdin is still open."""
    host = Host(name="here", address="127.0.0.1", connection="local", install_dir=str(tmp_path / "rf"))
    first, second = LocalConnection(host), LocalConnection(host)
    silent = await acquire(first, host, "deploy", heartbeat_s=3600.0, silence_s=1.0)  # one beat only
    started = time.monotonic()
    again = await acquire(second, host, "restart", wait_s=10.0)
    assert 0.5 < time.monotonic() - started < 5.0
    await again.release()
    await silent.release()


async def test_heartbeats_keep_the_lock_past_the_silence_limit(tmp_path: Path) -> None:
    host = Host(name="here", address="127.0.0.1", connection="local", install_dir=str(tmp_path / "rf"))
    first, second = LocalConnection(host), LocalConnection(host)
    lock = await acquire(first, host, "deploy", heartbeat_s=0.2, silence_s=1.0)
    await asyncio.sleep(2.5)  # the property itself: held for more than twice the silence limit
    with pytest.raises(HostLockedError):
        await acquire(second, host, "restart")
    await lock.release()
    again = await acquire(second, host, "restart")
    await again.release()


def _freeze_lock_holder(lock_file: Path) -> int:
    """SIGSTOP the process group of the shell holding `lock_file` (its watchdog included): the node stops
    acknowledging heartbeats, as a cut link looks from the controller. Returns the group."""
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if any(f.path == str(lock_file) for f in proc.open_files()):
                group = os.getpgid(proc.pid)
                os.killpg(group, signal.SIGSTOP)
                return group
    raise AssertionError(f"nobody holds {lock_file}")


async def test_a_holder_whose_heartbeats_go_unanswered_stops_its_step_before_the_node_lets_go(
    tmp_path: Path,
) -> None:
    host = Host(name="here", address="127.0.0.1", connection="local", install_dir=str(tmp_path / "rf"))
    conn = LocalConnection(host)
    lock = await acquire(conn, host, "deploy", heartbeat_s=0.1, silence_s=30.0, lost_s=1.0)
    changes = tmp_path / "changes"

    async def step() -> str:
        while True:  # a change of the node that goes on and on
            with changes.open("a") as out:
                out.write(f"{time.monotonic()}\n")
            await asyncio.sleep(0.05)

    async def held_step() -> str:
        await asyncio.sleep(0.5)
        return "done"

    assert await lock.guard(held_step(), conn) == "done"  # acknowledged: the step runs to its end
    group = _freeze_lock_holder(tmp_path / "rf" / "lock")
    try:
        frozen = time.monotonic()
        with pytest.raises(LockLostError, match=r"no heartbeat acknowledged for 1 s; the step was stopped"):
            await lock.guard(step(), conn)
        assert 0.8 < time.monotonic() - frozen < 4.0  # lost_s, well before the node's silence_s
        size = changes.stat().st_size
        await asyncio.sleep(0.3)
        assert changes.stat().st_size == size  # the step changes nothing more
    finally:
        os.killpg(group, signal.SIGCONT)
        await lock.release()


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every local user can reach (pytest's tmp_path is owner-only)."""
    made = Path(tempfile.mkdtemp(prefix="rf-lock-"))
    made.chmod(0o755)
    yield made
    shutil.rmtree(made, ignore_errors=True)


def _someone_else_can_flock(path: Path) -> bool:
    """Whether user nobody can take a flock on `path` (as any local user of a node could)."""
    result = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "flock", "-n", str(path), "true"],
        capture_output=True,
        check=False,
        timeout=10,
    )
    return result.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another local user (setpriv)")
async def test_the_lock_file_is_owner_only_so_no_other_user_can_block_changes(open_dir: Path) -> None:
    host = Host(name="here", address="127.0.0.1", connection="local", install_dir=str(open_dir / "rf"))
    old_umask = os.umask(0o022)  # the usual one: a plain `>>` makes the file world-readable
    try:
        lock = await acquire(LocalConnection(host), host, "deploy")
        await lock.release()
        made = open_dir / "rf" / "lock"
        assert stat.S_IMODE(made.stat().st_mode) == 0o600
        assert not _someone_else_can_flock(made)

        # A lock file left world-readable (by an older rpcfleet) is made owner-only by the next lock.
        made.chmod(0o644)
        assert _someone_else_can_flock(made)  # the check itself can tell
        lock = await acquire(LocalConnection(host), host, "deploy")
        assert stat.S_IMODE(made.stat().st_mode) == 0o600
        await lock.release()
        assert not _someone_else_can_flock(made)
    finally:
        os.umask(old_umask)


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
    held = await conn.hold(f"sh -c {shlex.quote(lock_script(host.install_dir, owner, 5.0))}")
    assert await held.readline(5.0) == "@ready"
    assert await held.send("0\n")  # its turn, no wait for another holder
    assert await held.readline(5.0) == "@locked"
    assert (folder / "lock.info").read_text().split(" ", 1)[1] == owner.describe() + "\n"
    assert not (tmp_path / "pwned").exists()
    await held.release()


async def test_a_holder_that_lets_go_while_it_is_looked_up_is_still_named(tmp_path: Path) -> None:
    """Refused, then the holder ends before its name is read (its shell is gone): the last owner written
    is the one that held it, not "another operator". Held here by a bare flock whose recorded shell is a
    pid that no longer exists, which is what a holder that just let go leaves behind."""
    host = Host(name="here", address="127.0.0.1", connection="local", install_dir=str(tmp_path / "rf"))
    run = tmp_path / "rf"  # the lock and its info: in the install dir itself
    run.mkdir(parents=True)
    gone = await asyncio.create_subprocess_exec("true")
    await gone.wait()
    (run / "lock.info").write_text(f"{gone.pid} root@ctl (pid 7, deploy, since 06:51:25)\n")
    holder = await asyncio.create_subprocess_exec("flock", str(run / "lock"), "sleep", "30")
    try:
        await until(lambda: not _flock_free(run / "lock"))
        with pytest.raises(HostLockedError) as refused:
            await acquire(LocalConnection(host), host, "restart")
        assert "is being changed by root@ctl (pid 7, deploy" in str(refused.value)
    finally:
        holder.kill()
        await holder.wait()


def _flock_free(path: Path) -> bool:
    return subprocess.run(["flock", "-n", str(path), "true"], check=False).returncode == 0


# --- the layer: check mode takes no lock, an interrupted caller lets the host step finish ----------------
# --- and a run takes all its hosts' locks, in one order, before it changes any -----------------------------


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
    begun, finished = asyncio.Event(), asyncio.Event()

    async def two_commands() -> str:
        begun.set()
        await asyncio.sleep(0.3)  # "switch the version"
        await asyncio.sleep(0.3)  # "start it"
        finished.set()
        return "done"

    caller = asyncio.ensure_future(run_to_completion(two_commands()))
    await asyncio.wait_for(begun.wait(), 5.0)
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
    began = asyncio.Event()

    async def fails_later() -> str:
        began.set()
        await asyncio.sleep(0.2)
        raise ServiceError("start failed")

    caller = asyncio.ensure_future(run_to_completion(fails_later()))
    await asyncio.wait_for(began.wait(), 5.0)  # the step runs: the cancel lands inside it
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

    # A run waiting for another operator's lock stops waiting at the interrupt: nothing was changed, and
    # the locks it had taken already are given back.
    async with await connect(hosts[1], FAST) as other:
        lock = await acquire(other, hosts[1], "deploy")
        with capture_logs() as logs:
            async with Session(options=FAST) as session:
                step = node_operation("deploy", body, OperationOptions(wait_lock=30.0))
                task = asyncio.ensure_future(session.run(hosts, step))
                await until(lambda: any(e["event"] == "host_lock_waiting" for e in logs))
                began = time.monotonic()
                session.interrupt("SIGTERM")
                run = await asyncio.wait_for(task, 5.0)
        assert time.monotonic() - began < 3.0
        assert [r.status for r in run.results] == ["skipped"] * 3 and run.interrupted
        assert all("SIGTERM" in r.message for r in run.results)
        assert started == [hosts[0].name]  # from the first run only
        await lock.release()
    for host in hosts:
        async with await connect(host, FAST) as conn:
            free = await acquire(conn, host, "check")
            await free.release()


def _recording(
    changed: list[tuple[str, str]], who: str, before: Callable[[], Awaitable[None]] | None = None
) -> Body[str]:
    async def body(ctx: HostContext, conn: object) -> StepOutcome[str]:
        if before is not None:
            await before()
        changed.append((who, ctx.host.name))
        await asyncio.sleep(0)  # another task may run between hosts
        return StepOutcome(who, True, f"changed by {who}")

    return body


async def _operator(
    hosts: list[Host],
    changed: list[tuple[str, str]],
    who: str,
    options: OperationOptions,
    before: Callable[[], Awaitable[None]] | None = None,
) -> RunResult[str]:
    async with Session(options=FAST) as session:
        return await session.run(hosts, node_operation("deploy", _recording(changed, who, before), options))


async def _until_the_other_tried(
    runs: dict[str, asyncio.Task[RunResult[str]]], other: str, logs: Sequence[Mapping[str, object]]
) -> None:
    """Hold the hosts until the other run was refused (it ended) or waits for them: however slow the
    machine, the two runs overlap (a run that ended before the other started would prove nothing)."""
    await until(lambda: runs[other].done() or any(e["event"] == "host_lock_waiting" for e in logs), 30.0)


@pytest.mark.soak
async def test_two_runs_at_once_never_split_the_hosts(fake_hosts: FakeHosts, rounds: int) -> None:
    """Failing fast, one run gets every host and the other changes nothing (exit 3); waiting, the second
    runs after the first on every host: never some hosts each."""
    from orchestrator.cli._running import LOCKED_EXIT, exit_status

    hosts = [_with_dir(f.host, "~/rf") for f in fake_hosts(3)]
    names = {h.name for h in hosts}
    for round_no in range(rounds):
        wait = 30.0 if round_no % 2 else 0.0
        changed: list[tuple[str, str]] = []

        options = OperationOptions(wait_lock=wait)
        runs_of: dict[str, asyncio.Task[RunResult[str]]] = {}
        with capture_logs() as logs:
            for who in "ab":
                held = functools.partial(_until_the_other_tried, runs_of, "b" if who == "a" else "a", logs)
                runs_of[who] = asyncio.ensure_future(_operator(hosts, changed, who, options, held))
            await asyncio.gather(*runs_of.values())
        runs = {who: task.result() for who, task in runs_of.items()}
        first = changed[0][0]
        assert [h for w, h in changed if w == first] and {h for w, h in changed if w == first} == names
        assert all(r.status == "changed" for r in runs[first].results)
        second = "b" if first == "a" else "a"
        if wait:
            assert all(r.status == "changed" for r in runs[second].results)
            assert [w for w, _ in changed] == [first] * 3 + [second] * 3, changed
        else:
            assert [w for w, _ in changed] == [first] * 3, changed  # the other changed nothing
            statuses = sorted(r.status for r in runs[second].results)
            assert statuses == ["failed", "skipped", "skipped"], runs[second].results
            for result in runs[second].results:
                assert isinstance(result.error, HostLockedError | NotStartedError)
                assert "is being changed by" in result.message and "deploy" in result.message
            assert exit_status([runs[second]]) == LOCKED_EXIT and exit_status([runs[first]]) == 0


async def test_an_unreachable_host_fails_alone(fake_hosts: FakeHosts) -> None:
    fakes = fake_hosts(3)
    hosts = [_with_dir(f.host, "~/rf") for f in fakes]
    fakes[1].stop_listening()
    changed: list[tuple[str, str]] = []
    async with Session(options=FAST) as session:
        run = await session.run(hosts, node_operation("deploy", _recording(changed, "a"), OperationOptions()))
    assert [r.status for r in run.results] == ["changed", "unreachable", "changed"]
    assert sorted(h for _, h in changed) == sorted([hosts[0].name, hosts[2].name])


async def test_a_step_run_inside_another_still_takes_its_hosts_lock(ssh_host: FakeHost) -> None:
    """Without the executor's gate (the step wrapped in another), the host's own lock is still taken."""
    host = _with_dir(ssh_host.host, "~/rf")
    changed: list[tuple[str, str]] = []
    inner = node_operation("deploy", _recording(changed, "a"), OperationOptions())

    async def wrapper(ctx: HostContext) -> StepOutcome[str]:
        return await inner(ctx)

    async with await connect(host, FAST) as other:
        lock = await acquire(other, host, "deploy")
        async with Session(options=FAST) as session:
            run = await session.run([host], wrapper)
        assert isinstance(run.results[0].error, HostLockedError) and not changed
        await lock.release()
    async with Session(options=FAST) as session:
        run = await session.run([host], wrapper)
    assert run.results[0].status == "changed" and changed == [("a", host.name)]
    async with await connect(host, FAST) as conn:  # and it let go
        free = await acquire(conn, host, "check")
        await free.release()


async def test_a_readied_lock_holds_nothing_until_its_turn(tmp_path: Path) -> None:
    """Readied (the slow part, for every host of a run at once), the lock is still free for anyone; at
    its turn it is taken in a round trip, and refused as usual when someone else took it meanwhile."""
    host = Host(name="here", address="127.0.0.1", connection="local", install_dir=str(tmp_path / "rf"))
    prepared = await ready(LocalConnection(host), host, "deploy")
    other = await acquire(LocalConnection(host), host, "restart")  # nothing held by the readied one
    with pytest.raises(HostLockedError, match=r"being changed by .*restart"):
        await take(prepared)
    await other.release()
    second = await ready(LocalConnection(host), host, "deploy")
    started = time.monotonic()
    lock = await take(second)
    assert time.monotonic() - started < 1.0
    with pytest.raises(HostLockedError):
        await acquire(LocalConnection(host), host, "restart")
    await lock.release()


async def test_a_readied_lock_that_never_gets_its_turn_ends_and_an_abandoned_one_at_once(
    tmp_path: Path,
) -> None:
    """No turn within `turn_s` (its controller stuck or gone): the node's command ends by itself; one
    abandoned ends at once. Neither takes the lock."""
    host = Host(name="here", address="127.0.0.1", connection="local", install_dir=str(tmp_path / "rf"))
    prepared = await ready(LocalConnection(host), host, "deploy", turn_s=1.0)
    assert await prepared.held.readline(5.0) is None  # ended after its 1 s
    await prepared.abandon()
    abandoned = await ready(LocalConnection(host), host, "deploy")
    await abandoned.abandon()
    await abandoned.abandon()  # idempotent
    lock = await acquire(LocalConnection(host), host, "restart")
    await lock.release()


def _node_flock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> Path:
    """A `flock` first on the node's PATH (a local host's commands inherit this process's) that runs
    `body` instead: how a node misbehaves between its `@ready` and the lock. Its pid goes to the file
    returned."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pid_file = tmp_path / "flock.pid"
    flock = bin_dir / "flock"
    flock.write_text(f"#!/bin/sh\necho $$ > {shlex.quote(str(pid_file))}\n{body}\n")
    flock.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return pid_file


async def test_a_lock_that_does_not_answer_in_time_says_so_and_leaves_nothing_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node's flock hangs (a stuck filesystem): `take` gives up at the wait plus the slack for the
    node's shell, says the lock did not answer (not that someone holds it, nor the slack's figure), and
    the abandoned command takes its flock with it."""
    from orchestrator.operations import lock as lock_module

    monkeypatch.setattr(lock_module, "_ANSWER_SLACK", 2.0)
    pid_file = _node_flock(tmp_path, monkeypatch, "exec sleep 60")
    host = Host(name="here", address="127.0.0.1", connection="local", install_dir=str(tmp_path / "rf"))
    prepared = await ready(LocalConnection(host), host, "deploy")
    started = time.monotonic()
    with pytest.raises(ServiceError) as failed:
        await take(prepared, wait_s=0.5)
    waited = time.monotonic() - started
    assert type(failed.value) is ServiceError and failed.value.host == "here"
    assert failed.value.message == "the lock did not answer in time"
    assert 2.4 < waited < 6.0, waited  # the wait (0.5 s) and the slack (2 s)
    pid = int(pid_file.read_text())
    await until(lambda: _gone(pid))


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_a_lock_command_that_ends_before_taking_the_lock_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node's shell dies after its turn (killed, out of memory) with nothing printed: `take` says the
    command ended without taking the lock, at once, not after the wait."""
    _node_flock(tmp_path, monkeypatch, "kill -KILL 0")  # the whole command's process group
    host = Host(name="here", address="127.0.0.1", connection="local", install_dir=str(tmp_path / "rf"))
    prepared = await ready(LocalConnection(host), host, "deploy")
    started = time.monotonic()
    with pytest.raises(ServiceError) as failed:
        await take(prepared, wait_s=30)
    assert type(failed.value) is ServiceError and failed.value.host == "here"
    assert failed.value.message == "the lock command ended without taking the lock"
    assert time.monotonic() - started < 5.0
