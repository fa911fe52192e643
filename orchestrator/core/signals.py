"""The one owner of signal handlers. SIGINT and SIGTERM are KeyboardInterrupt (`install`), never inside
a finalizer, a weakref callback or the import machinery's callbacks; a phase that wants them otherwise
(an interruptible executor session on its loop, serve's SIGHUP) takes them with `loop_handlers` /
`handling`, which give them back to the handlers from before.

CPython runs a Python signal handler between two bytecodes of whatever runs, including a module lock's
weakref callback in `importlib._bootstrap`, a weak dictionary's (asyncio's selector maps file descriptors
in one) and an object's `__del__` (a socket, a transport, a process collected by the garbage collector);
an exception raised there is printed ("Exception ignored in ...", a traceback) and dropped, so the signal
would be lost and the user would see a traceback. A signal that lands inside one of them is handled
again a moment later, outside it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # not imported: `rpcfleet --help` loads no asyncio
    import asyncio

INTERRUPTS = (signal.SIGINT, signal.SIGTERM)

_IMPORT_MACHINERY = "<frozen importlib"
# Where weakref callbacks live: WeakValueDictionary's and WeakKeyDictionary's `remove`, WeakSet's `_remove`,
# `finalize`. A signal that lands in one is dropped like one in `__del__` (`logs --follow` hung so, once
# in 30 Ctrl-Cs, its SIGINT lost in the selector's weak map).
_WEAKREF_MODULES = ("/weakref.py", "/_weakrefset.py")
_RETRY = 0.002  # seconds until a deferred signal is handled again
_STACK_DEPTH = 64  # frames looked at for a finalizer (one runs from deep inside any code)
_deferred: list[int] = []
_received: list[int] = []  # the signals this handler turned into KeyboardInterrupt, this command


def interrupt(signum: int, frame: FrameType | None) -> None:
    """The handler: KeyboardInterrupt, unless `frame` is in a callback whose exceptions CPython drops:
    then the signal is handled again `_RETRY` seconds later (SIGALRM), by when that callback is over.
    Not by sending the signal again at once: its handler would run inside this one, still within the
    callback."""
    if _in_a_callback_that_drops_exceptions(frame):
        _deferred[:] = [signum]
        signal.signal(signal.SIGALRM, _again)
        signal.setitimer(signal.ITIMER_REAL, _RETRY)
        return
    _received.append(signum)
    raise KeyboardInterrupt


def _in_a_callback_that_drops_exceptions(frame: FrameType | None) -> bool:
    """Whether `frame` runs inside an object's `__del__`, a weakref callback or the import machinery, at
    any depth (a frame of a weakref module outside a callback is only handled 2 ms later)."""
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return False
        code = frame.f_code
        if (
            code.co_name == "__del__"
            or code.co_filename.startswith(_IMPORT_MACHINERY)
            or code.co_filename.endswith(_WEAKREF_MODULES)
        ):
            return True
        frame = frame.f_back
    return False


def raise_if_interrupted() -> None:
    """KeyboardInterrupt again when a signal came and the command still runs: code that catches
    BaseException to clean up and carries on (a library, a thread's join) can swallow the first one, and
    the command must not run on past the next phase boundary."""
    if _received:
        raise KeyboardInterrupt


def interrupted() -> bool:
    """Whether a signal has interrupted this command."""
    return bool(_received)


def quiet_after_interrupt() -> None:
    """Once a signal has interrupted the command, what it cut short is only collected: an event loop half
    made (its `__del__` fails), a coroutine never awaited, a task of asyncio's own shutdown (a signal in
    `asyncio.run`'s closing `shutdown_asyncgens` leaves it pending). Their finalizers' complaints
    ("Exception ignored in ...", a RuntimeWarning, asyncio's "Task was destroyed but it is pending!") would
    follow the one line that reports the interrupt; they are dropped then, and printed as before
    otherwise. So is the exception of a thread the interrupt cut short (serve's load thread, its engine
    closed under it). For the program's process (not a library's)."""
    default_hook, default_show = sys.unraisablehook, warnings.showwarning
    default_thread_hook = threading.excepthook
    logging.getLogger("asyncio").addFilter(lambda _record: not _received)

    def unraisable(what: Any) -> None:
        if not _received:
            default_hook(what)

    def show(
        message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
    ) -> None:
        if not _received:
            default_show(message, category, filename, lineno, file, line)

    def thread_failed(what: Any) -> None:
        if not _received:
            default_thread_hook(what)

    sys.unraisablehook = unraisable
    warnings.showwarning = show
    threading.excepthook = thread_failed


def forget() -> None:
    """A new command starts (the CLI calls `main` once per command line, tests many times)."""
    _received.clear()


def _again(_signum: int, frame: FrameType | None) -> None:
    interrupt(_deferred[0] if _deferred else signal.SIGINT, frame)


def install() -> None:
    """`interrupt` for SIGINT and SIGTERM (the main thread only, as Python's handlers are)."""
    for sig in INTERRUPTS:
        signal.signal(sig, interrupt)


def ignore_interrupts() -> None:
    """No SIGINT or SIGTERM heard any more (the process is exiting)."""
    for sig in INTERRUPTS:
        signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def handling(sig: signal.Signals, handler: Callable[[int, FrameType | None], Any]) -> Iterator[None]:
    """`handler` for `sig` within the block, then the handler from before."""
    previous = signal.getsignal(sig)
    signal.signal(sig, handler)
    try:
        yield
    finally:
        signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


def loop_handlers(loop: asyncio.AbstractEventLoop, callback: Callable[[str], None]) -> Callable[[], None]:
    """SIGINT and SIGTERM call `callback(name)` on `loop`, between its tasks, until the returned function
    is called: it hands them back to the handlers from before (asyncio alone would leave SIGTERM at its
    default action, status 143, and SIGINT at Python's: the command's `interrupt` must hear the next one).

    Not asyncio's `add_signal_handler`: a signal it catches waits on its wake-up socket for the loop's
    next poll, and a phase that ends first (its last step runs on, then gives the handlers back) drops
    it: `run` once went on to load and generate after a SIGTERM. Here the handler queues the name; the
    loop calls `callback` for it, or `give_back` does for one still queued."""
    queued: list[str] = []

    def deliver(name: str) -> None:
        if name in queued:
            queued.remove(name)
            callback(name)

    def heard(signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        queued.append(name)
        with contextlib.suppress(RuntimeError):  # a closed loop: `give_back` delivers it
            loop.call_soon_threadsafe(deliver, name)  # wakes a loop that waits in its poll

    installed = [(sig, signal.getsignal(sig)) for sig in INTERRUPTS]
    for sig in INTERRUPTS:
        signal.signal(sig, heard)

    def give_back() -> None:
        for sig, previous in installed:
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        installed.clear()
        while queued:
            callback(queued.pop(0))

    return give_back


def interrupted_by(exc: BaseException) -> bool:
    """Whether `exc` is the interrupt, or wraps it: Python 3.11 turns an exception raised while a class
    is created (a descriptor's `__set_name__`, e.g. functools.cached_property) into a RuntimeError."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__cause__
    return False
