"""Where rpcfleet keeps its state on this machine."""

from __future__ import annotations

import os
from pathlib import Path


def rpcfleet_home() -> Path:
    """`$RPCFLEET_HOME`, default `~/.cache/rpcfleet` (read on every call so tests can point it elsewhere)."""
    value = os.environ.get("RPCFLEET_HOME")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "rpcfleet"
