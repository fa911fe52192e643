"""The one runtime for concurrency (`engine.runtime`, `engine.children`, `engine.shared`, `core.signals`):
one loop and one session per command, one bridge from sync code, one bound on concurrent work, one
memo rule, one owner of signals that gives them back, one way to start a child that dies with us."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType, SimpleNamespace

import pytest

from orchestrator.core import signals
from orchestrator.core.errors import ArtifactError, InstallError
from orchestrator.engine import children
from orchestrator.engine.executor import Session
from orchestrator.engine.runtime import LoopThread, Runtime, run_sync
from orchestrator.engine.shared import gather_bounded
from orchestrator.engine.threads import thread_pool
from orchestrator.inventory.model import Host
from orchestrator.operations.install import ensure
from tests.procs import gone, wait_gone
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 20


def test_a_runtime_keeps_one_loop_and_one_session_across_its_phases() -> None:
    loops: list[asyncio.AbstractEventLoop] = []

    async def phase() -> Session:
        loops.append(asyncio.get_running_loop())
        return runtime.session

    with Runtime(forks=3) as runtime:
        first, second = runtime.run(phase()), runtime.run(phase())
    assert first is second and first.forks == 3
    assert loops[0] is loops[1] and loops[0].is_closed()


def test_run_sync_runs_from_sync_code_and_from_inside_a_running_loop() -> None:
    async def where() -> int:
        await asyncio.sleep(0)
        return threading.get_ident()

    assert run_sync(where()) == threading.get_ident()

    async def nested() -> int:
        return run_sync(where())  # a library's sync call made from async code: a helper thread's loop

    assert asyncio.run(nested()) != threading.get_ident()


def test_a_loop_thread_runs_coroutines_from_any_thread_and_cancels_what_is_left_when_stopped() -> None:
    """The runtime's loop on a thread (the asyncssh forwards, serve's fleet view): a call returns its
    coroutine's result from another thread, a call that times out cancels its coroutine, and `stop`
    cancels what still runs (its `finally` runs: a forward closes) and ends the thread."""
    loop_thread = LoopThread("test-loop")
    ended: list[str] = []

    async def where() -> int:
        await asyncio.sleep(0)
        return threading.get_ident()

    started: list[str] = []

    async def forever(name: str) -> None:
        started.append(name)
        try:
            await asyncio.sleep(3600)
        finally:
            ended.append(name)

    try:
        assert loop_thread.call(where(), 10) not in (threading.get_ident(), None)
        with thread_pool(4, "callers") as pool:  # several threads at once, one loop
            assert len(set(pool.map(lambda _: loop_thread.call(where(), 10), range(8)))) == 1
        with pytest.raises(TimeoutError):
            loop_thread.call(forever("timed out"), 0.05)
        wait_until(lambda: "timed out" in ended, what="the timed-out coroutine cancelled")
        loop_thread.submit(forever("pending"))
        # Running, so it has a `finally` to run (one cancelled before it starts never runs at all).
        wait_until(lambda: "pending" in started, what="the submitted coroutine started")
    finally:
        loop_thread.stop()
    assert not loop_thread.alive() and loop_thread.loop.is_closed()
    assert ended == ["timed out", "pending"]


async def test_gather_bounded_keeps_the_limit_and_the_order() -> None:
    running, most = 0, 0

    async def work(i: int) -> int:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.01 * (5 - i % 5))
        running -= 1
        return i

    calls = [lambda i=i: work(i) for i in range(12)]
    assert await gather_bounded(calls, 3) == list(range(12))
    assert most == 3


async def test_the_artifact_chooser_tries_a_failing_artifact_once_per_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """engine.shared's rule (was: the chooser's own memo tried again for every host)."""
    tries: list[str] = []

    def resolve(spec: str, **_: object) -> None:
        tries.append(spec)
        raise ArtifactError(f"no artifact {spec!r}", hint="import one")

    monkeypatch.setattr(ensure, "resolve_artifact", resolve)
    chooser = ensure.ArtifactChooser("missing")
    state = SimpleNamespace(os="linux", arch="x86_64", gpu_runtime=None)
    hosts = [Host(name=f"n{i}", address="127.0.0.1", connection="local") for i in range(3)]
    for host in hosts:
        with pytest.raises(InstallError, match="no artifact 'missing'") as info:
            await chooser(host, state)  # type: ignore[arg-type]
        assert info.value.host == host.name and info.value.hint == "import one"
    assert tries == ["missing"]


def _mine(_signum: int, _frame: FrameType | None) -> None:
    raise AssertionError("the handler from before ran")


def test_signals_taken_for_a_phase_are_given_back_to_the_handlers_from_before() -> None:
    """20 rounds: a session's interruptible phase on a runtime's loop hears SIGTERM, then hands it back."""
    heard: list[str] = []
    with signals.handling(signal.SIGTERM, _mine), signals.handling(signal.SIGINT, _mine):
        with Runtime(on_interrupt=lambda why, n: heard.append(why)) as runtime:
            for round_no in range(20):

                async def phase() -> None:
                    async with runtime.session.catching_signals():
                        os.kill(os.getpid(), signal.SIGTERM)
                        await asyncio.sleep(0.01)

                runtime.run(phase())
                assert len(heard) == round_no + 1 and runtime.session.interrupted == "SIGTERM"
                assert signal.getsignal(signal.SIGTERM) is _mine and signal.getsignal(signal.SIGINT) is _mine
        assert signal.getsignal(signal.SIGHUP) is not _mine
        with signals.handling(signal.SIGHUP, _mine):
            assert signal.getsignal(signal.SIGHUP) is _mine
    assert signal.getsignal(signal.SIGTERM) is not _mine and signal.getsignal(signal.SIGHUP) is not _mine


def test_a_signal_that_comes_as_a_phase_ends_is_heard_not_lost() -> None:
    """20 rounds: SIGTERM lands while the phase's last step runs and the phase ends before the loop polls
    again (a cache check that is over at once). The session still hears it, and the handler from before
    does not (as `run` once lost a SIGTERM sent right after its probe: it went on to load and generate)."""
    heard: list[str] = []
    with (
        signals.handling(signal.SIGTERM, _mine),
        signals.handling(signal.SIGINT, _mine),
        Runtime(on_interrupt=lambda why, n: heard.append(why)) as runtime,
    ):
        for round_no in range(20):

            async def phase() -> None:
                async with runtime.session.catching_signals():
                    os.kill(os.getpid(), signal.SIGTERM)  # no await after it: no poll of the loop

            runtime.run(phase())
            assert len(heard) == round_no + 1, heard
            assert signal.getsignal(signal.SIGTERM) is _mine


def test_exit_descriptions() -> None:
    assert children.exit_description(None) == "still running"
    assert children.exit_description(-signal.SIGABRT) == "signal SIGABRT"
    assert children.exit_description(3) == "exit status 3"


def test_child_logs_are_pruned_beyond_the_newest_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RPCFLEET_HOME", str(tmp_path))
    folder = tmp_path / "logs"
    folder.mkdir()
    old = time.time() - 7200
    for i in range(children.KEEP_LOGS + 5):
        path = folder / f"worker-old-{i:02d}.log"
        path.write_text("x")
        os.utime(path, (old + i, old + i))
    (folder / "engine-old.log").write_text("x")
    os.utime(folder / "engine-old.log", (old, old))
    fresh = children.child_log_path("worker")
    assert fresh.parent == folder and fresh.name.startswith("worker-") and not fresh.exists()
    assert len(list(folder.glob("worker-*.log"))) == children.KEEP_LOGS - 1
    assert (folder / "engine-old.log").exists()  # another kind's logs are its own
    assert children.child_log_path("engine", unique=True) != children.child_log_path("engine", unique=True)


def test_child_logs_pruned_by_several_parents_at_once_never_fail_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """serve's formations load at once, each pruning the logs: one found a log that another had just
    removed, and that formation's load died with FileNotFoundError (the README's usage block, once)."""
    monkeypatch.setenv("RPCFLEET_HOME", str(tmp_path))
    folder = tmp_path / "logs"
    folder.mkdir()
    listed = Path.glob

    def with_one_just_removed(self: Path, pattern: str) -> Iterator[Path]:
        yield self / "engine-removed-meanwhile.log"  # listed, then pruned by another parent
        yield from listed(self, pattern)

    monkeypatch.setattr(Path, "glob", with_one_just_removed)
    assert children.child_log_path("engine", unique=True).parent == folder
    monkeypatch.undo()

    monkeypatch.setenv("RPCFLEET_HOME", str(tmp_path))
    old = time.time() - 7200
    for round_no in range(ROUNDS):  # and for real: 8 parents at once over stale logs
        for i in range(children.KEEP_LOGS + 10):
            path = folder / f"engine-old-{round_no}-{i:02d}.log"
            path.write_text("x")
            os.utime(path, (old + i, old + i))
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            made = list(pool.map(lambda _: children.child_log_path("engine", unique=True), range(8)))
        assert all(p.parent == folder for p in made)


PARENT = """
import sys, threading, time
from orchestrator.engine.children import spawn_child
out = {}
def start():
    out["child"] = spawn_child(["sleep", "120"], env={"PATH": "/usr/bin:/bin"}, die_with_parent=True)
thread = threading.Thread(target=start)
thread.start()
thread.join()  # the thread that asked is gone: the child must live on (PR_SET_PDEATHSIG is per thread)
print(out["child"].pid, flush=True)
time.sleep(120)
"""


def test_a_child_outlives_the_thread_that_asked_and_dies_with_its_parent() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ}
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        time.sleep(0.5)
        assert not gone(child)
        parent.kill()
        parent.wait(10)
        wait_gone(child, 10)
    finally:
        parent.kill()
        parent.wait(10)
