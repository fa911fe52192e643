"""A real Slurm cluster on a lab (Debian's slurm-wlm and munge; root): `slurm_cluster(lab, directory)`.

munged runs on the controller with a key of its own (its socket in `directory`: a path, so the nodes'
network namespaces reach it); slurmctld runs in the first node's network and UTS namespaces (it listens
there, never on the machine's own addresses); a slurmd runs in each node's (`-N` the node's name). The
slurm.conf names every node by its lab address (NodeAddr) and uses no cgroup for processes
(`proctrack/linuxproc`, `task/none`); slurmd 22.05 still loads its cgroup plugin, so a cgroup.conf names
cgroup v1 (this machine mounts the v1 controllers under a tmpfs, which autodetection refuses:
"No filesystem mounted on /sys/fs/cgroup"). Every daemon is stopped by its own process on exit.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.lab.state import Lab

DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")
CLIENTS = ("scontrol", "salloc", "sbatch", "scancel", "sinfo")


def require_slurm() -> None:
    """Skip (locally) or fail (in CI, where scripts/setup.sh installs them) without Slurm and munge."""
    missing = [p for p in DAEMONS if not Path(p).exists()] + [c for c in CLIENTS if not shutil.which(c)]
    if not missing:
        return
    reason = f"Slurm is not installed (missing {', '.join(missing)}; Debian: slurm-wlm munge)"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; scripts/setup.sh installs it in CI")
    pytest.skip(reason)


@dataclass(frozen=True)
class SlurmCluster:
    conf: Path
    directory: Path
    nodes: tuple[str, ...]

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(argv), capture_output=True, text=True, env=self.env, timeout=timeout, check=False
        )

    def allocate(self, nodes: int) -> str:
        """`salloc --no-shell -N nodes`: the job id of the granted allocation."""
        done = self.run(
            "salloc", "--no-shell", f"--nodes={nodes}", "--job-name=rpcfleet-test", "--immediate=20"
        )
        found = re.search(r"Granted job allocation (\d+)", done.stderr + done.stdout)
        assert found, done.stderr
        return found.group(1)

    def job_state(self, job: str) -> str:
        done = self.run("scontrol", "show", "job", job)
        found = re.search(r"JobState=(\w+)", done.stdout)
        return found.group(1) if found else done.stderr.strip()

    def wait_state(self, job: str, states: set[str], timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while (state := self.job_state(job)) not in states and time.monotonic() < deadline:
            time.sleep(0.2)
        return state


def _config(lab: Lab, directory: Path, spool: Path) -> str:
    first = lab.nodes[0]
    lines = [
        f"ClusterName=rfl{lab.name}"[:40],
        f"SlurmctldHost={first.name}({first.address})",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={directory / 'munge.sock'}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SchedulerType=sched/builtin",
        "SelectType=select/linear",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",
        f"StateSaveLocation={directory / 'state'}",
        f"SlurmdSpoolDir={spool}/%n",
        f"SlurmctldPidFile={directory / 'slurmctld.pid'}",
        f"SlurmdPidFile={directory / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={directory / 'slurmctld.log'}",
        f"SlurmdLogFile={directory / 'slurmd-%n.log'}",
    ]
    lines += [
        f"NodeName={node.name} NodeHostname={node.name} NodeAddr={node.address} CPUs=1 State=UNKNOWN"
        for node in lab.nodes
    ]
    lines.append("PartitionName=lab Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def _in_node(lab: Lab, index: int, argv: list[str]) -> list[str]:
    """`argv` in a node's network and UTS namespaces (its address, its hostname)."""
    holder = lab.nodes[index].holder_pid()
    assert holder is not None, f"node {lab.nodes[index].name} has no namespace holder"
    return ["nsenter", "-t", str(holder), "--net", "--uts", *argv]


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
        )


@contextlib.contextmanager
def slurm_cluster(lab: Lab, directory: Path) -> Iterator[SlurmCluster]:
    """Slurm on every node of `lab`, its files in `directory`; every node idle before it is yielded."""
    require_slurm()
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o711)  # munged wants its socket's directory searchable by all
    (directory / "state").mkdir(exist_ok=True)
    # A step's socket lives in the spool, and a Unix socket's path has at most 108 bytes: pytest's tmp_path
    # is too deep ("Unix socket path ... is too long. (116 > 108)", and the batch job is held).
    spool = Path(tempfile.mkdtemp(prefix="rfslurm-"))
    for node in lab.nodes:
        (spool / node.name).mkdir()
    key = directory / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = directory / "slurm.conf"
    conf.write_text(_config(lab, directory, spool))
    (directory / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
    cluster = SlurmCluster(conf, directory, tuple(node.name for node in lab.nodes))
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        munge = [DAEMONS[0], "-F", "-f", f"--socket={directory / 'munge.sock'}", f"--key-file={key}"]
        munge += [f"--pid-file={directory / 'munged.pid'}", f"--seed-file={directory / 'munged.seed'}"]
        munge += [f"--log-file={directory / 'munged.log'}"]
        daemons.append(_start(munge, directory / "munged.out"))
        _wait(lambda: (directory / "munge.sock").exists(), "munged's socket", directory / "munged.out")
        daemons.append(
            _start(_in_node(lab, 0, [DAEMONS[1], "-D", "-f", str(conf)]), directory / "slurmctld.out")
        )
        _wait(
            lambda: cluster.run("scontrol", "ping").stdout.count("UP") > 0,
            "slurmctld",
            directory / "slurmctld.out",
        )
        for index, node in enumerate(lab.nodes):
            slurmd = [DAEMONS[2], "-D", "-N", node.name, "-f", str(conf)]
            daemons.append(_start(_in_node(lab, index, slurmd), directory / f"slurmd-{node.name}.out"))

        def idle() -> bool:
            states = cluster.run("sinfo", "-h", "-N", "-o", "%T").stdout.split()
            return len(states) == len(lab.nodes) and all(state == "idle" for state in states)

        _wait(idle, "every slurmd idle", directory / f"slurmd-{lab.nodes[-1].name}.out")
        yield cluster
    finally:
        for daemon in reversed(daemons):
            daemon.terminate()
        for daemon in reversed(daemons):
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(timeout=5)
        shutil.rmtree(spool, ignore_errors=True)


def _wait(ready: Callable[[], bool], what: str, log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
    raise AssertionError(f"{what}: not ready in {timeout:.0f} s\n{tail}")
