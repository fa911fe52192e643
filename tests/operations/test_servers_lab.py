"""Tier 2: several rpc-servers on one host (`rpc_servers`), with real sshd, real servers and a real load.

One 2-node lab for the module: node 1 runs two servers (ports 50052 and 50053, the second named `b`),
node 2 one. Every stage treats each server as its own endpoint: deploy (one install, two supervised
servers with their own pid files and logs), status, probe, run across three endpoints of two machines,
restart and stop of one server that leave the other running, and the install lock shared by both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.artifacts.manifest import Artifact
from orchestrator.connectors.base import ConnectOptions
from orchestrator.connectors.connect import connect
from orchestrator.engine.executor import RunResult, Session
from orchestrator.inventory.load import load_inventory
from orchestrator.inventory.model import Host, server_hosts
from orchestrator.lab import cgroups
from orchestrator.lab.lifecycle import lab_down, lab_up
from orchestrator.lab.state import Lab
from orchestrator.operations.install.ensure import ArtifactChooser
from orchestrator.operations.install.plan import InstallState
from orchestrator.operations.lock import acquire
from orchestrator.operations.server.steps import make_deploy_step, make_rollback_step
from orchestrator.operations.systemd import unit_name
from tests.plugins.lab import leftovers, require_lab_privileges, session_lab_name

pytestmark = pytest.mark.lab

SERVERS = "[50052, {port: 50053, name: b}]"


def cli(lab: Lab, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args, "-i", str(lab.inventory)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200"},
    )


def cli_json(lab: Lab, *args: str) -> Any:
    done = cli(lab, *args, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def states(lab: Lab) -> dict[str, dict[str, Any]]:
    return {row["host"]: row["result"] for row in cli_json(lab, "status")}


@pytest.fixture(scope="module")
def two_server_lab() -> Iterator[Lab]:
    require_lab_privileges()
    name = session_lab_name("srv")
    made = lab_up(2, name=name, owner_pid=os.getpid(), node_variables={"1": {"rpc_servers": SERVERS}})
    try:
        yield made
    finally:
        lab_down(name)
        assert leftovers(made) == []


@pytest.fixture(scope="module")
def deployed(two_server_lab: Lab) -> Lab:
    lab = two_server_lab
    done = cli(lab, "deploy")
    assert done.returncode == 0, done.stdout + done.stderr
    return lab


def test_the_lab_declares_two_servers_on_node_one(two_server_lab: Lab) -> None:
    listed = cli_json(two_server_lab, "inventory", "list")
    one, two = (f"{node.name}" for node in two_server_lab.nodes)
    by_name = {host["name"]: host for host in listed}
    address = two_server_lab.nodes[0].address
    assert by_name[one]["endpoints"] == [f"{address}:50052", f"{address}:50053"]
    assert [s["name"] for s in by_name[one]["rpc_servers"]] == ["50052", "b"]
    assert by_name[two]["endpoints"] == [f"{two_server_lab.nodes[1].address}:50052"]
    graph = cli(two_server_lab, "inventory", "graph")
    assert f"|  |  |--{address}:50053 ({one}/b)" in graph.stdout, graph.stdout


def test_deploy_installs_once_and_supervises_each_server(deployed: Lab) -> None:
    one, two = (node.name for node in deployed.nodes)
    status = states(deployed)
    assert set(status) == {f"{one}/50052", f"{one}/b", two}
    assert all(s["state"] == "running" and s["supervisor"] == "process" for s in status.values())
    assert status[f"{one}/50052"]["endpoint"].endswith(":50052")
    assert status[f"{one}/b"]["endpoint"].endswith(":50053")
    assert status[f"{one}/50052"]["pid"] != status[f"{one}/b"]["pid"]
    install = deployed.nodes[0].home / "rpcfleet"
    assert len(list((install / "versions").iterdir())) == 1  # one install for both
    pids = {p.name: p.read_text().strip() for p in (install / "run").glob("rpc-server-*.pid")}
    assert pids == {
        "rpc-server-50052.pid": str(status[f"{one}/50052"]["pid"]),
        "rpc-server-b.pid": str(status[f"{one}/b"]["pid"]),
    }
    assert sorted(p.name for p in (install / "log").iterdir()) == ["rpc-server-50052.log", "rpc-server-b.log"]
    # A second deploy changes nothing on any server.
    again = cli_json(deployed, "deploy")
    assert [row["status"] for row in again] == ["ok", "ok", "ok"], again


def test_probe_sees_each_endpoint_with_its_own_device(deployed: Lab) -> None:
    one = deployed.nodes[0]
    probed = cli_json(deployed, "probe")
    nodes = {row["host"]: row for row in probed["nodes"]}
    assert nodes[f"{one.name}/50052"]["endpoint"] == f"{one.address}:50052"
    assert nodes[f"{one.name}/b"]["endpoint"] == f"{one.address}:50053"
    for name in (f"{one.name}/50052", f"{one.name}/b"):
        assert nodes[name]["ok"], nodes[name]
        assert len(nodes[name]["devices"]) == 1
    # Three CPU servers on two machines sharing one boot id: each gets its share, not all of the RAM.
    first = nodes[f"{one.name}/50052"]["devices"][0]
    assert first["free"] < first["total"] / 2


def test_run_loads_a_model_across_both_servers_of_a_host_and_another_node(
    deployed: Lab, gemma_model: Path
) -> None:
    one, two = deployed.nodes
    result = cli_json(
        deployed, "run", "-m", str(gemma_model), "-p", "The capital of France is the city of", "-n", "6"
    )
    devices = result["placement"]["devices"]
    endpoints = [device["endpoint"] for device in devices if device.get("endpoint")]
    assert endpoints == [f"{one.address}:50052", f"{one.address}:50053", f"{two.address}:50052"]
    assert all(device["actual_layers"] for device in devices if device.get("endpoint"))
    assert "Paris" in result["text"]


def test_restart_of_one_server_leaves_the_other_running(deployed: Lab) -> None:
    one = deployed.nodes[0].name
    before = states(deployed)
    done = cli(deployed, "restart", "-l", f"{one}/b")
    assert done.returncode == 0, done.stdout + done.stderr
    after = states(deployed)
    assert after[f"{one}/b"]["state"] == "running"
    assert after[f"{one}/b"]["pid"] != before[f"{one}/b"]["pid"]
    assert after[f"{one}/50052"]["pid"] == before[f"{one}/50052"]["pid"]  # untouched
    # Stop one, the other answers; start brings it back.
    assert cli(deployed, "stop", "-l", f"{one}/50052").returncode == 0
    after = states(deployed)
    assert after[f"{one}/50052"]["state"] == "stopped"
    assert (
        after[f"{one}/b"]["state"] == "running"
        and after[f"{one}/b"]["pid"] == states(deployed)[f"{one}/b"]["pid"]
    )
    assert cli(deployed, "start", "-l", one).returncode == 0
    assert {s["state"] for s in states(deployed).values()} == {"running"}


def test_two_operators_on_two_servers_of_one_host_share_its_install_lock(deployed: Lab) -> None:
    """The servers of one host share their install and so its lock: two restarts started at once on its
    two servers never run together (one waits with --wait-lock), and both end with their server
    restarted. Without --wait-lock the second is refused with exit status 3, having changed nothing."""
    one = deployed.nodes[0].name
    for _ in range(3):
        before = states(deployed)
        results: dict[str, subprocess.CompletedProcess[str]] = {}

        def restart(server: str, results: dict[str, subprocess.CompletedProcess[str]] = results) -> None:
            results[server] = cli(deployed, "restart", "-l", f"{one}/{server}", "--wait-lock", "60")

        threads = [threading.Thread(target=restart, args=(s,)) for s in ("50052", "b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert all(r.returncode == 0 for r in results.values()), {k: r.stderr for k, r in results.items()}
        after = states(deployed)
        for server in ("50052", "b"):
            assert after[f"{one}/{server}"]["pid"] != before[f"{one}/{server}"]["pid"]
            assert after[f"{one}/{server}"]["state"] == "running"


def test_a_lock_held_for_one_server_refuses_a_change_of_the_other(deployed: Lab) -> None:
    """One lock per install: held for server 50052 (another operator's change), a stop of server b is
    refused with exit status 3 naming the holder, and changes nothing; free again, the stop goes on."""
    one = deployed.nodes[0].name
    hosts = {host.name: host for host in server_hosts(load_inventory(deployed.inventory).hosts)}
    holds = threading.Event()
    release = threading.Event()

    async def hold() -> None:
        host = hosts[f"{one}/50052"]
        async with await connect(host, ConnectOptions(connect_timeout=5.0, command_timeout=10.0)) as conn:
            lock = await acquire(conn, host, "deploy")
            holds.set()
            await asyncio.get_running_loop().run_in_executor(None, release.wait, 60)
            await lock.release()

    holder = threading.Thread(target=asyncio.run, args=(hold(),))
    holder.start()
    try:
        assert holds.wait(30)
        refused = cli(deployed, "stop", "-l", f"{one}/b")
        assert refused.returncode == 3, refused.stdout + refused.stderr
        assert "is being changed by" in refused.stderr and "deploy" in refused.stderr
        assert states(deployed)[f"{one}/b"]["state"] == "running"  # nothing changed
    finally:
        release.set()
        holder.join()
    assert cli(deployed, "stop", "-l", f"{one}/b").returncode == 0
    assert states(deployed)[f"{one}/b"]["state"] == "stopped"
    assert cli(deployed, "start").returncode == 0


class _Fixed(ArtifactChooser):
    def __init__(self, artifact: Artifact) -> None:
        super().__init__()
        self.artifact = artifact

    async def __call__(self, host: Host, state: InstallState) -> Artifact:
        return self.artifact


async def _run(hosts: list[Host], step: Any) -> RunResult[Any]:
    async with Session(forks=8) as session:
        return await session.run(hosts, step, name="step")


async def test_an_upgrade_and_a_rollback_switch_the_install_once_for_both_servers(
    deployed: Lab, cpu_artifact: Artifact
) -> None:
    """The run's first server of an install switches it; the other restarts on what is current. A
    rollback per server would switch back twice: with two versions, back to the new one."""
    one = deployed.nodes[0].name
    servers = [s for s in server_hosts(load_inventory(deployed.inventory).hosts) if s.node_name == one]
    v2 = dataclasses.replace(cpu_artifact, id=f"{cpu_artifact.id}-v2")
    up = await _run(servers, make_deploy_step(_Fixed(v2)))
    assert up.ok, [str(r.error) for r in up.failed]
    assert [r.value.install.action for r in up.results] == ["install", "none"]
    assert {r.value.service.action for r in up.results} == {"restart"}
    back = await _run(servers, make_rollback_step())
    assert back.ok, [str(r.error) for r in back.failed]
    assert [r.value.install.action for r in back.results] == ["switch", "none"]
    status = states(deployed)
    for server in servers:
        assert status[server.name]["version"] == status[server.name]["running_version"] == cpu_artifact.id
    # --reinstall: uploaded and unpacked once, for the first server of the run
    again = await _run(servers, make_deploy_step(_Fixed(cpu_artifact), reinstall=True))
    assert again.ok and [r.value.install.action for r in again.results][1] == "none"
    assert again.results[0].value.install.action != "none"


async def test_a_busy_server_refuses_a_new_version_for_its_whole_install(
    deployed: Lab, cpu_artifact: Artifact, hold_server: Callable[[str], socket.socket]
) -> None:
    """Both servers of a host run from one install: a client on server b refuses the switch that a
    deploy of server 50052 alone would make (b would have to restart on it), before anything changes."""
    one = deployed.nodes[0].name
    servers = {s.name: s for s in server_hosts(load_inventory(deployed.inventory).hosts)}
    before = states(deployed)
    sock = hold_server(servers[f"{one}/b"].endpoint)
    try:
        v3 = dataclasses.replace(cpu_artifact, id=f"{cpu_artifact.id}-v3")
        refused = await _run([servers[f"{one}/50052"]], make_deploy_step(_Fixed(v3)))
        (result,) = refused.results
        assert result.status == "failed" and "busy" in str(result.error), result
        assert result.error is not None and result.error.host == f"{one}/b"
        after = states(deployed)
        assert {after[n]["version"] for n in (f"{one}/50052", f"{one}/b")} == {cpu_artifact.id}
        assert after[f"{one}/50052"]["pid"] == before[f"{one}/50052"]["pid"]
    finally:
        sock.close()


def test_a_playbooks_cache_warm_warms_both_servers_of_a_host(
    deployed: Lab, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """The two servers of node 1 share its install, its cache and its lock: a playbook's `cache_warm`
    (every host at once) warms both, one after the other. It failed the second with "is being changed
    by" this very run (each server took the install's lock on its own)."""
    one = deployed.nodes[0]
    inventory = tmp_path / "inventory.yml"  # the lab's, with rpc_cache (the step warms those hosts)
    inventory.write_text(deployed.inventory.read_text().replace("vars:\n", "vars:\n  rpc_cache: true\n", 1))
    # three layers of three tensors over the cache's 10 MiB, one layer per endpoint
    model = tiny_model_factory(n_layer=3, n_embd=1024, n_head=8, n_head_kv=4, n_ff=5632)
    playbook = tmp_path / "warm.yml"
    playbook.write_text(
        "name: warm\nhosts: all\nsteps:\n  - probe\n  - plan: {model: '{{ model }}', ctx: 1024}\n"
        "  - cache_warm\n"
    )
    for _ in range(2):  # warming a second time finds every file there
        argv = ["run-playbook", str(playbook), "-i", str(inventory), "-e", f"model={model}", "--json"]
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator", *argv],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
    cache = one.home / "rpcfleet" / "cache" / "rpc"
    assert len(list(cache.iterdir())) == 6  # both servers' layers: 3 tensors each
    subprocess.run(  # leave the module's lab as it was
        [sys.executable, "-m", "orchestrator", "cache", "clear", "-i", str(inventory)],
        check=True,
        timeout=120,
    )


# --- systemd: one unit per server -------------------------------------------------------------------------


def test_a_server_dropped_from_rpc_servers_is_undeclared_until_stopped(
    deployed: Lab, hold_server: Callable[[str], socket.socket], tmp_path: Path
) -> None:
    """Server b dropped from node 1's rpc_servers keeps running, and nothing showed it: `status` lists
    it as `undeclared` with its pid and port, `deploy` warns with the command that stops it, and
    `stop --undeclared` stops it and nothing else, never while a client holds it (refused, as any stop)."""
    import yaml

    one, two = deployed.nodes
    b = f"{one.name}/b"
    document = yaml.safe_load(deployed.inventory.read_text())
    fewer = tmp_path / "fewer.yml"
    document["hosts"][one.name]["rpc_servers"] = [50052]  # was [50052, {port: 50053, name: b}]
    fewer.write_text(yaml.safe_dump(document, sort_keys=False))
    assert b not in {h.name for h in server_hosts(load_inventory(fewer).hosts)}
    before = states(deployed)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator", *args, "-i", str(fewer)],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
            env={**os.environ, "NO_COLOR": "1", "COLUMNS": "250"},
        )

    try:
        status = run("status")
        assert status.returncode == 0, status.stdout + status.stderr
        (row,) = [line for line in status.stdout.splitlines() if line.split()[:1] == [b]]
        assert "undeclared" in row and str(before[b]["pid"]) in row and f"{one.address}:50053" in row, row
        assert f"`rpcfleet stop --undeclared -l {one.name}` stops it" in " ".join(status.stderr.split())
        deploy = run("deploy")
        assert deploy.returncode == 0, deploy.stdout + deploy.stderr
        assert f"{b} runs (pid {before[b]['pid']}, port 50053) but the inventory does not declare it" in (
            " ".join(deploy.stderr.split())
        )
        sock = hold_server(f"{one.address}:50053")
        try:
            refused = run("stop", "--undeclared")
            assert refused.returncode == 1 and "busy" in refused.stdout + refused.stderr, refused.stdout
            assert states(deployed)[b]["pid"] == before[b]["pid"]
        finally:
            sock.close()
        stopped = run("stop", "--undeclared")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        after = states(deployed)  # the lab's own inventory still declares b
        assert after[b]["state"] == "stopped"
        for kept in (f"{one.name}/50052", two.name):
            assert after[kept]["state"] == "running" and after[kept]["pid"] == before[kept]["pid"]
        assert "undeclared" not in run("status").stdout
        again = run("stop", "--undeclared")
        assert again.returncode == 0 and "no undeclared server runs" in again.stderr
    finally:
        assert cli(deployed, "start").returncode == 0


@pytest.fixture(scope="module")
def systemd_lab() -> Iterator[Lab]:
    """One node booting systemd, reached as root (system units), two servers, in a CPU share."""
    require_lab_privileges()
    name = session_lab_name("srvsd")
    made = lab_up(
        1,
        name=name,
        owner_pid=os.getpid(),
        init="systemd",
        variables={"supervisor": "systemd"},
        node_variables={"1": {"rpc_servers": SERVERS, "ssh_user": "root"}},
        cpus=0.8,
    )
    try:
        yield made
    finally:
        lab_down(name)
        assert leftovers(made) == []


def _group_pids(name: str) -> set[int]:
    """Every process in a node's CPU group, its sub-groups (the container's own) included."""
    top = cgroups.node_groups(name).limit
    return {int(pid) for procs in top.rglob("cgroup.procs") for pid in procs.read_text().split()}


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_systemd_runs_one_unit_per_server_and_restarts_each_alone(systemd_lab: Lab) -> None:
    lab = systemd_lab
    node = lab.nodes[0].name
    done = cli(lab, "deploy")
    assert done.returncode == 0, done.stdout + done.stderr
    status = states(lab)
    assert set(status) == {f"{node}/50052", f"{node}/b"}
    assert all(s["state"] == "running" and s["supervisor"] == "systemd" for s in status.values()), status
    units = lab.node_exec(1, ["sh", "-c", "ls /etc/systemd/system | grep '^rpcfleet-'"]).stdout.split()
    assert units == sorted([unit_name("~/rpcfleet", "50052"), unit_name("~/rpcfleet", "b")])
    assert units[0].endswith("--server-50052.service"), units
    # Both servers run inside the node's CPU share (the boot loop joined it, systemd's units inherit it).
    names = [_comm(pid) for pid in _group_pids(lab.nodes[0].namespace or "")]
    assert names.count("ggml-rpc-server") == 2, names
    # kill -9 of one server: its unit brings it back; the other server keeps its pid.
    lab.node_exec(1, ["kill", "-9", str(status[f"{node}/b"]["pid"])])

    def restarted() -> bool:
        now = states(lab)[f"{node}/b"]
        return now["state"] == "running" and now["pid"] != status[f"{node}/b"]["pid"]

    deadline = time.monotonic() + 30
    while not restarted():
        assert time.monotonic() < deadline, states(lab)
        time.sleep(0.3)
    after = states(lab)
    assert after[f"{node}/b"]["restarts"] == 1
    assert after[f"{node}/50052"]["pid"] == status[f"{node}/50052"]["pid"]
    # restart of the first server alone
    assert cli(lab, "restart", "-l", f"{node}/50052").returncode == 0
    final = states(lab)
    assert final[f"{node}/50052"]["pid"] != after[f"{node}/50052"]["pid"]
    assert final[f"{node}/b"]["pid"] == after[f"{node}/b"]["pid"]
