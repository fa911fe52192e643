"""Supervising the rpc-server on each host: start, stop, restart, status, deploy.

Files on the node, under the install folder (install/plan.py): `run/rpc-server.pid` (the pid of the
server we started), `log/rpc-server.log` (everything it prints, line-buffered, a marker line per
start) and `cache/` (its LLAMA_CACHE).

Facts the code relies on (§3 of docs/llama-rpc.md): the exit code of the server says nothing (0
after a failed bind), so ready means a HELLO answered with the expected protocol; SIGPIPE kills it unless
ignored; it serves one client at a time, so a connected client makes it *busy*, not broken; it must be
detached with every stream redirected or the SSH command never returns.

Read, then change: `read_node_state` gathers `node_facts` (orchestrator.facts: the install state's,
then the pid file with `ps` and `/proc/PID/cmdline`, the listening socket and connected clients from
`ss`, a failed bind in the log) in one round trip and `node_state_from_facts` (pure) builds a
`NodeState`; `classify` (pure) names the server's state; `plan_service` (pure) decides what to do.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from orchestrator.artifacts.patches import lacking, lacking_note
from orchestrator.connectors.base import Connection
from orchestrator.connectors.tunnel import target_of
from orchestrator.core.errors import RpcfleetError, ServiceError
from orchestrator.facts.base import Fact, gather
from orchestrator.facts.server import (
    FirewallRules,
    FirewallRulesFact,
    Launch,
    LaunchFact,
    Listener,
    ListenersFact,
    LogMatchFact,
    PortOwner,
    PortOwnersFact,
    ProcessState,
    RpcClientsFact,
    ServerProcessFact,
    SupervisorFact,
    SupervisorLoop,
)
from orchestrator.facts.systemd import SERVICE_USER, SystemdFact, SystemdInfo, UnitFact, UnitState
from orchestrator.inventory.model import Host
from orchestrator.operations.install.plan import (
    InstallState,
    install_facts,
    install_state_from_facts,
)
from orchestrator.operations.stale import find_stale
from orchestrator.operations.systemd import (
    START_LIMIT_INTERVAL,
    Supervision,
    choose_supervisor,
    unit_name,
)
from orchestrator.rpc.client import probe_endpoint
from orchestrator.rpc.records import Outcome, ProbeResult, ProtocolVersion

# stale: every client it holds is proven gone (`operations.stale`); a hint, it still counts as busy.
ServerState = Literal[
    "running", "stopped", "crashed", "crash-looping", "unhealthy", "busy", "stale", "orphan"
]


SERVER_BINARY = "ggml-rpc-server"


PID_FILE = "run/rpc-server.pid"


SUPERVISOR_PID_FILE = "run/rpc-supervisor.pid"  # the process supervisor's loop (supervise.py)


SUPERVISOR_STATE_FILE = "run/rpc-supervisor.state"


SUPERVISOR_SCRIPT = "run/rpc-supervise.sh"


LOG_FILE = "log/rpc-server.log"


CACHE_DIR = "cache"


@dataclass(frozen=True)
class ServerFiles:
    """One server's files on the node, relative to the install dir: the constants above for a host's
    only server, `-<name>` before the extension for each of several (`rpc_servers`), so the servers of
    one install never share a pid file, a supervisor loop or a log."""

    pid: str
    supervisor_pid: str
    supervisor_state: str
    supervisor_script: str
    log: str
    firewall: str  # rpc_allow_from's rules script (operations.firewall): root's, at the install dir's top


def server_files(server: str = "") -> ServerFiles:
    if not server:
        return ServerFiles(
            PID_FILE, SUPERVISOR_PID_FILE, SUPERVISOR_STATE_FILE, SUPERVISOR_SCRIPT, LOG_FILE, "firewall.sh"
        )
    return ServerFiles(
        f"run/rpc-server-{server}.pid",
        f"run/rpc-supervisor-{server}.pid",
        f"run/rpc-supervisor-{server}.state",
        f"run/rpc-supervise-{server}.sh",
        f"log/rpc-server-{server}.log",
        f"firewall-{server}.sh",
    )


LOG_MARKER = "=== rpcfleet: starting"


LOG_ROTATE_BYTES = 8 << 20


STATE_TIMEOUT = 20.0


START_TIMEOUT = 20.0


STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL


READY_TIMEOUT = 15.0


PROBE_TIMEOUT = 2.0


BIND_FAILED = "Failed to create server socket"


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
    if host.rpc_transport == "ssh" and not address.is_loopback:
        raise ServiceError(
            f"rpc_transport: ssh with rpc_host {bind}: the server would listen on the node's network "
            "while clients are meant to reach it only through SSH",
            host=host.name,
            hint="remove rpc_host (ssh transport binds 127.0.0.1) or use rpc_transport: tcp",
        )
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
    launch: Launch | None = None  # the tracked process's command line and environment
    port_owners: tuple[PortOwner, ...] = ()  # processes listening on the port, with argv0
    loop: SupervisorLoop = field(default_factory=SupervisorLoop)  # the process supervisor's (supervise.py)

    def is_our_binary(self, argv0: str | None) -> bool:
        prefix = f"{self.install_dir}/versions/"
        return argv0 is not None and argv0.startswith(prefix) and argv0.endswith(f"/bin/{SERVER_BINARY}")

    def version_of(self, argv0: str | None) -> str | None:
        if not self.is_our_binary(argv0) or argv0 is None:
            return None
        return argv0[len(f"{self.install_dir}/versions/") :].split("/", 1)[0]

    def orphans(self) -> tuple[PortOwner, ...]:
        """This install's servers holding the port without being the tracked one (a lost pid file, or
        a start that raced another)."""
        mine = self.pid if self.ours else None
        return tuple(o for o in self.port_owners if o.pid != mine and self.is_our_binary(o.argv0))

    @property
    def alive(self) -> bool:
        return bool(self.stat) and not (self.stat or "").startswith("Z")

    @property
    def ours(self) -> bool:
        """The pid file's process is alive and is our server binary (never a recycled pid)."""
        return self.alive and self.is_our_binary(self.argv0)

    @property
    def running_version(self) -> str | None:
        return self.version_of(self.argv0) if self.ours else None

    def foreign_listeners(self) -> tuple[Listener, ...]:
        """Listeners on the port that are not our server (the port is taken)."""
        mine = {self.pid} if self.ours else set()
        ours = mine | {o.pid for o in self.orphans()}
        return tuple(lst for lst in self.listeners if lst.pid is None or lst.pid not in ours)


@dataclass(frozen=True)
class NodeState:
    install: InstallState
    service: ServiceState  # the supervised server: from the pid file, or from the unit's MainPID
    supervisor: Supervision = "process"
    unit: UnitState | None = None  # this install's systemd unit, read whatever the supervisor
    systemd: SystemdInfo | None = None
    pid_file_pid: int | None = None  # the pid file's live process, whatever the supervisor
    firewall_rules: FirewallRules | None = None  # rpcfleet's rules for the port in INPUT (None: not read)

    def foreign_supervisor(self, pid: int) -> str:
        """Which other supervisor runs our server `pid` ("" when none): under systemd the process
        supervisor's pid file names it; under process this install's unit has it as MainPID."""
        if self.supervisor == "systemd" and pid == self.pid_file_pid:
            return "process"
        if self.supervisor == "process" and self.unit is not None and self.unit.main_pid == pid:
            return f"systemd ({self.unit.name})"
        return ""


def node_path(install_dir: str, relative: str) -> str:
    return f"{install_dir.rstrip('/')}/{relative}"


def node_facts(host: Host) -> list[Fact[Any]]:
    """The facts a `NodeState` is made of: the install state's, then the server's (one round trip)."""
    port = int(host.rpc_port)
    files = server_files(host.server)
    return [
        *install_facts(host.install_dir),
        # The port before the pid file: a server the process supervisor restarts between the two reads
        # is then the tracked one, not listening yet, never an orphan of the old pid.
        ListenersFact(port),
        RpcClientsFact(port),
        PortOwnersFact(port),
        ServerProcessFact(node_path(host.install_dir, files.pid)),
        LaunchFact(node_path(host.install_dir, files.pid), tuple(name for name, _ in host.rpc_env)),
        LogMatchFact(node_path(host.install_dir, files.log), LOG_MARKER, BIND_FAILED),
        SupervisorFact(
            node_path(host.install_dir, files.supervisor_pid),
            node_path(host.install_dir, files.supervisor_state),
            node_path(host.install_dir, files.supervisor_script),
            node_path(host.install_dir, files.log),
        ),
        SystemdFact(),
        UnitFact(unit_name(host.install_dir, host.server), BIND_FAILED),
        *([FirewallRulesFact(port)] if host.firewalled else []),
    ]


def node_state_from_facts(host: str, values: Mapping[str, Any], supervisor: str = "process") -> NodeState:
    """Pure: the values of `node_facts` (as `parse_gathered` returns them) -> `NodeState`, supervised as
    the inventory's `supervisor` asks (`auto`: systemd where rpcfleet may manage units)."""
    install = install_state_from_facts(host, values)
    info: SystemdInfo | None = values.get(SystemdFact.name)
    unit: UnitState | None = values.get(UnitFact.name)
    chosen = choose_supervisor(supervisor, info, host=host)
    process: ProcessState = values.get(ServerProcessFact.name) or ProcessState(None)
    pid_file_pid = process.pid if process.stat and not process.stat.startswith("Z") else None
    systemd = chosen == "systemd" and unit is not None
    if systemd and unit is not None:
        pid = unit.main_pid
        process = ProcessState(pid, unit.stat if pid else None, unit.argv0 if pid else None)
    service = ServiceState(
        host,
        install.install_dir,
        process.pid,
        process.stat,
        process.argv0,
        values.get(ListenersFact.name) or (),
        values.get(RpcClientsFact.name) or (),
        unit.failed_bind if systemd and unit is not None else bool(values.get(LogMatchFact.name)),
        None if systemd else values.get(LaunchFact.name),  # under systemd, drift is the unit's text
        values.get(PortOwnersFact.name) or (),
        values.get(SupervisorFact.name) or SupervisorLoop(),
    )
    rules = values.get(FirewallRulesFact.name)
    return NodeState(install, service, chosen, unit, info, pid_file_pid, rules)


async def read_node_state(conn: Connection, host: Host) -> NodeState:
    """Install state and server state in one round trip."""
    values = await gather(conn, node_facts(host), timeout=STATE_TIMEOUT)
    return node_state_from_facts(host.name, values, host.supervisor)


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
    supervisor: Supervision = "process"
    restarts: int | None = None  # automatic restarts since the last start: systemd's NRestarts, the loop's
    last_exit: str = ""  # how the server last ended (systemd: with the unit's Result)
    transport: str = "tcp"  # rpc_transport: how the controller reaches the server
    user: str | None = None  # the user the running server runs as (None: not running, or unknown)
    # rpc_allow_from's rules: "ok", "missing", "open" (some, but no REJECT), "partial" (not as many as
    # the inventory's list makes), "unknown" (not readable: no iptables, not root); None when the
    # inventory asks for none
    firewall: str | None = None

    @property
    def exposed(self) -> bool:
        """A running server the inventory firewalls whose port no REJECT closes: `status` fails."""
        return self.firewall in FIREWALL_OPEN

    def to_json(self) -> dict[str, object]:
        return {
            "host": self.host,
            "endpoint": self.endpoint,
            "transport": self.transport,
            "state": self.state,
            "pid": self.pid,
            "version": self.version,
            "running_version": self.running_version,
            "protocol": self.protocol,
            "clients": list(self.clients),
            "message": self.message,
            "supervisor": self.supervisor,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "user": self.user,
            "firewall": self.firewall,
        }


def needs_probe(state: NodeState) -> bool:
    """A probe is needed to tell running from unhealthy, except when a client holds the server."""
    return state.service.ours and not state.service.clients


def classify(
    host: Host, state: NodeState, probe: ProbeResult | None, stale: tuple[str, ...] = ()
) -> ServerStatus:
    """Pure: the server's state from the node's state and (when the process runs) a HELLO probe;
    `stale`: the clients proven gone (`operations.stale`), when every client is one of them."""
    svc, inst = state.service, state.install
    protocol = inst.protocol
    pid = svc.pid
    server: ServerState
    orphans = svc.orphans()
    if not svc.ours and orphans:
        first = orphans[0]
        other = state.foreign_supervisor(first.pid)
        why = (
            f"run by the {other} supervisor, the inventory says {state.supervisor}"
            if other
            else "this install's server holds the port untracked"
        )
        server, message = (
            "orphan",
            (
                f"orphan (pid {first.pid}, version {svc.version_of(first.argv0)}, path {first.argv0}): "
                f"{why}; `rpcfleet stop` or `deploy` replaces it"
            ),
        )
    elif not svc.ours:
        taken = svc.foreign_listeners()
        note = f"port {host.rpc_port} is taken: {taken[0].describe()}" if taken else ""
        failure = _unit_failure(state, taken=bool(taken))
        loop = svc.loop if state.supervisor == "process" else SupervisorLoop()
        if loop.state == "crash-looping" and loop.pid is None:
            server, message = "crash-looping", _crash_loop_message(loop, note)
        elif svc.pid is None and failure:
            server, message = "crashed", "; ".join(filter(None, [failure, note]))
        elif svc.pid is None:
            server, message = "stopped", note
        else:
            why = "exited (pid file left)" if not svc.alive else "its pid now belongs to another program"
            if svc.log_failed_bind:
                why = "could not bind its port (see `rpcfleet logs`)"
            elif loop.pid is not None and loop.state == "restarting":
                why = f"{loop.last}: the process supervisor restarts it in {loop.delay} s"
            elif loop.state == "exited" and not svc.alive:
                why = f"{loop.last}, not restarted (a clean exit)"
            server, message = "crashed", "; ".join(filter(None, [why, note]))
    elif svc.clients and set(svc.clients) <= set(stale):
        server = "stale"
        message = (
            f"stale client {', '.join(svc.clients)}: its socket on this controller is gone "
            "(the keepalive of the servers rpcfleet builds drops it within about 30 s; "
            "`restart --force` stops the server now)"
        )
    elif svc.clients:
        server, message = "busy", f"serving {', '.join(svc.clients)}"
    elif probe is None:
        server, message = "running", "not probed (bound to the node's loopback)"
    elif probe.outcome is Outcome.OK:
        # The protocol has a field of its own. `status` sends HELLO only (`probe_server`): no device
        # count to tell unless a fuller probe was made.
        count = len(probe.devices)
        server, message = "running", f"{count} device(s)" if count else "answers HELLO"
        protocol = str(probe.version) if probe.version else protocol
    elif probe.outcome is Outcome.BUSY:
        server, message = "busy", probe.message
    else:
        server, message = "unhealthy", f"{probe.outcome}: {probe.message}"
    systemd = state.supervisor == "systemd" and state.unit is not None
    restarts, last_exit = None, ""
    if systemd and state.unit is not None:
        restarts, last_exit = state.unit.restarts, state.unit.last_exit()
    elif state.supervisor == "process" and svc.loop.state:
        restarts, last_exit = svc.loop.restarts, svc.loop.last
    if inst.manifest is not None and (lacks := lacking(inst.manifest.patches)):
        message = "; ".join(filter(None, [message, lacking_note(lacks)]))
    user = None
    if svc.ours and systemd and state.unit is not None:
        user = (state.systemd.login if state.systemd else None) if state.unit.user else SERVICE_USER
    elif svc.ours and svc.launch is not None:
        user = svc.launch.user
    # a server that does not run needs no rule (a stop removes them)
    firewall = firewall_state(host, state.firewall_rules) if pid is not None else None
    if firewall in ("missing", "open", "partial"):
        exposed = " (no REJECT: the port is open to everyone)" if firewall in FIREWALL_OPEN else ""
        note = f"firewall: {firewall}{exposed} (`rpcfleet deploy` installs it)"
        message = "; ".join(filter(None, [message, note]))
    return ServerStatus(
        host=host.name,
        endpoint=host.endpoint,
        transport=host.rpc_transport,
        state=server,
        pid=pid,
        version=inst.current,
        running_version=svc.running_version,
        protocol=protocol,
        clients=svc.clients,
        message=message,
        supervisor=state.supervisor,
        restarts=restarts,
        last_exit=last_exit,
        user=user,
        firewall=firewall,
    )


# What `firewall_state` says of a port no REJECT of ours closes.
FIREWALL_OPEN = ("missing", "open")


def firewall_state(host: Host, rules: FirewallRules | None) -> str | None:
    """Pure: what `status` says of rpc_allow_from's rules, from how many of them, and of their REJECTs,
    are in INPUT."""
    if not host.firewalled:
        return None
    if rules is None:
        return "unknown"
    if rules.rules == 0:
        return "missing"
    if rules.rejects == 0:
        return "open"
    # operations.firewall: established connections, each source, the REJECT
    expected = len(host.rpc_allow_from or ()) + 2
    return "ok" if rules.rules == expected and rules.rejects == 1 else "partial"


def _crash_loop_message(loop: SupervisorLoop, note: str) -> str:
    """Why the process supervisor gave up, what to do, and the server's last log lines."""
    message = (
        f"{loop.failures} failures within {START_LIMIT_INTERVAL} s, the last: {loop.last}; the process "
        "supervisor stopped restarting it (`rpcfleet start` or `deploy` tries again)"
    )
    message = "; ".join(filter(None, [message, note]))
    return f"{message}\nlast log lines:\n{loop.log}" if loop.log.strip() else message


def _unit_failure(state: NodeState, *, taken: bool = False) -> str:
    """Why a systemd unit that should run does not ("" when it was stopped, or is not systemd's).

    The server exits with status 0 only after a failed bind: exited on its own (not killed by a stop)
    with another program on the port is that, even when journald lost the line of a process that died
    at once (its stream's unit is looked up after the fact)."""
    unit = state.unit
    if state.supervisor != "systemd" or unit is None or not unit.installed:
        return ""
    exited = unit.active in ("inactive", "failed") and unit.properties.get("ExecMainCode") == "1"
    if unit.failed_bind or (exited and taken):
        return "failed: could not bind its port (see `rpcfleet logs`)"
    if unit.active == "failed" or exited:
        return f"failed: {unit.last_exit()}"
    return ""


def expected_protocol(state: InstallState) -> ProtocolVersion | None:
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
    try:
        dialed = await target_of(host)
    except RpcfleetError as exc:
        return ProbeResult(host.endpoint, Outcome.REFUSED, None, (), f"SSH forward: {exc.message}", 0.0)
    return await probe_endpoint(
        dialed,
        expected=expected_protocol(state.install),
        connect_timeout=limit_s,
        read_timeout=limit_s,
        deadline=limit_s * 1.5,
        hello_only=True,
    )


async def server_status(conn: Connection, host: Host) -> ServerStatus:
    state = await read_node_state(conn, host)
    stale: tuple[str, ...] = ()
    if state.service.ours and state.service.clients:  # busy, unless every client is proven gone
        stale = tuple(c.peer for c in await find_stale(conn, host))
    return classify(host, state, await probe_server(host, state), stale)
