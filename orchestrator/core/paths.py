"""Where rpcfleet keeps its state on this machine."""

from __future__ import annotations

import os
from pathlib import Path


def rpcfleet_home() -> Path:
    """`$RPCFLEET_HOME`, default `~/.cache/rpcfleet` (read on every call so tests can point it elsewhere)."""
    value = os.environ.get("RPCFLEET_HOME")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "rpcfleet"


def labs_root() -> Path:
    """Where `rpcfleet lab` keeps each lab's state, one folder per lab name."""
    return rpcfleet_home() / "lab"


DEFAULT_LAB = "lab"


def default_lab_inventory_file() -> Path:
    """The inventory `rpcfleet lab up` writes for the default lab (present while that lab is up)."""
    return labs_root() / DEFAULT_LAB / "inventory.yml"
