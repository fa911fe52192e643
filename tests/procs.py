"""Local processes as /proc shows them."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path


def gone(pid: int) -> bool:
    """The process has exited (a zombie counts: it no longer runs)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: it exited between the open and the read
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def wait_gone(pid: int, limit: float = 5.0) -> None:
    """Wait until `gone(pid)`; fail the test after `limit` seconds."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if gone(pid):
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} is still alive")


def kill_supervised(read: Callable[[str], str]) -> None:
    """Kill an install's process supervisor loop, then its server: a server killed first is restarted.
    `read(relative)` returns a file of the install ("" when there is none)."""
    for relative, mark in (
        ("run/rpc-supervisor.pid", b"rpc-supervise.sh"),
        ("run/rpc-server.pid", b"ggml-rpc-server"),
    ):
        words = read(relative).split()
        if not words or not words[0].isdigit():
            continue
        pid = int(words[0])
        try:
            if mark not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            continue
        wait_gone(pid)


def file_reader(root: Path) -> Callable[[str], str]:
    """`read` for `kill_supervised`: files under `root`, as this machine sees them."""

    def read(relative: str) -> str:
        try:
            return (root / relative).read_text()
        except (FileNotFoundError, NotADirectoryError):
            return ""

    return read
