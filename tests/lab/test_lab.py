"""The emulated lab: namespaces with real OpenSSH (tier 2, root), the local lab, teardown and reaping,
and the connection failures only a real network can show (a pulled cable, a firewall, a dead sshd)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.connectors.base import ConnectOptions
from orchestrator.connectors.connect import connect
from orchestrator.connectors.local import LocalConnection
from orchestrator.core.errors import AuthenticationError, HostKeyError, LabError, UnreachableError
from orchestrator.inventory.load import load_inventory
from orchestrator.inventory.model import Host
from orchestrator.lab.lifecycle import (
    default_lab_inventory,
    lab_down,
    lab_repair,
    lab_status,
    lab_up,
    reap_stale,
)
from orchestrator.lab.procs import run_all
from orchestrator.lab.state import Lab
from tests.plugins.lab import lab_hosts_of, leftovers

MakeLab = Callable[..., Lab]
FAST = ConnectOptions(connect_timeout=1.0, keepalive_interval=1.0, keepalive_count_max=2)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


async def start_sleeper(host: Host) -> int:
    """A detached process on the node (as the product starts rpc-servers); its pid."""
    async with await connect(host, FAST) as conn:
        result = await conn.run(
            "setsid nohup sleep 600 >/dev/null 2>&1 </dev/null & echo $!", timeout=10, check=True
        )
    return int(result.stdout.strip())


def orphaned_lab(name: str) -> Lab:
    """A lab as a run killed half-way leaves it: its owner is gone and nothing ran `down`."""
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        return lab_up(2, name=name, owner_pid=owner.pid)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()


# ------------------------------------------------------------------------------------------ tier 2


@pytest.mark.lab
async def test_each_node_is_its_own_machine_over_real_ssh(lab: Lab, lab_hosts: list[Host]) -> None:
    assert [h.name for h in lab_hosts] == [n.name for n in lab.nodes]
    assert len({h.address for h in lab_hosts}) == 3

    async def visit(host: Host) -> tuple[str, str, str]:
        async with await connect(host, FAST) as conn:
            result = await conn.run(
                f"hostname; id -un; echo $HOME; echo {host.name} > ~/whoami; ip -o -4 addr show eth0",
                timeout=10,
                check=True,
            )
        hostname, user, home, addr = result.stdout.splitlines()[:4]
        assert host.address in addr
        return hostname, user, home

    answers = await asyncio.gather(*(visit(h) for h in lab_hosts))
    assert [a[0] for a in answers] == [n.name for n in lab.nodes]  # hostname: the node's own
    assert {a[1] for a in answers} == {lab.user}
    for node in lab.nodes:  # one HOME path, a different directory behind it on each node
        assert (node.home / "whoami").read_text().strip() == node.name
    assert len({(n.home / "whoami").stat().st_ino for n in lab.nodes}) == 3
    for host in lab_hosts:
        assert host.groups == ("lab",) and host.rpc_port == 50052 and host.install_dir == "~/rpcfleet"


@pytest.mark.lab
async def test_file_transfer_and_nodes_have_no_way_out(
    lab: Lab, lab_hosts: list[Host], tmp_path: Path
) -> None:
    source = tmp_path / "blob"
    source.write_bytes(os.urandom(300_000))
    async with await connect(lab_hosts[1], FAST) as conn:
        await conn.put(source, "~/blob")
        routes = await conn.run("ip route", timeout=10, check=True)
    assert (lab.nodes[1].home / "blob").read_bytes() == source.read_bytes()
    assert not (lab.nodes[0].home / "blob").exists()
    assert "default" not in routes.stdout  # namespaces have no way out of the lab


@pytest.mark.lab
def test_status_reports_every_node(lab: Lab, capsys: pytest.CaptureFixture[str]) -> None:
    status = lab_status(lab.name)
    assert status.healthy and status.kind == "netns" and status.user == lab.user
    assert [n.address for n in status.nodes] == [f"10.77.{lab.slot}.{11 + i}" for i in range(3)]
    assert all(n.namespace_present and n.reachable and n.sshd_pid for n in status.nodes)
    assert main(["lab", "status", "--name", lab.name, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["healthy"] is True and [n["name"] for n in data["nodes"]] == [n.name for n in lab.nodes]


@pytest.mark.lab
async def test_pulled_cable_is_unreachable_within_the_connect_timeout_others_fine(
    healthy_lab: Lab, lab_hosts: list[Host]
) -> None:
    healthy_lab.cut_link(2)

    async def attempt(host: Host) -> tuple[str, float]:
        started = time.monotonic()
        try:
            async with await connect(host, FAST) as conn:
                result = await conn.run("hostname", timeout=5, check=True)
            return result.stdout.strip(), time.monotonic() - started
        except UnreachableError as exc:
            return f"unreachable: {type(exc).__name__}", time.monotonic() - started

    results = await asyncio.gather(*(attempt(h) for h in lab_hosts))
    assert results[0][0] == lab_hosts[0].name and results[2][0] == lab_hosts[2].name
    assert results[1][0] == "unreachable: UnreachableError"
    assert 0.9 <= results[1][1] < 6.0  # the 1 s connect timeout (headroom for load), not minutes
    status = lab_status(healthy_lab.name, probe_timeout=0.3)
    assert [n.reachable for n in status.nodes] == [True, False, True]
    healthy_lab.restore_link(2)
    # back: the default connect timeout (a key exchange in 1 s failed at load average 22)
    async with await connect(lab_hosts[1]) as conn:
        assert (await conn.run("hostname", timeout=5)).stdout.strip() == lab_hosts[1].name


@pytest.mark.lab
async def test_cut_on_an_open_connection_is_noticed_by_keepalive(
    healthy_lab: Lab, lab_hosts: list[Host]
) -> None:
    async with await connect(lab_hosts[0], FAST) as conn:
        await conn.run("true", timeout=5, check=True)
        healthy_lab.cut_link(1)
        started = time.monotonic()
        with pytest.raises(UnreachableError):
            await conn.run("sleep 30", timeout=60)
        assert time.monotonic() - started < 10  # keepalive 1 s x 2, not the command timeout


@pytest.mark.lab
async def test_firewall_drop_times_out_reject_refuses_at_once(
    healthy_lab: Lab, lab_hosts: list[Host]
) -> None:
    healthy_lab.firewall_reject(3)
    started = time.monotonic()
    with pytest.raises(UnreachableError):
        await connect(lab_hosts[2], ConnectOptions(connect_timeout=10.0))
    assert time.monotonic() - started < 3.0  # a reset, answered in milliseconds, not the 10 s timeout
    healthy_lab.firewall_clear(3)
    healthy_lab.firewall_drop(3)
    started = time.monotonic()
    with pytest.raises(UnreachableError):
        await connect(lab_hosts[2], FAST)
    assert time.monotonic() - started >= 0.9
    healthy_lab.firewall_clear(3)
    async with await connect(lab_hosts[2], FAST) as conn:
        assert (await conn.run("hostname", timeout=5)).ok


@pytest.mark.lab
async def test_killed_sshd_refuses_new_connections_open_sessions_live_on(
    healthy_lab: Lab, lab_hosts: list[Host]
) -> None:
    old_pid = healthy_lab.nodes[0].sshd_pid()
    assert old_pid is not None and old_pid in healthy_lab.node_pids(1)
    async with await connect(lab_hosts[0], FAST) as conn:
        healthy_lab.kill_sshd(1)
        assert healthy_lab.nodes[0].sshd_pid() is None and not alive(old_pid)
        with pytest.raises(UnreachableError):
            await connect(lab_hosts[0], FAST)
        assert (await conn.run("hostname", timeout=5)).stdout.strip() == lab_hosts[0].name
    new_pid = healthy_lab.start_sshd(1)
    assert new_pid != old_pid
    async with await connect(lab_hosts[0], FAST) as conn:
        assert (await conn.run("hostname", timeout=5)).stdout.strip() == lab_hosts[0].name


@pytest.mark.lab
async def test_wrong_host_key_is_refused(lab: Lab, lab_hosts: list[Host], tmp_path: Path) -> None:
    lines = lab.known_hosts.read_text().splitlines()
    first_key = lines[0].split(None, 1)[1]
    second_key = lines[1].split(None, 1)[1]
    assert first_key != second_key
    tampered = tmp_path / "known_hosts"
    tampered.write_text(f"{lab.nodes[0].address} {second_key}\n")  # node 2's key claimed for node 1
    host = dataclasses.replace(lab_hosts[0], ssh_known_hosts=str(tampered))
    with pytest.raises(HostKeyError):
        await connect(host, FAST)
    unknown = tmp_path / "empty_known_hosts"
    unknown.write_text(f"{lab.nodes[2].address} {lines[2].split(None, 1)[1]}\n")
    with pytest.raises(HostKeyError):
        await connect(dataclasses.replace(lab_hosts[0], ssh_known_hosts=str(unknown)), FAST)


@pytest.mark.lab
async def test_wrong_client_key_is_an_authentication_error(
    lab: Lab, lab_hosts: list[Host], other_client_key_path: Path
) -> None:
    key = other_client_key_path
    with pytest.raises(AuthenticationError) as info:
        await connect(dataclasses.replace(lab_hosts[0], ssh_key=str(key)), FAST)
    assert lab_hosts[0].name in str(info.value)
    # The right key still works afterwards: nothing locks the user out.
    async with await connect(lab_hosts[0], FAST) as conn:
        assert (await conn.run("true", timeout=5)).ok


@pytest.mark.lab
async def test_node_exec_mounts_inside_the_node_only(healthy_lab: Lab, lab_hosts: list[Host]) -> None:
    node = healthy_lab.nodes[1]
    (node.home / "small").mkdir(exist_ok=True)
    mount_point = f"{healthy_lab.home_mount}/small"
    healthy_lab.node_exec(node, ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mount_point])
    try:
        async with await connect(lab_hosts[1], FAST) as conn:
            full = await conn.run("dd if=/dev/zero of=small/fill bs=64k count=64", timeout=10)
            df = await conn.run("df -k small | tail -1", timeout=10, check=True)
        assert full.exit_status != 0 and "No space left" in full.stderr
        assert "tmpfs" in df.stdout
        assert not (node.home / "small" / "fill").exists()  # the controller's view: an untouched dir
        root_mounts = await asyncio.to_thread(Path("/proc/self/mounts").read_text)
        assert mount_point not in root_mounts  # not in the root mount namespace
    finally:
        healthy_lab.node_exec(node, ["umount", mount_point], check=False)


# ------------------------------------------------------------------------------------------ lifecycle


@pytest.mark.lab
async def test_down_leaves_nothing_behind(make_lab: MakeLab) -> None:
    made = make_lab(2)
    sleeper = await start_sleeper(lab_hosts_of(made)[0])
    assert alive(sleeper) and sleeper in made.node_pids(1)
    assert leftovers(made)  # the check sees the lab while it is up
    started = time.monotonic()
    assert lab_down(made.name) is True
    assert time.monotonic() - started < 10.0  # seconds, not a hang (headroom for a busy machine)
    assert leftovers(made) == []
    assert not alive(sleeper)
    assert lab_down(made.name) is False  # idempotent
    with pytest.raises(LabError, match="no lab named"):
        lab_status(made.name)


@pytest.mark.lab
async def test_reap_removes_a_killed_runs_leftovers_only(lab: Lab, make_lab: MakeLab) -> None:
    orphan = orphaned_lab(f"t{os.getpid()}o")
    sleeper = await start_sleeper(lab_hosts_of(orphan)[1])
    # A run whose state dir was deleted outright: namespaces, links, user, sshds remain.
    lost = make_lab(2)
    while lost.dir.exists():  # its sshds may still be appending to their logs
        shutil.rmtree(lost.dir, ignore_errors=True)
    assert leftovers(orphan) and leftovers(lost)
    removed = reap_stale()
    assert any(f"rfl{orphan.slot}-" in r for r in removed) and any(f"rfl{lost.slot}-" in r for r in removed)
    assert leftovers(orphan) == [] and leftovers(lost) == []
    assert not alive(sleeper)
    assert lab_status(lab.name).healthy  # the live session lab is untouched
    assert reap_stale() == []


@pytest.mark.lab
def test_up_refuses_a_running_name_and_rejects_bad_input(lab: Lab) -> None:
    with pytest.raises(LabError, match="already up"):
        lab_up(1, name=lab.name)
    with pytest.raises(LabError, match="invalid lab name"):
        lab_up(1, name="Bad_Name")
    with pytest.raises(LabError, match="between 1 and"):
        lab_up(0, name="zero")


@pytest.mark.lab
@pytest.mark.parametrize("count", [3, 8])
def test_up_and_down_are_fast(count: int, make_lab: MakeLab) -> None:
    started = time.monotonic()
    made = make_lab(count)
    up = time.monotonic() - started
    assert lab_status(made.name).healthy
    started = time.monotonic()
    lab_down(made.name)
    down = time.monotonic() - started
    print(f"lab of {count}: up {up:.3f} s, down {down:.3f} s")
    # Measured 0.1-0.3 s up and 0.15-0.3 s down; bounds leave room for a loaded CI machine.
    assert up < 5 and down < 3


@pytest.mark.lab
def test_cli_up_writes_the_inventory_where_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name = f"t{os.getpid()}c"
    output = tmp_path / "inv" / "lab.yml"
    try:
        assert main(["lab", "up", "--nodes", "2", "--name", name, "-o", str(output), "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["healthy"] and len(data["nodes"]) == 2
        hosts = load_inventory(output).hosts
        assert [h.address for h in hosts] == [n["address"] for n in data["nodes"]]
        assert all(h.ssh_known_hosts and h.ssh_key and h.ssh_user for h in hosts)
    finally:
        assert main(["lab", "down", "--name", name]) == 0
    assert output.exists()  # the copy the user asked for stays


# ------------------------------------------------------------------------------------------ local lab


async def test_local_lab_gives_each_node_its_own_home_and_address(make_lab: MakeLab) -> None:
    made = make_lab(3, local=True)
    hosts = lab_hosts_of(made)
    assert [h.connection for h in hosts] == ["local"] * 3
    assert [h.supervisor for h in hosts] == ["process"] * 3  # never units on the machine running the lab
    assert [h.address for h in hosts] == [f"127.0.{made.slot}.{11 + i}" for i in range(3)]
    assert [h.rpc_host for h in hosts] == [h.address for h in hosts]
    for host, node in zip(hosts, made.nodes, strict=True):
        assert Path(host.vars["home"]) == node.home and host.install_dir.startswith(str(node.home))
        async with LocalConnection(host, home=Path(host.vars["home"])) as conn:
            result = await conn.run("pwd; echo $HOME; echo hi > mark", timeout=5, check=True)
        assert result.stdout.split() == [str(node.home)] * 2
        assert (node.home / "mark").exists()
    assert lab_status(made.name).healthy
    lab_down(made.name)
    assert not made.dir.exists()


def test_without_privileges_up_says_so_and_local_still_works(tmp_path: Path) -> None:
    """A real unprivileged run: root without CAP_NET_ADMIN/CAP_SYS_ADMIN (setpriv drops them)."""
    if os.geteuid() != 0:
        argv_prefix: list[str] = []
    else:
        argv_prefix = ["setpriv", "--bounding-set", "-net_admin,-sys_admin"]
    env = {**os.environ, "RPCFLEET_HOME": str(tmp_path), "COLUMNS": "300"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*argv_prefix, sys.executable, "-m", "orchestrator", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    refused = cli("lab", "up", "--nodes", "2")
    assert refused.returncode == 1
    assert "needs root" in refused.stderr and "--local" in refused.stderr
    assert "Traceback" not in refused.stderr
    made = cli("lab", "up", "--nodes", "2", "--local")
    assert made.returncode == 0, made.stderr
    hosts = load_inventory(tmp_path / "lab" / "lab" / "inventory.yml").hosts
    assert [h.connection for h in hosts] == ["local", "local"]
    assert cli("lab", "down").returncode == 0
    assert not (tmp_path / "lab" / "lab").exists()


def test_default_lab_inventory_hints_at_lab_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RPCFLEET_HOME", str(tmp_path))
    with pytest.raises(LabError) as info:
        default_lab_inventory()
    assert "rpcfleet lab up" in str(info.value)
    lab_up(1, local=True, name="other")
    try:  # another lab is up: the error names it and its inventory rather than saying none is
        with pytest.raises(LabError) as info:
            default_lab_inventory()
        assert "no lab named 'lab' is up" in info.value.message
        assert f"other: -i {tmp_path / 'lab' / 'other' / 'inventory.yml'}" in str(info.value.hint)
    finally:
        lab_down("other")
    lab_up(1, local=True)
    try:
        assert default_lab_inventory() == tmp_path / "lab" / "lab" / "inventory.yml"
    finally:
        lab_down()


@pytest.mark.lab
def test_down_all_spares_labs_of_running_sessions(
    lab: Lab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A home of its own: `down --all` must not touch other people's labs on this machine.
    monkeypatch.setenv("RPCFLEET_HOME", str(tmp_path))
    pid = os.getpid()
    unowned = lab_up(1, name=f"t{pid}u")
    owned = lab_up(1, name=f"t{pid}w", owner_pid=pid)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "orchestrator", "lab", "down", "--all"],
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "300"},
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        assert leftovers(unowned) == []
        assert f"kept lab {owned.name}" in result.stdout
        assert lab_status(owned.name).healthy
    finally:
        lab_down(unowned.name)
        lab_down(owned.name)
    monkeypatch.undo()
    assert lab_status(lab.name).healthy  # found through its bridge, from another home: live


def test_run_all_reaps_what_it_started_when_a_command_cannot_start(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[subprocess.Popen[str]] = []

    class Recording(subprocess.Popen[str]):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[call-overload]
            started.append(self)

    monkeypatch.setattr(subprocess, "Popen", Recording)
    with pytest.raises(LabError, match="cannot run /nonexistent/rpcfleet-tool") as info:
        run_all([["sleep", "30"], ["/nonexistent/rpcfleet-tool", "x"], ["sleep", "30"]])
    assert info.value.command == "/nonexistent/rpcfleet-tool x"
    (sleeper,) = started  # the third never started
    assert sleeper.returncode is not None  # killed and reaped, not left running
    with pytest.raises(ProcessLookupError):
        os.kill(sleeper.pid, 0)


# ------------------------------------------------------------------------------------------ repair


def _server_pid(node_home: Path) -> int | None:
    """The node's rpc-server pid (deployed to ~/rpcfleet), when it runs."""
    try:
        pid = int((node_home / "rpcfleet" / "run" / "rpc-server.pid").read_text())
    except (OSError, ValueError):
        return None
    return pid if alive(pid) else None


def _listeners(made: Lab, index: int) -> list[int]:
    """Listening sshds of node `index` (found in its namespace by their title, not by the pid file)."""
    config = f"-f {made.node(index).sshd_config} "
    titled = {}
    for pid in made.node_pids(index):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if title.startswith("sshd: ") and config in title and "[listener]" in title and alive(pid):
            titled[pid] = int(stat[stat.rfind(")") + 2 :].split()[1])
    # a connection's child is a fork of the listener, with its title until it execs: not a listener
    return sorted(pid for pid, parent in titled.items() if parent not in titled)


@pytest.mark.lab
def test_repair_brings_a_killed_sshd_back_and_leaves_the_other_nodes_alone(
    make_lab: MakeLab, cpu_artifact: object, capsys: pytest.CaptureFixture[str]
) -> None:
    made = make_lab(3)
    inv = ["-i", str(made.inventory)]
    name = ["--name", made.name]
    assert main(["deploy", *inv]) == 0, capsys.readouterr().err
    servers = [_server_pid(n.home) for n in made.nodes]
    assert all(servers), servers
    sshds = [n.sshd_pid() for n in made.nodes]
    assert all(sshds)
    victim = sshds[1]
    assert victim is not None
    os.kill(victim, signal.SIGKILL)  # as a user (or the OOM killer) would: the pid file stays
    assert poll_until(lambda: not alive(victim))
    capsys.readouterr()

    assert main(["lab", "status", *name]) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith(made.nodes[1].name))
    assert "dead" in row and "closed" in row
    assert f"rpcfleet lab repair --name {made.name}" in out
    # `lab up` on it says what is broken and what repairs it, and changes nothing
    assert main(["lab", "up", "--nodes", "3", *name]) == 1
    err = capsys.readouterr().err
    assert "already up" in err and f"{made.nodes[1].name} sshd dead" in err and "lab repair" in err

    assert main(["lab", "repair", *name]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"{made.nodes[1].name}\s+sshd dead\s+sshd started \(pid \d+\)", out), out
    assert "1 of 1 broken nodes repaired" in out and "2 healthy left alone" in out
    after = [n.sshd_pid() for n in made.nodes]
    assert after[0] == sshds[0] and after[2] == sshds[2]
    assert after[1] is not None and after[1] != sshds[1]
    assert [_server_pid(n.home) for n in made.nodes] == servers  # no server restarted, node 2's either
    assert main(["ping", *inv, "--json"]) == 0
    pinged = json.loads(capsys.readouterr().out)
    assert sorted(h["host"] for h in pinged if h["status"] == "ok") == [n.name for n in made.nodes], pinged
    assert lab_status(made.name).healthy

    # a healthy lab: nothing changes, and the output says so
    assert main(["lab", "repair", *name]) == 0
    assert capsys.readouterr().out.strip() == f"lab {made.name}: all 3 nodes healthy, nothing to repair"
    assert [n.sshd_pid() for n in made.nodes] == after
    assert [_server_pid(n.home) for n in made.nodes] == servers
    assert main(["lab", "repair", *name, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["repaired"] == [] and data["failed"] == [] and {n["fault"] for n in data["nodes"]} == {None}


def poll_until(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.lab
async def test_repair_starts_a_node_whose_processes_all_died_with_its_keys_and_home(
    make_lab: MakeLab,
) -> None:
    made = make_lab(3)
    hosts = lab_hosts_of(made)
    sleeper = await start_sleeper(hosts[1])  # stands for its servers: a power cut takes them too
    (made.nodes[1].home / "kept").write_text("on disk\n")
    sshds = [n.sshd_pid() for n in made.nodes]
    holders = [n.holder_pid() for n in made.nodes]
    made.kill_node(2)
    assert made.node_pids(2) == [] and not alive(sleeper)
    assert not lab_status(made.name, probe_timeout=0.3).healthy

    results = lab_repair(made.name)
    assert [(r.fault, r.action, r.ok) for r in results] == [
        (None, None, True),
        ("down", "node started", True),
        (None, None, True),
    ]
    assert [n.sshd_pid() for n in made.nodes][::2] == sshds[::2]  # the others: same sshd, same holder
    assert [n.holder_pid() for n in made.nodes][::2] == holders[::2]
    assert results[1].sshd_pid == made.nodes[1].sshd_pid() != sshds[1]
    # the same host key (known_hosts unchanged), hostname, user and home
    async with await connect(hosts[1], FAST) as conn:
        result = await conn.run("hostname; id -un; cat ~/kept", timeout=10, check=True)
    assert result.stdout.split("\n")[:3] == [made.nodes[1].name, made.user, "on disk"]
    made.node_exec(2, ["true"])  # its holder is back: faults and tests can enter the node

    # a dead holder under a live sshd: a new holder in that sshd's namespaces, the sshd kept
    holder = made.nodes[0].holder_pid()
    assert holder is not None and holder == holders[0]
    os.kill(holder, signal.SIGKILL)
    assert poll_until(lambda: made.nodes[0].holder_pid() is None)
    results = lab_repair(made.name)
    assert [(r.fault, r.action) for r in results] == [("holder dead", "holder started")] + [(None, None)] * 2
    assert made.nodes[0].sshd_pid() == sshds[0]
    assert made.node_exec(1, ["hostname"]).stdout.strip() == made.nodes[0].name  # the node's namespaces

    # a pulled cable is put back; several faults on one node are fixed one after the other
    made.cut_link(3)
    made.kill_sshd(3)
    results = lab_repair(made.name, probe_timeout=0.3)
    assert results[2].fault == "link down" and results[2].ok
    assert re.fullmatch(r"link up; sshd started \(pid \d+\)", results[2].action or ""), results[2]
    assert lab_status(made.name).healthy
    assert all(r.fault is None for r in lab_repair(made.name))


@pytest.mark.lab
def test_concurrent_repairs_start_one_sshd(make_lab: MakeLab) -> None:
    made = make_lab(1)
    for _ in range(20):
        made.kill_sshd(1)
        with ThreadPoolExecutor(2) as pool:
            results = [f.result() for f in [pool.submit(lab_repair, made.name) for _ in range(2)]]
        faults = sorted((r[0].fault or "") for r in results)
        assert faults == ["", "sshd dead"]  # one repaired it, the other found it healthy
        assert _listeners(made, 1) == [made.nodes[0].sshd_pid()]


@pytest.mark.lab
def test_repair_says_what_it_cannot_fix(make_lab: MakeLab, capsys: pytest.CaptureFixture[str]) -> None:
    made = make_lab(2)
    made.firewall_reject(1)
    assert main(["lab", "repair", "--name", made.name]) == 1
    captured = capsys.readouterr()
    assert "does not answer" in captured.err and "iptables" in captured.err
    assert "0 of 1 broken nodes repaired" in captured.out
    made.firewall_clear(1)
    assert lab_status(made.name).healthy


def test_repair_of_a_local_lab_makes_a_lost_home_again(make_lab: MakeLab) -> None:
    made = make_lab(2, local=True)
    (made.nodes[0].home / "mark").write_text("x")
    shutil.rmtree(made.nodes[1].home)
    assert not lab_status(made.name).healthy
    results = lab_repair(made.name)
    assert [(r.fault, r.action) for r in results] == [(None, None), ("home missing", "home created (empty)")]
    assert lab_status(made.name).healthy and (made.nodes[0].home / "mark").read_text() == "x"


def test_repair_without_a_lab_is_a_usage_error(tmp_path: Path) -> None:
    env = {**os.environ, "RPCFLEET_HOME": str(tmp_path), "COLUMNS": "300"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "orchestrator", *args]
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)

    for args, message in [
        ((), "no lab named 'lab' is up"),
        (("--name", "other"), "no lab named 'other' is up"),
        (("--name", "Bad_Name"), "invalid lab name 'Bad_Name'"),
    ]:
        result = cli("lab", "repair", *args)
        assert result.returncode == 2, result.stderr
        assert message in result.stderr and "Traceback" not in result.stderr
    assert "rpcfleet lab up" in cli("lab", "repair").stderr
    assert not (tmp_path / "lab" / "lab").exists()  # nothing made


@pytest.mark.lab
@pytest.mark.soak
def test_an_sshd_listening_without_its_pid_file_is_the_nodes_not_a_second_one(
    make_lab: MakeLab, capsys: pytest.CaptureFixture[str], rounds: int
) -> None:
    """sshd writes its pid file a moment after it listens: a check in between (a repair right after a
    power cut) once started a second sshd, which failed to bind, and left the node unrepairable. The
    listener is the node's own sshd: it is adopted, never doubled."""
    made = make_lab(2)
    for round_no in range(rounds):  # each node once in the suite
        index = round_no % 2 + 1
        node = made.node(index)
        pid = node.sshd_pid()
        assert pid is not None
        node.sshd_pid_file.unlink()  # as between sshd's listen and its pid file
        assert main(["lab", "repair", "--name", made.name]) == 0, capsys.readouterr().err
        assert "nothing to repair" in capsys.readouterr().out
        assert node.sshd_pid() == pid and node.sshd_pid_file.read_text().strip() == str(pid)
        assert _listeners(made, index) == [pid]
