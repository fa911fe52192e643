"""The one runtime for concurrency: where loops, sessions and the bridges between threads and loops live.

* `Runtime`: one event loop per command, and on it one `Session` (one SSH connection per host for the
  whole command: `run`'s probe and its cache check share it). The loop runs each phase with `run()`;
  between phases (a load, a generation) it is idle, and the session's connections stay open.
* `run_sync(coro)`: the one bridge for synchronous code that must await: on this thread when no loop
  runs here, else (called from async code) on a private loop in a helper thread.
* `LoopThread`: a loop that keeps running on a thread of its own, for work that must go on while the
  command's thread blocks or serves (the asyncssh forwards, serve's fleet view); `run_sync` and
  `LoopThread.call` are the bridges from threads to a loop.
* `engine/threads.py`: the threads of the rest of the code (serve's loads and watches, the worker's pipe
  reader and its child's watchdog, the lab's node work): `start_thread`, `thread_pool`.
* Signals: a `Session` owns SIGINT/SIGTERM while it is interruptible (`Session.catching_signals`) and
  gives them back to the handlers from before; `core.signals` is the command's own handler.

Outside engine/ no module makes a loop or a thread (tests/project/test_concurrency_home.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

from orchestrator.connectors.base import ConnectOptions
from orchestrator.core import signals
from orchestrator.engine.executor import DEFAULT_FORKS, Session
from orchestrator.engine.threads import start_thread, thread_pool

T = TypeVar("T")


def quiet_interrupts(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """A signal that lands inside a task raises its KeyboardInterrupt there: asyncio ends the run with it
    (reported once, as `interrupted`) but also keeps it as the task's exception, and would print "Task
    exception was never retrieved" and a traceback when the task is collected. Not for the interrupt, nor
    after it: what it cut short (a connect still pending when the loop closes: "Task was destroyed but
    it is pending!") is only collected (`core.signals.quiet_after_interrupt`)."""
    if not isinstance(context.get("exception"), KeyboardInterrupt) and not signals.interrupted():
        loop.default_exception_handler(context)


class Runtime:
    """One command's event loop and its one `Session`: `with Runtime(forks=...) as rt: rt.run(coro)`.

    `session` is opened on the loop at its first use and closed (its connections with it) when the
    runtime ends. `on_interrupt` is what the session reports a signal with while it is interruptible."""

    def __init__(
        self,
        *,
        forks: int | None = None,
        options: ConnectOptions | None = None,
        on_interrupt: Callable[[str, int], None] | None = None,
    ) -> None:
        self.forks = forks or DEFAULT_FORKS
        self.options = options
        self.on_interrupt = on_interrupt
        self._runner: asyncio.Runner | None = None
        self._session: Session | None = None

    def __enter__(self) -> Runtime:
        self._runner = asyncio.Runner()
        self._runner.get_loop().set_exception_handler(quiet_interrupts)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        runner, session = self._runner, self._session
        self._runner, self._session = None, None
        if runner is None:
            return
        try:
            if session is not None:
                runner.run(session.close())
        finally:
            runner.close()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` to its end on this command's loop (on this thread)."""
        if self._runner is None:
            coro.close()
            raise RuntimeError("the runtime is not running (use it as a context manager)")
        return self._runner.run(coro)

    @property
    def session(self) -> Session:
        """The command's session (created at the first use; not interruptible outside
        `Session.catching_signals`)."""
        if self._session is None:
            self._session = Session(forks=self.forks, options=self.options, on_interrupt=self.on_interrupt)
        return self._session


def run_once(coro: Coroutine[Any, Any, T]) -> T:
    """`coro` on a loop of its own, made and closed here (a command with one async phase)."""
    with Runtime() as runtime:
        return runtime.run(coro)


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """The bridge from synchronous code to a coroutine: on this thread when no loop runs here; from
    inside a running loop (a library called from async code) on a private loop in a helper thread, as
    a thread cannot wait on its own loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run_once(coro)
    with thread_pool(1, "run-sync") as pool:
        return pool.submit(run_once, coro).result()


class LoopThread:
    """An event loop running on a daemon thread of its own until `stop`: coroutines go to it with
    `submit` (a concurrent future) or `call` (wait for the result), from any thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(quiet_interrupts)
        self._thread = start_thread(self._run, name=name)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            # What is still pending when stopped (a forward's reader) is cancelled, not left to "Task
            # was destroyed but it is pending!"
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            with contextlib.suppress(BaseException):
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
                self.loop.run_until_complete(self.loop.shutdown_default_executor())  # to_thread's
            self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop; its result (or exception) comes through the future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (TimeoutError after `timeout` seconds; the
        coroutine is cancelled then)."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        """End the loop (its pending tasks cancelled) and wait up to `timeout` s for its thread."""
        with contextlib.suppress(RuntimeError):  # the loop already closed
            self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
