"""A memory limit per lab node (`lab up --memory`, issue 43): a memory cgroup every process of the node
joins, mounted inside the node so that the probe's memory fact reads it there, as on a machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.connectors.base import ConnectOptions
from orchestrator.connectors.connect import connect
from orchestrator.core.paths import rpcfleet_home
from orchestrator.facts.base import gather
from orchestrator.facts.system import MemoryFact
from orchestrator.lab import cgroups
from orchestrator.lab.lifecycle import lab_down, lab_repair, lab_up
from orchestrator.lab.state import PREFIX
from tests.plugins.lab import lab_hosts_of, leftovers, require_lab_privileges, session_lab_name

MiB = 1 << 20
FAST = ConnectOptions(connect_timeout=5.0, command_timeout=30.0)


def test_the_memory_lines_for_v1_and_v2(tmp_path: Path) -> None:
    """Pure: v2 writes memory.max (and no swap) in the unified root and mounts cgroup2 in the node; v1
    memory.limit_in_bytes, memory+swap held to it, and mounts the memory hierarchy under a tmpfs."""
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    lines = "\n".join(cgroups.memory_lines("rfl3-n1", 96 * MiB, v2))
    assert f"echo {96 * MiB} > {v2}/rfl3-n1/memory.max" in lines
    assert f"echo 0 > {v2}/rfl3-n1/memory.swap.max" in lines
    assert f"echo $$ > {v2}/rfl3-n1/cgroup.procs" in lines
    assert cgroups.mount_lines(v2) == ["mount -t cgroup2 cgroup2 /sys/fs/cgroup"]
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    lines = "\n".join(cgroups.memory_lines("rfl3-n1", 96 * MiB, v1))
    assert lines.index("memory.limit_in_bytes") < lines.index("memory.memsw.limit_in_bytes")
    assert f"echo $$ > {v1}/memory/rfl3-n1/cgroup.procs" in lines
    assert cgroups.mount_lines(v1)[-1] == "mount -t cgroup -o memory cgroup /sys/fs/cgroup/memory"
    with pytest.raises(Exception, match="--memory needs the memory controller"):
        cgroups.memory_group("rfl3-n1", tmp_path / "none")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--memory", "0"], "--memory: expected a size of 32MiB or more"),
        (["--memory", "lots"], "--memory: expected a size such as 8GiB"),
        (["--memory=-64MiB"], "--memory: expected a size such as 8GiB"),
        (["--memory", "16MiB"], "--memory: expected a size of 32MiB or more, such as 256MiB, got '16MiB'"),
        (["--memory", "64MiB", "--local"], "--memory needs a network-namespace lab"),
        (["--memory", "64MiB", "--init", "systemd"], "--memory is for nodes that boot no systemd"),
    ],
)
def test_a_bad_memory_is_a_usage_error_before_anything_is_made(argv: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "lab", "up", *argv, "--name", "never"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert message in " ".join(done.stderr.split()) and "Traceback" not in done.stderr
    assert not (rpcfleet_home() / "lab" / "never").exists()


@pytest.mark.lab
async def test_a_node_with_memory_has_its_limit_read_inside_it_and_down_removes_the_groups() -> None:
    require_lab_privileges()
    name = session_lab_name("mem")
    made = lab_up(2, name=name, owner_pid=os.getpid(), memory=64 * MiB)
    prefix = f"{PREFIX}{made.slot}-"
    try:
        one = made.nodes[0]
        assert cgroups.memory_limit_of(one.namespace or "") == 64 * MiB
        group = Path("/sys/fs/cgroup/memory", one.namespace or "")
        if cgroups.memory_group(one.namespace or "")[0] == "v2":
            group = Path("/sys/fs/cgroup", one.namespace or "")
        assert str(one.sshd_pid()) in (group / "cgroup.procs").read_text().split()

        async with await connect(lab_hosts_of(made)[0], FAST) as conn:
            facts = await gather(conn, [MemoryFact()], timeout=30)
            memory = facts["memory"]
            assert memory.cgroup is not None and memory.cgroup.endswith(one.namespace or "-")
            assert 32 * MiB < memory.cgroup_free < 64 * MiB, memory  # less what sshd and this login hold
            # past its limit a node's process is killed, as on a machine of that size
            done = await conn.run(
                "head -c 100M /dev/zero | tail >/dev/null; echo $?", timeout=60, check=False
            )
            assert done.stdout.strip() == "137", done

        made.kill_sshd(2)  # what repair starts joins the node's limit again
        assert [r.ok for r in lab_repair(made.name)] == [True, True]
        two = made.nodes[1]
        assert cgroups.memory_limit_of(two.namespace or "") == 64 * MiB
        assert (
            str(two.sshd_pid()) in (group.parent / (two.namespace or "") / "cgroup.procs").read_text().split()
        )
    finally:
        lab_down(name)
    assert cgroups.existing(prefix) == []
    assert leftovers(made) == []
