"""Tier 2: rolling restarts of real rpc-servers on lab nodes (network namespaces, real OpenSSH)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest

from orchestrator.inventory.model import Host
from orchestrator.lab.state import Lab
from orchestrator.operations.restart import RestartReport
from orchestrator.rpc.client import probe_endpoint
from orchestrator.rpc.records import Outcome
from tests.plugins.playbooks import NodeView, Play

pytestmark = pytest.mark.lab


async def _serving(hosts: list[Host]) -> list[bool]:
    """Which servers answer right now (busy counts: it serves someone, e.g. the restart's own probe)."""
    results = await asyncio.gather(
        *(
            probe_endpoint(h.endpoint, connect_timeout=0.5, read_timeout=0.5, deadline=1.0, hello_only=True)
            for h in hosts
        )
    )
    return [r.outcome in (Outcome.OK, Outcome.BUSY) for r in results]


def _statuses(result: object, step: int = 0) -> list[str]:
    return [r.status for r in result.steps[step].run.results]  # type: ignore[attr-defined]


async def test_serial_1_keeps_two_of_three_serving_at_every_moment(
    lab: Lab, deployed: list[Host], play: Play
) -> None:
    views = [NodeView(lab, h) for h in deployed]
    pids = [v.pid() for v in views]
    samples: list[list[bool]] = []
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            samples.append(await _serving(deployed))
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    try:
        result = await play("rolling-restart", deployed)
    finally:
        done.set()
        await watcher
    assert result.ok, [str(r.error) for s in result.steps for r in s.run.failed]
    assert _statuses(result) == ["changed"] * 3
    for r, view, before in zip(result.steps[0].run.results, views, pids, strict=True):
        assert isinstance(r.value, RestartReport) and r.value.action == "restarted"
        assert r.value.pid_before == before and view.pid() == r.value.pid_after != before
        assert view.server_alive()
        assert r.value.baseline and r.value.after  # the memory was measured and came back
    counts = [sum(s) for s in samples]
    assert len(samples) > 10
    assert min(counts) >= 2, counts
    # The watcher saw each node down once: it could have caught a batch of more than one.
    assert counts.count(2) > 0, counts
    down = {i for s in samples for i, up in enumerate(s) if not up}
    assert down == {0, 1, 2}
    assert result.recap.counts[deployed[0].name]["changed"] == 1


@pytest.mark.parametrize("fault", ["binary_removed", "port_taken"])
async def test_a_node_that_does_not_come_back_stops_the_run_and_the_rest_keeps_running(
    lab: Lab, deployed: list[Host], play: Play, fault: str
) -> None:
    first, broken, last = (NodeView(lab, h) for h in deployed)
    last_pid = last.pid()
    squatter: int | None = None
    if fault == "binary_removed":
        for binary in broken.binaries():
            binary.unlink()  # the running server keeps its image; a new start has nothing to run
        broken_pid = broken.pid()
    else:
        stopped = await play("teardown", [deployed[1]])
        assert _statuses(stopped) == ["changed"] and not broken.server_alive()
        host = deployed[1]
        code = (
            "import socket,time; s=socket.socket(); "
            "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            f"s.bind(('{host.address}', {host.rpc_port})); s.listen(); time.sleep(300)"
        )
        out = lab.node_exec(
            host.name,
            ["sh", "-c", f'setsid nohup python3 -c "{code}" </dev/null >/dev/null 2>&1 & echo $!'],
        )
        squatter = int(out.stdout.split()[-1])
        broken_pid = None
    try:
        result = await play("rolling-restart", deployed)
    finally:
        if squatter is not None:
            lab.node_exec(deployed[1].name, ["kill", str(squatter)], check=False)
    assert result.aborted and not result.ok
    assert _statuses(result) == ["changed", "failed", "skipped"]
    run = result.steps[0].run
    error = str(run.results[1].error)
    if fault == "binary_removed":
        assert "exited right after starting" in error or "no rpc-server" in error, error
        assert broken_pid is not None and not broken.server_alive()
    else:
        assert f"port {deployed[1].rpc_port}" in error and "taken" in error, error
    assert first.server_alive()
    assert last.pid() == last_pid and last.server_alive()  # untouched
    assert (await _serving([deployed[0], deployed[2]])) == [True, True]
    recap = result.recap.counts
    assert (recap[deployed[0].name]["changed"], recap[deployed[1].name]["failed"]) == (1, 1)
    assert recap[deployed[2].name]["skipped"] == 1


async def test_a_busy_node_is_refused_unless_forced(
    lab: Lab, deployed: list[Host], play: Play, hold_server: Callable[[str], socket.socket]
) -> None:
    views = [NodeView(lab, h) for h in deployed]
    pids = [v.pid() for v in views]
    held = hold_server(deployed[0].endpoint)  # a client mid-inference, as far as the server knows
    refused = await play("rolling-restart", deployed)
    assert _statuses(refused) == ["failed", "skipped", "skipped"]
    error = str(refused.steps[0].run.results[0].error)
    assert "refusing to restart a busy server" in error and "force" in error
    assert [v.pid() for v in views] == pids and all(v.server_alive() for v in views)

    forced = await play("rolling-restart", deployed, force=True)
    assert _statuses(forced) == ["changed"] * 3, [str(r.error) for r in forced.steps[0].run.failed]
    assert all(v.pid() != p for v, p in zip(views, pids, strict=True))
    held.settimeout(5)
    assert held.recv(1) == b""  # the forced restart cut the client off
