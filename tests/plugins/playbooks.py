"""Tier-2 fixtures for playbooks: the session lab with rpc-servers deployed by `playbooks/deploy.yml`.

- `fresh_nodes`: the lab's hosts with nothing of ours installed before and after the test.
- `deployed`: the same, with the pinned artifact installed and serving on every node (by deploy.yml).
- `play(name, hosts, **extra_vars)`: run a shipped playbook through the executor, as the CLI does.
- `NodeView`: what a test reads on a node from outside rpcfleet (pid file, log, installed binaries).
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.artifacts.manifest import Artifact
from orchestrator.engine.executor import Session
from orchestrator.inventory.model import Host
from orchestrator.lab.state import Lab
from orchestrator.playbooks.model import PlaybookResult
from orchestrator.playbooks.reader import load_playbook
from orchestrator.playbooks.runner import run_playbook
from tests.procs import file_reader, kill_supervised

PLAYBOOKS = Path(__file__).resolve().parents[2] / "playbooks"
INSTALL = "rpcfleet"  # the lab inventory's install_dir, under the node's home

Play = Callable[..., Awaitable[PlaybookResult]]


class NodeView:
    """A lab node's rpcfleet files, read from the root namespace (the node's home is a plain folder)."""

    def __init__(self, lab: Lab, host: Host) -> None:
        self.lab = lab
        self.host = host
        self.root = lab.node(host.name).home / INSTALL

    def pid(self) -> int | None:
        try:
            return int((self.root / "run/rpc-server.pid").read_text().split()[0])
        except (FileNotFoundError, IndexError, ValueError):
            return None

    def server_alive(self) -> bool:
        pid = self.pid()
        if pid is None:
            return False
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            return stat != "Z" and b"ggml-rpc-server" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except (FileNotFoundError, IndexError):
            return False

    def starts(self) -> int:
        """How many times a server was started (the launcher writes one marker line per start)."""
        try:
            log = (self.root / "log/rpc-server.log").read_text(errors="replace")
        except FileNotFoundError:
            return 0
        return log.count("=== rpcfleet: starting")

    def binaries(self) -> list[Path]:
        return sorted(self.root.glob("versions/*/bin/ggml-rpc-server"))

    def kill(self) -> None:
        """Kill the server and its process supervisor loop (which would restart it)."""
        kill_supervised(file_reader(self.root))


def _clean(lab: Lab, hosts: list[Host]) -> None:
    for host in hosts:
        view = NodeView(lab, host)
        view.kill()
        shutil.rmtree(view.root, ignore_errors=True)


@pytest.fixture
def fresh_nodes(lab: Lab, lab_hosts: list[Host]) -> Iterator[list[Host]]:
    _clean(lab, lab_hosts)
    yield lab_hosts
    lab.heal()
    _clean(lab, lab_hosts)


@pytest.fixture
def play() -> Play:
    async def run(name: str, hosts: list[Host], *, check: bool = False, **extra: Any) -> PlaybookResult:
        playbook = load_playbook(PLAYBOOKS / f"{name}.yml", extra)
        async with Session(forks=16) as session:
            return await run_playbook(playbook, hosts, session=session, check=check)

    return run


@pytest.fixture
async def deployed(fresh_nodes: list[Host], cpu_artifact: Artifact, play: Play) -> AsyncIterator[list[Host]]:
    result = await play("deploy", fresh_nodes)
    assert result.ok, {h: [str(r.error) for r in rs if r.error] for h, rs in result.by_host().items()}
    yield fresh_nodes
