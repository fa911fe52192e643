"""Tier 2: servers that free themselves from a vanished client (the keepalive patch of the servers
rpcfleet builds: SO_KEEPALIVE 15 s idle, 5 s interval, 3 probes, and TCP_USER_TIMEOUT 30 s).

A client on another node, not the controller, holds node 1's server (the server serves one client at a
time); then that node's link is cut (iptables DROP both ways) and the client killed, so no FIN or RST
ever reaches the server. With no rpcfleet command run, a new client gets HELLO within 60 s: the
server's kernel gave up on the dead peer by itself. The unpatched server waits in recv for ever: the
same test fails on it. A live client that is only idle answers the probes in its kernel and keeps the
server past the same window."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.artifacts.store import load_artifact
from orchestrator.lab.lifecycle import lab_down, lab_up
from orchestrator.lab.state import Lab
from orchestrator.rpc.client import probe_endpoint
from tests.plugins.lab import hold_from, require_lab_privileges, session_lab_name

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def keepalive_lab() -> Iterator[Lab]:
    require_lab_privileges()
    name = session_lab_name("ka")
    made = lab_up(2, name=name, owner_pid=os.getpid())
    try:
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator", "deploy", "-i", str(made.inventory)],
            capture_output=True, text=True, timeout=300, cwd=ROOT,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        yield made
    finally:
        lab_down(name)


def hold(lab: Lab, node: int, address: str) -> subprocess.Popen[str]:
    """A client in node `node` holding `address`'s server."""
    client = hold_from(lab, node, address, 50052)
    assert client is not None, "the server was busy"
    return client


def hello(endpoint: str) -> str:
    return asyncio.run(
        probe_endpoint(endpoint, hello_only=True, connect_timeout=2, read_timeout=2, deadline=3)
    ).outcome.value


def test_the_deployed_server_is_built_with_the_keepalive_patch(keepalive_lab: Lab) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "status", "-i", str(keepalive_lab.inventory), "--json"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    version = json.loads(done.stdout)[0]["result"]["version"]
    assert load_artifact(version).manifest.has_patch("keepalive")


def test_a_vanished_foreign_client_frees_the_server_within_60_s(keepalive_lab: Lab) -> None:
    server = keepalive_lab.nodes[0]
    endpoint = f"{server.address}:50052"
    client = hold(keepalive_lab, 2, server.address)
    try:
        assert hello(endpoint) == "busy"  # it serves the other node's client
        keepalive_lab.firewall_drop(2, outgoing=True)  # node 2 vanishes: nothing of it reaches the server
        client.kill()
        client.wait()
        started = time.monotonic()
        while hello(endpoint) != "ok":
            assert time.monotonic() - started < 60, "the server still serves the vanished client after 60 s"
            time.sleep(2)
        freed = time.monotonic() - started
        assert freed > 10  # it was the keepalive (15 s idle at the least), not a FIN that got through
    finally:
        client.kill()
        keepalive_lab.heal([2])


def test_a_live_idle_client_is_never_cut(keepalive_lab: Lab) -> None:
    server = keepalive_lab.nodes[0]
    endpoint = f"{server.address}:50052"
    client = hold(keepalive_lab, 2, server.address)
    try:
        time.sleep(45)  # past 15 s idle + 3 probes x 5 s, and past the 30 s user timeout
        assert client.poll() is None
        assert hello(endpoint) == "busy"  # still held: its kernel answered every probe
    finally:
        client.kill()
        client.wait()
