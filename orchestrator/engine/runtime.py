"""The one runtime for concurrency: where loops, sessions and the bridges between threads and loops live.

* `Runtime`: one event loop per command, and on it one `Session` (one SSH connection per host for the
  whole command: `run`'s probe and its cache check share it). The loop runs each phase with `run()`;
  between phases (a load, a generation) it is idle, and the session's connections stay open.
* `run_sync(coro)`: the one bridge for synchronous code that must await: on this thread when no loop
  runs here, else (called from async code) on a private loop in a helper thread.
* Signals: a `Session` owns SIGINT/SIGTERM while it is interruptible (`Session.catching_signals`) and
  gives them back to the handlers from before; `core.signals` is the command's own handler.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

from orchestrator.connectors.base import ConnectOptions
from orchestrator.core import signals
from orchestrator.engine.executor import DEFAULT_FORKS, Session

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
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(run_once, coro).result()
