"""operations/server/steps.py, server.py and process.py: bind policy, the node state built from facts,
classification and plans (pure), then real servers on loopback through `connection: local` hosts and an
in-process SSH host, and the CLI commands."""

from __future__ import annotations

import asyncio
import dataclasses
import getpass
import itertools
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from orchestrator.artifacts.manifest import Artifact
from orchestrator.cli import main
from orchestrator.connectors.connect import connect
from orchestrator.core.errors import ServiceError
from orchestrator.facts.server import Listener, ProcessState, SupervisorLoop
from orchestrator.facts.system import OsInfo
from orchestrator.facts.systemd import SystemdInfo
from orchestrator.inventory.model import Host
from orchestrator.operations.install.ensure import ArtifactChooser
from orchestrator.operations.install.plan import InstallState
from orchestrator.operations.launch import desired_launch, launch_diff, run_as_user, server_argv
from orchestrator.operations.server.process import launch_script
from orchestrator.operations.server.state import (
    LOG_MARKER,
    NodeState,
    ServerStatus,
    bind_policy,
    classify,
    node_state_from_facts,
    server_status,
)
from orchestrator.operations.server.steps import deploy, ensure_state, plan_service, rollback
from orchestrator.rpc.client import probe_endpoint
from orchestrator.rpc.records import DeviceMemory, Outcome, ProbeResult, ProtocolVersion
from tests.plugins.servers import free_port
from tests.procs import file_reader, kill_supervised, wait_gone
from tests.waits import until_value

# ---------------------------------------------------------------- pure

H = Host(name="n1", address="10.77.0.11", rpc_host="10.77.0.11")


@pytest.mark.parametrize("bind", ["10.77.0.11", "127.0.0.1", "192.168.1.5", "172.16.0.1"])
def test_private_and_loopback_binds_are_fine(bind: str) -> None:
    assert bind_policy(dataclasses.replace(H, rpc_host=bind)) is None


@pytest.mark.parametrize("bind", ["0.0.0.0", "8.8.8.8"])
def test_public_binds_need_allow_public_bind(bind: str) -> None:
    host = dataclasses.replace(H, rpc_host=bind)
    with pytest.raises(ServiceError, match=r"refusing to bind .* no authentication") as info:
        bind_policy(host)
    assert info.value.host == "n1" and "allow_public_bind" in (info.value.hint or "")
    warning = bind_policy(dataclasses.replace(host, allow_public_bind=True))
    assert warning is not None and "anyone who reaches it" in warning


@pytest.mark.parametrize("bind", ["localhost", "::1"])
def test_only_ipv4_literals_bind(bind: str) -> None:
    with pytest.raises(ServiceError, match="IPv4"):
        bind_policy(dataclasses.replace(H, rpc_host=bind))


def test_server_argv_and_launch_line() -> None:
    host = dataclasses.replace(
        H, rpc_port=50099, rpc_devices=("CUDA0", "CUDA1"), rpc_threads=6, rpc_cache=True, rpc_debug=True
    )
    argv = server_argv(host, "/home/lab/i", "v1")
    assert argv == [
        "/home/lab/i/versions/v1/bin/ggml-rpc-server",
        *("-H", "10.77.0.11", "-p", "50099", "-d", "CUDA0,CUDA1", "-t", "6", "-c"),
    ]
    script = launch_script(host, "/home/lab/i", "v1")
    assert "trap '' PIPE" in script
    # the loop, as $as, opens its log itself and runs the line
    loop = """setsid nohup $as sh -c 'exec >>"$1" 2>&1; shift; exec sh "$@"' sh "$D/log/rpc-server.log" """
    loop += '"$D/run/rpc-supervise.sh" "$D" v1 '
    assert loop + "env LLAMA_CACHE=/home/lab/i/cache GGML_RPC_DEBUG=1 stdbuf -oL " in script
    assert "</dev/null >/dev/null 2>&1 &\ni=0" in script  # never `&& ... &`
    assert "GGML_RPC_DEBUG" not in launch_script(H, "/i", "v1")
    assert "-d" not in server_argv(H, "/i", "v1") and "-c" not in server_argv(H, "/i", "v1")


def test_the_user_the_process_supervisor_runs_the_server_as() -> None:
    root = SystemdInfo(pid1=None, uid=0, login="root")
    lab = SystemdInfo(pid1=None, uid=1000, login="lab")
    assert run_as_user(H, root) == "rpcfleet"  # never root over SSH unless the inventory says so
    assert run_as_user(H, lab) == "lab"  # already unprivileged
    assert run_as_user(dataclasses.replace(H, rpc_run_as="root"), root) == "root"
    assert run_as_user(dataclasses.replace(H, rpc_run_as="svc"), lab) == "svc"
    assert run_as_user(dataclasses.replace(H, connection="local"), root) == "rpcfleet"  # root locally too
    assert run_as_user(H, None) is None
    # The same user: nothing to switch; root keeps the dirs; another user: made, given the dirs, switched.
    assert "setpriv" not in launch_script(H, "/i", "v1", user="lab", login="lab")
    as_root = launch_script(H, "/i", "v1", user="root", login="root")
    assert 'chown -R 0:0 "$D/run" "$D/log" "$D/cache"' in as_root and "setpriv" not in as_root
    switched = launch_script(H, "/i", "v1", user="rpcfleet", login="root")
    assert "useradd --system" in switched and "--comment 'rpcfleet rpc-server' rpcfleet" in switched
    assert 'as="setpriv --reuid=$U' in switched and 'as="runuser -u $U --"' in switched
    # A change of user is drift, said as such; an unknown user (an old reading) is none.
    want = desired_launch(H, "/i", "v1", "rpcfleet")
    assert launch_diff(want, dataclasses.replace(want, user="root")) == ("runs as root -> rpcfleet",)
    assert launch_diff(want, dataclasses.replace(want, user=None)) == ()


OURS = Listener("10.77.0.11:50052", "ggml-rpc-server", 4242)
RUNNING = ProcessState(4242, "Sl", "/home/lab/i/versions/v1/bin/ggml-rpc-server")


def _node(
    process: ProcessState = RUNNING,
    listeners: tuple[Listener, ...] | None = (OURS,),
    clients: tuple[str, ...] | None = ("10.77.0.1:38366",),
    bind_failed: bool = False,
    current: str | None = "v1",
    loop: SupervisorLoop | None = None,
) -> NodeState:
    """A NodeState built from parsed facts, as `read_node_state` builds it."""
    values = {
        "install_dir": "/home/lab/i",
        "os": OsInfo("Linux", "x86_64", "debian", "12", None),
        "current_link": f"versions/{current}" if current else None,
        "versions": ("v1",),
        "history": ("v1",),
        "free_space": None,
        "installed_manifest": None,
        "server_process": process,
        "listeners": listeners,
        "rpc_clients": clients,
        "log_match": bind_failed,
        "supervisor_loop": loop,
    }
    return node_state_from_facts("n1", values)


def test_the_process_supervisors_loop_in_status_and_plans() -> None:
    dead = ProcessState(4242, "", None)
    gave_up = SupervisorLoop(None, "crash-looping", 4, "exited with status 1", 5, 0, "error: NOPE0\nKilled")
    status = classify(H, _node(dead, (), (), loop=gave_up), None)
    assert (status.state, status.restarts, status.last_exit) == ("crash-looping", 4, "exited with status 1")
    assert status.message.startswith("5 failures within 60 s, the last: exited with status 1")
    assert status.message.endswith("last log lines:\nerror: NOPE0\nKilled")
    assert plan_service(status, "running", current="v1").action == "start"
    assert plan_service(status, "stopped", current="v1").action == "stop"
    waiting = SupervisorLoop(77, "restarting", 0, "killed by signal 9", delay=2)
    status = classify(H, _node(dead, (), (), loop=waiting), None)
    assert status.state == "crashed" and "restarts it in 2 s" in status.message
    ok = ProbeResult(H.endpoint, Outcome.OK, ProtocolVersion(7, 0, 0), (), "ok", 0.001)
    running = classify(H, _node(clients=(), loop=SupervisorLoop(77, "running", 1, "killed by signal 9")), ok)
    assert (running.state, running.restarts, running.last_exit) == ("running", 1, "killed by signal 9")


def test_node_state_from_facts() -> None:
    s = _node().service
    assert (s.pid, s.stat, s.alive, s.ours, s.running_version) == (4242, "Sl", True, True, "v1")
    assert s.listeners == (OURS,) and s.clients == ("10.77.0.1:38366",) and s.foreign_listeners() == ()
    assert not s.log_failed_bind and s.install_dir == "/home/lab/i"
    without_ss = _node(listeners=None, clients=None).service
    assert without_ss.listeners == () and without_ss.clients == ()


def test_a_recycled_pid_or_a_zombie_is_not_ours() -> None:
    recycled = _node(ProcessState(4242, "S", "/usr/bin/sleep")).service
    assert recycled.alive and not recycled.ours and recycled.running_version is None
    zombie = _node(ProcessState(4242, "Z", None)).service
    assert not zombie.alive and not zombie.ours
    gone = _node(ProcessState(4242, "", None)).service
    assert gone.stat == "" and not gone.alive
    other_install = ProcessState(4242, "Sl", "/home/lab/other/versions/v1/bin/ggml-rpc-server")
    assert not _node(other_install).service.ours


def _probe(outcome: Outcome, message: str = "") -> ProbeResult:
    version = ProtocolVersion(7, 0, 0) if outcome is Outcome.OK else None
    return ProbeResult("10.77.0.11:50052", outcome, version, (DeviceMemory(0, 1, 1),), message, 0.001)


def test_classify() -> None:
    running = _node(clients=())
    assert classify(H, running, _probe(Outcome.OK)).state == "running"
    assert classify(H, running, _probe(Outcome.OK)).protocol == "7.0.0"
    # the protocol has its own column in `status`: the detail does not say it again
    assert classify(H, running, _probe(Outcome.OK, "protocol 7.0.0, 1 device(s)")).message == "1 device(s)"
    # what `status` really has: a HELLO-only probe, which lists no devices (not "no devices")
    hello_only = replace(_probe(Outcome.OK, "protocol 7.0.0"), devices=())
    assert classify(H, running, hello_only).message == "answers HELLO"
    assert classify(H, running, _probe(Outcome.BUSY)).state == "busy"
    unhealthy = classify(H, running, _probe(Outcome.TIMEOUT, "no reply"))
    assert unhealthy.state == "unhealthy" and "no reply" in unhealthy.message
    busy = classify(H, _node(), None)
    assert busy.state == "busy" and busy.clients == ("10.77.0.1:38366",)
    exited = ProcessState(9, "", None)
    crashed = classify(H, _node(exited, (), ()), None)
    assert crashed.state == "crashed" and crashed.pid == 9 and "exited" in crashed.message
    bindfail = _node(exited, (), (), bind_failed=True)
    assert "could not bind" in classify(H, bindfail, None).message
    stopped = classify(H, _node(ProcessState(None), (), ()), None)
    assert (stopped.state, stopped.pid, stopped.version) == ("stopped", None, "v1")
    foreign = (Listener("10.77.0.11:50052", "python3", 77),)
    taken = classify(H, _node(ProcessState(None), foreign, ()), None)
    assert taken.state == "stopped" and "taken" in taken.message and "python3 (pid 77)" in taken.message


def _status(state: str, running: str | None = "v1", pid: int | None = 5) -> ServerStatus:
    return ServerStatus("n1", "e", state, pid, "v1", running, "7.0.0")  # type: ignore[arg-type]


def test_plan_service() -> None:
    assert plan_service(_status("running"), "running", current="v1").action == "none"
    assert plan_service(_status("busy"), "running", current="v1").action == "none"
    assert plan_service(_status("stopped", None, None), "running", current="v1").action == "start"
    assert plan_service(_status("crashed", None), "running", current="v1").action == "start"
    upgrade = plan_service(_status("running"), "running", current="v2")
    assert upgrade.action == "restart" and "running v1, installed v2" in upgrade.reason
    assert plan_service(_status("unhealthy"), "running", current="v1").action == "restart"
    assert plan_service(_status("stopped", None, None), "stopped", current="v1").action == "none"
    assert plan_service(_status("crashed", None), "stopped", current="v1").action == "stop"
    assert plan_service(_status("busy"), "stopped", current="v1").action == "stop"
    assert plan_service(_status("running"), "restarted", current="v1").action == "restart"
    assert plan_service(_status("stopped", None, None), "restarted", current="v1").action == "start"


# ---------------------------------------------------------------- real servers on loopback

_octet = itertools.count(150)


@pytest.fixture
def local_host(tmp_path: Path) -> Iterator[Host]:
    """A `connection: local` host with its own install folder and its own 127.0.0.x bind address."""
    address = f"127.0.0.{next(_octet) % 100 + 150}"
    host = Host(
        name="local1",
        address="127.0.0.1",
        connection="local",
        rpc_host=address,
        rpc_port=free_port(address),
        install_dir=str(tmp_path / "inst"),
        rpc_run_as=getpass.getuser(),  # this machine's own account: no dedicated user made here
    )
    yield host
    _kill_from_pid_file(host)


def _kill_from_pid_file(host: Host) -> None:
    kill_supervised(file_reader(Path(host.install_dir)))


def _pid(host: Host) -> int:
    return int((Path(host.install_dir) / "run" / "rpc-server.pid").read_text())


def _exists(path: str | Path) -> bool:
    return Path(path).exists()


def _environ(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def _spawn(*argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv)


def _sigpipe_ignored(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGPIPE - 1)))
    raise AssertionError("no SigIgn line")


@pytest.fixture
async def chooser(cpu_artifact: Artifact) -> AsyncIterator[ArtifactChooser]:
    yield ArtifactChooser(cpu_artifact.id)


async def test_deploy_lifecycle_on_a_local_host(
    local_host: Host, chooser: ArtifactChooser, cpu_artifact: Artifact, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = dataclasses.replace(local_host, rpc_debug=True, rpc_threads=1)
    conn = await connect(host)
    planned = await deploy(conn, host, chooser, check=True)
    assert planned.install.action == "install" and planned.service.action == "start"
    assert not _exists(host.install_dir)  # --check changed nothing

    first = await deploy(conn, host, chooser)
    assert first.changed and first.install.action == "install" and first.service.action == "start"
    pid = _pid(host)
    assert _sigpipe_ignored(pid)
    environ = _environ(pid)
    assert b"GGML_RPC_DEBUG=1" in environ
    assert f"LLAMA_CACHE={host.install_dir}/cache".encode() in environ
    log = (Path(host.install_dir) / "log" / "rpc-server.log").read_text()
    assert LOG_MARKER in log and "Starting RPC server v7.0.0" in log  # line-buffered: there at once

    status = await server_status(conn, host)
    assert (status.state, status.pid, status.version, status.protocol) == (
        "running", pid, cpu_artifact.id, "7.0.0",
    )  # fmt: skip

    commands: list[str] = []
    run = conn.run

    async def counted(command: str, **kwargs: Any) -> Any:
        commands.append(command)
        return await run(command, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(conn, "run", counted)
        second = await deploy(conn, host, chooser)
    assert not second.changed and _pid(host) == pid
    assert len(commands) == 1  # a deploy with nothing to do: one state read (and one HELLO)

    # A client holds the server: busy, and deploy leaves it alone.
    with socket.create_connection((host.rpc_host, host.rpc_port), timeout=2):
        held = await until_value(lambda: server_status(conn, host), lambda s: s.state == "busy", what="busy")
        assert held.state == "busy" and held.clients
        assert not (await deploy(conn, host, chooser)).changed

    os.kill(pid, signal.SIGKILL)
    wait_gone(pid)
    crashed = await server_status(conn, host)  # the process supervisor restarts it in 1 s
    assert crashed.state == "crashed" and crashed.pid == pid, crashed
    assert "killed by signal 9: the process supervisor restarts it in 1 s" in crashed.message
    deadline = asyncio.get_running_loop().time() + 20  # its 1 s, with headroom for a busy machine
    while (back := await server_status(conn, host)).state != "running":
        assert asyncio.get_running_loop().time() < deadline, back
        await asyncio.sleep(0.1)
    assert back.pid == _pid(host) != pid and (back.restarts, back.last_exit) == (1, "killed by signal 9")
    assert _sigpipe_ignored(back.pid) and b"GGML_RPC_DEBUG=1" in _environ(back.pid)  # the same launch line
    assert not (await deploy(conn, host, chooser)).changed

    restarted = await ensure_state(conn, host, "restarted")
    assert restarted.action == "restart"
    new_pid = _pid(host)
    stopped = await ensure_state(conn, host, "stopped")
    assert stopped.action == "stop"
    wait_gone(new_pid)
    assert (await server_status(conn, host)).state == "stopped"
    assert (await ensure_state(conn, host, "stopped")).action == "none"


async def test_a_timed_out_probe_does_not_kill_a_held_server(
    local_host: Host, chooser: ArtifactChooser
) -> None:
    conn = await connect(local_host)
    await deploy(conn, local_host, chooser)
    pid = _pid(local_host)
    holder = socket.create_connection((local_host.rpc_host, local_host.rpc_port), timeout=2)
    try:
        probe = await probe_endpoint(
            local_host.endpoint, connect_timeout=1, read_timeout=0.3, deadline=1, hello_only=True
        )
        assert probe.outcome in (Outcome.BUSY, Outcome.TIMEOUT)
    finally:
        holder.close()
    # The server now reads the probe's HELLO and writes to a closed socket: SIGPIPE, ignored. It takes
    # connections in order: it answers this HELLO only after that (and not at all had SIGPIPE killed it).
    again = await probe_endpoint(local_host.endpoint, hello_only=True)
    assert again.ok, again.message
    assert _pid(local_host) == pid and _exists(f"/proc/{pid}")


async def test_a_taken_port_is_a_clear_error(local_host: Host, chooser: ArtifactChooser) -> None:
    conn = await connect(local_host)
    with socket.socket() as squatter:
        squatter.bind((local_host.rpc_host, local_host.rpc_port))
        squatter.listen(1)
        with pytest.raises(ServiceError, match=rf"port {local_host.rpc_port} is already taken") as info:
            await deploy(conn, local_host, chooser)
        assert f"pid={os.getpid()}" not in str(info.value)  # named in words, not ss's syntax
        assert f"(pid {os.getpid()})" in str(info.value)
        status = await server_status(conn, local_host)
        assert status.state == "stopped" and "taken" in status.message


async def test_a_recycled_pid_is_never_signalled(local_host: Host, chooser: ArtifactChooser) -> None:
    conn = await connect(local_host)
    await deploy(conn, local_host, chooser)
    await ensure_state(conn, local_host, "stopped")
    stranger = _spawn("sleep", "30")
    try:
        pid_file = Path(local_host.install_dir) / "run" / "rpc-server.pid"
        pid_file.write_text(f"{stranger.pid}\n")
        status = await server_status(conn, local_host)
        assert status.state == "crashed" and "another program" in status.message
        change = await ensure_state(conn, local_host, "stopped")
        assert change.action == "stop"
        assert stranger.poll() is None and not pid_file.exists()
    finally:
        stranger.kill()
        stranger.wait()


async def test_rollback_restarts_on_the_previous_version(
    local_host: Host, chooser: ArtifactChooser, cpu_artifact: Artifact
) -> None:
    conn = await connect(local_host)
    await deploy(conn, local_host, chooser)
    first_pid = _pid(local_host)
    v2 = dataclasses.replace(cpu_artifact, id=f"{cpu_artifact.id}-v2")
    await chooser.forget()
    upgraded = await deploy(conn, local_host, _FixedChooser(v2))
    assert upgraded.install.action == "install" and upgraded.service.action == "restart"
    assert (await server_status(conn, local_host)).running_version == v2.id
    back = await rollback(conn, local_host)
    assert back.install.version == cpu_artifact.id and back.service.action == "restart"
    status = await server_status(conn, local_host)
    assert (status.state, status.version, status.running_version) == (
        "running",
        cpu_artifact.id,
        cpu_artifact.id,
    )
    assert _pid(local_host) != first_pid


class _FixedChooser(ArtifactChooser):
    def __init__(self, artifact: Artifact) -> None:
        super().__init__()
        self.artifact = artifact

    async def __call__(self, host: Host, state: InstallState) -> Artifact:
        return self.artifact


async def test_deploy_over_ssh_with_upload_progress(
    fake_hosts: Callable[..., list[object]], chooser: ArtifactChooser, cpu_artifact: Artifact
) -> None:
    fake = fake_hosts(1)[0]
    host = dataclasses.replace(fake.host, rpc_port=free_port(fake.host.rpc_host))  # type: ignore[attr-defined]
    seen: list[tuple[int, int]] = []
    conn = await connect(host)
    try:
        result = await deploy(conn, host, chooser, progress=lambda h, c: lambda d, t: seen.append((d, t)))
        assert result.install.action == "install" and result.service.action == "start"
        assert seen and seen[-1] == (cpu_artifact.size, cpu_artifact.size)
        assert (await server_status(conn, host)).state == "running"
        assert not (await deploy(conn, host, chooser)).changed
        assert (await ensure_state(conn, host, "stopped")).action == "stop"
    finally:
        await ensure_state(conn, host, "stopped")
        await conn.close()


# ---------------------------------------------------------------- the CLI


def _json_out(stdout: str) -> Any:
    return json.loads(stdout)  # stdout must be the document alone: logs go to stderr


def test_cli_deploy_status_stop(
    local_host: Host, cpu_artifact: Artifact, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(
        "hosts:\n"
        "  l1:\n"
        "    connection: local\n"
        f"    rpc_host: {local_host.rpc_host}\n"
        f"    rpc_port: {local_host.rpc_port}\n"
        f"    install_dir: {local_host.install_dir}\n"
        f"    rpc_artifact: {cpu_artifact.id}\n"
        f"    rpc_run_as: {getpass.getuser()}\n"
    )
    assert main(["deploy", "-i", str(inventory), "--check"]) == 0
    assert "would change" in capsys.readouterr().out and not Path(local_host.install_dir).exists()
    assert main(["deploy", "-i", str(inventory)]) == 0
    out = capsys.readouterr().out
    assert "install" in out and "recap" in out
    assert main(["deploy", "-i", str(inventory), "--json"]) == 0
    again = _json_out(capsys.readouterr().out)
    assert again[0]["status"] == "ok" and again[0]["result"]["install"]["action"] == "none"
    assert main(["status", "-i", str(inventory), "--json"]) == 0
    status = _json_out(capsys.readouterr().out)[0]["result"]
    assert status["state"] == "running" and status["version"] == cpu_artifact.id
    assert main(["logs", "-i", str(inventory), "-n", "5"]) == 0
    assert "l1" in capsys.readouterr().out
    assert main(["stop", "-i", str(inventory)]) == 0
    assert "stop" in capsys.readouterr().out
    assert main(["status", "-i", str(inventory), "--json"]) == 0
    assert _json_out(capsys.readouterr().out)[0]["result"]["state"] == "stopped"
    public = inventory.read_text().replace(local_host.rpc_host, "0.0.0.0")
    inventory.write_text(public)
    assert main(["start", "-i", str(inventory)]) == 1
    assert "refusing to bind" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() != 0, reason="the rule is about a controller that runs as root")
def test_a_local_host_deployed_by_root_runs_its_server_as_the_dedicated_user(
    local_host: Host, cpu_artifact: Artifact, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Never root unless the inventory says `rpc_run_as: root`: a `connection: local` host under a
    controller running as root gets the unprivileged `rpcfleet` user, as an SSH host reached as root."""
    folder = Path(tempfile.mkdtemp(prefix="rpcfleet-run-as-"))  # reachable by another user, unlike tmp_path
    folder.chmod(0o755)
    existed = subprocess.run(["id", "-u", "rpcfleet"], capture_output=True).returncode == 0
    inventory = tmp_path_factory.mktemp("inv") / "inventory.yml"
    install = folder / "inst"
    inventory.write_text(
        "hosts:\n"
        "  l1:\n"
        "    connection: local\n"
        f"    rpc_host: {local_host.rpc_host}\n"
        f"    rpc_port: {local_host.rpc_port}\n"
        f"    install_dir: {install}\n"
        f"    rpc_artifact: {cpu_artifact.id}\n"
    )
    try:
        assert main(["deploy", "-i", str(inventory)]) == 0
        pid = int((install / "run" / "rpc-server.pid").read_text())
        uid = Path(f"/proc/{pid}").stat().st_uid  # the process's user
        assert uid != 0 and pwd.getpwuid(uid).pw_name == "rpcfleet"
    finally:
        main(["stop", "-i", str(inventory), "--force"])
        kill_supervised(file_reader(install))
        if not existed:
            subprocess.run(["userdel", "rpcfleet"], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def test_status_names_a_server_built_without_keepalive_or_exit_status() -> None:
    """From the installed manifest: an artifact without the patches (imported, or built before they
    were applied on the node) frees no vanished client and reports no failed bind: `status` says so."""
    from orchestrator.artifacts.manifest import Manifest
    from orchestrator.artifacts.patches import PATCHES

    running = _node(clients=())

    def with_patches(*names: str) -> NodeState:
        labels = tuple(p.label for p in PATCHES if p.name in names)
        manifest = Manifest("7.0.0", "cpu", "linux", "x86_64", False, (), patches=labels)
        return replace(running, install=replace(running.install, manifest=manifest))

    patched = classify(H, with_patches("keepalive", "exit-status", "warm-wait"), _probe(Outcome.OK))
    assert "patch" not in patched.message, patched.message
    bare = classify(H, with_patches(), _probe(Outcome.OK)).message
    assert "built without the keepalive, exit-status patches (its manifest)" in bare, bare
    assert "holds it until its TCP gives up" in bare and "no supervisor restarts" in bare
    half = classify(H, with_patches("keepalive"), None).message
    assert "without the exit-status patch (its manifest)" in half and "keepalive" not in half, half
