"""Several rpc-servers per host (`rpc_servers`), pure parts: the inventory shape and its errors, the
servers as hosts of their own and their selection, their files and units on the node, the shared lock."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cli import _output, main
from orchestrator.core.errors import InventoryError
from orchestrator.engine.executor import Session
from orchestrator.inventory.load import load_inventory_text
from orchestrator.inventory.model import HostPatternError, Inventory, select_servers, server_hosts, servers_of
from orchestrator.operations.layer import HostLocks, OperationOptions
from orchestrator.operations.server.process import launch_script, stop_script
from orchestrator.operations.server.state import PID_FILE, server_files
from orchestrator.operations.supervise import supervise_sh
from orchestrator.operations.systemd import unit_name

TWO = """
hosts:
  h1:
    address: 10.0.0.1
    rpc_servers: [{port: 50052, devices: [CUDA0]}, {port: 50053, devices: CUDA1, name: gpu1, threads: 4}]
  h2:
    address: 10.0.0.2
"""


def inventory(text: str = TWO) -> Inventory:
    return load_inventory_text(text, Path("inv.yml"))


def test_each_server_is_a_host_of_its_own() -> None:
    h1, h2 = inventory().hosts
    first, second = servers_of(h1)
    assert (first.name, first.endpoint, first.rpc_devices, first.server) == (
        "h1/50052",
        "10.0.0.1:50052",
        ("CUDA0",),
        "50052",
    )
    assert (second.name, second.endpoint, second.rpc_devices, second.rpc_threads) == (
        "h1/gpu1",
        "10.0.0.1:50053",
        ("CUDA1",),
        4,
    )
    assert first.node_name == second.node_name == "h1" and first.install_key == second.install_key
    assert servers_of(h2) == (h2,) and h2.node_name == "h2"


def test_a_server_without_devices_takes_the_hosts() -> None:
    text = (
        "hosts:\n  h1:\n    rpc_devices: [CUDA0]\n    rpc_servers: [50052, {port: 50053, devices: [CUDA1]}]\n"
    )
    first, second = server_hosts(inventory(text).hosts)
    assert first.rpc_devices == ("CUDA0",) and second.rpc_devices == ("CUDA1",)


def test_ini_takes_the_list_as_yaml_text() -> None:
    text = '[gpu]\nh1 ansible_host=10.0.0.1 rpc_servers="[{port: 50052}, {port: 50053, devices: [CUDA1]}]"\n'
    loaded = load_inventory_text(text, Path("inv.ini"))
    assert [s.endpoint for s in server_hosts(loaded.hosts)] == ["10.0.0.1:50052", "10.0.0.1:50053"]


@pytest.mark.parametrize(
    ("servers", "message"),
    [
        ("[{port: 50052}, {port: 50052}]", "servers 1 and 2 both use port 50052"),
        ("[{port: 50052, devices: [CUDA0]}, {port: 50053, devices: [cuda0]}]", "both use device cuda0"),
        ('[{port: 50052, devices: ["CU DA"]}]', "server 1: expected a device name"),
        ("[{port: 50052}, {port: 70000}]", "server 2: port 70000 is out of range"),
        ("[{prot: 50052}]", "unknown key 'prot' (did you mean 'port'?)"),
        ("[{devices: [CUDA0]}]", "server 1: port is missing"),
        ("[{port: 50052, name: a}, {port: 50053, name: a}]", "are both named 'a'"),
        ("[{port: 50052, name: 'a/b'}]", "server 1: expected a name"),
        ("{port: 50052}", "expected a list of servers"),
    ],
)
def test_bad_servers_name_file_and_line(servers: str, message: str) -> None:
    text = f"hosts:\n  h1:\n    address: 10.0.0.1\n    rpc_servers: {servers}\n"
    with pytest.raises(InventoryError) as caught:
        inventory(text)
    assert message in caught.value.message
    assert caught.value.location is not None and caught.value.location.line == 4


def test_a_server_sharing_another_hosts_endpoint_or_inherited_devices_is_refused() -> None:
    text = "hosts:\n  h1:\n    address: 10.0.0.1\n    rpc_servers: [50052, 50053]\n"
    text += "  h2:\n    address: 10.0.0.1\n    rpc_port: 50053\n"
    with pytest.raises(InventoryError) as caught:
        inventory(text)
    assert "servers 'h1/50053' and 'h2' share the rpc endpoint 10.0.0.1:50053" in caught.value.message
    text = "hosts:\n  h1:\n    rpc_devices: CUDA0\n    rpc_servers: [50052, 50053]\n"
    with pytest.raises(InventoryError, match="servers 50052, 50053 would all use rpc_devices CUDA0"):
        inventory(text)


def test_a_host_named_like_another_hosts_server_is_refused() -> None:
    # `-l h1/50052` selected both, and status, probe and plan showed two rows of one name
    text = "hosts:\n  h1:\n    address: 10.0.0.1\n    rpc_servers: [50052, 50053]\n"
    text += "  h1/50052:\n    address: 10.0.0.2\n"
    with pytest.raises(InventoryError) as caught:
        inventory(text)
    assert "host 'h1/50052' has the name of a server of host 'h1'" in caught.value.message
    assert caught.value.location is not None and caught.value.location.line == 5


def test_ntp_server_is_no_typo_of_rpc_servers() -> None:
    loaded = inventory("hosts:\n  h1:\n    ntp_server: 10.0.0.9\n    rcp_port: 1\n")
    assert (
        len(loaded.warnings) == 1 and "'rcp_port'" in loaded.warnings[0] and "rpc_port" in loaded.warnings[0]
    )


@pytest.mark.parametrize(
    ("pattern", "names"),
    [
        (None, ["h1/50052", "h1/gpu1", "h2"]),
        ("h1", ["h1/50052", "h1/gpu1"]),
        ("h1/gpu1", ["h1/gpu1"]),
        ("h2,h1/50052", ["h1/50052", "h2"]),
        ("!h1/gpu1", ["h1/50052", "h2"]),
        ("all,!h1/50052", ["h1/gpu1", "h2"]),
        ("h1/gpu1,!h2", ["h1/gpu1"]),
        ("ungrouped:!h1", ["h2"]),
    ],
)
def test_select_servers(pattern: str | None, names: list[str]) -> None:
    assert [s.name for s in select_servers(inventory(), pattern)] == names


def test_select_servers_refuses_what_selects_nothing() -> None:
    with pytest.raises(HostPatternError):
        select_servers(inventory(), "h1/nope")
    with pytest.raises(HostPatternError, match="selects no server"):
        select_servers(inventory(), "h1/gpu1,!h1/gpu1")
    with pytest.raises(HostPatternError, match="not a server"):
        select_servers(inventory(), "all,&h1/gpu1")


def test_each_server_has_its_own_files_loop_and_unit() -> None:
    assert server_files("").pid == PID_FILE  # a host's only server keeps the files it always had
    files = server_files("gpu1")
    assert (files.pid, files.log, files.supervisor_script) == (
        "run/rpc-server-gpu1.pid",
        "log/rpc-server-gpu1.log",
        "run/rpc-supervise-gpu1.sh",
    )
    assert unit_name("~/rpcfleet") == "rpcfleet-home-rpcfleet.service"
    assert unit_name("~/rpcfleet", "gpu1") == "rpcfleet-home-rpcfleet--server-gpu1.service"
    assert unit_name("/opt/a-b", "1").endswith("--server-1.service")
    assert len({unit_name("~/rpcfleet", s) for s in ("", "a", "b", "a-b")}) == 4
    loop = supervise_sh(files)
    assert 'pf="$D/run/rpc-server-gpu1.pid"' in loop and 'log="$D/log/rpc-server-gpu1.log"' in loop
    stop = stop_script("/i", 50053, server="gpu1")
    assert 'pf="$D/run/rpc-server-gpu1.pid"' in stop and "rpc-supervisor-gpu1.pid" in stop
    assert "rpc-server.pid" not in stop
    second = servers_of(inventory().hosts[0])[1]
    start = launch_script(second, "/i", "v1")
    assert "run/rpc-supervise-gpu1.sh" in start and "-p 50053" in start and "CUDA1" in start
    assert "rpc-server.pid" not in start and "rpc-server.log" not in start


class _Lock:
    def __init__(self, taken: list[str], name: str) -> None:
        self.taken, self.name = taken, name

    async def release(self) -> None:
        self.taken.remove(self.name)


async def test_the_servers_of_one_host_take_its_lock_once_and_run_one_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run over two servers of one host takes that install's lock once (a second flock from the same
    run would wait for the first: a deadlock), keeps it until both servers' changes ended, and runs
    those changes one after the other (the first switches a version in, the next finds it)."""
    from orchestrator.operations import layer

    taken: list[str] = []

    async def fake_acquire(conn: Any, host: Any, operation: str, **_: Any) -> _Lock:
        assert host.node_name not in taken, "the install's lock taken twice"
        taken.append(host.node_name)
        return _Lock(taken, host.node_name)

    class FakeConnection:
        async def another(self) -> FakeConnection:  # the lock's own connection
            return FakeConnection()

    async def fake_connection(self: Session, host: Any) -> Any:
        return FakeConnection()

    monkeypatch.setattr(layer, "acquire", fake_acquire)
    monkeypatch.setattr(Session, "connection", fake_connection)
    servers = server_hosts(inventory().hosts)
    for _ in range(20):
        locks = HostLocks("restart", OperationOptions())
        async with Session(forks=8) as session:
            assert await locks.enter(session, servers) == {}
        assert taken == ["h1", "h2"]
        assert all(locks.holds(s) for s in servers)
        running: list[str] = []

        async def change(server: Any, locks: HostLocks = locks, running: list[str] = running) -> None:
            async with locks.serial(server):
                running.append(server.name)
                assert len([n for n in running if n.startswith(server.node_name)]) == 1
                await asyncio.sleep(0.001)
                running.remove(server.name)
            await locks.leave(server)

        await asyncio.gather(*(change(s) for s in servers))
        assert taken == []
        # the run's first server of each install changes the install itself, once
        assert [locks.first_of_install(s) for s in [*servers, *servers]] == [True, False, True] + [False] * 3


def test_a_server_pattern_selects_its_machine_where_machines_are_listed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # `inventory list` and `ping` work on machines: `-l h1/gpu1` (as docs/inventories.md writes it) was
    # "host pattern 'h1/gpu1' matches no host or group"
    path = tmp_path / "inv.yml"
    path.write_text(TWO)
    for pattern, machines in [("h1/gpu1", ["h1"]), ("!h1/gpu1", ["h1", "h2"]), ("h2,h1/50052", ["h1", "h2"])]:
        assert main(["inventory", "list", "-i", str(path), "-l", pattern, "--json"]) == 0
        assert [h["name"] for h in json.loads(capsys.readouterr().out)] == machines, pattern
    assert main(["inventory", "list", "-i", str(path), "-l", "h1/nope"]) == 2
    assert "host pattern 'h1/nope' matches no host or group" in capsys.readouterr().err
    assert main(["inventory", "show", "h1/gpu1", "-i", str(path)]) == 2  # was "no host 'h1/gpu1'"
    assert "'h1/gpu1' is a server of host 'h1', not a host" in capsys.readouterr().err


def test_inventory_list_graph_and_show_name_the_servers(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_output.console, "width", 200)
    path = tmp_path / "inv.yml"
    path.write_text(TWO)
    assert main(["inventory", "list", "-i", str(path), "--json"]) == 0
    listed = {h["name"]: h for h in json.loads(capsys.readouterr().out)}
    assert listed["h1"]["endpoints"] == ["10.0.0.1:50052", "10.0.0.1:50053"]
    assert listed["h1"]["rpc_servers"][1] == {
        "name": "gpu1",
        "port": 50053,
        "devices": ["CUDA1"],
        "threads": 4,
    }
    assert main(["inventory", "list", "-i", str(path)]) == 0
    assert "10.0.0.1:50053 (h1/gpu1: CUDA1)" in capsys.readouterr().out
    assert main(["inventory", "graph", "-i", str(path)]) == 0
    graph = capsys.readouterr().out
    rungs = [
        "  |  |--h1",
        "  |  |  |--10.0.0.1:50052 (h1/50052: CUDA0)",
        "  |  |  |--10.0.0.1:50053 (h1/gpu1: CUDA1)",
    ]
    assert "\n".join(rungs) in graph
    assert main(["inventory", "show", "h1", "-i", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "endpoints: 10.0.0.1:50052 (h1/50052: CUDA0), 10.0.0.1:50053 (h1/gpu1: CUDA1)" in shown
    assert "[gpu1: port 50053, devices CUDA1 -t 4]" in shown
    bad = tmp_path / "bad.yml"
    bad.write_text("hosts:\n  h1:\n    rpc_servers: [50052, 50052]\n")
    assert main(["inventory", "list", "-i", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.yml:3:" in err and "both use port 50052" in err and "Traceback" not in err


def test_undeclared_servers_are_the_live_ones_the_host_does_not_declare() -> None:
    """What the node's live pid files say (`LiveServersFact`'s lines) against the host's `rpc_servers`:
    a name dropped from the list, or the single server left from before the list, is undeclared."""
    from orchestrator.inventory.model import Host
    from orchestrator.inventory.variables import RpcServer
    from orchestrator.operations.undeclared import parse_live_servers, server_view, undeclared

    live = parse_live_servers(
        "server -a.pid 101 50052\nloop -a.pid 100\nserver -b.pid 201 50053\nloop -c.pid 300\n"
        "server .pid 401 50060\nnoise\nserver -d.pid notapid 1\n"
    )
    assert [(s.server, s.pid, s.port, s.loop) for s in live] == [
        ("a", 101, 50052, 100),
        ("b", 201, 50053, None),
        ("c", None, None, 300),  # its loop waits to restart it: still running, as far as a user can tell
        ("", 401, 50060, None),
    ]
    two = Host(name="h1", address="10.0.0.1", rpc_servers=(RpcServer(50052, "a"), RpcServer(50053, "b")))
    assert [s.server for s in undeclared(two, live)] == ["c", ""]
    single = Host(name="h1", address="10.0.0.1", rpc_port=50060)
    assert [s.server for s in undeclared(single, live)] == ["a", "b", "c"]
    c, unnamed = undeclared(two, live)
    assert (server_view(two, c).name, server_view(two, c).server, server_view(two, c).rpc_port) == (
        "h1/c",
        "c",
        50052,
    )
    view = server_view(two, unnamed)
    assert (view.name, view.server, view.rpc_port, view.rpc_servers) == ("h1", "", 50060, ())
