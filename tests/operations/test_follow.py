"""`rpcfleet logs --follow`: new lines as they come, across a rotation, without the connection noise."""

from __future__ import annotations

import asyncio
import dataclasses
import getpass
from pathlib import Path

import pytest

from orchestrator.artifacts.manifest import Artifact
from orchestrator.cli import main
from orchestrator.engine.executor import Session
from orchestrator.inventory.load import load_inventory
from orchestrator.inventory.model import Host
from orchestrator.operations.follow import CONNECTION_NOISE, is_noise, make_follow_step, parse_chunk
from orchestrator.rpc.client import probe_endpoint
from tests.plugins.servers import free_port, write_local_inventory


async def _wait_for(seen: list[str], n: int) -> None:
    for _ in range(200):
        if len(seen) >= n:
            return
        await asyncio.sleep(0.02)


async def test_follow_prints_new_complete_lines_without_noise(tmp_path: Path) -> None:
    log = tmp_path / "log" / "rpc-server.log"
    log.parent.mkdir()
    log.write_text("old line, already shown by the tail\n")
    user = getpass.getuser()
    host = Host(name="node1", address="127.0.0.1", connection="local", install_dir=str(tmp_path))
    host = dataclasses.replace(host, rpc_run_as=user)
    seen: list[str] = []
    marks: list[str] = []
    stop = asyncio.Event()

    def on_lines(name: str, lines: list[str]) -> None:
        assert name == "node1"
        marks.extend(line for line in lines if line == "mark")
        seen.extend(line for line in lines if line != "mark")

    async with Session(forks=1) as session:
        task = asyncio.create_task(
            session.run([host], make_follow_step(on_lines, interval=0.05, stop=stop), name="follow")
        )
        # The follow starts at the log's end: a line written before its first read is never shown. Write
        # marks until one shows (poll): from then on it reads every new line.
        for _ in range(300):
            with log.open("a") as f:
                f.write("mark\n")
            await asyncio.sleep(0.1)
            if marks:
                break
        assert marks, "the follow never showed a new line"
        with log.open("a") as f:
            f.write("Accepted client connection\nStarting RPC server v7.0.0\nClient connection closed\nhalf")
        await _wait_for(seen, 1)
        with log.open("a") as f:
            f.write(" a line\n")
        await _wait_for(seen, 2)
        log.write_text("after rotation\n")  # smaller than before: read from its start
        await _wait_for(seen, 3)
        stop.set()
        run = await asyncio.wait_for(task, 5)
    assert run.ok
    assert seen == ["Starting RPC server v7.0.0", "half a line", "after rotation"]


def test_noise_lines_are_the_servers_connection_lines() -> None:
    # ggml-rpc-server 7.0.0, one probe: these two lines (see bench/probe.py's server logs)
    assert all(is_noise(line) for line in CONNECTION_NOISE)
    assert not is_noise("Starting RPC server v7.0.0") and not is_noise("Accepted client connection from x")
    assert parse_chunk("12\nabc", 20) is not None and parse_chunk("12\nabc", 20).rotated  # type: ignore[union-attr]
    assert parse_chunk("", 0) is None


def test_logs_leave_out_probe_noise_before_taking_the_last_lines(
    cpu_artifact: Artifact, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real server probed 30 times (60 connection lines): `rpcfleet logs` still shows its start-up
    banner, because the noise is left out before the last 40 lines are taken; --noise keeps it."""
    address = "127.0.0.149"
    inventory = write_local_inventory(
        tmp_path / "inventory.yml",
        {
            "l1": {
                "rpc_host": address,
                "rpc_port": free_port(address),
                "install_dir": str(tmp_path / "inst"),
                "rpc_artifact": cpu_artifact.id,
                "supervisor": "process",
            }
        },
    )
    host = load_inventory(inventory).host("l1")
    log = Path(host.install_dir) / "log" / "rpc-server.log"
    assert main(["deploy", "-i", str(inventory)]) == 0
    try:
        banner = [line for line in log.read_text().splitlines() if line.strip() and not is_noise(line)]

        async def probes() -> None:
            for _ in range(30):
                assert (await probe_endpoint(host.endpoint, hello_only=True)).ok

        asyncio.run(probes())
        lines = log.read_text().splitlines()
        assert sum(is_noise(line) for line in lines[-40:]) == 40  # the last 40 lines are all noise
        capsys.readouterr()
        assert main(["logs", "-i", str(inventory)]) == 0
        out = [line.strip() for line in capsys.readouterr().out.splitlines()]
        assert banner and all(line.strip() in out for line in banner)
        assert not any(is_noise(line) for line in out)
        assert main(["logs", "-i", str(inventory), "-n", "3", "--noise"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert sum(is_noise(line) for line in out) == 3
    finally:
        assert main(["stop", "-i", str(inventory), "--force"]) == 0
