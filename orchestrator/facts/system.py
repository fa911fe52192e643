"""Facts about the machine: OS, user, CPUs, machine id, memory, free disk space."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from orchestrator.connectors.base import shell_path

if TYPE_CHECKING:
    pass
from orchestrator.facts.base import NOT_FOUND, Fact, MiB


@dataclass(frozen=True)
class OsInfo:
    system: str | None  # uname -s: Linux, Darwin
    machine: str | None  # uname -m: x86_64, aarch64, arm64
    os_id: str | None  # os-release ID: debian, ubuntu, rhel
    version_id: str | None
    pretty_name: str | None


_OS_RELEASE_MARK = "@@rpcfleet-os-release@@"


def parse_os_release(text: str) -> dict[str, str]:
    """`KEY=value` lines with shell quoting, as os-release(5) defines them."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, raw = line.partition("=")
        try:
            parts = shlex.split(raw)
        except ValueError:
            parts = [raw.strip("\"'")]
        values[key.strip()] = " ".join(parts)
    return values


@dataclass(frozen=True)
class OsFact(Fact[OsInfo]):
    name: ClassVar[str] = "os"

    def command(self) -> str:
        return (
            f"uname -s -m; echo {_OS_RELEASE_MARK}; "
            "cat /etc/os-release 2>/dev/null || cat /usr/lib/os-release 2>/dev/null || true"
        )

    def parse(self, stdout: str, stderr: str, exit_status: int) -> OsInfo:
        head, _, release = stdout.partition(_OS_RELEASE_MARK)
        words = head.split()
        values = parse_os_release(release)
        return OsInfo(
            system=words[0] if words else None,
            machine=words[1] if len(words) > 1 else None,
            os_id=values.get("ID"),
            version_id=values.get("VERSION_ID"),
            pretty_name=values.get("PRETTY_NAME"),
        )


@dataclass(frozen=True)
class UserFact(Fact[str | None]):
    """The remote user commands run as."""

    name: ClassVar[str] = "user"

    def command(self) -> str:
        return "id -un"

    def parse(self, stdout: str, stderr: str, exit_status: int) -> str | None:
        return stdout.strip() or None if exit_status == 0 else None


@dataclass(frozen=True)
class CpuCountFact(Fact[int | None]):
    """CPUs this process may use (`nproc` honours affinity and cgroup cpusets)."""

    name: ClassVar[str] = "cpu_count"

    def command(self) -> str:
        return "nproc 2>/dev/null || getconf _NPROCESSORS_ONLN"

    def parse(self, stdout: str, stderr: str, exit_status: int) -> int | None:
        text = stdout.strip().splitlines()
        if exit_status != 0 or not text or not text[0].strip().isdigit():
            return None
        count = int(text[0].strip())
        return count if count > 0 else None


class MachineIdFact(Fact[str | None]):
    """Which machine the host runs on: `boot_id:<id>` (the running kernel, shared by every network
    namespace and container on it), else `machine_id:<id>` (/etc/machine-id); None when neither is
    readable. Servers with the same value share one machine's RAM."""

    name: ClassVar[str] = "machine_id"

    def command(self) -> str:
        return (
            "if [ -r /proc/sys/kernel/random/boot_id ]; then "
            "printf 'boot_id '; cat /proc/sys/kernel/random/boot_id; "
            "elif [ -r /etc/machine-id ]; then printf 'machine_id '; cat /etc/machine-id; "
            f"else exit {NOT_FOUND}; fi"
        )

    def parse(self, stdout: str, stderr: str, exit_status: int) -> str | None:
        fields = stdout.split()
        if exit_status != 0 or len(fields) != 2 or fields[0] not in ("boot_id", "machine_id"):
            return None
        value = fields[1].lower()
        if not _MACHINE_ID_RE.fullmatch(value):
            return None
        return f"{fields[0]}:{value}"


_MACHINE_ID_RE = re.compile(r"[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}")


@dataclass(frozen=True)
class MemInfo:
    total: int  # bytes
    available: int | None  # bytes; None on kernels before 3.14 (no MemAvailable)
    # The memory cgroup whose limit leaves the host's processes least (its folder; None: no limit), and
    # what it leaves: its limit less what it holds, its reclaimable file cache counted free as
    # MemAvailable counts it (a container, a systemd slice with MemoryMax, a lab node's --memory).
    cgroup: str | None = None
    cgroup_free: int | None = None


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo -> {field: bytes} (`kB` means KiB there); unit-less fields (HugePages_*) as counts."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        match = re.fullmatch(r"\s*([A-Za-z0-9_()]+):\s+(\d+)(?:\s+([kKmMgG]i?B))?\s*", line)
        if match is None:
            continue
        key, number, unit = match.groups()
        scale = {"k": 1024, "m": MiB, "g": 1024 * MiB}.get(unit[0].lower(), 1) if unit else 1
        values[key] = int(number) * scale
    return values


_CGROUP_MARK = "@@rpcfleet-memory-cgroup@@"


# v1 writes "no limit" as the largest page-aligned 64-bit number; any limit past 2**62 is none.
_NO_LIMIT = 1 << 62


# For each memory hierarchy of this shell (v2's `0::PATH`; v1's `N:...memory...:PATH`), its cgroup and
# every one above it that the mount shows: `cgroup DIR`, then `max`, `current` and the file cache that
# is inactive (reclaimable first), each level's own lines. A limit above binds too (a slice's MemoryMax).
_CGROUP_SCRIPT = (  # shell builtins only: the probe gathers it on every host with a short timeout
    "while IFS=: read -r _ c p; do "
    'case ",$c," in '
    ",,) d=/sys/fs/cgroup$p; m=memory.max; u=memory.current; i=inactive_file ;; "
    "*,memory,*) d=/sys/fs/cgroup/memory$p; m=memory.limit_in_bytes; u=memory.usage_in_bytes; "
    "i=total_inactive_file ;; "
    "*) continue ;; esac; "
    "while :; do "
    'd=${d%/}; if [ -r "$d/$m" ]; then x=; y=; read -r x 2>/dev/null <"$d/$m"; '
    'read -r y 2>/dev/null <"$d/$u"; echo "cgroup $d"; echo "max $x"; echo "current $y"; '
    'while read -r k v; do if [ "$k" = "$i" ]; then echo "inactive $v"; fi; '
    'done 2>/dev/null <"$d/memory.stat"; '
    "fi; "
    'case "$d" in /sys/fs/cgroup|/sys/fs/cgroup/memory|"") break ;; esac; d=${d%/*}; '
    "done; done </proc/self/cgroup"
)


def parse_cgroup_memory(text: str) -> tuple[str | None, int | None]:
    """The `_CGROUP_SCRIPT` lines -> (the cgroup whose limit leaves least, what it leaves), or (None,
    None) where no level has a limit. A level without `current` is skipped: its headroom is unknown."""
    best: tuple[str | None, int | None] = (None, None)
    levels: list[dict[str, str]] = []
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if key == "cgroup":
            levels.append({"cgroup": value.strip()})
        elif levels and key in ("max", "current", "inactive"):
            levels[-1][key] = value.strip()
    for level in levels:
        limit, current = level.get("max", ""), level.get("current", "")
        if not limit.isdigit() or not current.isdigit() or int(limit) >= _NO_LIMIT:
            continue
        inactive = level.get("inactive", "0")
        held = int(current) - (int(inactive) if inactive.isdigit() else 0)
        left = max(0, int(limit) - max(0, held))
        if best[1] is None or left < best[1]:
            best = (level["cgroup"], left)
    return best


@dataclass(frozen=True)
class MemoryFact(Fact[MemInfo | None]):
    """/proc/meminfo, and the memory cgroup limit over the processes of the host's sessions."""

    name: ClassVar[str] = "memory"

    def command(self) -> str:
        return f"cat /proc/meminfo || exit 1; echo {_CGROUP_MARK}; {_CGROUP_SCRIPT}"

    def parse(self, stdout: str, stderr: str, exit_status: int) -> MemInfo | None:
        meminfo, _, cgroups = stdout.partition(_CGROUP_MARK)
        values = parse_meminfo(meminfo)
        if "MemTotal" not in values:
            return None
        cgroup, left = parse_cgroup_memory(cgroups)
        return MemInfo(
            total=values["MemTotal"], available=values.get("MemAvailable"), cgroup=cgroup, cgroup_free=left
        )


_DF_ROW_RE = re.compile(r"\s(\d+)\s+(\d+)\s+(\d+)\s+(?:\d+%|-)\s")


@dataclass(frozen=True)
class FreeSpaceFact(Fact[int | None]):
    """Bytes free (for this user) on the file system holding `path`, or that would hold it: the nearest
    existing folder above it counts (`df -Pk`)."""

    path: str
    name: ClassVar[str] = "free_space"

    def command(self) -> str:
        return f'p={shell_path(self.path)}; while [ ! -d "$p" ]; do p=$(dirname "$p"); done; df -Pk "$p"'

    def parse(self, stdout: str, stderr: str, exit_status: int) -> int | None:
        lines = stdout.splitlines()
        # Filesystem 1024-blocks Used Available Capacity Mounted-on; a name may hold spaces.
        match = _DF_ROW_RE.search(lines[1] + " ") if len(lines) > 1 else None
        return int(match.group(3)) * 1024 if match else None
