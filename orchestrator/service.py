"""Supervising the rpc-server on each host: start, stop, restart, status, deploy.

Files on the node, under the install folder (see install.py): `run/rpc-server.pid` (the pid of the
server we started), `log/rpc-server.log` (everything it prints, line-buffered, a marker line per
start) and `cache/` (its LLAMA_CACHE).

Facts the code relies on (docs/llama-rpc.md §3): the exit code of the server says nothing (0 after a
failed bind), so ready means a HELLO answered with the expected protocol; SIGPIPE kills it unless
ignored; it serves one client at a time, so a connected client makes it *busy*, not broken; it must be
detached with every stream redirected or the SSH command never returns.

Read, then change: `read_node_state` gathers `node_facts` (orchestrator.facts: the install state's,
then the pid file with `ps` and `/proc/PID/cmdline`, the listening socket and connected clients from
`ss`, a failed bind in the log) in one round trip and `node_state_from_facts` (pure) builds a
`NodeState`; `classify` (pure) names the server's state; `plan_service` (pure) decides what to do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import shlex
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from orchestrator.connection import Connection
from orchestrator.errors import CommandTimeoutError, ServiceError, tail
from orchestrator.executor import HostContext, StepOutcome
from orchestrator.facts import (
    PID_IS_NUMBER,
    PROC_ARGV0,
    PS_STAT,
    READ_PID,
    Fact,
    Listener,
    ListenersFact,
    LogMatchFact,
    LogTailFact,
    ProcessState,
    RpcClientsFact,
    ServerProcessFact,
    gather,
    parse_listener,
)
from orchestrator.install import (
    ArtifactChooser,
    BuildLogFactory,
    InstallChange,
    InstallState,
    ProgressFactory,
    apply_install,
    ensure_installed,
    install_facts,
    install_state_from_facts,
    plan_rollback,
    read_install_state,
)
from orchestrator.inventory import Host
from orchestrator.rpc import Outcome, ProbeResult, ProtocolVersion, probe_endpoint

__all__ = [
    "LOG_MARKER",
    "DeployResult",
    "Listener",
    "NodeState",
    "ServerState",
    "ServerStatus",
    "ServiceChange",
    "ServiceState",
    "bind_policy",
    "classify",
    "deploy",
    "ensure_running",
    "ensure_stopped",
    "launch_script",
    "make_deploy_step",
    "make_logs_step",
    "make_restart_step",
    "make_rollback_step",
    "make_start_step",
    "make_status_step",
    "make_stop_step",
    "node_facts",
    "node_state_from_facts",
    "plan_service",
    "read_node_state",
    "rollback",
    "server_argv",
    "server_status",
    "stop_script",
    "wait_ready",
]

ServerState = Literal["running", "stopped", "crashed", "unhealthy", "busy"]
SERVER_BINARY = "ggml-rpc-server"
PID_FILE = "run/rpc-server.pid"
LOG_FILE = "log/rpc-server.log"
CACHE_DIR = "cache"
LOG_MARKER = "=== rpcfleet: starting"
LOG_ROTATE_BYTES = 8 << 20
STATE_TIMEOUT = 20.0
START_TIMEOUT = 20.0
STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL
READY_TIMEOUT = 15.0
PROBE_TIMEOUT = 2.0
BIND_FAILED = "Failed to create server socket"


# ---------------------------------------------------------------- bind policy


def bind_policy(host: Host) -> str | None:
    """Check the server's bind address: an IPv4 literal, private or loopback unless the inventory
    allows a public bind. Returns a warning for an allowed public bind; raises ServiceError otherwise."""
    bind = host.rpc_host or host.address
    try:
        address = ipaddress.ip_address(bind)
    except ValueError:
        raise ServiceError(
            f"rpc_host {bind!r} is not an IPv4 address; ggml-rpc-server binds only IPv4 literals",
            host=host.name,
        ) from None
    if address.version != 4:
        raise ServiceError(f"rpc_host {bind} is IPv6; ggml-rpc-server binds only IPv4", host=host.name)
    public = address.is_unspecified or not (
        address.is_private or address.is_loopback or address.is_link_local
    )
    if not public:
        return None
    what = "every interface (0.0.0.0)" if address.is_unspecified else f"the public address {bind}"
    if not host.allow_public_bind:
        raise ServiceError(
            f"refusing to bind the rpc-server to {what}: the RPC protocol has no authentication",
            host=host.name,
            hint="bind to a private address, or set allow_public_bind: true in the inventory",
        )
    return f"rpc-server bound to {what} (allow_public_bind): anyone who reaches it can use it"


# ---------------------------------------------------------------- reading the state


@dataclass(frozen=True)
class ServiceState:
    """The server's state on a node, as one command read it."""

    host: str
    install_dir: str
    pid: int | None  # from the pid file
    stat: str | None  # `ps -o stat=` of that pid ("" when the process is gone)
    argv0: str | None  # first word of /proc/PID/cmdline
    listeners: tuple[Listener, ...] = ()
    clients: tuple[str, ...] = ()  # peers of established connections to the port
    log_failed_bind: bool = False  # the log since the last start says the bind failed

    @property
    def alive(self) -> bool:
        return bool(self.stat) and not (self.stat or "").startswith("Z")

    @property
    def ours(self) -> bool:
        """The pid file's process is alive and is our server binary (never a recycled pid)."""
        prefix = f"{self.install_dir}/versions/"
        return (
            self.alive
            and self.argv0 is not None
            and self.argv0.startswith(prefix)
            and self.argv0.endswith(f"/bin/{SERVER_BINARY}")
        )

    @property
    def running_version(self) -> str | None:
        if not self.ours or self.argv0 is None:
            return None
        return self.argv0[len(f"{self.install_dir}/versions/") :].split("/", 1)[0]

    def foreign_listeners(self) -> tuple[Listener, ...]:
        """Listeners on the port that are not our server (the port is taken)."""
        mine = self.pid if self.ours else None
        return tuple(lst for lst in self.listeners if lst.pid is None or lst.pid != mine)


@dataclass(frozen=True)
class NodeState:
    install: InstallState
    service: ServiceState


def _node_path(install_dir: str, relative: str) -> str:
    return f"{install_dir.rstrip('/')}/{relative}"


def node_facts(host: Host) -> list[Fact[Any]]:
    """The facts a `NodeState` is made of: the install state's, then the server's (one round trip)."""
    port = int(host.rpc_port)
    return [
        *install_facts(host.install_dir),
        ServerProcessFact(_node_path(host.install_dir, PID_FILE)),
        ListenersFact(port),
        RpcClientsFact(port),
        LogMatchFact(_node_path(host.install_dir, LOG_FILE), LOG_MARKER, BIND_FAILED),
    ]


def node_state_from_facts(host: str, values: Mapping[str, Any]) -> NodeState:
    """Pure: the values of `node_facts` (as `parse_gathered` returns them) -> `NodeState`."""
    install = install_state_from_facts(host, values)
    process: ProcessState = values.get(ServerProcessFact.name) or ProcessState(None)
    service = ServiceState(
        host,
        install.install_dir,
        process.pid,
        process.stat,
        process.argv0,
        values.get(ListenersFact.name) or (),
        values.get(RpcClientsFact.name) or (),
        bool(values.get(LogMatchFact.name)),
    )
    return NodeState(install, service)


async def read_node_state(conn: Connection, host: Host) -> NodeState:
    """Install state and server state in one round trip."""
    values = await gather(conn, node_facts(host), timeout=STATE_TIMEOUT)
    return node_state_from_facts(host.name, values)


# ---------------------------------------------------------------- status


@dataclass(frozen=True)
class ServerStatus:
    """What `rpcfleet status` shows for one server."""

    host: str
    endpoint: str
    state: ServerState
    pid: int | None
    version: str | None  # the installed (current) version
    running_version: str | None  # the version the running process was started from
    protocol: str | None  # of the installed version (or the HELLO's when answered)
    clients: tuple[str, ...] = ()
    message: str = ""

    def to_json(self) -> dict[str, object]:
        return {
            "host": self.host,
            "endpoint": self.endpoint,
            "state": self.state,
            "pid": self.pid,
            "version": self.version,
            "running_version": self.running_version,
            "protocol": self.protocol,
            "clients": list(self.clients),
            "message": self.message,
        }


def needs_probe(state: NodeState) -> bool:
    """A probe is needed to tell running from unhealthy, except when a client holds the server."""
    return state.service.ours and not state.service.clients


def classify(host: Host, state: NodeState, probe: ProbeResult | None) -> ServerStatus:
    """Pure: the server's state from the node's state and (when the process runs) a HELLO probe."""
    svc, inst = state.service, state.install
    protocol = inst.protocol
    pid = svc.pid
    server: ServerState
    if not svc.ours:
        taken = svc.foreign_listeners()
        note = f"port {host.rpc_port} is taken: {taken[0].describe()}" if taken else ""
        if svc.pid is None:
            server, message = "stopped", note
        else:
            why = "exited (pid file left)" if not svc.alive else "its pid now belongs to another program"
            if svc.log_failed_bind:
                why = "could not bind its port (see `rpcfleet logs`)"
            server, message = "crashed", "; ".join(filter(None, [why, note]))
    elif svc.clients:
        server, message = "busy", f"serving {', '.join(svc.clients)}"
    elif probe is None:
        server, message = "running", "not probed (bound to the node's loopback)"
    elif probe.outcome is Outcome.OK:
        server, message = "running", probe.message
        protocol = str(probe.version) if probe.version else protocol
    elif probe.outcome is Outcome.BUSY:
        server, message = "busy", probe.message
    else:
        server, message = "unhealthy", f"{probe.outcome}: {probe.message}"
    return ServerStatus(
        host=host.name,
        endpoint=host.endpoint,
        state=server,
        pid=pid,
        version=inst.current,
        running_version=svc.running_version,
        protocol=protocol,
        clients=svc.clients,
        message=message,
    )


def _expected(state: InstallState) -> ProtocolVersion | None:
    if state.protocol is None:
        return None
    try:
        return ProtocolVersion.parse(state.protocol)
    except ValueError:
        return None


async def probe_server(host: Host, state: NodeState, *, limit_s: float = PROBE_TIMEOUT) -> ProbeResult | None:
    target = None if host.binds_own_loopback else host.endpoint
    if target is None or not needs_probe(state):
        return None
    return await probe_endpoint(
        target,
        expected=_expected(state.install),
        connect_timeout=limit_s,
        read_timeout=limit_s,
        deadline=limit_s * 1.5,
        hello_only=True,
    )


async def server_status(conn: Connection, host: Host) -> ServerStatus:
    state = await read_node_state(conn, host)
    return classify(host, state, await probe_server(host, state))


# ---------------------------------------------------------------- start, stop


def server_argv(host: Host, install_dir: str, version: str) -> list[str]:
    """The server's command line, from the inventory."""
    argv = [
        f"{install_dir}/versions/{version}/bin/{SERVER_BINARY}",
        "-H",
        host.rpc_host or host.address,
        "-p",
        str(int(host.rpc_port)),
    ]
    if host.rpc_devices:
        argv += ["-d", ",".join(host.rpc_devices)]
    if host.rpc_threads is not None:
        argv += ["-t", str(int(host.rpc_threads))]
    if host.rpc_cache:
        argv.append("-c")
    return argv


def launch_script(host: Host, install_dir: str, version: str) -> str:
    """The node-side script that starts the server detached and records its pid.

    `trap '' PIPE` before the launch: an ignored signal stays ignored across fork and exec, so a
    client that hangs up early costs a `send failed` line, not the server. `setsid nohup` with every
    stream redirected detaches it from the SSH session; `; ... & echo $!` (never `&&` before the `&`)
    keeps the SSH command from waiting on it. `stdbuf -oL` makes its stdout reach the log at once.
    """
    q = shlex.quote
    port = int(host.rpc_port)
    env = [f"LLAMA_CACHE={install_dir}/{CACHE_DIR}"]
    if host.rpc_debug:
        env.append("GGML_RPC_DEBUG=1")
    command = " ".join(q(a) for a in ["env", *env, "stdbuf", "-oL", *server_argv(host, install_dir, version)])
    log = f'"$D/{LOG_FILE}"'
    return "\n".join(
        [
            f"D={q(install_dir)}",
            f'mkdir -p "$D/run" "$D/log" "$D/{CACHE_DIR}" || exit 1',
            f"taken=$({{ {ListenersFact(port).command()}; }} 2>/dev/null)",
            'if [ -n "$taken" ]; then echo "@taken $taken"; exit 0; fi',
            f'if [ -f {log} ] && [ "$(wc -c < {log})" -gt {LOG_ROTATE_BYTES} ]; then mv -f {log} {log}.1; fi',
            f'echo "{LOG_MARKER} {version} at $(date -u +%Y-%m-%dT%H:%M:%SZ) ===" >> {log}',
            "cd ~ || cd /",
            "trap '' PIPE",
            f"setsid nohup {command} </dev/null >>{log} 2>&1 &",
            "pid=$!",
            f'echo "$pid" > "$D/{PID_FILE}"',
            'echo "@started $pid"',
        ]
    )


def stop_script(install_dir: str, grace: float = STOP_GRACE) -> str:
    """SIGTERM, wait, SIGKILL; only a pid whose /proc/PID/cmdline is our install's server is signalled."""
    q = shlex.quote
    steps = max(1, int(grace * 10))
    return "\n".join(
        [
            f"D={q(install_dir)}",
            f'pf="$D/{PID_FILE}"',
            'if [ ! -f "$pf" ]; then echo "@none"; exit 0; fi',
            READ_PID,
            f'{PID_IS_NUMBER} || {{ rm -f "$pf"; echo "@none"; exit 0; }}',
            "alive() {",
            f'  s=$({PS_STAT}) || return 1; case "$s" in Z*) return 1;; esac',
            "}",
            "ours() {",
            f"  a=$({PROC_ARGV0})",
            f'  case "$a" in "$D"/versions/*/bin/{SERVER_BINARY}) return 0;; esac; return 1',
            "}",
            'if ! alive || ! ours; then rm -f "$pf"; echo "@gone $pid"; exit 0; fi',
            'kill -TERM "$pid" 2>/dev/null',
            f"i=0; while alive && [ $i -lt {steps} ]; do sleep 0.1; i=$((i+1)); done",
            "if alive; then",
            '  kill -KILL "$pid" 2>/dev/null; echo "@killed $pid"',
            "  i=0; while alive && [ $i -lt 30 ]; do sleep 0.1; i=$((i+1)); done",
            "fi",
            'if alive; then echo "@stuck $pid"; exit 0; fi',
            'rm -f "$pf"',
            'echo "@stopped $pid"',
        ]
    )


async def _sh(conn: Connection, script: str, limit_s: float) -> str:
    result = await conn.run(f"sh -c {shlex.quote(script)}", timeout=limit_s)
    if not result.ok:
        raise ServiceError(
            "a server command failed",
            host=conn.host.name,
            exit_status=result.exit_status,
            stderr=result.stderr or result.stdout,
        )
    return result.stdout


def _keys(stdout: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in stdout.splitlines():
        if line.startswith("@"):
            key, _, value = line[1:].partition(" ")
            found.setdefault(key, value.strip())
    return found


async def stop_server(conn: Connection, host: Host, install_dir: str) -> str:
    """Stop our server; returns what happened ("stopped", "killed", "gone", "none")."""
    try:
        out = _keys(await _sh(conn, stop_script(install_dir), STOP_GRACE + 15))
    except CommandTimeoutError as exc:
        raise ServiceError("stopping the rpc-server did not finish", host=host.name) from exc
    if "stuck" in out:
        raise ServiceError(f"the rpc-server (pid {out['stuck']}) survived SIGKILL", host=host.name)
    for key in ("killed", "stopped", "gone", "none"):
        if key in out:
            return key
    raise ServiceError(f"unexpected answer from the stop script: {tail(str(out))}", host=host.name)


async def _log_tail(conn: Connection, install_dir: str, lines: int = 8) -> str:
    fact = LogTailFact(f"{install_dir}/{LOG_FILE}", lines)
    try:
        result = await conn.run(fact.command(), timeout=10)
    except Exception:
        return ""
    return fact.parse(result.stdout, result.stderr, result.exit_status) or ""


async def start_server(conn: Connection, host: Host, state: NodeState) -> int:
    """Launch the current version detached; returns its pid. Refuses a taken port, naming its owner."""
    version = state.install.current
    if version is None or not state.install.installed:
        raise ServiceError("no rpc-server is installed (run `rpcfleet deploy`)", host=host.name)
    out = _keys(await _sh(conn, launch_script(host, state.install.install_dir, version), START_TIMEOUT))
    if "taken" in out:
        listener = parse_listener(out["taken"])
        who = listener.describe() if listener else out["taken"]
        raise ServiceError(
            f"port {host.rpc_port} is already taken: {who}",
            host=host.name,
            hint="stop that process or choose another rpc_port",
        )
    if not out.get("started", "").isdigit():
        raise ServiceError("the launch script did not report a pid", host=host.name, stderr=str(out))
    return int(out["started"])


async def wait_ready(
    conn: Connection, host: Host, state: NodeState, pid: int, *, limit_s: float = READY_TIMEOUT
) -> ProbeResult | None:
    """Until HELLO answers with the expected protocol: the exit code proves nothing. Meanwhile, every
    half second, make sure the process still lives and read its log for a failed bind."""
    target = None if host.binds_own_loopback else host.endpoint
    expected = _expected(state.install)
    install_dir = state.install.install_dir
    deadline = time.monotonic() + limit_s
    next_check = time.monotonic() + 0.3
    last: ProbeResult | None = None
    while True:
        if target is not None:
            last = await probe_endpoint(
                target,
                expected=expected,
                connect_timeout=1.0,
                read_timeout=2.0,
                deadline=3.0,
                hello_only=True,
            )
            if last.outcome in (Outcome.OK, Outcome.BUSY):
                return last
            if last.outcome is Outcome.VERSION_MISMATCH:
                raise ServiceError(
                    f"the started server speaks another protocol: {last.message}", host=host.name
                )
        now = time.monotonic()
        if now >= next_check or target is None:
            next_check = now + 0.5
            svc = (await read_node_state(conn, host)).service
            # Until the exec chain (setsid, nohup, env, stdbuf) reaches the server, argv0 is theirs.
            launching = svc.pid == pid and svc.alive and now < deadline - limit_s + 3.0
            if (svc.pid != pid or not svc.ours) and not launching:
                log = await _log_tail(conn, install_dir)
                if BIND_FAILED in log or svc.log_failed_bind:
                    taken = svc.foreign_listeners()
                    who = f": {taken[0].describe()}" if taken else ""
                    raise ServiceError(
                        f"the rpc-server could not bind {host.rpc_host or host.address}:{host.rpc_port}{who}",
                        host=host.name,
                        stderr=log,
                    )
                raise ServiceError("the rpc-server exited right after starting", host=host.name, stderr=log)
            if target is None and any(lst.pid == pid for lst in svc.listeners):
                return None  # loopback-only server on a remote node: listening is all we can see
        if time.monotonic() >= deadline:
            why = last.message if last else "no listener"
            raise ServiceError(
                f"the rpc-server did not answer HELLO within {limit_s:g} s ({why})",
                host=host.name,
                stderr=await _log_tail(conn, install_dir),
            )
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------- plans and steps

ServiceAction = Literal["none", "start", "restart", "stop"]


@dataclass(frozen=True)
class ServiceChange:
    host: str
    action: ServiceAction
    reason: str = ""
    status: ServerStatus | None = None  # before the change
    warnings: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return self.action != "none"

    def describe(self) -> str:
        if self.action == "none":
            return self.reason or "nothing to do"
        return f"{self.action}: {self.reason}" if self.reason else self.action

    def to_json(self) -> dict[str, object]:
        return {"action": self.action, "reason": self.reason, "warnings": list(self.warnings)}


def plan_service(
    status: ServerStatus, want: Literal["running", "stopped", "restarted"], *, current: str | None
) -> ServiceChange:
    """Pure: what brings the server to `want`, given its status and the installed version `current`."""
    host = status.host
    if want == "stopped":
        if status.state == "stopped":
            return ServiceChange(host, "none", "already stopped", status)
        if status.state == "crashed":
            return ServiceChange(host, "stop", "remove the stale pid file of a crashed server", status)
        return ServiceChange(host, "stop", f"{status.state} (pid {status.pid})", status)
    if want == "restarted":
        return ServiceChange(host, "restart" if status.pid else "start", "restart requested", status)
    if status.state in ("stopped", "crashed"):
        return ServiceChange(host, "start", status.state, status)
    if status.running_version != current:
        reason = f"running {status.running_version}, installed {current}"
        return ServiceChange(host, "restart", reason, status)
    if status.state == "unhealthy":
        return ServiceChange(host, "restart", f"unhealthy: {status.message}", status)
    return ServiceChange(host, "none", f"{status.state} (pid {status.pid})", status)


async def ensure_state(
    conn: Connection,
    host: Host,
    want: Literal["running", "stopped", "restarted"],
    *,
    check: bool = False,
    state: NodeState | None = None,
) -> ServiceChange:
    """Read (unless given), plan, and (unless `check`) apply: start, stop or restart the server."""
    warnings: list[str] = []
    if want != "stopped":
        warning = bind_policy(host)
        if warning:
            warnings.append(warning)
    state = state or await read_node_state(conn, host)
    status = classify(host, state, await probe_server(host, state))
    change = plan_service(status, want, current=state.install.current)
    change = ServiceChange(change.host, change.action, change.reason, status, tuple(warnings))
    if not change.changed or check:
        return change
    install_dir = state.install.install_dir
    if change.action in ("stop", "restart"):
        await stop_server(conn, host, install_dir)
    if change.action in ("start", "restart"):
        pid = await start_server(conn, host, state)
        await wait_ready(conn, host, state, pid)
    return change


async def ensure_running(
    conn: Connection, host: Host, *, check: bool = False, state: NodeState | None = None
) -> ServiceChange:
    return await ensure_state(conn, host, "running", check=check, state=state)


async def ensure_stopped(
    conn: Connection, host: Host, *, check: bool = False, state: NodeState | None = None
) -> ServiceChange:
    return await ensure_state(conn, host, "stopped", check=check, state=state)


def _service_step(
    want: Literal["running", "stopped", "restarted"], check: bool
) -> Callable[[HostContext], Awaitable[StepOutcome[ServiceChange]]]:
    async def step(ctx: HostContext) -> StepOutcome[ServiceChange]:
        conn = await ctx.connection()
        change = await ensure_state(conn, ctx.host, want, check=check)
        return StepOutcome(change, change.changed, change.describe())

    step.__name__ = {"running": "start", "stopped": "stop", "restarted": "restart"}[want]
    return step


def make_start_step(*, check: bool = False) -> Callable[[HostContext], Awaitable[StepOutcome[ServiceChange]]]:
    return _service_step("running", check)


def make_stop_step(*, check: bool = False) -> Callable[[HostContext], Awaitable[StepOutcome[ServiceChange]]]:
    return _service_step("stopped", check)


def make_restart_step(
    *, check: bool = False
) -> Callable[[HostContext], Awaitable[StepOutcome[ServiceChange]]]:
    return _service_step("restarted", check)


def make_status_step() -> Callable[[HostContext], Awaitable[StepOutcome[ServerStatus]]]:
    async def status(ctx: HostContext) -> StepOutcome[ServerStatus]:
        result = await server_status(await ctx.connection(), ctx.host)
        return StepOutcome(
            result, False, f"{result.state}: {result.message}" if result.message else result.state
        )

    return status


def make_logs_step(lines: int = 50) -> Callable[[HostContext], Awaitable[StepOutcome[str]]]:
    async def logs(ctx: HostContext) -> StepOutcome[str]:
        conn = await ctx.connection()
        fact = LogTailFact(_node_path(ctx.host.install_dir, LOG_FILE), lines)
        result = await conn.run(fact.command(), timeout=15)
        text = fact.parse(result.stdout, result.stderr, result.exit_status)
        if text is None:
            raise ServiceError("no rpc-server log yet", host=ctx.host.name, stderr=result.stderr)
        return StepOutcome(text, False, f"{len(text.splitlines())} lines")

    return logs


@dataclass(frozen=True)
class DeployResult:
    """One host's deploy: the install change, the server change, and the server's status after."""

    install: InstallChange
    service: ServiceChange
    status: ServerStatus | None = None
    warnings: tuple[str, ...] = field(default=())

    @property
    def changed(self) -> bool:
        return self.install.changed or self.service.changed

    def describe(self) -> str:
        parts = []
        if self.install.changed:
            parts.append(self.install.describe())
        if self.service.changed:
            parts.append(self.service.describe())
        return "; ".join(parts) or f"{self.install.version} {self.service.describe()}"

    def to_json(self) -> dict[str, object]:
        return {
            "install": self.install.to_json(),
            "service": self.service.to_json(),
            "warnings": list(self.warnings),
        }


async def deploy(
    conn: Connection,
    host: Host,
    choose: ArtifactChooser,
    *,
    check: bool = False,
    force: bool = False,
    progress: ProgressFactory | None = None,
    build_log: BuildLogFactory | None = None,
) -> DeployResult:
    """Install the pinned artifact and have it serve: one state read, then only the needed changes.

    A failed install (or on-node build) raises before the server is touched: the running version keeps
    serving.
    """
    warning = bind_policy(host)  # refuse a bad bind before changing anything
    state = await read_node_state(conn, host)
    change = await ensure_installed(
        conn,
        host,
        choose,
        state=state.install,
        check=check,
        force=force,
        progress=progress,
        build_log=build_log,
    )
    if change.changed and change.manifest is None and not check:
        # A switch to a version built on the node: only the node has its manifest.
        state = NodeState(await read_install_state(conn, host), state.service)
    elif change.changed:
        # What the install made (or, with --check, would make) current: no second read needed.
        installed = sorted({*state.install.versions, change.version} - set(change.prune))
        manifest = change.manifest or state.install.manifest
        install = dataclasses.replace(
            state.install, current=change.version, versions=tuple(installed), manifest=manifest, problems=()
        )
        state = NodeState(install, state.service)
    service = await ensure_state(conn, host, "running", check=check, state=state)
    warnings = (warning,) if warning else ()
    return DeployResult(change, service, service.status, warnings)


def make_deploy_step(
    choose: ArtifactChooser,
    *,
    check: bool = False,
    force: bool = False,
    progress: ProgressFactory | None = None,
    build_log: BuildLogFactory | None = None,
) -> Callable[[HostContext], Awaitable[StepOutcome[DeployResult]]]:
    async def deploy_step(ctx: HostContext) -> StepOutcome[DeployResult]:
        conn = await ctx.connection()
        result = await deploy(
            conn, ctx.host, choose, check=check, force=force, progress=progress, build_log=build_log
        )
        return StepOutcome(result, result.changed, result.describe())

    deploy_step.__name__ = "deploy"
    return deploy_step


async def rollback(
    conn: Connection, host: Host, *, to: str | None = None, check: bool = False
) -> DeployResult:
    """Switch `current` back to the previous version (or `to`) and have that version serve."""
    state = await read_node_state(conn, host)
    change = plan_rollback(state.install, to=to)
    if change.changed and not check:
        await apply_install(conn, change)
        state = await read_node_state(conn, host)
    elif change.changed:
        state = NodeState(dataclasses.replace(state.install, current=change.version), state.service)
    service = await ensure_state(conn, host, "running", check=check, state=state)
    return DeployResult(change, service, service.status)


def make_rollback_step(
    *, to: str | None = None, check: bool = False
) -> Callable[[HostContext], Awaitable[StepOutcome[DeployResult]]]:
    async def rollback_step(ctx: HostContext) -> StepOutcome[DeployResult]:
        result = await rollback(await ctx.connection(), ctx.host, to=to, check=check)
        return StepOutcome(result, result.changed, result.describe())

    rollback_step.__name__ = "rollback"
    return rollback_step
