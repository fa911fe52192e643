"""Connections, tier 2: what only a real OpenSSH server can prove (the in-process fake kills a dropped
command's process group itself, which sshd does not)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from orchestrator.connectors.base import ConnectOptions
from orchestrator.connectors.connect import connect
from orchestrator.core.errors import CommandTimeoutError
from orchestrator.inventory.model import Host
from orchestrator.lab.state import Lab
from tests.plugins.lab import lab_hosts_of, own_lab
from tests.procs import gone, wait_gone

pytestmark = pytest.mark.lab
FAST = ConnectOptions(connect_timeout=5.0, command_timeout=10.0)


@pytest.fixture(scope="module")
def conn_lab() -> Iterator[Lab]:
    with own_lab(1, "cn") as made:
        yield made


@pytest.fixture
def node(conn_lab: Lab) -> Host:
    return lab_hosts_of(conn_lab)[0]


async def test_a_timed_out_command_is_killed_on_the_node(node: Host) -> None:
    async with await connect(node, FAST) as conn:
        with pytest.raises(CommandTimeoutError) as info:
            await conn.run("echo $$; exec sleep 60", timeout=0.5)
        pid = int(info.value.stdout.split()[0])
        wait_gone(pid)  # lab nodes share this machine's pid space
        assert (await conn.run("echo still here")).stdout == "still here\n"


async def test_a_cancelled_command_is_killed_on_the_node(node: Host) -> None:
    """Ctrl-C lands while a remote command runs: the command does not run on after its channel closes."""
    async with await connect(node, FAST) as conn:
        for _ in range(20):
            running = asyncio.create_task(conn.run("echo $$; exec sleep 60", timeout=30))
            line = await conn.run("pgrep -n -x sleep -u $(id -u) || true")
            while not line.stdout.strip():
                line = await conn.run("pgrep -n -x sleep -u $(id -u) || true")
            pid = int(line.stdout)
            assert not gone(pid)  # the command runs: the cancel below lands mid-command
            running.cancel()
            with pytest.raises(asyncio.CancelledError):
                await running
            wait_gone(pid)
