"""Host facts: each one a shell command plus a pure parser of its output (pyinfra's design).

A `Fact[T]` knows the command that reads it (`command()`) and how to turn that command's stdout,
stderr and exit status into a `T` (`parse()`); parsing does no I/O and is tested from data files.
`gather_command(facts, token)` joins several commands into one script, so one SSH round trip reads
them all; `split_output(stdout, token, n)` cuts that script's output back into per-fact outputs and
`parse_gathered` parses them; `gather(conn, facts, timeout=...)` does all three over a connection.
The state reads of install.py, service.py and probe.py are these facts (change scripts reuse pieces).

A tool that is not installed (no nvidia-smi on a CPU node, no ss) is a normal answer ("none"), not an
error: only the caller knows whether it needed it.
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar

from orchestrator.connection import shell_path

if TYPE_CHECKING:
    from orchestrator.connection import Connection

T = TypeVar("T")

MiB = 1024 * 1024
NOT_FOUND = 127  # the shell's "command not found"
# A GPU tool can hang on a wedged driver; one fact must not stall the whole gathering.
TOOL_TIMEOUT_S = 15


def _with_tool(tool: str, args: str) -> str:
    """Run `tool args` under `timeout` when available; exit 127 when the tool is absent."""
    return (
        f"command -v {tool} >/dev/null 2>&1 || exit {NOT_FOUND}; "
        f"if command -v timeout >/dev/null 2>&1; then timeout {TOOL_TIMEOUT_S} {tool} {args}; "
        f"else {tool} {args}; fi"
    )


def _tail(text: str, lines: int = 3) -> str:
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(kept[-lines:])


class Fact(ABC, Generic[T]):
    """A command that reads something about a host, and a pure parser of its output."""

    name: ClassVar[str]

    @abstractmethod
    def command(self) -> str:
        """A POSIX shell command (run by sh or bash) that prints what `parse` reads."""

    @abstractmethod
    def parse(self, stdout: str, stderr: str, exit_status: int) -> T:
        """Turn the command's output into the fact's value; never raises for odd output."""


# --- OS and architecture ----------------------------------------------------------------------------------


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


# --- CPUs and memory --------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class MemoryFact(Fact[MemInfo | None]):
    name: ClassVar[str] = "memory"

    def command(self) -> str:
        return "cat /proc/meminfo"

    def parse(self, stdout: str, stderr: str, exit_status: int) -> MemInfo | None:
        values = parse_meminfo(stdout)
        if "MemTotal" not in values:
            return None
        return MemInfo(total=values["MemTotal"], available=values.get("MemAvailable"))


# --- GPUs -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    vendor: Literal["nvidia", "amd"]
    index: int
    name: str
    total: int | None  # bytes
    free: int | None  # bytes


@dataclass(frozen=True)
class GpuReport:
    """What one GPU tool said. `present=False`: the tool is not installed (a normal answer)."""

    tool: str
    present: bool
    gpus: tuple[Gpu, ...] = ()
    error: str | None = None  # the tool ran but failed (driver not loaded, timed out...)


def _mib(text: str) -> int | None:
    text = text.strip()
    return int(text) * MiB if text.isdigit() else None  # "[N/A]", "[Not Supported]"


def parse_nvidia_smi_csv(text: str) -> tuple[Gpu, ...]:
    """`index, name, memory.total, memory.free` rows (csv, noheader, nounits; MiB)."""
    gpus: list[Gpu] = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4 or not fields[0].isdigit():
            continue
        name = ", ".join(fields[1:-2])  # a name could hold a comma; the numbers are the last two
        gpus.append(Gpu("nvidia", int(fields[0]), name, _mib(fields[-2]), _mib(fields[-1])))
    return tuple(gpus)


@dataclass(frozen=True)
class NvidiaGpuFact(Fact[GpuReport]):
    name: ClassVar[str] = "nvidia_gpus"
    QUERY: ClassVar[str] = "--query-gpu=index,name,memory.total,memory.free --format=csv,noheader,nounits"

    def command(self) -> str:
        return _with_tool("nvidia-smi", self.QUERY)

    def parse(self, stdout: str, stderr: str, exit_status: int) -> GpuReport:
        if exit_status == NOT_FOUND:
            return GpuReport("nvidia-smi", present=False)
        gpus = parse_nvidia_smi_csv(stdout) if exit_status == 0 else ()
        error = None
        if exit_status == 124:
            error = f"nvidia-smi timed out after {TOOL_TIMEOUT_S} s"
        elif exit_status != 0 or (not gpus and stdout.strip()):
            # nvidia-smi prints its failures on stdout ("NVIDIA-SMI has failed ...", "No devices were found").
            error = _tail(stdout + "\n" + stderr) or f"exit status {exit_status}"
        return GpuReport("nvidia-smi", present=True, gpus=gpus, error=error)


_AMD_NAME_KEYS = ("Card Series", "Card series", "Device Name", "Card Model", "Card model", "Card SKU")


def parse_rocm_smi_json(text: str) -> tuple[Gpu, ...]:
    """`rocm-smi --showmeminfo vram --json`: {"card0": {"VRAM Total Memory (B)": "...", "VRAM Total
    Used Memory (B)": "..."}, ...}; warnings before the JSON and non-card keys are skipped."""
    start = text.find("{")
    if start < 0:
        raise ValueError("no JSON object in rocm-smi output")
    data, _ = json.JSONDecoder().raw_decode(text[start:])
    if not isinstance(data, dict):
        raise ValueError("rocm-smi JSON is not an object")
    gpus: list[Gpu] = []
    for key, card in data.items():
        match = re.fullmatch(r"card(\d+)", str(key))
        if match is None or not isinstance(card, dict):
            continue
        total = _int_or_none(card.get("VRAM Total Memory (B)"))
        used = _int_or_none(card.get("VRAM Total Used Memory (B)"))
        free = total - used if total is not None and used is not None else None
        name = next((str(card[k]) for k in _AMD_NAME_KEYS if card.get(k) not in (None, "", "N/A")), str(key))
        gpus.append(Gpu("amd", int(match.group(1)), name, total, free))
    return tuple(sorted(gpus, key=lambda g: g.index))


def _int_or_none(value: object) -> int | None:
    text = str(value).strip() if value is not None else ""
    return int(text) if text.isdigit() else None


@dataclass(frozen=True)
class RocmGpuFact(Fact[GpuReport]):
    name: ClassVar[str] = "rocm_gpus"

    def command(self) -> str:
        return _with_tool("rocm-smi", "--showmeminfo vram --json")

    def parse(self, stdout: str, stderr: str, exit_status: int) -> GpuReport:
        if exit_status == NOT_FOUND:
            return GpuReport("rocm-smi", present=False)
        if exit_status == 124:
            return GpuReport("rocm-smi", present=True, error=f"rocm-smi timed out after {TOOL_TIMEOUT_S} s")
        try:
            gpus = parse_rocm_smi_json(stdout)
        except ValueError:
            gpus = ()
            if exit_status != 0 or stdout.strip():
                return GpuReport(
                    "rocm-smi",
                    present=True,
                    error=_tail(stdout + "\n" + stderr) or f"exit status {exit_status}",
                )
        error = None if exit_status == 0 else (_tail(stderr) or f"exit status {exit_status}")
        return GpuReport("rocm-smi", present=True, gpus=gpus, error=error)


# --- clients on the rpc port ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RpcClientsFact(Fact[tuple[str, ...] | None]):
    """Peers with an established TCP connection to local port `port` (None: `ss` is not installed).

    A connection the server has not accepted yet (a client waiting while it serves another) counts too:
    the kernel established it.
    """

    port: int
    name: ClassVar[str] = "rpc_clients"

    def command(self) -> str:
        port = int(self.port)  # an int, so nothing else can reach the shell
        return (
            f"command -v ss >/dev/null 2>&1 || exit {NOT_FOUND}; "
            f"ss -Htn state established '( sport = :{port} )'"
        )

    def parse(self, stdout: str, stderr: str, exit_status: int) -> tuple[str, ...] | None:
        if exit_status != 0:
            return None
        peers: list[str] = []
        for line in stdout.splitlines():
            fields = line.split()
            # Recv-Q Send-Q Local:Port Peer:Port [Process]; with a state filter there is no State column.
            if len(fields) >= 4 and fields[0].isdigit() and fields[1].isdigit():
                peers.append(fields[3])
        return tuple(peers)


# --- listening sockets on the rpc port --------------------------------------------------------------------

_USERS_RE = re.compile(r'\("([^"]*)",pid=(\d+)')


@dataclass(frozen=True)
class Listener:
    """A listening TCP socket (one line of `ss -Hltnp`); no process when it is not visible to this user."""

    local: str
    process: str | None = None
    pid: int | None = None

    def describe(self) -> str:
        if self.pid is None:
            return f"{self.local} (process not visible to this user)"
        return f"{self.local} by {self.process} (pid {self.pid})"


def parse_listener(line: str) -> Listener | None:
    """One `ss -Hltnp` line: `State Recv-Q Send-Q Local:Port Peer:Port users:(("name",pid=N,fd=M))`."""
    fields = line.split()
    addresses = [f for f in fields if ":" in f and not f.startswith("users:")]
    if not addresses:
        return None
    match = _USERS_RE.search(line)
    if match is None:
        return Listener(addresses[0])
    return Listener(addresses[0], match.group(1), int(match.group(2)))


@dataclass(frozen=True)
class ListenersFact(Fact[tuple[Listener, ...] | None]):
    """Listening TCP sockets on local port `port`, with their process (None: `ss` is not installed or
    failed)."""

    port: int
    name: ClassVar[str] = "listeners"

    def command(self) -> str:
        port = int(self.port)  # an int, so nothing else can reach the shell
        return f"command -v ss >/dev/null 2>&1 || exit {NOT_FOUND}; ss -Hltnp 'sport = :{port}'"

    def parse(self, stdout: str, stderr: str, exit_status: int) -> tuple[Listener, ...] | None:
        if exit_status != 0:
            return None
        found = (parse_listener(line) for line in stdout.splitlines())
        return tuple(listener for listener in found if listener is not None)


# --- the install folder (see install.py for its layout) ---------------------------------------------------


def _under(install_dir: str, relative: str) -> str:
    """`install_dir/relative` for the shell (`~` expanded there)."""
    return shell_path(install_dir.rstrip("/") + "/" + relative)


@dataclass(frozen=True)
class InstallDirFact(Fact[str | None]):
    """`install_dir` as the node's shell expands it (`~/x` -> `/home/user/x`)."""

    install_dir: str
    name: ClassVar[str] = "install_dir"

    def command(self) -> str:
        return f"printf '%s\\n' {shell_path(self.install_dir)}"

    def parse(self, stdout: str, stderr: str, exit_status: int) -> str | None:
        path = stdout.rstrip("\n")
        return path if exit_status == 0 and path.strip() else None


@dataclass(frozen=True)
class CurrentLinkFact(Fact[str | None]):
    """Where `<install_dir>/current` points, as written in the link (None: no such link)."""

    install_dir: str
    name: ClassVar[str] = "current_link"
    ABSENT: ClassVar[int] = 3

    def command(self) -> str:
        return f'l={_under(self.install_dir, "current")}; [ -L "$l" ] || exit {self.ABSENT}; readlink "$l"'

    def parse(self, stdout: str, stderr: str, exit_status: int) -> str | None:
        return None if exit_status == self.ABSENT else stdout.strip()


@dataclass(frozen=True)
class VersionsFact(Fact[tuple[str, ...]]):
    """The folders in `<install_dir>/versions/`, sorted."""

    install_dir: str
    name: ClassVar[str] = "versions"

    def command(self) -> str:
        folder = _under(self.install_dir, "versions")
        return f'for v in {folder}/*; do if [ -d "$v" ]; then printf \'%s\\n\' "${{v##*/}}"; fi; done'

    def parse(self, stdout: str, stderr: str, exit_status: int) -> tuple[str, ...]:
        return tuple(sorted(line.strip() for line in stdout.splitlines() if line.strip()))


@dataclass(frozen=True)
class HistoryFact(Fact[tuple[str, ...]]):
    """`<install_dir>/history`: the ids made current, oldest first, each once (its most recent time)."""

    install_dir: str
    name: ClassVar[str] = "history"

    def command(self) -> str:
        return f'h={_under(self.install_dir, "history")}; [ -f "$h" ] || exit 0; cat "$h"'

    def parse(self, stdout: str, stderr: str, exit_status: int) -> tuple[str, ...]:
        history: list[str] = []
        for line in stdout.splitlines():
            version = line.strip()
            if version:
                if version in history:
                    history.remove(version)
                history.append(version)
        return tuple(history)


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


@dataclass(frozen=True)
class InstalledManifest:
    data: dict[str, Any]  # the manifest as found; {} when it could not be read
    error: str | None = None  # why it could not be read (not JSON, not an object)

    @property
    def protocol(self) -> str | None:
        value = self.data.get("protocol")
        return value if isinstance(value, str) else None


@dataclass(frozen=True)
class InstalledManifestFact(Fact[InstalledManifest | None]):
    """`<install_dir>/current/manifest.json` (None: nothing installed)."""

    install_dir: str
    name: ClassVar[str] = "installed_manifest"
    ABSENT: ClassVar[int] = 3

    def command(self) -> str:
        path = _under(self.install_dir, "current/manifest.json")
        return f"if [ -f {path} ]; then cat {path}; else exit {self.ABSENT}; fi"

    def parse(self, stdout: str, stderr: str, exit_status: int) -> InstalledManifest | None:
        if exit_status == self.ABSENT:
            return None
        if exit_status != 0:
            return InstalledManifest({}, error=_tail(stderr) or f"exit status {exit_status}")
        try:
            data = json.loads(stdout)
        except ValueError as exc:
            return InstalledManifest({}, error=f"not JSON: {exc}")
        if not isinstance(data, dict):
            return InstalledManifest({}, error=f"not a JSON object but {type(data).__name__}")
        return InstalledManifest(data)


# --- the server process and its log -----------------------------------------------------------------------

# Shell pieces reading the process whose pid is in $pid; the stop script (service.py) reuses them.
READ_PID = 'pid=$(head -n 1 "$pf")'
PID_IS_NUMBER = 'case "$pid" in ""|*[!0-9]*) false;; *) true;; esac'
PS_STAT = 'ps -o stat= -p "$pid" 2>/dev/null'
PROC_ARGV0 = "tr '\\0' '\\n' < /proc/$pid/cmdline 2>/dev/null | head -n 1"


@dataclass(frozen=True)
class ProcessState:
    """The process a pid file names. `stat` is None without a usable pid, "" when no such process
    exists; `argv0` (from /proc/PID/cmdline, exact even with spaces) is None when unreadable."""

    pid: int | None
    stat: str | None = None  # ps STAT, e.g. "Ssl", "Z"
    argv0: str | None = None


@dataclass(frozen=True)
class ServerProcessFact(Fact[ProcessState]):
    """The pid in `pid_file` and that process's `ps` state and first argument.

    `kill -0` succeeds on a zombie and on a recycled pid, so the caller checks `stat` and `argv0`.
    """

    pid_file: str
    name: ClassVar[str] = "server_process"

    def command(self) -> str:
        return "\n".join(
            [
                f"pf={shell_path(self.pid_file)}",
                '[ -f "$pf" ] || exit 0',
                READ_PID,
                "printf 'pid %s\\n' \"$pid\"",
                f"{PID_IS_NUMBER} || exit 0",
                f"printf 'stat %s\\n' \"$({PS_STAT})\"",
                f"if [ -r /proc/$pid/cmdline ]; then printf 'argv0 %s\\n' \"$({PROC_ARGV0})\"; fi",
            ]
        )

    def parse(self, stdout: str, stderr: str, exit_status: int) -> ProcessState:
        values: dict[str, str] = {}
        for line in stdout.splitlines():
            key, _, value = line.partition(" ")
            if key in ("pid", "stat", "argv0"):
                values.setdefault(key, value.strip())
        pid = values.get("pid", "")
        if not pid.isdigit():
            return ProcessState(None)
        return ProcessState(int(pid), values.get("stat", ""), values.get("argv0") or None)


@dataclass(frozen=True)
class LogMatchFact(Fact[bool]):
    """Whether a line of the log `path` after its last line starting with `marker` contains `text`
    (False when there is no log)."""

    path: str
    marker: str
    text: str
    name: ClassVar[str] = "log_match"

    def command(self) -> str:
        path = shell_path(self.path)
        # The strings reach awk through the environment: no quoting or regex rules apply to them.
        return (
            f"[ -f {path} ] || exit 0; "
            f"__rf_m={shlex.quote(self.marker)} __rf_t={shlex.quote(self.text)} awk '"
            'index($0, ENVIRON["__rf_m"]) == 1 {f=0} index($0, ENVIRON["__rf_t"]) {f=1} '
            f'END {{if (f) print "found"}}\' {path}'
        )

    def parse(self, stdout: str, stderr: str, exit_status: int) -> bool:
        return exit_status == 0 and stdout.strip() == "found"


@dataclass(frozen=True)
class LogTailFact(Fact[str | None]):
    """The last `lines` lines of the log `path` (None: no readable log)."""

    path: str
    lines: int = 8
    name: ClassVar[str] = "log_tail"

    def command(self) -> str:
        return f"tail -n {int(self.lines)} {shell_path(self.path)}"

    def parse(self, stdout: str, stderr: str, exit_status: int) -> str | None:
        return stdout if exit_status == 0 else None


# --- gathering several facts in one round trip ------------------------------------------------------------


@dataclass(frozen=True)
class RawOutput:
    stdout: str
    stderr: str
    exit_status: int


def new_token() -> str:
    """A delimiter token no command output will contain by chance."""
    return secrets.token_hex(8)


def _mark(token: str, index: int, part: str) -> str:
    return f"@@rpcfleet-{token}-{index}-{part}@@"


def gather_command(facts: Sequence[Fact[Any]], token: str) -> str:
    """One bash script running every fact's command in its own subshell, stdin closed.

    Its stdout carries, per fact: a marker, the fact's stdout, a marker, its stderr, a marker with its
    exit status. Each marker is preceded by a newline that `split_output` removes again, so outputs come
    back byte for byte. Needs bash or a POSIX sh with mktemp.
    """
    if not re.fullmatch(r"[0-9a-zA-Z]+", token):
        raise ValueError("the token must be alphanumeric")
    lines = ["__rf_err=$(mktemp) || exit 1", "trap 'rm -f \"$__rf_err\"' EXIT"]
    for i, fact in enumerate(facts):
        lines += [
            f"printf '\\n%s\\n' '{_mark(token, i, 'out')}'",
            f'( {fact.command()}\n) </dev/null 2>"$__rf_err"; __rf_rc=$?',
            f"printf '\\n%s\\n' '{_mark(token, i, 'err')}'",
            'cat "$__rf_err"',
            f"printf '\\n%s\\n' '@@rpcfleet-{token}-{i}-exit-'\"$__rf_rc\"'@@'",
        ]
    return "\n".join(lines) + "\n"


def split_output(stdout: str, token: str, count: int) -> list[RawOutput]:
    """Cut a gathered script's stdout into `count` per-fact outputs.

    A fact whose markers are missing (the script was cut short) gets exit status -1 and what was found.
    """
    pattern = re.compile(rf"\n@@rpcfleet-{re.escape(token)}-(\d+)-(out|err|exit-(-?\d+))@@\n")
    outs: dict[int, str] = {}
    errs: dict[int, str] = {}
    codes: dict[int, int] = {}
    current: tuple[int, str] | None = None
    position = 0
    for match in pattern.finditer(stdout):
        if current is not None:
            index, part = current
            (outs if part == "out" else errs)[index] = stdout[position : match.start()]
        index, part = int(match.group(1)), match.group(2)
        if part.startswith("exit-"):
            codes[index] = int(match.group(3))
            current = None
        else:
            current = (index, part)
        position = match.end()
    if current is not None:
        index, part = current
        (outs if part == "out" else errs)[index] = stdout[position:]
    return [RawOutput(outs.get(i, ""), errs.get(i, ""), codes.get(i, -1)) for i in range(count)]


def parse_gathered(facts: Sequence[Fact[Any]], stdout: str, token: str) -> dict[str, Any]:
    """Parse a gathered script's stdout: {fact.name: value}. Facts of one name: give them distinct names."""
    raws = split_output(stdout, token, len(facts))
    return {
        fact.name: fact.parse(raw.stdout, raw.stderr, raw.exit_status)
        for fact, raw in zip(facts, raws, strict=True)
    }


async def gather(
    conn: Connection,
    facts: Sequence[Fact[Any]],
    *,
    timeout: float,  # noqa: ASYNC109 (the API: a per-call limit)
    check: bool = True,
) -> dict[str, Any]:
    """Read `facts` over `conn` in one round trip: {fact.name: value}. `check`: raise CommandError when
    the script itself fails (a fact's own failure is part of its value)."""
    token = new_token()
    result = await conn.run(gather_command(facts, token), timeout=timeout, check=check)
    return parse_gathered(facts, result.stdout, token)


FACT_TYPES: Mapping[str, type[Fact[Any]]] = {
    cls.name: cls
    for cls in (
        OsFact,
        CpuCountFact,
        MachineIdFact,
        MemoryFact,
        NvidiaGpuFact,
        RocmGpuFact,
        RpcClientsFact,
        ListenersFact,
        InstallDirFact,
        CurrentLinkFact,
        VersionsFact,
        HistoryFact,
        FreeSpaceFact,
        InstalledManifestFact,
        ServerProcessFact,
        LogMatchFact,
        LogTailFact,
    )
}
