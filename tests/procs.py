"""Local processes as /proc shows them."""

from __future__ import annotations

import time
from pathlib import Path


def gone(pid: int) -> bool:
    """The process has exited (a zombie counts: it no longer runs)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
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
