"""Facts about an rpc-server install and its process: clients, listeners, versions, pid, log."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from orchestrator.connectors.base import shell_path
from orchestrator.connectors.nodescript import parse_key_line

if TYPE_CHECKING:
    pass
from orchestrator.facts.base import NOT_FOUND, Fact, tail


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
            return InstalledManifest({}, error=tail(stderr) or f"exit status {exit_status}")
        try:
            data = json.loads(stdout)
        except ValueError as exc:
            return InstalledManifest({}, error=f"not JSON: {exc}")
        if not isinstance(data, dict):
            return InstalledManifest({}, error=f"not a JSON object but {type(data).__name__}")
        return InstalledManifest(data)


# Shell pieces reading the process whose pid is in $pid; the stop script (operations/server/process.py)
# reuses them.
READ_PID = 'pid=$(head -n 1 "$pf")'


PID_IS_NUMBER = 'case "$pid" in ""|*[!0-9]*) false;; *) true;; esac'


PS_STAT = 'ps -o stat= -p "$pid" 2>/dev/null'


PROC_ARGV0 = "tr '\\0' '\\n' < /proc/$pid/cmdline 2>/dev/null | head -n 1"


SUPERVISOR_SCRIPT_ARG = "tr '\\0' '\\n' < /proc/$pid/cmdline 2>/dev/null | sed -n 2p"  # `sh SCRIPT ...`


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
    """The last `lines` lines of the log `path` (None: no readable log), after leaving out the lines
    that match the extended regex `drop` (when given): filtered first, so that `lines` are all kept."""

    path: str
    lines: int = 8
    drop: str = ""
    name: ClassVar[str] = "log_tail"

    def command(self) -> str:
        f = shell_path(self.path)
        if not self.drop:
            return f"tail -n {int(self.lines)} {f}"
        return f"[ -r {f} ] || exit 1; grep -v -E -e {shlex.quote(self.drop)} {f} | tail -n {int(self.lines)}"

    def parse(self, stdout: str, stderr: str, exit_status: int) -> str | None:
        return stdout if exit_status == 0 else None


@dataclass(frozen=True)
class Launch:
    """How a server process was started: its whole command line and the environment rpcfleet sets."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()  # (name, value), sorted by name
    user: str | None = None  # the user it runs as (None: not known)


LAUNCH_ENV = ("LLAMA_CACHE", "GGML_RPC_DEBUG")  # the variables a launch line sets


@dataclass(frozen=True)
class LaunchFact(Fact[Launch | None]):
    """The command line and rpcfleet's environment variables of the process in `pid_file` (None: no such
    process, or /proc is not readable)."""

    pid_file: str
    # The inventory's own variables (`rpc_env`) read besides LAUNCH_ENV: names of letters, digits and _.
    env_names: tuple[str, ...] = ()
    name: ClassVar[str] = "launch"

    def command(self) -> str:
        keys = "|".join(dict.fromkeys([*LAUNCH_ENV, *(n for n in self.env_names if n.isidentifier())]))
        return "\n".join(
            [
                f"pf={shell_path(self.pid_file)}",
                '[ -f "$pf" ] || exit 0',
                READ_PID,
                f"{PID_IS_NUMBER} || exit 0",
                "[ -r /proc/$pid/cmdline ] || exit 0",
                "echo @argv; tr '\\0' '\\n' < /proc/$pid/cmdline 2>/dev/null",
                # The owner of /proc/PID is the process's effective user.
                'echo "@user $(stat -c %U /proc/$pid 2>/dev/null)"',
                f"echo @env; tr '\\0' '\\n' < /proc/$pid/environ 2>/dev/null | grep -E '^({keys})=' || true",
            ]
        )

    def parse(self, stdout: str, stderr: str, exit_status: int) -> Launch | None:
        argv: list[str] = []
        env: list[tuple[str, str]] = []
        section = None
        user: str | None = None
        for line in stdout.splitlines():
            pair = parse_key_line(line)
            if pair is not None and pair[0] == "user" and section == "@argv":
                user = pair[1] or None
                section = None
            elif line in ("@argv", "@env"):
                section = line
            elif section == "@argv":
                argv.append(line)
            elif section == "@env" and "=" in line:
                key, _, value = line.partition("=")
                env.append((key, value))
        return Launch(tuple(argv), tuple(sorted(env)), user) if argv else None


@dataclass(frozen=True)
class PortOwner:
    """A process listening on the port, with the first word of its command line."""

    pid: int
    argv0: str | None


@dataclass(frozen=True)
class FirewallRules:
    """rpcfleet's rules for a port in INPUT: how many, and how many of them are its REJECT (none: the
    port is open to everyone the rules do not name)."""

    rules: int
    rejects: int


@dataclass(frozen=True)
class FirewallRulesFact(Fact[FirewallRules | None]):
    """rpcfleet's rules for `port` in INPUT (operations.firewall: the comment `rpcfleet <install dir>
    <port>`, quoted by `iptables -S` as it holds spaces), counted, and the REJECTs among them; None when
    they cannot be read (no iptables, not root)."""

    port: int
    name: ClassVar[str] = "firewall_rules"

    def command(self) -> str:
        port = int(self.port)
        return (
            "IPT=$(command -v iptables || ls /usr/sbin/iptables /sbin/iptables 2>/dev/null | head -n 1); "
            '[ -n "$IPT" ] && [ "$(id -u)" = 0 ] || exit 3; '
            'R=$("$IPT" -w -S INPUT | grep -e "^-A " | sed "s/\\$/ /" | grep -F -e " --dport '
            f"{port} \" | grep -F -e '--comment \"rpcfleet ' | grep -F -e ' {port}\" ' || true); "
            # the target follows the comment: a REJECT is the end of the line, never a comment's text
            'printf "%s %s\\n" "$(printf "%s" "$R" | grep -c . || true)" '
            '"$(printf "%s" "$R" | grep -c -e " -j REJECT --reject-with tcp-reset \\$" || true)"'
        )

    def parse(self, stdout: str, stderr: str, exit_status: int) -> FirewallRules | None:
        counts = stdout.split()
        if exit_status != 0 or len(counts) != 2 or not all(c.isdigit() for c in counts):
            return None
        return FirewallRules(int(counts[0]), int(counts[1]))


@dataclass(frozen=True)
class PortOwnersFact(Fact[tuple[PortOwner, ...]]):
    """The processes listening on local TCP `port` that this user can see, each with its argv0."""

    port: int
    name: ClassVar[str] = "port_owners"

    def command(self) -> str:
        port = int(self.port)
        return (
            f"command -v ss >/dev/null 2>&1 || exit 0; "
            f"for pid in $(ss -Hltnp 'sport = :{port}' | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u); do "
            f'printf \'%s %s\\n\' "$pid" "$({PROC_ARGV0})"; done'
        )

    def parse(self, stdout: str, stderr: str, exit_status: int) -> tuple[PortOwner, ...]:
        owners = []
        for line in stdout.splitlines():
            pid, _, argv0 = line.partition(" ")
            if pid.isdigit():
                owners.append(PortOwner(int(pid), argv0.strip() or None))
        return tuple(owners)


@dataclass(frozen=True)
class SupervisorLoop:
    """The process supervisor's loop (operations/supervise.py) as its files say.

    `pid` is set only while the loop runs (alive, and its script is this install's). `state` is the
    loop's last word: running, restarting, crash-looping, exited ("" without a state file)."""

    pid: int | None = None
    state: str = ""
    restarts: int = 0  # automatic restarts since rpcfleet started it
    last: str = ""  # how the server last ended ("killed by signal 9")
    failures: int = 0  # failures within the start-limit window when it gave up
    delay: int = 0  # seconds until the next restart (restarting)
    log: str = ""  # the server's last log lines, when the loop gave up


@dataclass(frozen=True)
class SupervisorFact(Fact[SupervisorLoop]):
    """The loop's pid file (checked against /proc: alive, running `script`), its state file and, once it
    gave up, the server's last log lines (the supervisor's own `=== rpcfleet` lines left out)."""

    pid_file: str
    state_file: str
    script: str
    log_file: str
    lines: int = 5
    name: ClassVar[str] = "supervisor_loop"

    def command(self) -> str:
        st = shell_path(self.state_file)
        return "\n".join(
            [
                f"pf={shell_path(self.pid_file)}",
                'if [ -f "$pf" ]; then',
                f"  {READ_PID}",
                f"  if {PID_IS_NUMBER}; then",
                "    printf '@pid %s\\n' \"$pid\"",
                f"    printf '@stat %s\\n' \"$({PS_STAT})\"",
                f'    [ "$({SUPERVISOR_SCRIPT_ARG})" = {shell_path(self.script)} ] && echo @ours',
                "  fi",
                "fi",
                f"[ -f {st} ] || exit 0",
                f"sed 's/^/@/' {st}",
                f"if grep -qx 'state crash-looping' {st}; then",
                "  echo @log",
                f"  grep -v '^=== rpcfleet' {shell_path(self.log_file)} 2>/dev/null "
                f"| tail -n {int(self.lines)}",
                "fi",
            ]
        )

    def parse(self, stdout: str, stderr: str, exit_status: int) -> SupervisorLoop:
        values: dict[str, str] = {}
        lines = stdout.splitlines()
        log: list[str] = []
        for i, line in enumerate(lines):
            if line == "@log":
                log = lines[i + 1 :]
                break
            pair = parse_key_line(line)
            if pair is not None:
                values.setdefault(*pair)
        stat, pid = values.get("stat", ""), values.get("pid", "")
        alive = bool(stat) and not stat.startswith("Z") and "ours" in values

        def number(key: str) -> int:
            text = values.get(key, "")
            return int(text) if text.isdigit() else 0

        return SupervisorLoop(
            int(pid) if alive and pid.isdigit() else None,
            values.get("state", ""),
            number("restarts"),
            values.get("last", ""),
            number("failures"),
            number("delay"),
            "\n".join(log),
        )
