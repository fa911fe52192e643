"""Importing the SSH connector prints nothing: asyncssh 2.24 with cryptography 48+ warned ten times about
DSA on every command (issue 43), before any key was read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_ssh_connector_imports_without_a_warning() -> None:
    # A fresh interpreter: this one imported asyncssh long ago. `-W error` turns any warning into a failure.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", "import orchestrator.connectors.ssh, asyncssh.crypto.dsa"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert (done.returncode, done.stderr) == (0, "")


def test_only_the_dsa_warning_is_dropped() -> None:
    code = (
        "import warnings, orchestrator.connectors.ssh\n"
        "warnings.warn('DSA is deprecated (not from asyncssh)', UserWarning)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert "DSA is deprecated (not from asyncssh)" in done.stderr
