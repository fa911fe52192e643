"""Tier 2: the systemd supervisor on lab nodes that boot systemd (`lab up --init systemd`), real servers.

One 2-node systemd lab for the module: node 1 is reached as the lab user (a user unit with lingering),
node 2 as root (a system unit running as the dedicated user `rpcfleet`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.artifacts.manifest import Artifact
from orchestrator.artifacts.patches import WARM_WAIT_MARK
from orchestrator.connectors.base import ConnectOptions
from orchestrator.connectors.connect import connect
from orchestrator.core.fnv import cache_name, fnv1a64
from orchestrator.engine.executor import RunResult, Session
from orchestrator.inventory.model import Host
from orchestrator.lab import systemd
from orchestrator.lab.lifecycle import lab_down, lab_repair, lab_status
from orchestrator.lab.state import Lab
from orchestrator.operations.cache import WarmItem, cache_path
from orchestrator.operations.cache_stream import ChildRemote, stream_command, stream_script
from orchestrator.operations.install.ensure import ArtifactChooser
from orchestrator.operations.install.plan import InstallState
from orchestrator.operations.layer import OperationOptions
from orchestrator.operations.server.state import ServerStatus, read_node_state
from orchestrator.operations.server.steps import (
    make_deploy_step,
    make_logs_step,
    make_remove_unit_step,
    make_service_step,
    make_status_step,
)
from orchestrator.operations.systemd import SERVICE_USER_MARK, unit_name
from orchestrator.rpc.client import probe_endpoint
from orchestrator.rpc.records import Outcome
from tests.plugins.lab import connect_from_node, lab_hosts_of, leftovers, own_lab
from tests.waits import wait_until

pytestmark = pytest.mark.lab


class _Fixed(ArtifactChooser):
    def __init__(self, artifact: Artifact) -> None:
        super().__init__()
        self.artifact = artifact

    async def __call__(self, host: Host, state: InstallState) -> Artifact:
        return self.artifact


@pytest.fixture(scope="module")
def sd_lab() -> Iterator[Lab]:
    with own_lab(2, "sd", init="systemd") as made:
        yield made


@pytest.fixture(scope="module")
def sd_hosts(sd_lab: Lab) -> list[Host]:
    user, root = lab_hosts_of(sd_lab)
    return [
        dataclasses.replace(user, supervisor="systemd"),
        dataclasses.replace(root, supervisor="systemd", ssh_user="root"),
    ]


@pytest.fixture
def chooser(cpu_artifact: Artifact) -> ArtifactChooser:
    return _Fixed(cpu_artifact)


@pytest.fixture
def hosts(sd_lab: Lab, sd_hosts: list[Host]) -> Iterator[list[Host]]:
    """The systemd hosts; their units removed (and nothing left) after the test."""
    yield sd_hosts
    removed = _run_sync(sd_hosts, make_remove_unit_step(), "remove_unit")
    assert removed.ok, [str(r.error) for r in removed.failed]


def _run_sync(hosts: list[Host], step: Any, name: str) -> RunResult[Any]:
    return asyncio.run(_run(hosts, step, name))


async def _run(hosts: list[Host], step: Any, name: str) -> RunResult[Any]:
    async with Session(forks=8) as session:
        return await session.run(hosts, step, name=name)


async def _states(hosts: list[Host]) -> dict[str, ServerStatus]:
    run = await _run(hosts, make_status_step(), "status")
    assert run.ok, [str(r.error) for r in run.failed]
    return {r.host.name: r.value for r in run.results if isinstance(r.value, ServerStatus)}


def _unit_files(lab: Lab, host: Host) -> list[str]:
    folder = "/etc/systemd/system" if host.ssh_user == "root" else f"/home/{lab.user}/.config/systemd/user"
    out = lab.node_exec(host.name, ["sh", "-c", f"ls {folder} | grep '^rpcfleet-' || true"]).stdout
    return out.split()


async def _until_hello(host: Host, limit_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        if (await probe_endpoint(host.endpoint, hello_only=True, deadline=1.0)).ok:
            return time.monotonic() - started
        await asyncio.sleep(0.05)
    raise AssertionError(f"{host.name} did not answer HELLO within {limit_s} s")


async def test_deploy_installs_an_enabled_unit_and_a_second_deploy_changes_nothing(
    hosts: list[Host], sd_lab: Lab, chooser: ArtifactChooser
) -> None:
    checked = await _run(hosts, make_deploy_step(chooser, OperationOptions(check=True)), "deploy")
    for result, host in zip(checked.results, hosts, strict=True):  # --check shows the unit, writes nothing
        unit = unit_name(host.install_dir)
        assert f"write {unit}, enable {unit}" in result.message and _unit_files(sd_lab, host) == [], result
    first = await _run(hosts, make_deploy_step(chooser), "deploy")
    assert first.ok, [str(r.error) for r in first.failed]
    for host in hosts:
        state = await _read(host)
        assert state.supervisor == "systemd" and state.unit is not None
        assert state.unit.installed and state.unit.enabled and state.unit.active == "active"
        assert state.unit.user == (host.ssh_user != "root")
        assert _unit_files(sd_lab, host) == [unit_name(host.install_dir)]
        assert (await probe_endpoint(host.endpoint, hello_only=True)).ok
    # the system unit runs as the dedicated user, the user unit as the login user
    users = {h.name: _main_user(sd_lab, h) for h in hosts}
    assert users == {hosts[0].name: sd_lab.user, hosts[1].name: "rpcfleet"}
    pids = {s.host: s.pid for s in (await _states(hosts)).values()}
    second = await _run(hosts, make_deploy_step(chooser), "deploy")
    assert [r.status for r in second.results] == ["ok", "ok"], [r.message for r in second.results]
    assert {s.host: s.pid for s in (await _states(hosts)).values()} == pids
    # restart and stop through the same operations as the process supervisor
    restarted = await _run(hosts, make_service_step("restarted", OperationOptions()), "restart")
    assert restarted.ok, [str(r.error) for r in restarted.failed]
    after = await _states(hosts)
    assert all(after[n].pid not in (None, pids[n]) and after[n].state == "running" for n in pids)
    stopped = await _run(hosts, make_service_step("stopped", OperationOptions()), "stop")
    assert stopped.ok and {s.state for s in (await _states(hosts)).values()} == {"stopped"}
    for host in hosts:
        assert (await probe_endpoint(host.endpoint, hello_only=True, deadline=2)).outcome is Outcome.REFUSED


async def _read(host: Host) -> Any:
    async with Session(forks=1) as session:
        conn = await session.connection(host)
        return await read_node_state(conn, host)


def _main_user(lab: Lab, host: Host) -> str:
    scope = "" if host.ssh_user == "root" else f"--user -M {lab.user}@ "
    unit = unit_name(host.install_dir)
    out = lab.node_exec(host.name, ["sh", "-c", f"systemctl {scope}show -p MainPID --value {unit}"]).stdout
    return lab.node_exec(host.name, ["ps", "-o", "user=", "-p", out.strip()]).stdout.strip()


async def test_kill_9_comes_back_counted_and_a_reboot_starts_it_again(
    hosts: list[Host], sd_lab: Lab, chooser: ArtifactChooser
) -> None:
    assert (await _run(hosts, make_deploy_step(chooser), "deploy")).ok
    before = await _states(hosts)
    for host in hosts:
        sd_lab.node_exec(host.name, ["kill", "-9", str(_main_pid(sd_lab, host))])
    for host in hosts:
        assert await _until_hello(host, 5.0) < 5.0
    after = await _states(hosts)
    for host in hosts:
        assert after[host.name].state == "running" and after[host.name].restarts == 1
        assert after[host.name].last_exit == "code=killed, status=9/KILL", after[host.name]
        assert after[host.name].pid != before[host.name].pid
    sd_lab.reboot(hosts[1].name)  # no rpcfleet command afterwards: the enabled unit starts at boot
    await _until_hello(hosts[1], 10.0)
    logs = await _run([hosts[1]], make_logs_step(200), "logs")
    assert logs.ok and "Started rpcfleet-" in str(logs.results[0].value)
    for _ in range(30):  # 60 connection lines in the journal: left out before the last lines are taken
        assert (await probe_endpoint(hosts[1].endpoint, hello_only=True)).ok
    logs = await _run([hosts[1]], make_logs_step(20), "logs")
    text = str(logs.results[0].value)
    assert logs.ok and "Started rpcfleet-" in text and "client connection" not in text.lower(), text
    noisy = await _run([hosts[1]], make_logs_step(20, noise=True), "logs")
    assert str(noisy.results[0].value).lower().count("client connection") == 20


async def test_after_a_reboot_the_port_is_closed_to_others_before_any_rpcfleet_command(
    hosts: list[Host], sd_lab: Lab, chooser: ArtifactChooser
) -> None:
    """A reboot forgets every iptables rule; the enabled unit starts the server at boot, and its
    ExecStartPre puts rpc_allow_from's rules back before the server listens."""
    host = dataclasses.replace(hosts[1], rpc_allow_from=("controller",))
    other = sd_lab.nodes[0]
    try:
        deployed = await _run([host], make_deploy_step(chooser), "deploy")
        assert deployed.ok, [str(r.error) for r in deployed.failed]
        assert connect_from_node(sd_lab, other, host.address, host.rpc_port) == "refused"
        sd_lab.reboot(host.name)  # no rpcfleet command afterwards
        await _until_hello(host, 10.0)  # the controller is let in
        assert connect_from_node(sd_lab, other, host.address, host.rpc_port) == "refused"
        assert (await _states([host]))[host.name].firewall == "ok"
        sd_lab.node_exec(host.name, ["iptables", "-w", "-F", "INPUT"])
        assert (await _states([host]))[host.name].firewall == "missing"
    finally:
        sd_lab.node_exec(host.name, ["iptables", "-w", "-F", "INPUT"])


def _main_pid(lab: Lab, host: Host) -> int:
    scope = "" if host.ssh_user == "root" else f"--user -M {lab.user}@ "
    unit = unit_name(host.install_dir)
    out = lab.node_exec(host.name, ["sh", "-c", f"systemctl {scope}show -p MainPID --value {unit}"]).stdout
    return int(out.strip())


async def test_a_taken_port_fails_with_the_reason_and_no_restart_loop(
    hosts: list[Host], sd_lab: Lab, chooser: ArtifactChooser
) -> None:
    host = dataclasses.replace(hosts[1], rpc_port=22)  # sshd holds port 22 of the node
    result = (await _run([host], make_deploy_step(chooser), "deploy")).results[0]
    assert result.status == "failed" and "port 22 is already taken" in str(result.error)
    # Taken after the unit was installed (the check before the start cannot see it): the server's bind fails
    assert (await _run([hosts[1]], make_deploy_step(chooser), "deploy")).ok
    await _run([hosts[1]], make_service_step("stopped", OperationOptions()), "stop")
    blocker = sd_lab.node_exec(
        hosts[1].name,
        ["systemd-run", "--unit=blocker", "python3", "-c",
         f"import socket,time; s=socket.socket(); s.bind(('{hosts[1].address}', 50052)); "
         "s.listen(); time.sleep(60)"],
    )  # fmt: skip
    assert blocker.returncode == 0
    try:
        unit = unit_name(hosts[1].install_dir)
        listening = ["ss", "-Hltn", "sport = :50052"]
        wait_until(
            lambda: sd_lab.node_exec(hosts[1].name, listening).stdout.strip(), what="the blocker's bind"
        )
        sd_lab.node_exec(hosts[1].name, ["systemctl", "start", unit])
        await asyncio.sleep(2.5)  # more than RestartSec: a restart loop would show
        status = (await _states([hosts[1]]))[hosts[1].name]
        assert status.state == "crashed" and "could not bind its port" in status.message, status
        assert status.restarts == 0
    finally:
        sd_lab.node_exec(hosts[1].name, ["systemctl", "stop", "blocker"], check=False)


async def test_teardown_leaves_no_unit_user_or_file(
    sd_lab: Lab, sd_hosts: list[Host], chooser: ArtifactChooser
) -> None:

    assert (await _run(sd_hosts, make_deploy_step(chooser), "deploy")).ok
    removed = await _run(sd_hosts, make_remove_unit_step(), "remove_unit")
    assert [r.status for r in removed.results] == ["changed", "changed"]
    for host in sd_hosts:
        assert _unit_files(sd_lab, host) == []
        wants = sd_lab.node_exec(
            host.name,
            ["sh", "-c", "ls /etc/systemd/system/*.wants /home/*/.config/systemd/user/*.wants; true"],
        ).stdout
        assert "rpcfleet-" not in wants
    assert sd_lab.node_exec(sd_hosts[1].name, ["id", "rpcfleet"], check=False).returncode != 0
    again = await _run(sd_hosts, make_remove_unit_step(), "remove_unit")
    assert [r.status for r in again.results] == ["ok", "ok"]


def _comment_of_user(lab: Lab, host: Host) -> str | None:
    found = lab.node_exec(host.name, ["getent", "passwd", "rpcfleet"], check=False)
    return found.stdout.strip().split(":")[4] if found.returncode == 0 else None


async def test_teardown_removes_only_the_user_rpcfleet_created(
    sd_lab: Lab, sd_hosts: list[Host], chooser: ArtifactChooser
) -> None:
    root = sd_hosts[1]
    # An account of that name made by someone else: used, and left alone by the teardown.
    sd_lab.node_exec(root.name, ["useradd", "--system", "--no-create-home", "--comment", "ops", "rpcfleet"])
    try:
        assert (await _run([root], make_deploy_step(chooser), "deploy")).ok
        removed = await _run([root], make_remove_unit_step(), "remove_unit")
        assert removed.results[0].status == "changed", removed.results[0].error
        assert "user" not in removed.results[0].message and _unit_files(sd_lab, root) == []
        assert _comment_of_user(sd_lab, root) == "ops"
    finally:
        sd_lab.node_exec(root.name, ["userdel", "rpcfleet"], check=False)
    # The account rpcfleet creates carries its mark, and goes with the last unit.
    assert (await _run([root], make_deploy_step(chooser), "deploy")).ok
    assert _comment_of_user(sd_lab, root) == SERVICE_USER_MARK
    removed = await _run([root], make_remove_unit_step(), "remove_unit")
    assert "and user rpcfleet" in removed.results[0].message
    assert _comment_of_user(sd_lab, root) is None


async def test_a_failed_disable_keeps_the_unit_file(
    sd_lab: Lab, sd_hosts: list[Host], chooser: ArtifactChooser
) -> None:
    """`systemctl disable --now` fails (the wants folder is read-only: systemd cannot unlink the unit's
    link there): the teardown fails with that reason and the unit file stays, still enabled."""
    root = sd_hosts[1]
    unit = unit_name(root.install_dir)
    wants = "/etc/systemd/system/multi-user.target.wants"
    assert (await _run([root], make_deploy_step(chooser), "deploy")).ok
    sd_lab.node_exec(root.name, ["mount", "--bind", "-o", "bind,ro", wants, wants])
    try:
        removed = await _run([root], make_remove_unit_step(), "remove_unit")
        (result,) = removed.results
        assert result.status == "failed" and result.error is not None
        assert f"could not remove {unit}: systemctl disable --now failed" in result.error.message
        assert "Read-only file system" in str(result.error), str(result.error)
        assert _unit_files(sd_lab, root) == [unit]
        enabled = sd_lab.node_exec(root.name, ["systemctl", "is-enabled", unit], check=False)
        assert enabled.stdout.strip() == "enabled"
    finally:
        sd_lab.node_exec(root.name, ["umount", wants])
    removed = await _run([root], make_remove_unit_step(), "remove_unit")
    assert removed.results[0].status == "changed" and _unit_files(sd_lab, root) == []


async def test_auto_picks_systemd_on_systemd_nodes_and_process_on_plain_ones(
    sd_hosts: list[Host], lab_hosts: list[Host]
) -> None:
    for host in [sd_hosts[0], sd_hosts[1]]:
        assert (await _read(dataclasses.replace(host, supervisor="auto"))).supervisor == "systemd"
    plain = dataclasses.replace(lab_hosts[0], supervisor="auto")
    assert (await _read(plain)).supervisor == "process"
    from orchestrator.core.errors import ServiceError

    with pytest.raises(ServiceError, match=r"PID 1 is .*, not systemd"):
        await _read(dataclasses.replace(lab_hosts[0], supervisor="systemd"))


async def test_a_busy_server_is_not_stopped_by_systemctl_without_force(
    hosts: list[Host], sd_lab: Lab, chooser: ArtifactChooser
) -> None:
    host = hosts[1]  # a system unit
    assert (await _run([host], make_deploy_step(chooser), "deploy")).ok
    pid = _main_pid(sd_lab, host)
    holder = socket.create_connection((host.address, host.rpc_port), timeout=2)  # a model's connection
    try:
        refused = (await _run([host], make_service_step("stopped", OperationOptions()), "stop")).results[0]
        assert refused.status == "failed" and "refusing to stop a busy server" in str(refused.error)
        assert _main_pid(sd_lab, host) == pid and _unit_active(sd_lab, host) == "active"
        forced = await _run([host], make_service_step("stopped", OperationOptions(force=True)), "stop")
        assert forced.ok, [str(r.error) for r in forced.failed]
    finally:
        holder.close()
    # stopped by systemctl, so systemd does not start it again (Restart=on-failure)
    await asyncio.sleep(1.5)  # the property itself: longer than RestartSec (1 s), a restart would show
    assert _unit_active(sd_lab, host) == "inactive"
    assert (await _states([host]))[host.name].state == "stopped"


def _unit_active(lab: Lab, host: Host) -> str:
    scope = "" if host.ssh_user == "root" else f"--user -M {lab.user}@ "
    unit = unit_name(host.install_dir)
    return lab.node_exec(
        host.name, ["sh", "-c", f"systemctl {scope}is-active {unit}"], check=False
    ).stdout.strip()


def _pid_file(lab: Lab, host: Host) -> str:
    path = f"/home/{lab.user}/{host.install_dir.removeprefix('~/')}/run/rpc-server.pid"
    return lab.node_exec(host.name, ["sh", "-c", f"cat {path} 2>/dev/null || true"]).stdout.strip()


async def test_switching_a_running_server_from_process_to_systemd_and_back(
    hosts: list[Host], sd_lab: Lab, chooser: ArtifactChooser
) -> None:
    systemd_host = hosts[0]  # a user unit with lingering
    process_host = dataclasses.replace(systemd_host, supervisor="process")
    assert (await _run([process_host], make_deploy_step(chooser), "deploy")).ok
    process_pid = int(_pid_file(sd_lab, systemd_host))
    status = (await _states([systemd_host]))[systemd_host.name]
    assert status.state == "orphan" and "run by the process supervisor" in status.message, status
    # The inventory now says systemd: the process server is stopped through the layer, the unit installed.
    moved = (await _run([systemd_host], make_deploy_step(chooser), "deploy")).results[0]
    assert moved.status == "changed", moved.message
    gone = sd_lab.node_exec(systemd_host.name, ["kill", "-0", str(process_pid)], check=False)
    assert gone.returncode != 0  # the process supervisor's server was stopped
    assert _pid_file(sd_lab, systemd_host) == ""
    assert _unit_active(sd_lab, systemd_host) == "active" and _main_pid(sd_lab, systemd_host) != process_pid
    after = (await _states([systemd_host]))[systemd_host.name]
    assert (after.state, after.supervisor, after.pid) == (
        "running",
        "systemd",
        _main_pid(sd_lab, systemd_host),
    )
    # And back: the unit is stopped and disabled (no start at the next boot), the process server runs.
    back = (await _run([process_host], make_deploy_step(chooser), "deploy")).results[0]
    assert back.status == "changed", back.message
    assert _unit_active(sd_lab, systemd_host) == "inactive"
    scope = f"--user -M {sd_lab.user}@ "
    enabled = sd_lab.node_exec(
        systemd_host.name,
        ["sh", "-c", f"systemctl {scope}is-enabled {unit_name(systemd_host.install_dir)}"],
        check=False,
    ).stdout.strip()
    assert enabled == "disabled"
    final = (await _states([process_host]))[process_host.name]
    assert (final.state, final.supervisor) == ("running", "process") and str(final.pid) == _pid_file(
        sd_lab, systemd_host
    )


async def test_a_changed_launch_line_rewrites_the_unit_shown_first_in_check_mode(
    hosts: list[Host], sd_lab: Lab, chooser: ArtifactChooser
) -> None:
    host = hosts[1]
    assert (await _run([host], make_deploy_step(chooser), "deploy")).ok
    pid, unit = _main_pid(sd_lab, host), f"/etc/systemd/system/{unit_name(host.install_dir)}"
    text = sd_lab.node_exec(host.name, ["cat", unit]).stdout
    threads = dataclasses.replace(host, rpc_threads=2)
    checked = (
        await _run([threads], make_deploy_step(chooser, OperationOptions(check=True)), "deploy")
    ).results[0]
    assert (
        "would restart" in checked.message
        and f"unit {unit_name(host.install_dir)} differs" in checked.message
    )
    assert sd_lab.node_exec(host.name, ["cat", unit]).stdout == text and _main_pid(sd_lab, host) == pid
    changed = (await _run([threads], make_deploy_step(chooser), "deploy")).results[0]
    assert changed.status == "changed", changed.message
    assert " -t 2" in sd_lab.node_exec(host.name, ["cat", unit]).stdout and _main_pid(sd_lab, host) != pid
    again = (await _run([threads], make_deploy_step(chooser), "deploy")).results[0]
    assert again.status == "ok", again.message


def _systemd_leftovers(lab: Lab) -> list[str]:
    """What a systemd lab could leave, found without the lab module: its namespaces, links, users and
    processes (tests.plugins.lab), mounts below its dir, cgroups and nspawn dirs named after its slot,
    processes in such a cgroup, and the dedicated user on this machine."""
    found = leftovers(lab)
    found += [f"mount {line.split()[4]}" for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if line.split()[4].startswith(f"{lab.dir}/")]  # fmt: skip
    prefix = f"rfl{lab.slot}-"
    found += [f"cgroup {p}" for p in Path("/sys/fs/cgroup").rglob(f"{prefix}*") if p.is_dir()]
    found += [f"nspawn {p}" for p in Path("/run/systemd/nspawn").rglob(f"{prefix}*")]
    for entry in Path("/proc").iterdir():
        try:  # a zombie is its parent's to reap (this machine's PID 1 may never): not counted
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
            if stat and stat.rsplit(")", 1)[1].split()[0] != "Z" and prefix in (entry / "cgroup").read_text():
                found.append(f"process {entry.name} in a {prefix} cgroup: {stat[:80]}")
        except OSError:
            continue
    return found


async def test_repair_starts_a_stopped_sshd_and_boots_a_node_that_lost_power(sd_lab: Lab) -> None:
    user_host = lab_hosts_of(sd_lab)[1]
    first = sd_lab.nodes[0]
    kept = (first.sshd_pid(), systemd.leader(first))
    sd_lab.kill_sshd(2)  # ssh.service stopped: systemd would restart a killed one by itself
    results = lab_repair(sd_lab.name)
    assert (results[0].fault, results[1].fault) == (None, "sshd dead")
    assert results[1].ok and (results[1].action or "").startswith("sshd started (pid ")
    assert sd_lab.nodes[1].sshd_pid() is not None

    old_leader = systemd.leader(sd_lab.nodes[1])
    sd_lab.kill_node(2)
    assert sd_lab.node_pids(2) == [] and not lab_status(sd_lab.name, probe_timeout=0.3).healthy
    results = lab_repair(sd_lab.name)
    assert [(r.fault, r.action, r.error) for r in results] == [
        (None, None, None),
        ("down", "node booted", None),
    ]
    assert systemd.leader(sd_lab.nodes[1]) not in (None, old_leader)
    async with await connect(user_host, ConnectOptions(connect_timeout=2.0)) as conn:
        result = await conn.run("hostname; systemctl is-system-running", timeout=20)
    assert result.stdout.split()[0] == sd_lab.nodes[1].name
    assert result.stdout.split()[1] in ("running", "degraded")
    assert (first.sshd_pid(), systemd.leader(first)) == kept  # the healthy node was not touched
    assert lab_status(sd_lab.name).healthy


# ---------------------------------------------------------------- a warm beside a load, under the unit

CMD_ALLOC_BUFFER, CMD_BUFFER_GET_BASE, CMD_SET_TENSOR_HASH = 0, 3, 7


def _tensor(buffer: int, data: int, size: int) -> bytes:
    """ggml-rpc's `rpc_tensor` (packed, 296 bytes): an F32 vector of `size` bytes at `data` in `buffer`."""
    n = size // 4
    return struct.pack(
        "<QIQ4I4II16ii10QQQQ64si",
        1, 0, buffer, n, 1, 1, 1, 4, size, size, size, 0, *([0] * 16), 0, *([0] * 10), 0, 0, data, b"", 0,
    )  # fmt: skip


async def _ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, cmd: int, payload: bytes) -> None:
    writer.write(struct.pack("<BQ", cmd, len(payload)) + payload)
    await writer.drain()


async def _reply(reader: asyncio.StreamReader, size: int, limit_s: float) -> bytes:
    header = await asyncio.wait_for(reader.readexactly(8), limit_s)
    assert struct.unpack("<Q", header)[0] == size
    return await asyncio.wait_for(reader.readexactly(size), limit_s)


async def test_the_servers_unit_waits_for_a_warm_of_its_cache_as_root(
    hosts: list[Host], sd_lab: Lab, chooser: ArtifactChooser, tmp_path: Path
) -> None:
    """The system unit (ProtectProc=invisible, User=rpcfleet) and a warm made as root: the warm writes
    its mark and files as the server's user, so the server sees the warm's process and waits for the
    file it is asked for (the `warm-wait` patch), then reads it as a hit. A warm of root's would be
    invisible to it: a miss at once, and the tensor sent over the link."""
    host = dataclasses.replace(hosts[1], rpc_cache=True)
    deployed = await _run([host], make_deploy_step(chooser), "deploy")
    assert deployed.ok, [str(r.error) for r in deployed.failed]
    assert _main_user(sd_lab, host) == "rpcfleet"
    data = os.urandom(1 << 20)
    (tmp_path / "tensor.bin").write_bytes(data)
    item = WarmItem(cache_name(fnv1a64(data)), tmp_path / "tensor.bin", 0, len(data))
    assert item.name is not None
    async with Session(forks=1) as session:
        conn = await session.connection(host)
        command = stream_command(host, conn, stream_script(cache_path(host), [item]))
        assert command is not None
        warm = await ChildRemote.start(command)
        try:
            assert await asyncio.wait_for(warm.readline(), 30) == "ready"
            mark = f"{cache_path(host)}/{WARM_WAIT_MARK}"
            seen = await conn.run(f'stat -c %U {mark} && grep ^Uid: "/proc/$(cat {mark})/status"', timeout=30)
            assert seen.stdout.split()[:3] == ["rpcfleet", "Uid:", _uid(sd_lab, host, "rpcfleet")], seen

            address, port = host.endpoint.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(address, int(port))
            try:
                await _ask(reader, writer, 14, bytes(24))  # HELLO, all-zero caps: plain TCP
                assert (await _reply(reader, 28, 10))[:3] == bytes([7, 0, 0])
                await _ask(reader, writer, CMD_ALLOC_BUFFER, struct.pack("<IQ", 0, len(data)))
                buffer, _size = struct.unpack("<QQ", await _reply(reader, 16, 10))
                await _ask(reader, writer, CMD_BUFFER_GET_BASE, struct.pack("<Q", buffer))
                (base,) = struct.unpack("<Q", await _reply(reader, 8, 10))
                request = _tensor(buffer, base, len(data)) + struct.pack("<QQ", 0, int(item.name, 16))
                await _ask(reader, writer, CMD_SET_TENSOR_HASH, request)
                with pytest.raises(TimeoutError):  # the server waits: the warm it sees is alive
                    await _reply(reader, 1, 3.0)
                stdin = warm.input()
                assert stdin is not None
                stdin.write(data + f"{item.name}\n".encode())
                await stdin.drain()
                assert await asyncio.wait_for(warm.readline(), 30) == f"ok {item.name}"
                assert await _reply(reader, 1, 30) == b"\x01"  # the file that landed, read as a hit
            finally:
                writer.close()
            stdin.close()
            status, stderr = await asyncio.wait_for(warm.finish(), 30)
            assert status == 0, stderr
        finally:
            await warm.stop()
        owners = await conn.run(f"cd {cache_path(host)} && stat -c '%U %n' * && ls -A", timeout=30)
    assert owners.stdout.split() == ["rpcfleet", item.name, item.name], owners  # no mark left


def _uid(lab: Lab, host: Host, user: str) -> str:
    return lab.node_exec(host.name, ["id", "-u", user]).stdout.strip()


def test_zz_lab_down_of_a_systemd_lab_leaves_nothing(sd_lab: Lab) -> None:
    """Last in the module: it takes the module's lab down (the fixture's own down then finds nothing)."""
    assert _systemd_leftovers(sd_lab)  # the check sees the lab while it is up
    had_user = subprocess.run(["getent", "passwd", "rpcfleet"], capture_output=True).returncode == 0
    assert lab_down(sd_lab.name) is True
    assert _systemd_leftovers(sd_lab) == []
    if not had_user:
        assert subprocess.run(["getent", "passwd", "rpcfleet"], capture_output=True).returncode != 0
    assert lab_down(sd_lab.name) is False
