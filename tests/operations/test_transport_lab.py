"""Tier 2: `rpc_transport: ssh` and `rpc_allow_from` on a lab of this module (namespaces, real sshd).

With ssh transport the deployed servers listen on their node's loopback only, the controller reaches
them through one SSH forward per node (OpenSSH, host keys verified), `run` generates text through them,
and a forward killed during a load is a clean error naming the node's real endpoint. With
`rpc_allow_from: [controller]` (deployed over a root SSH connection to a node) the controller connects
and another lab node is refused; stopping the server removes the rule.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from orchestrator.artifacts.manifest import Artifact
from orchestrator.cli import main
from orchestrator.connectors.connect import connect
from orchestrator.connectors.tunnel import OpenSSHTunnel, Tunnels
from orchestrator.core.errors import RpcfleetError, UnreachableError
from orchestrator.engine.threads import start_thread
from orchestrator.inventory.load import load_inventory
from orchestrator.inventory.model import Host
from orchestrator.lab.lifecycle import inventory_document
from orchestrator.lab.state import Lab, LabNode
from orchestrator.operations.firewall import apply_firewall
from orchestrator.rpc.client import probe_endpoint
from orchestrator.rpc.records import Outcome
from orchestrator.rpc.wire import HELLO_REPLY_SIZE, device_count_request, hello_request
from tests.plugins.lab import connect_from_controller, connect_from_node, own_lab

pytestmark = [pytest.mark.lab, pytest.mark.llama]

RPC_PORT = 50052


@pytest.fixture(scope="module")
def transport_lab() -> Iterator[Lab]:
    with own_lab(3, "tr") as made:
        yield made


def _write_inventory(lab: Lab, path: Path, **common: Any) -> Path:
    doc = inventory_document(lab)
    doc["vars"].update(common)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _forwarders(pid: int) -> list[psutil.Process]:
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        if cmd[:2] == ["ssh", "-M"] and "-L" in cmd:
            found.append(child)
    return found


@pytest.fixture(scope="module")
def ssh_inventory(
    transport_lab: Lab, cpu_artifact: Artifact, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    path = _write_inventory(
        transport_lab, tmp_path_factory.mktemp("transport") / "ssh.yml", rpc_transport="ssh"
    )
    assert main(["-i", str(path), "deploy"]) == 0
    return path


def test_ssh_transport_deploys_on_loopback_only_and_run_generates_through_the_forwards(
    transport_lab: Lab, ssh_inventory: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes = transport_lab.nodes
    for i, node in enumerate(nodes):
        lines = transport_lab.node_exec(node, ["ss", "-Htln", f"sport = :{RPC_PORT}"]).stdout.splitlines()
        listening = [line.split()[3] for line in lines]  # the local address of each listener
        assert listening == [f"127.0.0.1:{RPC_PORT}"], lines
        # Nothing answers on the node's address: neither here nor from another lab node.
        assert connect_from_controller(node.address, RPC_PORT) == "refused"
        other = (i + 1) % len(nodes)
        assert connect_from_node(transport_lab, nodes[other], node.address, RPC_PORT) == "refused"
    capsys.readouterr()
    assert main(["-i", str(ssh_inventory), "status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    text = json.dumps(status)
    assert text.count('"transport": "ssh"') == len(nodes), text
    assert text.count('"state": "running"') == len(nodes), text
    argv = ["-i", str(ssh_inventory), "run", "-m", str(tiny_model), "-p", "hello", "-n", "8"]
    assert main([*argv, "--ctx", "512", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"].strip()
    endpoints = {d["endpoint"] for d in out["placement"]["devices"]}
    # Plans and placements name the real hosts, never the forwards.
    assert endpoints == {f"{n.address}:{RPC_PORT}" for n in nodes}, endpoints
    assert not _forwarders(os.getpid())  # the forwards lived as long as the command
    # A playbook too: restart (readiness through the forward), probe, plan, load_check.
    preload = Path(__file__).resolve().parents[2] / "playbooks" / "preload.yml"
    argv = [
        "-i",
        str(ssh_inventory),
        "run-playbook",
        str(preload),
        "-e",
        f"model={tiny_model}",
        "-e",
        "ctx=512",
    ]
    assert main(argv) == 0, capsys.readouterr()
    assert not _forwarders(os.getpid())


def test_a_forward_killed_during_a_load_is_a_clean_error_naming_the_node(
    transport_lab: Lab, ssh_inventory: Path, tiny_model_factory: Any, tmp_path: Path
) -> None:
    model = tiny_model_factory(n_layer=6, n_embd=1024, n_head=8, n_head_kv=8, n_ff=2816)  # about 130 MB
    victim = transport_lab.nodes[1]
    assert victim.veth is not None
    shape = ["tc", "qdisc", "replace", "dev", victim.veth, "root", "tbf", "rate", "80mbit"]
    subprocess.run([*shape, "burst", "64kb", "latency", "100ms"], check=True)
    try:
        argv = [sys.executable, "-m", "orchestrator", "-i", str(ssh_inventory), "run", "-m", str(model)]
        env = {**os.environ, "RPCFLEET_HOME": str(tmp_path), "COLUMNS": "200"}
        run = subprocess.Popen(
            [*argv, "-p", "hi", "-n", "4", "--ctx", "512"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        killed = None
        seen: set[str] = set()
        deadline = time.monotonic() + 60
        while killed is None and time.monotonic() < deadline and run.poll() is None:
            # The load is under way when the victim's server holds a connection that lasts (the same
            # peer in two polls 0.3 s apart): the probe's connections come and go.
            held = transport_lab.node_exec(
                victim, ["ss", "-Htn", "state", "established", f"sport = :{RPC_PORT}"]
            )
            peers = {line.split()[-1] for line in held.stdout.splitlines() if line.strip()}
            mine = [p for p in _forwarders(run.pid) if victim.address in " ".join(p.cmdline())]
            if peers & seen and mine:
                mine[0].kill()
                killed = time.monotonic()
            seen = peers
            time.sleep(0.3)
        assert killed is not None, run.communicate(timeout=30)
        _, err_bytes = run.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", victim.veth, "root"], check=False)
    err = err_bytes.decode()
    assert run.returncode == 1, err
    assert f"lost {victim.address}:{RPC_PORT} (refused) while loading the model" in err, err
    assert "127.0.0.1" not in err.split("hint")[0], err  # the real host, not the forward
    assert "Traceback" not in err
    assert took < 30, took


def _tagged_rules(lab: Lab, node: LabNode) -> list[str]:
    rules = lab.node_exec(node, ["iptables", "-w", "-S", "INPUT"]).stdout.splitlines()
    return [rule for rule in rules if '"rpcfleet ' in rule]


@pytest.fixture
def root_node(transport_lab: Lab, tmp_path: Path) -> Iterator[tuple[LabNode, Path]]:
    """Node 2 with a second sshd that lets root in (key auth, its own known_hosts entry): the lab's
    user is not root, and changing a node's firewall takes root."""
    node = transport_lab.nodes[1]
    pub = transport_lab.client_key.with_name(transport_lab.client_key.name + ".pub")
    (tmp_path / "authorized_keys").write_text(pub.read_text())
    host_pub = node.host_key.with_name(node.host_key.name + ".pub").read_text().split()
    (tmp_path / "known_hosts").write_text(f"[{node.address}]:2222 {host_pub[0]} {host_pub[1]}\n")
    config = tmp_path / "sshd_config"
    config.write_text(
        "\n".join(
            [
                f"ListenAddress {node.address}",
                "Port 2222",
                f'HostKey "{node.host_key}"',
                f'PidFile "{tmp_path / "sshd.pid"}"',
                f'AuthorizedKeysFile "{tmp_path / "authorized_keys"}"',
                "AllowUsers root",
                "PermitRootLogin prohibit-password",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "Subsystem sftp internal-sftp",
            ]
        )
        + "\n"
    )
    transport_lab.node_exec(node, ["/usr/sbin/sshd", "-f", str(config), "-E", str(tmp_path / "sshd.log")])
    deadline = time.monotonic() + 10
    while not (tmp_path / "sshd.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int((tmp_path / "sshd.pid").read_text())
    inventory = {
        "hosts": {
            "rootnode": {
                "address": node.address,
                "ssh_user": "root",
                "ssh_port": 2222,
                "ssh_key": str(transport_lab.client_key),
                "ssh_known_hosts": str(tmp_path / "known_hosts"),
                "install_dir": str(tmp_path / "install"),
                "rpc_port": 50053,
                "rpc_allow_from": ["controller"],
                # This node shares the machine's accounts, and tmp_path is 0700: no dedicated user here.
                "rpc_run_as": "root",
            }
        }
    }
    path = tmp_path / "root.yml"
    path.write_text(yaml.safe_dump(inventory))
    try:
        yield node, path
    finally:
        os.kill(pid, 15)
        # A failed test leaves no rule behind: deleted by number, as their text may hold shell syntax.
        while _tagged_rules(transport_lab, node):
            rules = transport_lab.node_exec(node, ["iptables", "-w", "-S", "INPUT"]).stdout.splitlines()
            number = [r for r in rules if r.startswith("-A ")].index(_tagged_rules(transport_lab, node)[0])
            transport_lab.node_exec(node, ["iptables", "-w", "-D", "INPUT", str(number + 1)])


def test_rpc_allow_from_admits_the_controller_only_and_goes_with_the_server(
    transport_lab: Lab,
    cpu_artifact: Artifact,
    root_node: tuple[LabNode, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    node, inventory = root_node
    other = transport_lab.nodes[2]
    assert main(["-i", str(inventory), "deploy"]) == 0, capsys.readouterr()
    rules = _tagged_rules(transport_lab, node)
    controller = node.address.rsplit(".", 1)[0] + ".1"  # the bridge: the controller as the node sees it
    assert len(rules) == 3, rules
    assert "--ctstate RELATED,ESTABLISHED" in rules[0] and "-j ACCEPT" in rules[0], rules
    assert f"-s {controller}/32" in rules[1], rules
    assert "-j ACCEPT" in rules[1] and "--dport 50053" in rules[1] and "-j REJECT" in rules[2], rules
    assert connect_from_controller(node.address, 50053) == "connected"
    assert connect_from_node(transport_lab, other, node.address, 50053) == "refused"
    assert connect_from_node(transport_lab, other, node.address, 22) == "connected"  # only the RPC port
    # Idempotent: a second deploy leaves the same rules.
    assert main(["-i", str(inventory), "deploy"]) == 0
    assert _tagged_rules(transport_lab, node) == rules
    # The rule goes with the server.
    assert main(["-i", str(inventory), "stop"]) == 0
    assert _tagged_rules(transport_lab, node) == []
    assert connect_from_node(transport_lab, other, node.address, 50053) == "refused"  # nothing listens


def _comment_of(rule: str) -> str:
    """The comment of an `iptables -S` line, unescaped as libxtables escaped it (`\\"`, `\\\\`, `\\'`)."""
    rest = rule.split('--comment "', 1)[1]
    out, escaped = [], False
    for char in rest:
        if escaped:
            out.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            return "".join(out)
        else:
            out.append(char)
    raise AssertionError(f"unterminated comment in {rule!r}")


def test_a_hostile_install_dir_runs_nothing_and_its_rules_stay_right(
    transport_lab: Lab, root_node: tuple[LabNode, Path]
) -> None:
    """install_dir is in the rules' comment, which the firewall script reads back from `iptables -S`:
    shell syntax in it must never run (as root), and quotes in it must not lose track of the rules."""
    node, inventory = root_node
    host = load_inventory(inventory).hosts[0]
    # a short folder: pytest-xdist's tmp_path would take the paths past the comment's 255 bytes
    base = Path(tempfile.mkdtemp(prefix="rf", dir="/tmp"))
    pwned = base / "pwned"
    hostile = [
        f"{base}/rf$(touch {pwned})`touch {pwned}`",  # no quote: the listing shows it as is
        f"{base}/rf \"$(touch {pwned})\" 'x' \\ $HOME;touch {pwned}",  # quotes, backslashes: escaped
    ]
    wider = dataclasses.replace(host, rpc_allow_from=("controller", "10.77.0.0/16"))

    async def apply(which: Host, install_dir: str, *, install: bool) -> str:
        async with await connect(which) as conn:
            return (await apply_firewall(conn, which, install_dir, install=install)).outcome

    for install_dir in hostile:
        tag = f"rpcfleet {install_dir} 50053"

        def ours(tag: str = tag) -> list[str]:
            return [r for r in _tagged_rules(transport_lab, node) if _comment_of(r) == tag]

        assert asyncio.run(apply(host, install_dir, install=True)) == "installed"
        assert len(ours()) == 3 and "-j ACCEPT" in ours()[1] and "-j REJECT" in ours()[2], ours()
        assert asyncio.run(apply(host, install_dir, install=True)) == "unchanged"  # found again
        assert asyncio.run(apply(wider, install_dir, install=True)) == "installed"  # replaced: read back
        assert len(ours()) == 4 and "-s 10.77.0.0/16" in ours()[2], ours()
        assert asyncio.run(apply(host, install_dir, install=False)) == "removed"
        assert ours() == [] and _tagged_rules(transport_lab, node) == []
        assert not pwned.exists()
        assert transport_lab.node_exec(node, ["test", "-e", str(pwned)], check=False).returncode == 1
    shutil.rmtree(base)


def test_a_live_client_is_not_reset_when_another_operators_deploy_replaces_the_list(
    transport_lab: Lab, cpu_artifact: Artifact, root_node: tuple[LabNode, Path]
) -> None:
    """`controller` is whoever deploys: another operator's no-op deploy replaces the ACCEPT, and the
    established connection of the first operator's client must live on (the state rule)."""
    node, inventory = root_node
    assert main(["-i", str(inventory), "deploy"]) == 0
    host = load_inventory(inventory).hosts[0]
    other_operator = dataclasses.replace(host, rpc_allow_from=("192.0.2.9",))

    async def replace_list() -> str:
        async with await connect(other_operator) as conn:
            result = await apply_firewall(conn, other_operator, host.install_dir, install=True)
            return result.outcome

    with socket.create_connection((node.address, 50053), timeout=5) as live:
        live.sendall(hello_request())
        assert len(_receive(live, 8 + HELLO_REPLY_SIZE)) == 8 + HELLO_REPLY_SIZE
        assert asyncio.run(replace_list()) == "installed"
        assert connect_from_controller(node.address, 50053) == "refused"  # the new list holds
        live.sendall(device_count_request())  # reset here without the state rule
        assert len(_receive(live, 8 + 4)) == 12
    assert main(["-i", str(inventory), "stop"]) == 0


def _receive(sock: socket.socket, size: int) -> bytes:
    got = b""
    while len(got) < size:
        chunk = sock.recv(size - len(got))
        assert chunk, f"closed after {len(got)} bytes"
        got += chunk
    return got


def test_status_says_firewall_missing_and_a_restart_installs_it_again(
    transport_lab: Lab,
    cpu_artifact: Artifact,
    root_node: tuple[LabNode, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    node, inventory = root_node
    other = transport_lab.nodes[2]

    def firewall(exit_status: int = 0) -> str:
        capsys.readouterr()
        assert main(["-i", str(inventory), "status", "--json"]) == exit_status
        return str(json.loads(capsys.readouterr().out)[0]["result"]["firewall"])

    assert main(["-i", str(inventory), "deploy"]) == 0
    assert firewall() == "ok"
    transport_lab.node_exec(node, ["iptables", "-w", "-F", "INPUT"])  # as a reboot or an admin would
    assert firewall(exit_status=1) == "missing"  # open to everyone: status fails
    assert connect_from_node(transport_lab, other, node.address, 50053) == "connected"
    assert main(["-i", str(inventory), "restart", "--rolling"]) == 0  # operations.restart starts it
    assert firewall() == "ok"
    assert connect_from_node(transport_lab, other, node.address, 50053) == "refused"
    assert main(["-i", str(inventory), "stop"]) == 0


def test_rpc_allow_from_without_root_is_a_clear_error(
    transport_lab: Lab, cpu_artifact: Artifact, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write_inventory(
        transport_lab, tmp_path / "allow.yml", rpc_allow_from=["controller"], rpc_port=50054
    )
    node = transport_lab.nodes[2]
    capsys.readouterr()
    assert main(["-i", str(path), "-l", node.name, "deploy"]) == 1
    out = capsys.readouterr()
    text = out.out + out.err
    assert "rpc_allow_from needs root on the node" in text and "is not root" in text, text
    assert "Traceback" not in text
    assert _tagged_rules(transport_lab, node) == []
    lines = transport_lab.node_exec(node, ["ss", "-Htln", "sport = :50054"]).stdout
    assert not lines.strip()  # refused before the server started


async def test_a_dead_forward_is_opened_again_on_the_next_dial(
    transport_lab: Lab, ssh_inventory: Path
) -> None:
    host = load_inventory(ssh_inventory).hosts[0]
    with Tunnels() as tunnels:
        first = tunnels.target(host).dial
        assert tunnels.target(host).dial == first  # reused
        assert (await probe_endpoint(first)).outcome is Outcome.OK
        tunnel = tunnels.tunnel(host)
        assert isinstance(tunnel, OpenSSHTunnel)
        tunnel.process.kill()
        tunnel.process.wait(timeout=5)
        assert (await probe_endpoint(first, connect_timeout=2, deadline=3)).outcome is Outcome.REFUSED
        again = tunnels.target(host).dial
        assert again != first
        assert (await probe_endpoint(again)).outcome is Outcome.OK
    assert not _forwarders(os.getpid())


@pytest.mark.parametrize("forwarder", ["openssh", "asyncssh"])
async def test_a_forward_asked_for_by_a_passing_thread_lives_on_the_runtime(
    forwarder: str, transport_lab: Lab, ssh_inventory: Path
) -> None:
    """Forwards are the runtime's, not their caller's: one opened for a thread that then ends keeps
    forwarding (openssh: started by the runtime's spawner thread, whose end alone would fire its
    parent-death signal; asyncssh: on the runtime's `LoopThread`, which `close` ends)."""
    host = load_inventory(ssh_inventory).hosts[0]
    dialed: list[str] = []
    with Tunnels(forwarder) as tunnels:  # type: ignore[arg-type]
        start_thread(lambda: dialed.append(tunnels.target(host).dial), name="passing").join()
        await asyncio.sleep(1.0)  # a parent-death signal from the passing thread would have landed
        assert (await probe_endpoint(dialed[0])).outcome is Outcome.OK
        loops = [t for t in threading.enumerate() if t.name == "rpcfleet-tunnels"]
        assert len(loops) == (forwarder == "asyncssh")
    assert not any(t.is_alive() for t in loops)
    assert not _forwarders(os.getpid())


async def test_a_hostile_ssh_config_in_home_breaks_both_clients_and_the_tests_empty_one_none(
    transport_lab: Lab, ssh_inventory: Path, empty_ssh_home: Path
) -> None:
    """What keeps a developer's own `~/.ssh/config` out of the tests is the autouse empty `~/.ssh`
    (tests/plugins/home.py), and it holds for both SSH clients: the asyncssh connector and the OpenSSH
    forwarder read HOME's config (ssh itself would read the passwd entry's home: `-F`). With the empty
    one, the lab's own key and known_hosts connect; a hostile one (`ProxyCommand false`) breaks both."""
    host = load_inventory(ssh_inventory).hosts[0]
    assert host.ssh_key and host.ssh_known_hosts  # the lab's, named by its inventory

    async def login() -> str:
        async with await connect(host) as conn:
            return (await conn.run("echo in")).stdout.strip()

    assert await login() == "in"
    with Tunnels() as tunnels:
        assert (await probe_endpoint(tunnels.target(host).dial)).outcome is Outcome.OK
    (empty_ssh_home / ".ssh" / "config").write_text("Host *\n  ProxyCommand false\n")
    with pytest.raises(RpcfleetError):
        await login()
    with Tunnels() as tunnels, pytest.raises(UnreachableError):
        tunnels.target(host)


def test_serve_generates_through_the_forwards(
    transport_lab: Lab, ssh_inventory: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """`rpcfleet serve` over rpc_transport: ssh: its worker dials the forwards, /health names real hosts."""
    import urllib.request

    import openai

    from tests.plugins.servers import free_port

    # An earlier test of this module may leave a server stopped: every server started, before serve plans.
    assert main(["-i", str(ssh_inventory), "start"]) == 0
    port = free_port()
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "orchestrator", "serve", "-i", str(ssh_inventory), "-m", str(tiny_model)]
    argv += ["--ctx", "512", "--port", str(port), "--model-name", "tiny", "--split"]
    with log.open("wb") as out:
        env = {**os.environ, "RPCFLEET_API_KEY": "k"}
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline, health = time.monotonic() + 90, {}
        while time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()[-3000:]
            try:
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/health", headers={"Authorization": "Bearer k"}
                )
                with urllib.request.urlopen(request, timeout=5) as answer:
                    health = json.loads(answer.read())
            except OSError:
                health = {}
            if health.get("status") == "ready":
                break
            time.sleep(0.2)
        assert health.get("status") == "ready", (health, log.read_text()[-3000:])
        assert set(health["plan"]["endpoints"]) == {f"{n.address}:{RPC_PORT}" for n in transport_lab.nodes}
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=60)
        reply = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0)
        assert reply.choices[0].text.strip()
        forwards = _forwarders(process.pid)
        assert forwards  # its worker's connections go through serve's own forwards
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(30)
    _gone, alive = psutil.wait_procs(forwards, timeout=10)
    assert not alive  # the forwards lived as long as serve


_HOLD_A_FORWARD = """
import sys
from orchestrator.connectors.tunnel import Tunnels
from orchestrator.inventory.load import load_inventory
host = load_inventory(sys.argv[1]).hosts[0]
tunnels = Tunnels()
print(tunnels.target(host).dial, tunnels.tunnel(host).process.pid, flush=True)
sys.stdin.read()
"""


def test_a_controller_killed_with_sigkill_leaves_no_forward(ssh_inventory: Path) -> None:
    controller = subprocess.Popen(
        [sys.executable, "-c", _HOLD_A_FORWARD, str(ssh_inventory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert controller.stdout is not None
    dialed, pid = controller.stdout.readline().split()
    forward = psutil.Process(int(pid))
    assert forward.cmdline()[:2] == ["ssh", "-M"] and forward.is_running()
    controller.kill()
    controller.wait(5)
    forward.wait(10)  # psutil.TimeoutExpired if the forward outlived its controller
    host, port = dialed.rsplit(":", 1)
    assert connect_from_controller(host, int(port)) == "refused"
