"""The threads of rpcfleet outside the runtime's loops: made here, so that engine/ is the one place that
makes a thread (tests/project/test_concurrency_home.py). No imports of the rest of rpcfleet: the worker child
uses it too, and starts in a fraction of a second."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable


def start_thread(target: Callable[..., object], *args: object, name: str) -> threading.Thread:
    """`target(*args)` on a new daemon thread, started: a thread never holds the process open; what must
    end before the process does is joined by its owner."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    return thread


def thread_pool(workers: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A pool of up to `workers` (at least 1) threads named `name_N`; the caller shuts it down (`with`)."""
    return concurrent.futures.ThreadPoolExecutor(max(1, workers), thread_name_prefix=name)
