"""Every test runs with an empty `~/.ssh`: HOME is a fresh folder per test, and no ssh-agent.

What a developer's own `~/.ssh` holds (a `config` with `Host *` lines, keys, an agent, known_hosts) must
not change what a test sees: the connectors read `~/.ssh/config` and `~/.ssh/known_hosts` through HOME,
and asyncssh its default keys and `SSH_AUTH_SOCK`. Tests name their keys and known_hosts files (the lab's
inventory does). `RPCFLEET_HOME` keeps its value (default: the real `~/.cache/rpcfleet`, where set-up
put the builds and models), so the caches are found whatever HOME is.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REAL_HOME = Path.home()
RPCFLEET_HOME = os.environ.get("RPCFLEET_HOME") or str(REAL_HOME / ".cache" / "rpcfleet")


@pytest.fixture(autouse=True)
def empty_ssh_home(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Path]:
    """This test's HOME, with an empty `.ssh` (mode 0700, as ssh wants it)."""
    home = tmp_path_factory.mktemp("home")
    (home / ".ssh").mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("RPCFLEET_HOME", os.environ.get("RPCFLEET_HOME") or RPCFLEET_HOME)
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    yield home
