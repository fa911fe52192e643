"""Tier 2: the operations layer under the conditions that break orchestrators (issue 13).

Real OpenSSH nodes in network namespaces, real servers, a real model generating through them. Each race
is looped, not sampled: concurrent version switches, interrupts at random moments, restarts against a
busy fleet. After every round the truth is read from outside rpcfleet (the node's sockets and /proc):
exactly one server per host, the tracked one, running the version `current` names.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.artifacts.manifest import Artifact
from orchestrator.cli import main
from orchestrator.core.poll import poll
from orchestrator.engine.executor import RunResult, Session
from orchestrator.inventory.model import Host
from orchestrator.lab.state import Lab
from orchestrator.operations.install.ensure import ArtifactChooser
from orchestrator.operations.install.plan import InstallState
from orchestrator.operations.layer import OperationOptions
from orchestrator.operations.server.state import ServerStatus
from orchestrator.operations.server.steps import DeployResult, make_deploy_step, make_status_step
from tests.plugins.playbooks import PLAYBOOKS, NodeView

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]


class _Fixed(ArtifactChooser):
    """Always this artifact (a variant of the real one under another id stands for another version)."""

    def __init__(self, artifact: Artifact) -> None:
        super().__init__()
        self.artifact = artifact

    async def __call__(self, host: Host, state: InstallState) -> Artifact:
        return self.artifact


@pytest.fixture
def versions(cpu_artifact: Artifact) -> tuple[Artifact, Artifact]:
    return (
        dataclasses.replace(cpu_artifact, id=f"{cpu_artifact.id}-one"),
        dataclasses.replace(cpu_artifact, id=f"{cpu_artifact.id}-two"),
    )


@dataclasses.dataclass(frozen=True)
class Truth:
    """A node as the kernel sees it: the pid file, who listens on the port and from which version."""

    tracked: int | None
    listeners: tuple[tuple[int, str | None], ...]  # (pid, version of its binary)
    current: str | None
    argv: tuple[str, ...]
    env: dict[str, str]


def _proc(pid: int, name: str) -> bytes:
    """/proc/PID/NAME, or nothing for a process that exited meanwhile (a restart in progress)."""
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def truth(lab: Lab, host: Host, port: int | None = None) -> Truth:
    view = NodeView(lab, host)
    out = lab.node_exec(host.name, ["ss", "-Hltnp", f"sport = :{port or host.rpc_port}"]).stdout
    pids = sorted({int(p.split("=")[1]) for p in out.split() for p in p.split(",") if p.startswith("pid=")})
    listeners = []
    for pid in pids:
        binary = _proc(pid, "cmdline").split(b"\0")[0].decode()
        parts = binary.split("/versions/")
        listeners.append((pid, parts[1].split("/")[0] if len(parts) == 2 else None))
    link = view.root / "current"
    current = str(link.readlink()).rstrip("/").split("/")[-1] if link.is_symlink() else None
    tracked = view.pid()
    argv: tuple[str, ...] = ()
    env: dict[str, str] = {}
    if tracked:
        argv = tuple(a.decode() for a in _proc(tracked, "cmdline").split(b"\0") if a)
        for item in _proc(tracked, "environ").split(b"\0"):
            key, _, value = item.decode(errors="replace").partition("=")
            if key in ("LLAMA_CACHE", "GGML_RPC_DEBUG"):
                env[key] = value
    return Truth(tracked, tuple(listeners), current, argv, env)


def assert_one_true_server(lab: Lab, hosts: list[Host], statuses: dict[str, ServerStatus]) -> None:
    for host in hosts:
        seen = truth(lab, host)
        assert len(seen.listeners) == 1, f"{host.name}: listeners {seen.listeners}"
        pid, version = seen.listeners[0]
        assert pid == seen.tracked, f"{host.name}: {pid} listens, the pid file says {seen.tracked}"
        assert version == seen.current, f"{host.name}: running {version}, current {seen.current}"
        status = statuses[host.name]
        assert status.state == "running" and status.pid == pid and status.running_version == version


async def statuses_of(hosts: list[Host]) -> dict[str, ServerStatus]:
    async with Session() as session:
        run = await session.run(hosts, make_status_step(), name="status")
    assert run.ok, [str(r.error) for r in run.failed]
    return {r.host.name: r.value for r in run.results if isinstance(r.value, ServerStatus)}


@pytest.fixture
def fleet(deployed: list[Host]) -> list[Host]:
    return deployed


def _inventory_with(lab: Lab, path: Path, **variables: Any) -> Path:
    doc = yaml.safe_load(lab.inventory.read_text())
    doc["vars"].update(variables)
    path.write_text(yaml.safe_dump(doc))
    return path


# --- two operators at once ---------------------------------------------------------------------------------


@pytest.mark.soak
async def test_concurrent_version_switching_deploys_leave_one_true_server(
    lab: Lab, fleet: list[Host], versions: tuple[Artifact, Artifact], rounds: int
) -> None:
    """Two deploys at the same instant: one gets every host; the other fails at once having changed
    nothing (exit 3), or waits and deploys every host after it. Never some hosts each (issue 21)."""
    from orchestrator.cli._running import LOCKED_EXIT, exit_status

    async def operator(artifact: Artifact, wait: float) -> RunResult[Any]:
        async with Session() as session:
            step = make_deploy_step(_Fixed(artifact), OperationOptions(wait_lock=wait))
            return await session.run(fleet, step, name="deploy")

    views = [NodeView(lab, h) for h in fleet]
    for round_no in range(rounds):
        one, two = versions if round_no % 2 == 0 else versions[::-1]
        # half the rounds wait for the lock, half fail fast; the first two one of each, every order by 4
        wait = 60.0 if round_no % 4 in (0, 3) else 0.0
        before = [truth(lab, h).current for h in fleet]
        starts = [v.starts() for v in views]
        first, second = await asyncio.gather(operator(one, wait), operator(two, wait))
        now = [truth(lab, h).current for h in fleet]
        assert len(set(now)) == 1, f"round {round_no}: the hosts were split: {now}"
        if wait:
            assert first.ok and second.ok, [str(r.error) for r in (*first.failed, *second.failed)]
        else:
            winner, loser = (first, second) if first.ok else (second, first)
            assert winner.ok, [str(r.error) for r in winner.failed]
            assert exit_status([loser]) == LOCKED_EXIT, [str(r.error) for r in loser.results]
            assert not loser.succeeded  # it changed nothing: no host started
            assert all("is being changed by" in r.message for r in loser.results), loser.results
            won = one.id if winner is first else two.id
            assert now == [won] * len(fleet)
            # Only the winner restarted servers: at most once per host (not at all where it was current).
            for view, was, count in zip(views, before, starts, strict=True):
                assert view.starts() == count + (0 if was == won else 1), (view.host.name, was, won)
        assert_one_true_server(lab, fleet, await statuses_of(fleet))


# --- interrupts ---------------------------------------------------------------------------------------------


@pytest.mark.soak
async def test_interrupts_at_random_moments_leave_every_host_old_or_new_never_stopped(
    lab: Lab, fleet: list[Host], versions: tuple[Artifact, Artifact], rounds: int
) -> None:
    rng = random.Random(13)
    # An uninterrupted deploy first: how long one takes here, so that every interrupt falls inside a run.
    started = time.monotonic()
    async with Session(forks=1) as session:
        run = await session.run(
            fleet, make_deploy_step(_Fixed(versions[1]), OperationOptions()), name="deploy"
        )
    assert run.ok and not run.interrupted
    span = time.monotonic() - started
    landed = 0
    for round_no in range(rounds):
        target = versions[round_no % 2]
        before = {h.name: truth(lab, h).current for h in fleet}
        async with Session(forks=1) as session:  # one host at a time: an interrupt falls between hosts too
            step = make_deploy_step(_Fixed(target), OperationOptions())
            asyncio.get_running_loop().call_later(rng.uniform(0.0, span), session.interrupt, "SIGINT")
            run = await session.run(fleet, step, name="deploy")
        landed += run.interrupted
        if run.interrupted:  # it landed in this run: what it stopped says so
            assert session.interrupted == "SIGINT"
        statuses = await statuses_of(fleet)
        assert_one_true_server(lab, fleet, statuses)  # every host serves, old or new
        for result in run.results:
            now = truth(lab, result.host).current
            if result.status == "changed":
                assert now == target.id
            elif result.status == "ok":  # already on the target (an earlier round was interrupted first)
                assert now == before[result.host.name] == target.id
            elif result.status == "skipped":
                assert run.interrupted, "a host is skipped only by an interrupt that landed"
                assert "not started: SIGINT" in result.message and now == before[result.host.name]
            else:
                pytest.fail(f"{result.host.name}: {result.status} {result.error}")
    # The loop proves something only if the interrupts came during the runs, not after them.
    assert landed >= rounds // 2, (
        f"only {landed} of {rounds} interrupts landed during a deploy ({span:.2f} s)"
    )


def test_sigint_to_the_cli_during_a_deploy_prints_the_recap_and_the_finishing_command(
    lab: Lab, fleet: list[Host], tmp_path: Path
) -> None:
    """The real signal path: Ctrl-C to `rpcfleet deploy` at three moments of a run, each proven to be
    inside it: once every lock is held (the first host being changed), and right after the first host
    was changed (then with a random delay of up to 50 ms). Each must land: status 130, the recap."""
    rng = random.Random(7)
    for round_no in range(3):
        threads = 1 + round_no % 2 + 1  # each round changes the launch line: every host is restarted
        inventory = _inventory_with(lab, tmp_path / f"inv{round_no}.yml", rpc_threads=threads)
        child = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "deploy", "-i", str(inventory), "--forks", "1"],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

        def changed(threads: int = threads) -> list[str]:
            return [h.name for h in fleet if f"-t {threads}" in " ".join(truth(lab, h).argv)]

        deadline = time.monotonic() + 60
        # The deploy takes every host's lock (each lock file names it) before it changes any.
        infos = [NodeView(lab, h).root / "lock.info" for h in fleet]
        while not all(info.exists() and str(child.pid) in info.read_text() for info in infos):
            assert child.poll() is None and time.monotonic() < deadline, "the deploy never held its locks"
            time.sleep(0.01)
        if round_no > 0:
            while not changed():  # the first host is done: two are left (one at a time)
                assert child.poll() is None and time.monotonic() < deadline, "no host was changed"
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.05) if round_no == 2 else 0.0)
        at_signal = changed()
        assert len(at_signal) < len(fleet) - 1 and child.poll() is None  # hosts are left: it lands mid-run
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)
        assert "Traceback" not in out + err
        statuses = asyncio.run(statuses_of(fleet))
        assert_one_true_server(lab, fleet, statuses)
        done = changed()
        pending = [h.name for h in fleet if h.name not in done]
        assert child.returncode == 130, err
        assert "interrupted" in err and "finish with: rpcfleet deploy" in err, err
        assert pending and f"-l {','.join(pending)}" in err, err
        assert set(at_signal) <= set(done) and done, "the host in flight when Ctrl-C came must have finished"


# --- a model generating through the fleet -------------------------------------------------------------------

_CLIENT = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    import orchestrator as rf

    inventory, model, stop = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    hosts = list(rf.load_inventory(inventory).hosts)
    fleet = asyncio.run(rf.probe_fleet(hosts))
    plan = rf.make_plan(rf.to_plan_devices(fleet), rf.profile_model(model), rf.PlanOptions(n_ctx=256))
    llm = rf.load_llama(plan, model, verbose=False)
    print("loaded", flush=True)
    tokens = 0
    while not stop.exists():
        out = llm("Once upon a time", max_tokens=16, temperature=0.0)
        tokens += out["usage"]["completion_tokens"]
    llm.close()
    print("tokens", tokens, flush=True)
    """
)


@pytest.fixture
def generating(lab: Lab, fleet: list[Host], tiny_model: Path, tmp_path: Path) -> Iterator[Path]:
    """A model loaded across the lab's three servers, generating until the yielded stop file exists."""
    stop = tmp_path / "stop"
    client = subprocess.Popen(
        [sys.executable, "-c", _CLIENT, str(lab.inventory), str(tiny_model), str(stop)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert client.stdout is not None
    line = client.stdout.readline()
    assert line.strip() == "loaded", client.stderr.read() if client.stderr else ""
    yield stop
    stop.touch()
    out, err = client.communicate(timeout=60)
    assert client.returncode == 0, err[-2000:]
    assert int(out.split()[-1]) > 0  # it generated, and finished its generation


@pytest.mark.soak(quick=5)
def test_restarts_against_a_generating_fleet_are_all_refused(
    lab: Lab,
    fleet: list[Host],
    generating: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    rounds: int,
) -> None:
    views = [NodeView(lab, h) for h in fleet]
    pids, starts = [v.pid() for v in views], [v.starts() for v in views]
    inv = str(lab.inventory)
    changed = str(_inventory_with(lab, tmp_path / "threads.yml", rpc_threads=2))
    attempts = [
        ["restart", "-i", inv],
        ["restart", "--rolling", "-i", inv],
        ["run-playbook", str(PLAYBOOKS / "rolling-restart.yml"), "-i", inv],
        ["stop", "-i", inv],
        ["deploy", "-i", changed],  # a launch-line change would restart: refused while busy
    ]
    for attempt in range(rounds):  # the suite: each command once
        argv = attempts[attempt % len(attempts)]
        assert main(argv) == 1, argv
        out = capsys.readouterr()
        assert "busy" in out.out + out.err, argv
        assert [v.pid() for v in views] == pids and [v.starts() for v in views] == starts, argv
    assert all(v.server_alive() for v in views)


# --- desired state includes the launch line -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("variables", "flag", "expect"),
    [
        (
            {"rpc_threads": 2},
            "-t 2 added",
            lambda t: "-t" in t.argv and t.argv[t.argv.index("-t") + 1] == "2",
        ),
        ({"rpc_cache": True}, "-c added", lambda t: "-c" in t.argv),
        ({"rpc_debug": True}, "GGML_RPC_DEBUG=1 added", lambda t: t.env.get("GGML_RPC_DEBUG") == "1"),
        ({"rpc_devices": ["CPU"]}, "-d CPU added", lambda t: "-d" in t.argv and "CPU" in t.argv),
        ({"rpc_port": 50062}, "-p 50052 -> 50062", lambda t: t.argv[t.argv.index("-p") + 1] == "50062"),
    ],
    ids=["threads", "cache", "debug", "devices", "port"],
)
def test_each_launch_line_variable_is_applied_by_the_next_deploy(
    lab: Lab,
    fleet: list[Host],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    variables: dict[str, Any],
    flag: str,
    expect: Any,
) -> None:
    inventory = str(_inventory_with(lab, tmp_path / "changed.yml", **variables))
    before = [truth(lab, h) for h in fleet]
    assert main(["deploy", "-i", inventory, "--check"]) == 0
    out = capsys.readouterr().out
    assert out.count(f"launch line: {flag}") == len(fleet), out
    assert [truth(lab, h).tracked for h in fleet] == [t.tracked for t in before]  # --check changed nothing

    assert main(["deploy", "-i", inventory, "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    for result in results:
        assert result["status"] == "changed" and flag in result["message"]
        assert result["message"].startswith("restarted: running pid")
    port = variables.get("rpc_port")
    for host in fleet:
        seen = truth(lab, host, port)
        assert expect(seen), seen.argv
        assert len(seen.listeners) == 1 and seen.listeners[0][0] == seen.tracked

    assert main(["deploy", "-i", inventory, "--json"]) == 0  # applied: the same inventory changes nothing
    assert [r["status"] for r in json.loads(capsys.readouterr().out)] == ["ok"] * len(fleet)
    assert main(["deploy", "-i", str(lab.inventory)]) == 0  # and back
    capsys.readouterr()
    assert all(len(truth(lab, h).listeners) == 1 for h in fleet)


# --- orphans ---------------------------------------------------------------------------------------------


async def test_an_orphan_is_reported_then_replaced_by_deploy(
    lab: Lab, fleet: list[Host], cpu_artifact: Artifact
) -> None:
    host = fleet[0]
    view = NodeView(lab, host)
    orphan = view.pid()
    (view.root / "run/rpc-server.pid").unlink()  # the pid file is lost: the server runs untracked
    status = (await statuses_of([host]))[host.name]
    assert status.state == "orphan" and f"pid {orphan}" in status.message
    assert f"version {cpu_artifact.id}" in status.message and "/versions/" in status.message

    async with Session() as session:
        run = await session.run([host], make_deploy_step(_Fixed(cpu_artifact)), name="deploy")
    result = run.results[0]
    assert result.status == "changed", result.error
    assert isinstance(result.value, DeployResult) and result.value.service.action == "restart"
    seen = truth(lab, host)
    assert len(seen.listeners) == 1 and seen.listeners[0][0] == seen.tracked != orphan
    assert not _is_server(orphan)


def _is_server(pid: int | None) -> bool:
    cmdline = Path(f"/proc/{pid}/cmdline")
    return cmdline.exists() and b"ggml-rpc-server" in cmdline.read_bytes()


def test_two_cli_restarts_at_once_one_restarts_every_host_the_other_exits_3(
    lab: Lab, fleet: list[Host]
) -> None:
    """The race of the deploy test above, end to end through two `rpcfleet restart` processes (a few
    rounds: the race itself is looped there): exit 0 and every host restarted, exit 3 and none; with
    --wait-lock both restart every host."""
    views = [NodeView(lab, h) for h in fleet]
    for round_no in range(4):
        wait = ["--wait-lock", "60"] if round_no % 2 else []
        starts = [v.starts() for v in views]
        argv = [sys.executable, "-m", "orchestrator", "restart", "-i", str(lab.inventory), *wait]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        children = [
            subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for _ in range(2)
        ]
        outs = [child.communicate(timeout=120) for child in children]
        codes = sorted(child.returncode for child in children)
        restarts = [v.starts() - before for v, before in zip(views, starts, strict=True)]
        if wait:
            assert codes == [0, 0], outs
            assert restarts == [2] * len(fleet)
        else:
            assert codes == [0, 3], outs
            assert restarts == [1] * len(fleet)  # the loser restarted nothing
            loser = outs[[c.returncode for c in children].index(3)]
            assert "is being changed by" in loser[0] + loser[1] and "Traceback" not in loser[1], loser
        assert all(v.server_alive() for v in views)


async def test_a_locked_host_makes_the_cli_exit_3_naming_the_holder(
    lab: Lab, fleet: list[Host], capsys: pytest.CaptureFixture[str]
) -> None:
    from orchestrator.connectors.connect import connect
    from orchestrator.operations.lock import acquire

    async with await connect(fleet[0]) as conn:
        lock = await acquire(conn, fleet[0], "deploy")
        try:
            status = await asyncio.to_thread(main, ["restart", "-i", str(lab.inventory), "-l", fleet[0].name])
        finally:
            await lock.release()
    out = capsys.readouterr()
    assert status == 3
    assert f"{fleet[0].name} is being changed by" in out.out + out.err and "--wait-lock" in out.out + out.err


def test_results_state_what_is_true_after_the_change(
    lab: Lab, fleet: list[Host], cpu_artifact: Artifact, capsys: pytest.CaptureFixture[str]
) -> None:
    inv, host = str(lab.inventory), fleet[0].name
    pid = NodeView(lab, fleet[0]).pid()
    assert main(["stop", "-i", inv, "-l", host, "--json"]) == 0
    (stopped,) = json.loads(capsys.readouterr().out)
    assert stopped["message"] == f"stopped (was running pid {pid})"
    assert main(["start", "-i", inv, "-l", host, "--json"]) == 0
    (started,) = json.loads(capsys.readouterr().out)
    new_pid = NodeView(lab, fleet[0]).pid()
    assert started["message"] == f"started: running pid {new_pid}, version {cpu_artifact.id} (was stopped)"
    assert started["result"]["after"]["state"] == "running"
    assert main(["restart", "--rolling", "-i", inv, "--json"]) == 0
    rolled = json.loads(capsys.readouterr().out)  # JSON, not tables
    assert rolled["ok"] and [r["status"] for r in rolled["steps"][0]["results"]] == ["changed"] * len(fleet)
    assert all(r["result"]["action"] == "restarted" for r in rolled["steps"][0]["results"])


# --- the host lock on a real sshd (what the fake hosts of test_lock.py cannot show) ------------------------

_HOLDER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from orchestrator.connectors.connect import connect
    from orchestrator.inventory.load import load_inventory
    from orchestrator.operations.lock import acquire

    async def hold() -> None:
        host = next(h for h in load_inventory(Path(sys.argv[1])).hosts if h.name == sys.argv[2])
        conn = await connect(host)

        def told(*_: object) -> None:
            print("waiting", flush=True)

        await acquire(conn, host, "deploy", wait_s=float(sys.argv[3]), on_wait=told)
        print("locked", flush=True)
        await asyncio.Event().wait()

    asyncio.run(hold())
    """
)


def _holder(lab: Lab, host: Host, *, wait_s: float = 0.0, expect: str = "locked") -> subprocess.Popen[str]:
    """Another controller, in its own process, holding `host`'s lock (as a deploy does) until killed;
    with `expect="waiting"`, returned once it waits for someone else's."""
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(lab.inventory), host.name, str(wait_s)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.strip() == expect, child.stderr.read() if child.stderr else ""
    return child


def _held_on_node(lab: Lab, host: Host) -> bool:
    """Whether someone holds the lock, asked of the kernel (a flock of its own, not rpcfleet's answer)."""
    path = NodeView(lab, host).root / "lock"
    return subprocess.run(["flock", "-n", str(path), "true"], check=False, timeout=10).returncode != 0


def _ssh_ports_of(pid: int, host: Host) -> list[tuple[str, int]]:
    """The controller side (address, port) of each SSH connection to `host` of `pid` or its children."""
    import psutil

    pids = {pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))}
    sockets = subprocess.run(["ss", "-Htnp"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in sockets.splitlines():
        fields = line.split()
        if any(f"pid={p}," in line for p in pids) and fields[4] == f"{host.address}:22":
            address, _, port = fields[3].rpartition(":")
            found.append((address, int(port)))
    assert found, f"no SSH connection of pid {pid} to {host.address}"
    return found


async def test_a_controller_cut_off_loses_its_lock_within_the_silence_limit(
    lab: Lab, fresh_nodes: list[Host]
) -> None:
    """Issue 20: the controller's link is cut and the controller dies; the node never hears of it (sshd
    keeps the session, with no ClientAlive). The holder notices the missing heartbeats, and a second
    operator gets the lock within 30 s."""
    from orchestrator.connectors.connect import connect
    from orchestrator.operations.lock import SILENCE_S, acquire

    host = fresh_nodes[0]
    child = _holder(lab, host)
    # Cut its connections inside the node (the step's and the lock's own), both ways: they stay cut,
    # like a machine that is gone (a healed link would let the dead controller's kernel retransmit its
    # FIN). Other connections pass.
    rules = [
        rule
        for address, port in _ssh_ports_of(child.pid, host)
        for rule in (
            ["INPUT", "-p", "tcp", "-s", address, "--sport", str(port), "-j", "DROP"],
            ["OUTPUT", "-p", "tcp", "-d", address, "--dport", str(port), "-j", "DROP"],
        )
    ]
    for rule in rules:
        lab.node_exec(host.name, ["iptables", "-w", "-I", *rule])
    try:
        child.kill()
        child.wait(10)
        cut = time.monotonic()
        # The cut landed: the node did not hear of the death (a connection that closes releases at once).
        await asyncio.sleep(1.0)
        assert _held_on_node(lab, host), "the lock was released: the cut did not land"
        async with await connect(host) as conn:
            lock = await acquire(conn, host, "second", wait_s=30.0)
            took = time.monotonic() - cut
            await lock.release()
        assert took < SILENCE_S + 10.0, took  # the silence rule (headroom for load), before wait_s
        # The node's lock file is owner-only (issue 20): no other local user can block changes with it.
        assert ((NodeView(lab, host).root / "lock").stat().st_mode & 0o777) == 0o600
    finally:
        for rule in rules:
            lab.node_exec(host.name, ["iptables", "-w", "-D", *rule], check=False)
        if child.poll() is None:
            child.kill()


def _shape(veth: str, rate: str | None) -> None:
    """Limit what the host sends to a node's veth to `rate` (tbf: netem is not in this kernel); None: heal."""
    if rate is None:
        subprocess.run(["tc", "qdisc", "del", "dev", veth, "root"], check=False, timeout=10)
        return
    tbf = ["tbf", "rate", rate, "burst", "4kb", "latency", "2s"]
    subprocess.run(["tc", "qdisc", "replace", "dev", veth, "root", *tbf], check=True, timeout=10)


def _deploy_process(lab: Lab, host: Host) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "deploy", "-i", str(lab.inventory), "-l", host.name],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


async def test_a_deploy_cut_off_mid_run_loses_its_lock_and_another_operator_gets_it_within_30_s(
    lab: Lab, fresh_nodes: list[Host]
) -> None:
    """Issue 20, as written: a real `rpcfleet deploy` holds the node's lock (its upload slowed to 1 Mbit/s,
    so it lasts), its links to the node are cut and the controller dies; once the shaping is healed, a
    second operator gets the lock within 30 s."""
    from orchestrator.connectors.connect import connect
    from orchestrator.operations.lock import acquire

    host = fresh_nodes[0]
    veth = next(n.veth for n in lab.nodes if n.name == host.name)
    assert veth is not None
    _shape(veth, "1mbit")
    deploy = _deploy_process(lab, host)
    rules: list[list[str]] = []
    try:
        deadline = time.monotonic() + 60
        lock_file = NodeView(lab, host).root / "lock"
        while not (lock_file.exists() and _held_on_node(lab, host)):
            assert deploy.poll() is None, f"deploy ended before it held the lock: {deploy.stderr}"
            assert time.monotonic() < deadline, "deploy never took the node's lock"
            await asyncio.sleep(0.1)
        for address, port in _ssh_ports_of(deploy.pid, host):  # every link of this controller, both ways
            rules += [
                ["INPUT", "-p", "tcp", "-s", address, "--sport", str(port), "-j", "DROP"],
                ["OUTPUT", "-p", "tcp", "-d", address, "--dport", str(port), "-j", "DROP"],
            ]
        for rule in rules:
            lab.node_exec(host.name, ["iptables", "-w", "-I", *rule])
        deploy.kill()
        deploy.wait(10)
        cut = time.monotonic()
        await asyncio.sleep(1.0)
        assert _held_on_node(lab, host), "the lock was released: the cut did not land"
        _shape(veth, None)  # the heal
        async with await connect(host) as conn:
            lock = await acquire(conn, host, "second", wait_s=30.0)
            took = time.monotonic() - cut
            await lock.release()
        assert took < 30.0, took
    finally:
        _shape(veth, None)
        for rule in rules:
            lab.node_exec(host.name, ["iptables", "-w", "-D", *rule], check=False)
        if deploy.poll() is None:
            deploy.kill()
            deploy.wait(10)


async def test_a_holder_cut_off_for_17_s_stops_its_step_before_the_node_gives_its_lock_away(
    lab: Lab, fresh_nodes: list[Host]
) -> None:
    """Issue 31: the node gives the lock up 15 s after the last heartbeat it read; a cut of 17 s outlasts
    that. The holder stops its step (and drops its connection) before, so once the link is back nothing
    of it runs on the node while another operator holds the lock."""
    from orchestrator.connectors.base import shell_path
    from orchestrator.connectors.connect import connect
    from orchestrator.engine.executor import HostContext, StepOutcome
    from orchestrator.operations.layer import node_operation
    from orchestrator.operations.lock import SILENCE_S, LockLostError, acquire

    host = fresh_nodes[0]
    node = lab.node(host.name)
    changes = NodeView(lab, host).root / "changes"
    cut: list[float] = []
    was_cut = asyncio.Event()

    async def body(ctx: HostContext, conn: Any) -> StepOutcome[str]:
        for step in range(400):  # a change made of many commands
            await conn.run(f"date +%s.%N >> {shell_path(host.install_dir)}/changes", timeout=120)
            if step == 3:
                lab.cut_link(node)
                cut.append(time.monotonic())
                was_cut.set()
            await asyncio.sleep(0.2)
        return StepOutcome("done", True, "done")

    async def heal() -> None:
        await was_cut.wait()
        await asyncio.sleep(17.0 - (time.monotonic() - cut[0]))
        lab.restore_link(node)

    healer = asyncio.ensure_future(heal())
    try:
        async with Session() as session:
            run = await session.run([host], node_operation("deploy", body, OperationOptions()))
        stopped = time.monotonic() - cut[0]
        (result,) = run.results
        assert isinstance(result.error, LockLostError), result
        print(f"the step stopped {stopped:.1f} s after the cut")  # shown with -s
        assert stopped < SILENCE_S, stopped  # before the node could give the lock away
        await healer
        async with await connect(host) as conn:
            second = await acquire(conn, host, "second", wait_s=10.0)
            taken = time.time()
            await asyncio.sleep(3.0)  # what the first holder queued would land by now
            await second.release()
        written = [float(line) for line in changes.read_text().split()]
        assert len(written) >= 4 and max(written) < taken, (written, taken)
    finally:
        lab.restore_link(node)
        healer.cancel()


async def test_heartbeats_are_not_held_up_by_an_upload_at_1_mbit_s(
    lab: Lab, fresh_nodes: list[Host], tmp_path: Path
) -> None:
    """Issue 31: on the step's connection a heartbeat would wait behind the upload's 2 MiB SSH window
    (17 s at 1 Mbit/s, past the node's 15 s). On the lock's own connection it does not: a second operator
    is refused all along a 30 s upload, and the upload ends with the lock held."""
    from orchestrator.connectors.connect import connect
    from orchestrator.engine.executor import HostContext, StepOutcome
    from orchestrator.operations.layer import node_operation
    from orchestrator.operations.lock import SILENCE_S, HostLockedError, acquire

    host = fresh_nodes[0]
    veth = lab.node(host.name).veth
    assert veth is not None
    payload = tmp_path / "payload"
    payload.write_bytes(os.urandom(4 << 20))  # 33 s at 1 Mbit/s
    uploading = asyncio.Event()
    done = asyncio.Event()

    async def body(ctx: HostContext, conn: Any) -> StepOutcome[str]:
        uploading.set()
        await conn.put(payload, f"{host.install_dir}/payload")
        done.set()
        return StepOutcome("uploaded", True, "uploaded")

    refused: list[float] = []
    taken: list[float] = []

    async def second_operator() -> None:
        await uploading.wait()
        started = time.monotonic()
        async with await connect(host) as other:
            while not done.is_set():
                try:
                    lock = await acquire(other, host, "second")
                except HostLockedError:
                    refused.append(time.monotonic() - started)
                    await asyncio.sleep(2.0)
                    continue
                # The first holder sets `done` before it lets go: got while it is unset, the lock was lost.
                if not done.is_set():
                    taken.append(time.monotonic() - started)
                await lock.release()
                return

    _shape(veth, "1mbit")
    try:
        async with Session() as session:
            run, _ = await asyncio.gather(
                session.run([host], node_operation("deploy", body, OperationOptions())), second_operator()
            )
        print(f"the second operator was refused at {[round(t, 1) for t in refused]} s")  # shown with -s
        assert run.ok, ([str(r.error) for r in run.failed], refused, taken)
        assert not taken, f"the second operator got the lock during the upload at {taken}, refused {refused}"
        assert refused and max(refused) > SILENCE_S + 5.0, refused  # refused long past the node's limit
    finally:
        _shape(veth, None)


async def test_a_killed_controller_and_a_closed_connection_release_at_once(
    lab: Lab, fresh_nodes: list[Host]
) -> None:
    """Through a real sshd: the channel closes, the holder's stdin reaches end of file, the lock goes."""
    from orchestrator.connectors.connect import connect
    from orchestrator.operations.lock import acquire

    host = fresh_nodes[0]
    child = _holder(lab, host)
    assert _held_on_node(lab, host)
    child.kill()
    child.wait(10)
    async with await connect(host) as conn:
        started = time.monotonic()
        lock = await acquire(conn, host, "second", wait_s=10.0)
        assert time.monotonic() - started < 6.0  # at once (headroom for load), not after SILENCE_S
        # ... and the lock's connection closed without releasing the lock.
        assert lock.connection is not None
        await lock.connection.close()
    async with await connect(host) as conn:
        started = time.monotonic()
        again = await acquire(conn, host, "third", wait_s=10.0)
        assert time.monotonic() - started < 6.0  # at once (headroom for load), not after SILENCE_S
        await again.release()
    await lock.release()


def _waiting_flocks(lab: Lab, host: Host) -> list[int]:
    """The node's processes still waiting for a lock (`flock -w`)."""
    waiting = []
    for pid in lab.node_pids(host.name):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"flock\0-w"):
                waiting.append(pid)
    return waiting


async def test_a_waiter_whose_controller_dies_leaves_nothing_waiting_on_the_node(
    lab: Lab, fresh_nodes: list[Host]
) -> None:
    """A controller killed while it waits for another operator's lock: sshd sends its command no signal
    and the waiting `flock -w` does not read its stdin, so without the holder's watchdog it would wait on
    and later take the lock for a controller that is gone."""
    from orchestrator.connectors.connect import connect
    from orchestrator.operations.lock import acquire

    host = fresh_nodes[0]
    async with await connect(host) as conn:
        lock = await acquire(conn, host, "deploy")
        child = _holder(lab, host, wait_s=60.0, expect="waiting")
        # The check sees a waiter while there is one (told "@held" just before its `flock -w` starts).
        assert poll(lambda: _waiting_flocks(lab, host) or None, timeout=10.0, interval=0.05)
        child.kill()
        child.wait(10)
        assert poll(lambda: not _waiting_flocks(lab, host) or None, timeout=5.0, interval=0.05)
        await lock.release()
        third = await acquire(conn, host, "third")  # at once: no leftover waiter took it
        assert "third" in (NodeView(lab, host).root / "lock.info").read_text()
        await third.release()
