"""Tier 2: the user the process supervisor runs the server as (`rpc_run_as`), real servers on a lab node
that boots systemd (its own /etc/passwd, root may log in), reached as root with `supervisor: process`.

Connected as root, the server and its loop run as the dedicated unprivileged user `rpcfleet`, made when
missing (marked as the systemd supervisor marks it); `rpc_run_as: root` runs them as root, with a
warning; a change of user is drift: the next deploy restarts and says why.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shlex
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator.artifacts.manifest import Artifact
from orchestrator.engine.executor import RunResult, Session
from orchestrator.inventory.model import Host
from orchestrator.lab.state import Lab
from orchestrator.operations.cache import cache_path, upload_script
from orchestrator.operations.cache_stream import TEMP_PREFIX
from orchestrator.operations.install.ensure import ArtifactChooser
from orchestrator.operations.install.plan import InstallState
from orchestrator.operations.layer import OperationOptions
from orchestrator.operations.server.state import ServerStatus
from orchestrator.operations.server.steps import make_deploy_step, make_service_step, make_status_step
from orchestrator.operations.systemd import SERVICE_USER_MARK
from tests.plugins.lab import lab_hosts_of, own_lab

pytestmark = pytest.mark.lab

INSTALL = "/opt/rpcfleet"  # outside every home: reachable for the dedicated user
AS_SERVER_USER = ["setpriv", "--reuid=rpcfleet", "--regid=rpcfleet", "--init-groups", "sh", "-c"]


class FixedArtifact(ArtifactChooser):
    def __init__(self, artifact: Artifact) -> None:
        super().__init__()
        self.artifact = artifact

    async def __call__(self, host: Host, state: InstallState) -> Artifact:
        return self.artifact


@pytest.fixture(scope="module")
def ra_lab() -> Iterator[Lab]:
    with own_lab(1, "ra", init="systemd") as made:
        yield made


@pytest.fixture
def root_host(ra_lab: Lab) -> Iterator[Host]:
    """The node reached as root, process supervisor; its server stopped after the test."""
    host = dataclasses.replace(
        lab_hosts_of(ra_lab)[0], ssh_user="root", supervisor="process", install_dir=INSTALL
    )
    yield host
    stopped = _run_sync([host], make_service_step("stopped", OperationOptions(force=True)), "stop")
    assert stopped.ok, [str(r.error) for r in stopped.failed]


@pytest.fixture
def chooser(cpu_artifact: Artifact) -> ArtifactChooser:
    return FixedArtifact(cpu_artifact)


def _run_sync(hosts: list[Host], step: Any, name: str) -> RunResult[Any]:
    return asyncio.run(_run(hosts, step, name))


async def _run(hosts: list[Host], step: Any, name: str) -> RunResult[Any]:
    async with Session(forks=4) as session:
        return await session.run(hosts, step, name=name)


async def _status(host: Host) -> ServerStatus:
    run = await _run([host], make_status_step(), "status")
    assert run.ok, [str(r.error) for r in run.failed]
    value = run.results[0].value
    assert isinstance(value, ServerStatus)
    return value


def _uid_of(lab: Lab, pid: int) -> int:
    """The real uid of process `pid` on the node (the `Uid:` line of /proc/PID/status)."""
    line = lab.node_exec(1, ["grep", "^Uid:", f"/proc/{pid}/status"]).stdout
    return int(line.split()[1])


def _passwd(lab: Lab, user: str) -> list[str]:
    out = lab.node_exec(1, ["getent", "passwd", user], check=False).stdout.strip()
    return out.split(":") if out else []


def _loop_pid(lab: Lab) -> int:
    return int(lab.node_exec(1, ["cat", f"{INSTALL}/run/rpc-supervisor.pid"]).stdout.strip())


async def test_as_root_the_server_runs_as_the_dedicated_user_made_for_it(
    ra_lab: Lab, root_host: Host, chooser: ArtifactChooser
) -> None:
    assert _passwd(ra_lab, "rpcfleet") == []  # a fresh node: rpcfleet makes the account
    deployed = (await _run([root_host], make_deploy_step(chooser), "deploy")).results[0]
    assert deployed.status == "changed", deployed.message
    account = _passwd(ra_lab, "rpcfleet")
    assert account and account[4] == SERVICE_USER_MARK and account[6] == "/usr/sbin/nologin", account
    uid = int(account[2])
    assert uid != 0
    status = await _status(root_host)
    assert (status.state, status.user) == ("running", "rpcfleet"), status
    assert status.pid is not None and _uid_of(ra_lab, status.pid) == uid
    assert _uid_of(ra_lab, _loop_pid(ra_lab)) == uid  # the loop too: nothing of it runs as root
    again = (await _run([root_host], make_deploy_step(chooser), "deploy")).results[0]
    assert again.status == "ok", again.message  # the same user: no drift

    restarted = (await _run([root_host], make_service_step("restarted", OperationOptions()), "r")).results[0]
    assert restarted.status == "changed", restarted.message
    after = await _status(root_host)
    assert after.pid not in (None, status.pid) and after.user == "rpcfleet"
    assert after.pid is not None and _uid_of(ra_lab, after.pid) == uid

    # The loop, as rpcfleet, restarts a killed server (it can write its pid and state files).
    ra_lab.node_exec(1, ["kill", "-9", str(after.pid)])
    for _ in range(100):
        back = await _status(root_host)
        if back.state == "running" and back.pid != after.pid:
            break
        await asyncio.sleep(0.1)
    assert back.state == "running" and back.pid is not None and back.restarts == 1, back
    assert _uid_of(ra_lab, back.pid) == uid

    # A stop is refused while a client holds the server, run as another user or not.
    holder = socket.create_connection((root_host.address, root_host.rpc_port), timeout=2)
    try:
        refused = (await _run([root_host], make_service_step("stopped", OperationOptions()), "s")).results[0]
        assert refused.status == "failed" and "refusing to stop a busy server" in str(refused.error)
        assert (await _status(root_host)).pid == back.pid
    finally:
        holder.close()
    stopped = (await _run([root_host], make_service_step("stopped", OperationOptions()), "stop")).results[0]
    assert stopped.status == "changed", stopped.message
    assert (await _status(root_host)).state == "stopped"
    left = ra_lab.node_exec(1, ["pgrep", "-u", "rpcfleet"], check=False).stdout.split()
    assert left == [], left


async def test_changing_rpc_run_as_is_drift_and_root_comes_with_a_warning(
    ra_lab: Lab, root_host: Host, chooser: ArtifactChooser
) -> None:
    assert (await _run([root_host], make_deploy_step(chooser), "deploy")).ok
    before = await _status(root_host)
    as_root = dataclasses.replace(root_host, rpc_run_as="root")
    moved = (await _run([as_root], make_deploy_step(chooser), "deploy")).results[0]
    assert moved.status == "changed" and "runs as rpcfleet -> root" in moved.message, moved.message
    warnings = moved.value.warnings
    assert any("runs as root (rpc_run_as: root)" in w for w in warnings), warnings
    now = await _status(as_root)
    assert now.user == "root" and now.pid not in (None, before.pid) and now.pid is not None
    assert _uid_of(ra_lab, now.pid) == 0 and _uid_of(ra_lab, _loop_pid(ra_lab)) == 0
    # Root runs the loop's script again: the dirs it lies in are root's, not the other user's.
    owners = ra_lab.node_exec(1, ["stat", "-c", "%U", f"{INSTALL}/run", f"{INSTALL}/log"]).stdout.split()
    assert owners == ["root", "root"], owners
    same = (await _run([as_root], make_deploy_step(chooser), "deploy")).results[0]
    assert same.status == "ok" and any("runs as root" in w for w in same.value.warnings), same.message

    back = (await _run([root_host], make_deploy_step(chooser), "deploy")).results[0]
    assert back.status == "changed" and "runs as root -> rpcfleet" in back.message, back.message
    assert not any("root" in w for w in back.value.warnings), back.value.warnings
    final = await _status(root_host)
    assert final.user == "rpcfleet" and final.pid is not None and _uid_of(ra_lab, final.pid) != 0


async def test_what_cannot_run_as_the_user_is_a_clear_error(
    ra_lab: Lab, root_host: Host, chooser: ArtifactChooser
) -> None:
    # /root is 0700: the dedicated user cannot reach a server installed below it.
    in_root_home = dataclasses.replace(root_host, install_dir="~/rpcfleet")
    try:
        failed = (await _run([in_root_home], make_deploy_step(chooser), "deploy")).results[0]
        assert failed.status == "failed", failed.message
        text = str(failed.error)
        assert "rpcfleet cannot reach /root/rpcfleet/versions/" in text and "install_dir" in text, text
        assert (await _status(in_root_home)).state == "stopped"
    finally:
        await _run([in_root_home], make_service_step("stopped", OperationOptions(force=True)), "stop")
    unknown = dataclasses.replace(root_host, rpc_run_as="nosuchuser")
    failed = (await _run([unknown], make_deploy_step(chooser), "deploy")).results[0]
    assert failed.status == "failed" and "there is no user nosuchuser" in str(failed.error), failed.error
    assert _passwd(ra_lab, "nosuchuser") == []
    # Another user needs root: the lab user cannot switch.
    as_lab_user = dataclasses.replace(lab_hosts_of(ra_lab)[0], supervisor="process", rpc_run_as="rpcfleet")
    try:
        failed = (await _run([as_lab_user], make_deploy_step(chooser), "deploy")).results[0]
        assert failed.status == "failed", failed.message
        assert "rpc_run_as: rpcfleet needs rpcfleet to connect as root" in str(failed.error), failed.error
    finally:
        await _run([as_lab_user], make_service_step("stopped", OperationOptions(force=True)), "stop")


async def test_root_never_writes_through_a_link_the_server_user_planted(
    ra_lab: Lab, root_host: Host, chooser: ArtifactChooser
) -> None:
    """The server's user owns run/, log/ and cache/. A compromised server plants links there to files
    only root may change; the next deploy, start, lock and cache warm (as root) leave those files as
    they were: the lock lives in the install dir, the log marker and the loop's script are written as the
    server's user, and the cache takes fresh files only (noclobber)."""
    deployed = (await _run([root_host], make_deploy_step(chooser), "deploy")).results[0]
    assert deployed.status == "changed", deployed.message
    await _run([root_host], make_service_step("stopped", OperationOptions(force=True)), "stop")
    targets = {f"/etc/rpcfleet-target-{i}": f"a file of root, {i}" for i in range(5)}
    for path, text in targets.items():
        ra_lab.node_exec(1, ["sh", "-c", f"printf %s '{text}' > {path} && chmod 644 {path}"])

    def plant(link: str, target: str) -> None:
        ra_lab.node_exec(
            1, [*AS_SERVER_USER, f'mkdir -p "$(dirname {link})" && rm -f {link} && ln -s {target} {link}']
        )

    plant(f"{INSTALL}/run/lock", "/etc/rpcfleet-target-0")  # the old lock's place: chmod 600 followed it
    plant(f"{INSTALL}/run/lock.info", "/etc/rpcfleet-target-1")
    started = await _run([root_host], make_service_step("running", OperationOptions()), "start")
    assert started.results[0].status == "changed", started.results[0].message
    await _run([root_host], make_service_step("stopped", OperationOptions(force=True)), "stop")
    for link, target in [("log/rpc-server.log", 2), ("run/rpc-supervise.sh.tmp", 3)]:
        plant(f"{INSTALL}/{link}", f"/etc/rpcfleet-target-{target}")  # the start is refused: written as
        refused = await _run([root_host], make_service_step("running", OperationOptions()), "start")
        assert refused.results[0].status == "failed", refused.results[0].message  # the user, it may not
        ra_lab.node_exec(1, ["rm", "-f", f"{INSTALL}/{link}"])
    # The cache warm's upload: a link planted at its temporary name is not written through.
    script = upload_script(root_host, "0123456789abcdef", 4).replace("$$", "77")
    tmp = f"{cache_path(root_host)}/{TEMP_PREFIX}0123456789abcdef.77"
    plant(tmp, "/etc/rpcfleet-target-4")
    ra_lab.node_exec(1, ["sh", "-c", f"printf abcd | sh -c {shlex.quote(script)}"])
    for path, text in targets.items():
        got = ra_lab.node_exec(1, ["stat", "-c", "%a %U", path]).stdout.split()
        assert got == ["644", "root"], (path, got)
        assert ra_lab.node_exec(1, ["cat", path]).stdout == text, path
