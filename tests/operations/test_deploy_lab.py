"""Tier 2: deploy the real artifact to lab nodes (network namespaces, real OpenSSH) and break things."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.artifacts.manifest import Artifact
from orchestrator.core.errors import InstallError
from orchestrator.engine.executor import RunResult, Session
from orchestrator.inventory.model import Host
from orchestrator.lab.state import Lab
from orchestrator.operations.install.apply import apply_install
from orchestrator.operations.install.ensure import ArtifactChooser
from orchestrator.operations.install.plan import InstallState, plan_install
from orchestrator.operations.layer import OperationOptions
from orchestrator.operations.server.state import ServerStatus, read_node_state
from orchestrator.operations.server.steps import (
    DeployResult,
    make_deploy_step,
    make_rollback_step,
    make_service_step,
    make_status_step,
)
from orchestrator.rpc.client import probe_endpoint
from orchestrator.rpc.records import Outcome
from tests.procs import kill_supervised, wait_gone
from tests.waits import until_value

pytestmark = pytest.mark.lab

INSTALL_DIRS = ("rpcfleet", "fulldisk", "taken")  # under the lab user's home on each node


class _Fixed(ArtifactChooser):
    """Always this artifact (a variant of the real one under another id stands for a new version)."""

    def __init__(self, artifact: Artifact) -> None:
        super().__init__()
        self.artifact = artifact

    async def __call__(self, host: Host, state: InstallState) -> Artifact:
        return self.artifact


def _variant(artifact: Artifact, tag: str) -> Artifact:
    return dataclasses.replace(artifact, id=f"{artifact.id}-{tag}")


async def _run(hosts: list[Host], step: Any, name: str) -> RunResult[Any]:
    async with Session(forks=16) as session:
        return await session.run(hosts, step, name=name)


async def _states(hosts: list[Host]) -> dict[str, ServerStatus]:
    run = await _run(hosts, make_status_step(), "status")
    assert run.ok, [str(r.error) for r in run.failed]
    return {r.host.name: r.value for r in run.results if isinstance(r.value, ServerStatus)}


def _service_action(value: object) -> str:
    assert isinstance(value, DeployResult)
    return value.service.action


def _node_file(lab: Lab, host: Host, relative: str) -> Path:
    return lab.node(host.name).home / relative


def _server_pid(lab: Lab, host: Host, install: str = "rpcfleet") -> int:
    return int(_node_read(lab, host, f"{install}/run/rpc-server.pid") or "0")


def _node_read(lab: Lab, host: Host, relative: str) -> str:
    """A file as the node sees it (inside its mount namespace, where a test may have mounted a tmpfs)."""
    path = f"/home/{lab.user}/{relative}"
    return lab.node_exec(host.name, ["sh", "-c", f"cat {path} 2>/dev/null || true"]).stdout.strip()


def _node_ls(lab: Lab, host: Host, relative: str) -> list[str]:
    return lab.node_exec(host.name, ["ls", "-A", f"/home/{lab.user}/{relative}"]).stdout.split()


def _clean(lab: Lab, hosts: list[Host]) -> None:
    """Kill our servers (by pid file) and remove every install folder this module uses."""
    for host in hosts:
        for install in INSTALL_DIRS:
            kill_supervised(lambda relative: _node_read(lab, host, f"{install}/{relative}"))  # noqa: B023
            if install == "fulldisk":
                lab.node_exec(host.name, ["umount", "-l", f"/home/{lab.user}/fulldisk"], check=False)
            shutil.rmtree(_node_file(lab, host, install), ignore_errors=True)


@pytest.fixture
def nodes(lab: Lab, lab_hosts: list[Host]) -> Iterator[list[Host]]:
    """The lab's hosts, with nothing of ours installed before and after the test."""
    _clean(lab, lab_hosts)
    yield lab_hosts
    lab.heal()
    _clean(lab, lab_hosts)


@pytest.fixture
def chooser(cpu_artifact: Artifact) -> ArtifactChooser:
    return _Fixed(cpu_artifact)


async def test_deploy_noop_restart_stop(
    nodes: list[Host], lab: Lab, chooser: ArtifactChooser, cpu_artifact: Artifact
) -> None:
    first = await _run(nodes, make_deploy_step(chooser), "deploy")
    assert [r.status for r in first.results] == ["changed"] * 3, [str(r.error) for r in first.failed]
    for r in first.results:
        assert isinstance(r.value, DeployResult)
        assert (r.value.install.action, r.value.service.action) == ("install", "start")
        hello = await probe_endpoint(r.host.endpoint, hello_only=True)
        assert hello.ok and str(hello.version) == cpu_artifact.protocol
    pids = {h.name: _server_pid(lab, h) for h in nodes}

    second = await _run(nodes, make_deploy_step(chooser), "deploy")  # its time: bench/deploy.py (no-op)
    assert [r.status for r in second.results] == ["ok"] * 3
    assert {h.name: _server_pid(lab, h) for h in nodes} == pids

    states = await _states(nodes)
    assert {s.state for s in states.values()} == {"running"}
    assert {s.version for s in states.values()} == {cpu_artifact.id}

    restarted = await _run(nodes, make_service_step("restarted", OperationOptions()), "restart")
    assert [r.status for r in restarted.results] == ["changed"] * 3
    new_pids = {h.name: _server_pid(lab, h) for h in nodes}
    assert all(new_pids[n] != pids[n] for n in pids)
    assert {s.state for s in (await _states(nodes)).values()} == {"running"}

    stopped = await _run(nodes, make_service_step("stopped", OperationOptions()), "stop")
    assert [r.status for r in stopped.results] == ["changed"] * 3
    for pid in new_pids.values():
        wait_gone(pid)
    assert {s.state for s in (await _states(nodes)).values()} == {"stopped"}
    for host in nodes:
        refused = await probe_endpoint(host.endpoint, hello_only=True, deadline=2)
        assert refused.outcome is Outcome.REFUSED


async def test_a_killed_server_is_back_within_5_s_without_rpcfleet(
    nodes: list[Host], lab: Lab, chooser: ArtifactChooser, hold_server: Callable[[str], socket.socket]
) -> None:
    assert (await _run(nodes, make_deploy_step(chooser), "deploy")).ok
    victim = nodes[1]
    # A stop refused by the busy check leaves the supervisor in place.
    held = hold_server(victim.endpoint)
    refused = (await _run([victim], make_service_step("stopped", OperationOptions()), "stop")).results[0]
    assert refused.status == "failed" and "busy" in str(refused.error), refused.error
    held.close()

    pid = _server_pid(lab, victim)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_gone(pid)
    while not (await probe_endpoint(victim.endpoint, hello_only=True, connect_timeout=0.5, deadline=1)).ok:
        assert time.monotonic() - killed_at < 5.0, "the killed server did not answer HELLO within 5 s"
        await asyncio.sleep(0.05)
    back = _server_pid(lab, victim)
    assert back != pid
    states = await _states(nodes)
    status = states[victim.name]
    assert (status.state, status.pid, status.restarts, status.last_exit) == (
        "running", back, 1, "killed by signal 9",
    )  # fmt: skip
    assert {states[h.name].restarts for h in nodes if h != victim} == {0}
    again = await _run(nodes, make_deploy_step(chooser), "deploy")
    assert [r.status for r in again.results] == ["ok"] * 3  # it serves as the inventory says: nothing to do


def _loop_pid(lab: Lab, host: Host) -> int:
    return int(_node_read(lab, host, "rpcfleet/run/rpc-supervisor.pid") or "0")


async def test_a_server_failing_at_every_start_is_crash_looping_with_its_last_log_lines(
    nodes: list[Host], lab: Lab, chooser: ArtifactChooser
) -> None:
    host = dataclasses.replace(nodes[0], rpc_devices=("NOPE0",))  # the server exits 1 at once
    started = time.monotonic()
    failed = (await _run([host], make_deploy_step(chooser), "deploy")).results[0]
    assert failed.status == "failed" and "exited right after starting" in str(failed.error), failed.error
    loop = _loop_pid(lab, host)
    # Restarted after 1, 2, 4 and 8 s, then given up at the 5th failure within 60 s.
    while (status := (await _states([host]))[host.name]).state != "crash-looping":
        assert status.state == "crashed", status
        assert time.monotonic() - started < 45, status  # 15 s of backoff; headroom for a busy machine
        await asyncio.sleep(0.5)
    assert time.monotonic() - started > 14
    assert "5 failures within 60 s, the last: exited with status 1" in status.message, status.message
    assert "last log lines:" in status.message and "NOPE0" in status.message, status.message
    assert (status.restarts, status.last_exit) == (4, "exited with status 1")
    wait_gone(loop)
    log = _node_read(lab, host, "rpcfleet/log/rpc-server.log")
    assert log.count("(restart ") == 4 and "not restarted (crash-looping)" in log
    await asyncio.sleep(2.5)  # gave up: nothing restarts it any more
    assert _node_read(lab, host, "rpcfleet/log/rpc-server.log").count("(restart ") == 4

    fixed = (await _run([nodes[0]], make_deploy_step(chooser), "deploy")).results[0]
    assert fixed.status == "changed" and _service_action(fixed.value) == "start", fixed.error
    status = (await _states([nodes[0]]))[nodes[0].name]
    assert (status.state, status.restarts) == ("running", 0)


def _squat(lab: Lab, host: Host) -> int:
    """Another program listens on the host's rpc port (until killed); returns its pid."""
    code = (
        "import socket,time; s=socket.socket(); "
        f"s.bind(('{host.rpc_host or host.address}', {host.rpc_port})); s.listen(); time.sleep(300)"
    )
    out = lab.node_exec(
        host.name, ["sh", "-c", f'setsid nohup python3 -c "{code}" </dev/null >/dev/null 2>&1 & echo $!']
    )
    return int(out.stdout.split()[-1])


async def test_a_port_taken_after_a_crash_is_a_reason_not_a_loop(
    nodes: list[Host], lab: Lab, chooser: ArtifactChooser
) -> None:
    host = nodes[2]
    assert (await _run([host], make_deploy_step(chooser), "deploy")).ok
    pid, loop = _server_pid(lab, host), _loop_pid(lab, host)
    os.kill(pid, signal.SIGKILL)
    squatter = _squat(lab, host)  # before the supervisor's restart, 1 s after the kill
    try:
        wait_gone(loop, limit=5)  # one restart, a failed bind (status 1), the port another's: the loop ends
        status = (await _states([host]))[host.name]
        assert status.state == "crashed" and "could not bind its port" in status.message, status
        assert f"port {host.rpc_port} is taken" in status.message  # by root's squatter, unseen by the user
        taken = f"could not bind: port {host.rpc_port} is taken by another program"
        assert (status.restarts, status.last_exit) == (1, taken)
        log = _node_read(lab, host, "rpcfleet/log/rpc-server.log")
        assert log.count("(restart ") == 1 and "Failed to create server socket" in log
        assert f"{taken}: not restarted" in log
    finally:
        lab.node_exec(host.name, ["kill", str(squatter)], check=False)
    back = (await _run([host], make_deploy_step(chooser), "deploy")).results[0]
    assert back.status == "changed" and _service_action(back.value) == "start", back.error


async def test_a_stop_racing_a_restart_leaves_nothing_running(
    nodes: list[Host], lab: Lab, chooser: ArtifactChooser
) -> None:
    """The server is killed, then stopped before, while and after the supervisor restarts it (1 s): the
    stop wins every time, and nothing starts again. 21 rounds, 7 per node."""
    assert (await _run(nodes, make_deploy_step(chooser), "deploy")).ok
    stop, start = (make_service_step(want, OperationOptions()) for want in ("stopped", "running"))

    async def rounds(index: int, host: Host) -> None:
        async with Session() as session:  # one SSH connection per node for all its rounds
            for i in range(7):
                pid, loop = _server_pid(lab, host), _loop_pid(lab, host)
                os.kill(pid, signal.SIGKILL)
                await asyncio.sleep(1.3 * (3 * i + index) / 20)
                stopped = (await session.run([host], stop, name="stop")).results[0]
                assert stopped.status == "changed", stopped.error
                await asyncio.to_thread(wait_gone, loop)
                await asyncio.sleep(1.2)  # past the supervisor's restart (1 s after the kill)
                listening = lab.node_exec(host.name, ["ss", "-Hltn", f"sport = :{host.rpc_port}"]).stdout
                assert listening.strip() == "", f"round {i}: {listening}"
                started = (await session.run([host], start, name="start")).results[0]
                assert started.status == "changed", started.error

    await asyncio.gather(*(rounds(i, h) for i, h in enumerate(nodes)))


async def test_a_corrupted_archive_is_refused_and_the_old_version_keeps_serving(
    nodes: list[Host], lab: Lab, chooser: ArtifactChooser, cpu_artifact: Artifact, tmp_path: Path
) -> None:
    host = nodes[0]
    assert (await _run([host], make_deploy_step(chooser), "deploy")).ok
    pid = _server_pid(lab, host)
    data = bytearray(cpu_artifact.archive.read_bytes())
    data[len(data) // 3] ^= 0x55
    (tmp_path / "bad.tar.gz").write_bytes(bytes(data))
    bad = dataclasses.replace(_variant(cpu_artifact, "bad"), archive=tmp_path / "bad.tar.gz")
    run = await _run([host], make_deploy_step(_Fixed(bad)), "deploy")
    result = run.results[0]
    assert result.status == "failed"
    assert "checksum failed" in str(result.error) and f"{cpu_artifact.id} stays installed" in str(
        result.error
    )
    status = (await _states([host]))[host.name]
    assert (status.state, status.version, status.pid) == ("running", cpu_artifact.id, pid)
    assert (await probe_endpoint(host.endpoint, hello_only=True)).ok
    assert list(_node_file(lab, host, "rpcfleet/tmp").iterdir()) == []


async def test_a_full_disk_fails_cleanly(
    nodes: list[Host], lab: Lab, chooser: ArtifactChooser, cpu_artifact: Artifact
) -> None:
    host = dataclasses.replace(nodes[2], install_dir="~/fulldisk", rpc_port=50053)
    mount_point = f"/home/{lab.user}/fulldisk"
    lab.node_exec(host.name, ["mkdir", "-p", mount_point])
    # Room for one version (archive + files + margin), not for a second one beside it.
    lab.node_exec(host.name, ["mount", "-t", "tmpfs", "-o", "size=6m,mode=1777", "tmpfs", mount_point])
    first = await _run([host], make_deploy_step(chooser), "deploy")
    assert first.ok, [str(r.error) for r in first.failed]
    pid = _server_pid(lab, host, "fulldisk")

    v2 = _variant(cpu_artifact, "v2")
    refused = (await _run([host], make_deploy_step(_Fixed(v2)), "deploy")).results[0]
    assert refused.status == "failed"
    assert "not enough disk space" in str(refused.error) and f"{cpu_artifact.id} stays installed" in str(
        refused.error
    )

    # Past the early check (as if df had lied): the disk really fills during upload or unpack.
    async with Session() as session:
        conn = await session.connection(host)
        state = (await read_node_state(conn, host)).install
        change = plan_install(dataclasses.replace(state, free_bytes=1 << 40), v2)
        with pytest.raises(InstallError, match=f"{cpu_artifact.id} stays installed") as info:
            await apply_install(conn, change)
        assert "space" in str(info.value).lower() or "failure" in str(info.value).lower()
        after = (await read_node_state(conn, host)).install
    assert after.current == cpu_artifact.id and after.versions == (cpu_artifact.id,)
    assert _node_ls(lab, host, "fulldisk/tmp") == []
    status = (await _states([host]))[host.name]
    assert (status.state, status.pid, status.version) == ("running", pid, cpu_artifact.id)


async def test_a_taken_port_is_a_clear_error(nodes: list[Host], chooser: ArtifactChooser) -> None:
    # sshd listens on port 22 of every node: a port taken by a process this user cannot even see.
    host = dataclasses.replace(nodes[0], install_dir="~/taken", rpc_port=22)
    result = (await _run([host], make_deploy_step(chooser), "deploy")).results[0]
    assert result.status == "failed"
    assert f"port 22 is already taken: {host.address}:22" in str(result.error)
    assert (await _states([host]))[host.name].state == "stopped"


async def test_an_unreachable_node_is_reported_while_the_others_deploy(
    nodes: list[Host], lab: Lab, chooser: ArtifactChooser
) -> None:
    lab.firewall_reject(nodes[2].name)
    run = await _run(nodes, make_deploy_step(chooser), "deploy")
    statuses = {r.host.name: r.status for r in run.results}
    assert statuses == {nodes[0].name: "changed", nodes[1].name: "changed", nodes[2].name: "unreachable"}
    assert "refused" in str(run.by_host()[nodes[2].name].error).lower()
    for host in nodes[:2]:
        assert (await probe_endpoint(host.endpoint, hello_only=True)).ok


async def test_rollback_returns_to_the_previous_version(
    nodes: list[Host], chooser: ArtifactChooser, cpu_artifact: Artifact
) -> None:
    assert (await _run(nodes, make_deploy_step(chooser), "deploy")).ok
    v2 = _variant(cpu_artifact, "v2")
    upgrade = await _run(nodes, make_deploy_step(_Fixed(v2)), "deploy")
    assert upgrade.ok and all(_service_action(r.value) == "restart" for r in upgrade.results)
    assert {s.running_version for s in (await _states(nodes)).values()} == {v2.id}
    back = await _run(nodes, make_rollback_step(), "rollback")
    assert [r.status for r in back.results] == ["changed"] * 3
    states = await _states(nodes)
    assert {(s.state, s.version, s.running_version) for s in states.values()} == {
        ("running", cpu_artifact.id, cpu_artifact.id)
    }


async def test_a_timed_out_probe_of_a_held_server_does_not_kill_it(
    nodes: list[Host], lab: Lab, chooser: ArtifactChooser
) -> None:
    host = nodes[0]
    assert (await _run([host], make_deploy_step(chooser), "deploy")).ok
    pid = _server_pid(lab, host)
    holder = socket.create_connection((host.rpc_host, host.rpc_port), timeout=2)
    try:
        await until_value(
            lambda: _states([host]), lambda states: states[host.name].state == "busy", what="busy"
        )
        probe = await probe_endpoint(host.endpoint, connect_timeout=1, read_timeout=0.3, deadline=1)
        assert probe.outcome in (Outcome.BUSY, Outcome.TIMEOUT)
    finally:
        holder.close()
    # The server now answers the dead probe: SIGPIPE, ignored. It takes connections in order: this HELLO
    # is answered only after that (and not at all had SIGPIPE killed it).
    assert (await probe_endpoint(host.endpoint, hello_only=True)).ok
    status = (await _states([host]))[host.name]
    assert (status.state, status.pid) == ("running", pid)
