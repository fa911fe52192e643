"""Tier 2: `rpc_allow_from` never fails open, with the real iptables (nf_tables) of a lab node and a real
rpc-server deployed over a root SSH login (changing a firewall takes root; the lab's user is not).

A rule iptables refuses (an IPv6 source slipped past the inventory) leaves the old rules, or, where there
were none, a port that rejects every new connection while established ones go on; replacing a list
never leaves a moment without a REJECT (every rule change watched with xtables-monitor); `status` fails
for a running server whose REJECT is gone; a controller that reaches the node over IPv6 is refused and
the port closed; an install dir another user may write is refused before root runs its rules script.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pwd
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.artifacts.manifest import Artifact
from orchestrator.cli import main
from orchestrator.connectors.connect import connect
from orchestrator.core.errors import ServiceError
from orchestrator.inventory.load import load_inventory
from orchestrator.inventory.model import Host
from orchestrator.lab.state import Lab, LabNode
from orchestrator.operations.firewall import apply_firewall
from orchestrator.rpc.wire import HELLO_REPLY_SIZE, device_count_request, hello_request
from tests.plugins.lab import connect_from_controller, connect_from_node, own_lab

pytestmark = [pytest.mark.lab, pytest.mark.llama]

PORT = 50062


@dataclass(frozen=True)
class RootNode:
    """Node 1 of the module's lab with a second sshd that lets root in, over IPv4 and IPv6."""

    lab: Lab
    node: LabNode
    other: LabNode  # another lab node: never in a list unless a test puts it there
    dir: Path
    v6_node: str  # the node's IPv6 address (root's sshd listens there too)
    v6_controller: str  # this machine's, on the lab's bridge

    def host_vars(self, **changes: Any) -> dict[str, Any]:
        return {
            "address": self.node.address,
            "ssh_user": "root",
            "ssh_port": 2222,
            "ssh_key": str(self.lab.client_key),
            "ssh_known_hosts": str(self.dir / "known_hosts"),
            "install_dir": str(self.dir / "install"),
            "rpc_port": PORT,
            "rpc_allow_from": ["controller"],
            "rpc_run_as": "root",  # the node shares this machine's accounts, and the dir is 0700
            **changes,
        }

    def inventory(self, path: Path, **changes: Any) -> Path:
        path.write_text(yaml.safe_dump({"hosts": {"rootnode": self.host_vars(**changes)}}))
        return path

    def tagged(self) -> list[str]:
        rules = self.lab.node_exec(self.node, ["iptables", "-w", "-S", "INPUT"]).stdout.splitlines()
        return [rule for rule in rules if '"rpcfleet ' in rule and f' {PORT}"' in rule]


@pytest.fixture(scope="module")
def root_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RootNode]:
    with own_lab(2, "fw") as lab:
        node, other = lab.nodes
        assert lab.bridge is not None
        directory = tmp_path_factory.mktemp("firewall")
        v6_controller, v6_node = f"fd77:{lab.slot}::1", f"fd77:{lab.slot}::{node.index + 10}"
        # no duplicate address detection: the address is usable at once
        subprocess.run(["ip", "addr", "add", f"{v6_controller}/64", "dev", lab.bridge, "nodad"], check=True)
        lab.node_exec(node, ["ip", "addr", "add", f"{v6_node}/64", "dev", "eth0", "nodad"])
        pub = lab.client_key.with_name(lab.client_key.name + ".pub")
        (directory / "authorized_keys").write_text(pub.read_text())
        key = node.host_key.with_name(node.host_key.name + ".pub").read_text().split()
        (directory / "known_hosts").write_text(
            "".join(f"[{address}]:2222 {key[0]} {key[1]}\n" for address in (node.address, v6_node))
        )
        config = directory / "sshd_config"
        config.write_text(
            f"ListenAddress {node.address}\nListenAddress {v6_node}\nPort 2222\n"
            f'HostKey "{node.host_key}"\nPidFile "{directory / "sshd.pid"}"\n'
            f'AuthorizedKeysFile "{directory / "authorized_keys"}"\nAllowUsers root\n'
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nSubsystem sftp internal-sftp\n"
        )
        lab.node_exec(node, ["/usr/sbin/sshd", "-f", str(config), "-E", str(directory / "sshd.log")])
        deadline = time.monotonic() + 10
        while not (directory / "sshd.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = int((directory / "sshd.pid").read_text())
        try:
            yield RootNode(lab, node, other, directory, v6_node, v6_controller)
        finally:
            os.kill(pid, 15)


@pytest.fixture
def root(root_node: RootNode, tmp_path: Path) -> Iterator[RootNode]:
    """The root node, its server stopped and its INPUT chain emptied after the test (the lab's own)."""
    yield root_node
    main(["-i", str(root_node.inventory(tmp_path / "cleanup.yml")), "stop"])
    root_node.lab.node_exec(root_node.node, ["iptables", "-w", "-F", "INPUT"])


async def _apply(host: Host) -> str:
    async with await connect(host) as conn:
        return (await apply_firewall(conn, host, host.install_dir, install=True)).outcome


def _receive(sock: socket.socket, size: int) -> bytes:
    got = b""
    while len(got) < size:
        chunk = sock.recv(size - len(got))
        assert chunk, f"closed after {len(got)} bytes"
        got += chunk
    return got


def test_a_rule_iptables_refuses_leaves_the_old_rules_or_a_port_that_rejects_all_but_established(
    root: RootNode, cpu_artifact: Artifact, tmp_path: Path
) -> None:
    inventory = root.inventory(tmp_path / "inv.yml")
    assert main(["-i", str(inventory), "deploy"]) == 0
    rules = root.tagged()
    assert len(rules) == 3 and "-j REJECT" in rules[2], rules
    # An IPv6 source, past the inventory's refusal: iptables refuses it after the state rule and the
    # controller's ACCEPT went in.
    host = load_inventory(inventory).hosts[0]
    bad = dataclasses.replace(host, rpc_allow_from=("controller", "fd00::/64"))
    with socket.create_connection((root.node.address, PORT), timeout=5) as live:
        live.sendall(hello_request())
        assert len(_receive(live, 8 + HELLO_REPLY_SIZE)) == 8 + HELLO_REPLY_SIZE
        with pytest.raises(ServiceError) as info:
            asyncio.run(_apply(bad))
        assert connect_from_node(root.lab, root.other, root.node.address, PORT) == "refused"
        assert root.tagged() == rules  # the partial new set deleted, the old one whole
        assert "iptables refused a rule; the previous rules stay" in str(info.value)
        assert info.value.host == "rootnode"
        # With no rule left before it (a reboot under the process supervisor, an admin's flush):
        root.lab.node_exec(root.node, ["iptables", "-w", "-F", "INPUT"])
        with pytest.raises(ServiceError) as info:
            asyncio.run(_apply(bad))
        assert connect_from_node(root.lab, root.other, root.node.address, PORT) == "refused"
        assert "the port now rejects every new connection" in str(info.value)
        closed = root.tagged()
        assert len(closed) == 2, closed
        assert "--ctstate RELATED,ESTABLISHED" in closed[0] and "-j REJECT" in closed[1], closed
        assert connect_from_node(root.lab, root.other, root.node.address, PORT) == "refused"
        assert connect_from_controller(root.node.address, PORT) == "refused"
        live.sendall(device_count_request())  # the established connection goes on
        assert len(_receive(live, 8 + 4)) == 12


class _RuleEvents:
    """Every rule change in a node's IPv4 tables, as xtables-monitor reports it (nf_tables events)."""

    def __init__(self, root: RootNode) -> None:
        assert root.node.namespace is not None
        self.root = root
        argv = ["ip", "netns", "exec", root.node.namespace, "stdbuf", "-oL", "xtables-monitor", "-e", "-4"]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self._mark("begin")  # the monitor listens from here on

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def _mark(self, name: str) -> None:
        """A rule added and deleted again, waited for in the events: what came before it was seen."""
        rule = ["INPUT", "-p", "tcp", "--dport", "9", "-m", "comment", "--comment", f"mark-{name}"]
        rule += ["-j", "ACCEPT"]
        deadline = time.monotonic() + 10
        while not any(f"mark-{name}" in line for line in self.lines):
            assert time.monotonic() < deadline, self.lines
            self.root.lab.node_exec(self.root.node, ["iptables", "-w", "-A", *rule])
            self.root.lab.node_exec(self.root.node, ["iptables", "-w", "-D", *rule])
            time.sleep(0.1)

    def stop(self) -> list[str]:
        self._mark("end")
        self.process.terminate()
        self.process.wait(10)
        self.reader.join(10)
        return [line for line in self.lines if "EVENT:" in line and "mark-" not in line]


def test_replacing_the_list_never_leaves_the_port_without_its_reject(
    root: RootNode, cpu_artifact: Artifact, tmp_path: Path
) -> None:
    old = root.inventory(tmp_path / "old.yml")
    assert main(["-i", str(old), "deploy"]) == 0
    assert connect_from_node(root.lab, root.other, root.node.address, PORT) == "refused"
    rejects = sum("-j REJECT" in rule for rule in root.tagged())
    assert rejects == 1
    new = root.inventory(tmp_path / "new.yml", rpc_allow_from=["controller", root.other.address])
    events = _RuleEvents(root)
    try:
        assert main(["-i", str(new), "deploy"]) == 0
    finally:
        seen = events.stop()
    ours = [line for line in seen if '"rpcfleet ' in line and f' {PORT}"' in line]
    assert any(" -A INPUT" in line for line in ours) and any(" -D INPUT" in line for line in ours), seen
    lowest = rejects
    for line in ours:
        if "-j REJECT" in line:
            rejects += 1 if " -A INPUT" in line else -1 if " -D INPUT" in line else 0
            lowest = min(lowest, rejects)
    assert lowest >= 1, ours  # at every moment a REJECT of ours closed the port
    rules = root.tagged()
    assert len(rules) == 4 and f"-s {root.other.address}/32" in rules[2] and "-j REJECT" in rules[3], rules
    assert connect_from_node(root.lab, root.other, root.node.address, PORT) == "connected"


def test_status_fails_for_a_running_server_whose_reject_is_gone(
    root: RootNode, cpu_artifact: Artifact, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inventory = root.inventory(tmp_path / "inv.yml")

    def status(exit_status: int) -> dict[str, Any]:
        capsys.readouterr()
        assert main(["-i", str(inventory), "status", "--json"]) == exit_status
        return dict(json.loads(capsys.readouterr().out)[0]["result"])

    assert main(["-i", str(inventory), "deploy"]) == 0
    assert status(0)["firewall"] == "ok"
    reject = root.tagged()[-1]
    assert "-j REJECT" in reject
    listed = root.lab.node_exec(root.node, ["iptables", "-w", "-S", "INPUT"]).stdout.splitlines()
    number = [rule for rule in listed if rule.startswith("-A ")].index(reject) + 1
    root.lab.node_exec(root.node, ["iptables", "-w", "-D", "INPUT", str(number)])  # the REJECT alone
    assert connect_from_node(root.lab, root.other, root.node.address, PORT) == "connected"
    result = status(1)
    assert result["firewall"] == "open" and result["state"] == "running", result
    assert "no REJECT: the port is open to everyone" in result["message"], result
    assert main(["-i", str(inventory), "status"]) == 1  # the table too
    root.lab.node_exec(root.node, ["iptables", "-w", "-F", "INPUT"])
    assert status(1)["firewall"] == "missing"
    assert main(["-i", str(inventory), "deploy"]) == 0
    assert status(0)["firewall"] == "ok"


def test_a_controller_that_reaches_the_node_over_ipv6_is_refused_and_the_port_closed(
    root: RootNode, cpu_artifact: Artifact, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # SSH over IPv6, the server bound to the node's IPv4 address: `controller` is an IPv6 address
    install = tmp_path / "install"
    inventory = root.inventory(
        tmp_path / "v6.yml", address=root.v6_node, rpc_host=root.node.address, install_dir=str(install)
    )
    capsys.readouterr()
    assert main(["-i", str(inventory), "deploy"]) == 1
    out = capsys.readouterr()
    closed = root.tagged()
    assert len(closed) == 2 and "-j REJECT" in closed[1], closed
    text = out.out + out.err
    assert f"reaches the node over IPv6 ({root.v6_controller})" in text, text
    assert "rootnode" in text and "Traceback" not in text
    listening = root.lab.node_exec(root.node, ["ss", "-Htln", f"sport = :{PORT}"]).stdout
    assert not listening.strip()  # refused before the server started
    assert not (install / "firewall.sh").exists()  # nothing written for root to run


@pytest.mark.parametrize("how", ["owned by another user", "writable by all"])
def test_an_install_dir_another_user_may_write_is_refused_before_root_runs_its_script(
    how: str, root: RootNode, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    if how == "owned by another user":
        assert root.lab.user is not None
        os.chown(shared, pwd.getpwnam(root.lab.user).pw_uid, -1)
        mode = "755"
    else:
        shared.chmod(0o777)
        mode = "777"
    install = shared / "install"
    install.mkdir()
    marker = tmp_path / "ran"
    planted = f"#!/bin/sh\ntouch {marker}\n"  # what the other user put there
    (install / "firewall.sh").write_text(planted)
    host = load_inventory(root.inventory(tmp_path / "inv.yml", install_dir=str(install))).hosts[0]
    refused = rf"{re.escape(str(shared))} \(owner \S+, mode {mode}\) is not root's alone"
    with pytest.raises(ServiceError, match=refused) as info:
        asyncio.run(_apply(host))
    assert info.value.host == "rootnode"
    assert not marker.exists()
    assert (install / "firewall.sh").read_text() == planted  # neither run nor replaced
    closed = root.tagged()
    assert len(closed) == 2 and "-j REJECT" in closed[1], closed
