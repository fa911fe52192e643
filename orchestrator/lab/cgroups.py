"""A CPU share per lab node (`rpcfleet lab up --cpus 0.6`): one cgroup per node with a CPU quota.

The node's first process (the holder that starts sshd, or a systemd node's boot loop) joins the group
before it starts anything, so every process of the node inherits it: sshd, its sessions, the servers
they start. Three nodes of 0.6 CPU then behave like three small machines, not like three processes
sharing this machine's cores.

cgroup v2 (`/sys/fs/cgroup/cgroup.controllers` lists `cpu`): `cpu.max` = "QUOTA PERIOD", usage from
the group's `cpu.stat`. cgroup v1 (this project's machines mount v1 controllers and an empty v2 tree at
`unified`): `cpu.cfs_quota_us`/`cpu.cfs_period_us` in the `cpu` hierarchy, usage from the group's
`cpu.stat` in `unified` (v2's `usage_usec` is counted without the cpu controller), else `cpuacct.usage`.

A memory limit per node (`lab up --memory 192MiB`) is a group of the same name in the memory
controller: `memory.max` on v2, `memory.limit_in_bytes` on v1 (swap held to it too, where the kernel
accounts swap), so a node is a small machine for memory as well: its processes are reclaimed, then
killed, past it. The node mounts that hierarchy at /sys/fs/cgroup in its own mount namespace (`ip netns
exec` gives it a /sys without one), as a real machine has it, so what runs there (the probe's memory
fact) reads its own limit.

The groups are named after the node's namespace (`rfl<slot>-<node>`), so `lab down` and the reaping of
dead labs find them by the slot's prefix. The shell lines make and fill the group themselves, so a node
that `lab repair` starts again joins its group with the same quota, made again if it was gone.
"""

from __future__ import annotations

import contextlib
import math
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from orchestrator.core.errors import LabError

CGROUP_ROOT = Path("/sys/fs/cgroup")


# The quota's period: short, so that a node is a small machine at every moment. Over the kernel's default
# 100 ms a node idle between short bursts (one node's layers of a token, a few ms) ran them at a whole
# core's speed: a split over three 0.6-CPU nodes ran as fast as one full machine. The kernel's least
# quota and period are 1 ms; the period grows where the quota would be less.
FINE_PERIOD_US = 2_000
MAX_PERIOD_US = 100_000
MIN_QUOTA_US = 1_000


MIN_CPUS = 0.01  # the kernel refuses a quota under 1 ms per period


# A node's sshd and one login take about 10 MiB: under this it could not even be reached.
MIN_MEMORY = 32 * 1024 * 1024


CgroupMode = Literal["v2", "v1"]


@dataclass(frozen=True)
class CpuGroups:
    """Where one node's CPU groups live: `limit` holds the quota, `account` the usage (may be the same)."""

    mode: CgroupMode
    limit: Path
    account: Path


def cgroup_mode(root: Path = CGROUP_ROOT) -> CgroupMode | None:
    """v2 when the unified root offers the cpu controller, v1 when a v1 `cpu` hierarchy is mounted."""
    controllers = root / "cgroup.controllers"
    with contextlib.suppress(OSError):
        if "cpu" in controllers.read_text().split():
            return "v2"
    if (root / "cpu" / "cpu.cfs_quota_us").exists():
        return "v1"
    return None


def node_groups(name: str, root: Path = CGROUP_ROOT) -> CpuGroups:
    """The groups of the node whose namespace is `name`; LabError where no CPU quota can be set."""
    mode = cgroup_mode(root)
    if mode == "v2":
        return CpuGroups("v2", root / name, root / name)
    if mode == "v1":
        unified = root / "unified"
        account = unified / name if (unified / "cgroup.procs").exists() else root / "cpuacct" / name
        return CpuGroups("v1", root / "cpu" / name, account)
    raise LabError(
        f"--cpus needs the cpu controller: neither cgroup v2 with cpu in {root}/cgroup.controllers nor a "
        f"cgroup v1 cpu hierarchy at {root}/cpu"
    )


def check_cpus(cpus: float) -> float:
    """--cpus: a positive number of CPUs (0.6: 1.2 ms of every 2 ms)."""
    if not cpus >= MIN_CPUS or cpus != cpus or cpus > 4096:
        raise LabError(f"--cpus must be between {MIN_CPUS} and 4096 CPUs, not {cpus:g}")
    return cpus


def share_us(cpus: float) -> tuple[int, int]:
    """(quota, period) in microseconds for `cpus` CPUs: the shortest period (at least 2 ms) whose quota
    is at least the kernel's 1 ms."""
    period = min(MAX_PERIOD_US, max(FINE_PERIOD_US, math.ceil(MIN_QUOTA_US / cpus)))
    return max(MIN_QUOTA_US, round(cpus * period)), period


def q(path: Path) -> str:
    return shlex.quote(str(path))


def join_lines(name: str, cpus: float, root: Path = CGROUP_ROOT) -> list[str]:
    """Shell lines: make the node's groups (if gone), set the quota, move this shell (`$$`) in; exit 1
    when that fails (a node without its share would measure the wrong thing)."""
    groups = node_groups(name, root)
    quota, period = share_us(cpus)
    fail = f'{{ echo "rpcfleet lab: cannot put the node in its cpu cgroup {groups.limit}" >&2; exit 1; }}'
    if groups.mode == "v2":
        return [
            f"grep -qw cpu {q(root / 'cgroup.subtree_control')} || "
            f"echo +cpu > {q(root / 'cgroup.subtree_control')} || {fail}",
            f"mkdir -p {q(groups.limit)} || {fail}",
            f"echo '{quota} {period}' > {q(groups.limit / 'cpu.max')} || {fail}",
            f"echo $$ > {q(groups.limit / 'cgroup.procs')} || {fail}",
        ]
    return [
        f"mkdir -p {q(groups.limit)} {q(groups.account)} || {fail}",
        f"echo {period} > {q(groups.limit / 'cpu.cfs_period_us')} || {fail}",
        f"echo {quota} > {q(groups.limit / 'cpu.cfs_quota_us')} || {fail}",
        f"echo $$ > {q(groups.limit / 'cgroup.procs')} || {fail}",
        f"echo $$ > {q(groups.account / 'cgroup.procs')} || {fail}",
    ]


def memory_group(name: str, root: Path = CGROUP_ROOT) -> tuple[CgroupMode, Path]:
    """(mode, folder) of the node's memory group; LabError where no memory limit can be set."""
    with contextlib.suppress(OSError):
        if "memory" in (root / "cgroup.controllers").read_text().split():
            return "v2", root / name
    if (root / "memory" / "memory.limit_in_bytes").exists():
        return "v1", root / "memory" / name
    raise LabError(
        f"--memory needs the memory controller: neither cgroup v2 with memory in {root}/cgroup.controllers "
        f"nor a cgroup v1 memory hierarchy at {root}/memory"
    )


def check_memory(memory: int) -> int:
    """--memory: bytes, enough for the node's sshd and a login."""
    if memory < MIN_MEMORY:
        raise LabError(f"--memory must be at least {MIN_MEMORY // 1024 // 1024} MiB, not {memory} bytes")
    return memory


def memory_lines(name: str, memory: int, root: Path = CGROUP_ROOT) -> list[str]:
    """Shell lines: make the node's memory group (if gone), set its limit, move this shell (`$$`) in;
    exit 1 when that fails (a node without its limit would measure the wrong thing)."""
    mode, group = memory_group(name, root)
    fail = f'{{ echo "rpcfleet lab: cannot put the node in its memory cgroup {group}" >&2; exit 1; }}'
    if mode == "v2":
        control = root / "cgroup.subtree_control"
        return [
            f"grep -qw memory {q(control)} || echo +memory > {q(control)} || {fail}",
            f"mkdir -p {q(group)} || {fail}",
            f"echo {memory} > {q(group / 'memory.max')} || {fail}",
            # no swap beyond the limit: the node is a machine of that much memory
            f"if [ -e {q(group / 'memory.swap.max')} ]; then echo 0 > {q(group / 'memory.swap.max')}; fi",
            f"echo $$ > {q(group / 'cgroup.procs')} || {fail}",
        ]
    swap = group / "memory.memsw.limit_in_bytes"
    return [
        f"mkdir -p {q(group)} || {fail}",
        f"echo {memory} > {q(group / 'memory.limit_in_bytes')} || {fail}",
        # memory + swap may not be less than memory: set after it (swap accounting may be off)
        f"if [ -e {q(swap)} ]; then echo {memory} > {q(swap)} || {fail}; fi",
        f"echo $$ > {q(group / 'cgroup.procs')} || {fail}",
    ]


def mount_lines(root: Path = CGROUP_ROOT) -> list[str]:
    """Shell lines run in the node's own mount namespace: its memory hierarchy at /sys/fs/cgroup (v2:
    the unified tree; v1: a tmpfs holding the memory controller's tree, as systemd mounts it)."""
    mode, _ = memory_group("node", root)
    if mode == "v2":
        return ["mount -t cgroup2 cgroup2 /sys/fs/cgroup"]
    # v1 mounts again the hierarchy holding memory, with its controllers (`cpu,memory` where co-mounted)
    controllers = (root / "memory").resolve().name
    return [
        "mount -t tmpfs -o mode=0755,size=64k cgroup /sys/fs/cgroup",
        "mkdir /sys/fs/cgroup/memory",
        f"mount -t cgroup -o {shlex.quote(controllers)} cgroup /sys/fs/cgroup/memory",
    ]


def in_share(name: str, cpus: float | None, argv: list[str], memory: int | None = None) -> list[str]:
    """`argv` run inside the node's CPU share and memory limit (neither: `argv` as it is). It joins from
    the root namespaces: `ip netns exec` mounts a /sys without the cgroup trees, and `nsenter` keeps the
    caller's cgroup, so whatever a repair starts in a node (its sshd, a new holder) joins here first."""
    lines = [*(join_lines(name, cpus) if cpus is not None else [])]
    lines += memory_lines(name, memory) if memory is not None else []
    if not lines:
        return argv
    return ["sh", "-c", "; ".join(["set -e", *lines, 'exec "$@"']), "node", *argv]


def memory_limit_of(name: str, root: Path = CGROUP_ROOT) -> int | None:
    """The node's memory limit as its group says (None: no group, or no limit)."""
    try:
        mode, group = memory_group(name, root)
        text = (group / ("memory.max" if mode == "v2" else "memory.limit_in_bytes")).read_text().strip()
    except (OSError, LabError):
        return None
    # v1 says "no limit" with the largest page-aligned 64-bit number
    return None if text == "max" or int(text) >= 1 << 62 else int(text)


def usage_us(name: str, root: Path = CGROUP_ROOT) -> int:
    """CPU time the node's processes used so far, in microseconds (the group's `cpu.stat`)."""
    groups = node_groups(name, root)
    stat = groups.account / "cpu.stat"
    if stat.exists():
        for line in stat.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value)
    return int((groups.account / "cpuacct.usage").read_text()) // 1000


def throttled(name: str, root: Path = CGROUP_ROOT) -> int:
    """Periods in which the node used up its quota and waited (`nr_throttled` of its `cpu.stat`)."""
    for line in (node_groups(name, root).limit / "cpu.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "nr_throttled":
            return int(value)
    return 0


def quota_of(name: str, root: Path = CGROUP_ROOT) -> float | None:
    """The node's CPU share as its group says (None: no group, or no limit)."""
    groups = node_groups(name, root)
    try:
        if groups.mode == "v2":
            quota, period = (groups.limit / "cpu.max").read_text().split()
        else:
            quota = (groups.limit / "cpu.cfs_quota_us").read_text().strip()
            period = (groups.limit / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    if quota in ("max", "-1"):
        return None
    return int(quota) / int(period)


def members(name: str, root: Path = CGROUP_ROOT) -> list[int]:
    """The processes in the node's CPU group."""
    with contextlib.suppress(OSError, LabError):
        text = (node_groups(name, root).limit / "cgroup.procs").read_text()
        return [int(pid) for pid in text.split()]
    return []


def existing(prefix: str, root: Path = CGROUP_ROOT) -> list[Path]:
    """The CPU and memory groups of every node whose name starts with `prefix` (a slot's), in every
    hierarchy."""
    parents = [root, root / "cpu", root / "cpuacct", root / "memory", root / "unified"]
    found: list[Path] = []
    for parent in parents:
        if (parent / "cgroup.procs").exists():
            found += [p for p in parent.glob(f"{prefix}*") if p.is_dir()]
    return found


def remove(prefix: str, root: Path = CGROUP_ROOT, timeout: float = 3.0) -> list[str]:
    """Remove the CPU and memory groups of `prefix*` nodes (deepest first), once their processes are
    gone: a group with a process in it cannot be removed, and a killed process leaves it a moment later."""
    removed: list[str] = []
    deadline = time.monotonic() + timeout
    for top in existing(prefix, root):
        inner = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for path in [*inner, top]:
            while True:
                try:
                    path.rmdir()
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(0.02)
                    continue
                if path == top:
                    removed.append(f"cgroup {top}")
                break
    return removed
