"""Starting and stopping the server process: launch line, scripts, readiness."""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass

from orchestrator.connectors.base import Connection
from orchestrator.connectors.nodescript import NodeScript, Planned, ScriptOutput, run_script
from orchestrator.connectors.tunnel import target_of
from orchestrator.core.errors import ServiceError, ServiceScriptError, tail
from orchestrator.core.poll import poll_async
from orchestrator.facts.server import (
    PID_IS_NUMBER,
    PROC_ARGV0,
    PS_STAT,
    READ_PID,
    Listener,
    ListenersFact,
    LogTailFact,
    parse_listener,
)
from orchestrator.facts.systemd import SERVICE_USER, USER_ENV
from orchestrator.inventory.model import Host
from orchestrator.operations import BUSY_GRACE
from orchestrator.operations.firewall import apply_firewall, planned_firewall, rules_path
from orchestrator.operations.launch import (
    desired_launch,
    launch_diff,
    launch_env,
    run_as_user,
    server_argv,
)
from orchestrator.operations.server.state import (
    BIND_FAILED,
    CACHE_DIR,
    LOG_FILE,
    LOG_MARKER,
    LOG_ROTATE_BYTES,
    READY_TIMEOUT,
    SERVER_BINARY,
    START_TIMEOUT,
    STOP_GRACE,
    NodeState,
    ServerFiles,
    expected_protocol,
    read_node_state,
    server_files,
)
from orchestrator.operations.supervise import stop_loop_lines, supervise_sh
from orchestrator.operations.systemd import (
    SERVICE_USER_MARK,
    control_script,
    install_unit_script,
    journal_command,
    render_unit,
    systemctl,
)
from orchestrator.rpc.client import probe_endpoint
from orchestrator.rpc.records import Outcome, ProbeResult


def launch_script(
    host: Host, install_dir: str, version: str, *, user: str | None = None, login: str | None = None
) -> str:
    """The node-side script that starts the process supervisor's loop (supervise.py) detached, the loop
    the server; prints the server's pid once the loop recorded it.

    `user` (`launch.run_as_user`) other than `login` (who rpcfleet connects as): the loop and the server
    run as that user (`as_user_lines`).

    `trap '' PIPE` before the launch: an ignored signal stays ignored across fork and exec, so a
    client that hangs up early costs a `send failed` line, not the server. `setsid nohup` with every
    stream redirected detaches the loop from the SSH session; `; ... &` (never `&&` before the `&`)
    keeps the SSH command from waiting on it. `stdbuf -oL` makes the server's stdout reach the log at once.
    """
    q = shlex.quote
    port = int(host.rpc_port)
    env = [f"{key}={value}" for key, value in launch_env(host, install_dir).items()]
    command = " ".join(q(a) for a in ["env", *env, "stdbuf", "-oL", *server_argv(host, install_dir, version)])
    files = server_files(host.server)
    log, pid_file, script = f'"$D/{files.log}"', f'"$D/{files.pid}"', f'"$D/{files.supervisor_script}"'
    return "\n".join(
        [
            f"D={q(install_dir)}",
            f'mkdir -p "$D/run" "$D/log" "$D/{CACHE_DIR}" || exit 1',
            *_retire_loop(files),
            _taken_check(port),
            f'if [ -f {log} ] && [ "$(wc -c < {log})" -gt {LOG_ROTATE_BYTES} ]; then mv -f {log} {log}.1; fi',
            f"rm -f {pid_file}",
            *as_user_lines(user, login, f"{install_dir}/versions/{version}/bin/{SERVER_BINARY}"),
            # Written as the server's user ($as): root never writes through a name in that user's folders
            # (a link planted there would make root write wherever it points).
            f'marker="{LOG_MARKER} {version} at $(date -u +%Y-%m-%dT%H:%M:%SZ) ==="',
            f"""$as sh -c 'echo "$1" >> "$2"' sh "$marker" {log} ||""",
            '  { echo "@error the server\'s user cannot write its log (a link planted there?)"; exit 0; }',
            f"""$as sh -c 'printf "%s" "$1" > "$2.tmp" && mv -f "$2.tmp" "$2"' sh {q(supervise_sh(files))} """
            f"{script} ||",
            "  { echo \"@error the server's user cannot write its loop's script in run/\"; exit 0; }",
            'if [ -n "$as" ]; then cd /; else cd ~ || cd /; fi',  # another user may not enter this HOME
            "trap '' PIPE",
            # The log is opened by the loop itself, as its user: never by root through a planted link.
            f"""setsid nohup $as sh -c 'exec >>"$1" 2>&1; shift; exec sh "$@"' sh {log} {script} "$D" """
            f"{q(version)} {command} </dev/null >/dev/null 2>&1 &",
            f"i=0; while [ ! -s {pid_file} ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done",
            f"pid=$(head -n 1 {pid_file} 2>/dev/null)",
            'if [ -n "$pid" ]; then echo "@started $pid"; else echo "@pid 0"; fi',
        ]
    )


def as_user_lines(user: str | None, login: str | None, binary: str) -> list[str]:
    """Shell ($D set): set `$as` to the command prefix that runs the loop as `user` ("" when it is the
    login user), making the dedicated user when it is missing and the run, log and cache dirs its own.
    Prints `@error <why>` and exits when that cannot be done: not root, no such user, no setpriv or
    runuser, the install dir out of the user's reach."""
    q = shlex.quote
    dirs = '"$D/run" "$D/log" "$D/' + CACHE_DIR + '"'
    if user is None or user == login:
        # Root again after another user: the dirs root runs the loop's script from are root's again.
        return ['as=""', *([f"chown -R 0:0 {dirs}"] if login == "root" else [])]
    fail = 'echo "@error $1"; exit 0'
    return [
        f"U={q(user)}",
        f"fail() {{ {fail}; }}",
        '[ "$(id -u)" = 0 ] || fail "rpc_run_as: $U needs rpcfleet to connect as root (it is $(id -un))"',
        'if ! id -u "$U" >/dev/null 2>&1; then',
        f'  [ "$U" = {SERVICE_USER} ] || fail "rpc_run_as: there is no user $U on this node"',
        f"  useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin "
        f'--comment {q(SERVICE_USER_MARK)} {SERVICE_USER} 2>&1 || fail "cannot create the user $U"',
        '  echo "@created $U"',
        "fi",
        # setpriv (util-linux) execs with no session and no PAM; runuser (util-linux too) otherwise.
        "if command -v setpriv >/dev/null 2>&1; then",
        '  as="setpriv --reuid=$U --regid=$(id -g "$U") --init-groups"',
        'elif command -v runuser >/dev/null 2>&1; then as="runuser -u $U --"',
        'else fail "neither setpriv nor runuser is installed (package util-linux): cannot run as $U"; fi',
        f'chown -R "$U:$(id -g "$U")" {dirs} || fail "cannot give $U the run, log and cache dirs of $D"',
        f"B={q(binary)}",
        '$as test -x "$B" || fail "$U cannot reach $B (a folder above it is closed to that user, such as a '
        '0700 home): choose an install_dir that user can reach, or set rpc_run_as"',
    ]


def _retire_loop(files: ServerFiles) -> list[str]:
    """Shell ($D set): a loop still waiting to restart a crashed server must not start a second one (nor
    race a systemd unit for the port): stop it, and kill what it started since the state was read."""
    return [*stop_loop_lines(files), 'if [ -n "$loopkids" ]; then kill -KILL $loopkids 2>/dev/null; fi']


def _taken_check(port: int) -> str:
    """Shell: print `@taken <listener>` and exit when something listens on the port already."""
    listeners = ListenersFact(port).command()
    return (
        f'taken=$({{ {listeners}; }} 2>/dev/null)\nif [ -n "$taken" ]; then echo "@taken $taken"; exit 0; fi'
    )


def unit_text(host: Host, state: NodeState) -> str | None:
    """The systemd unit the inventory asks for the installed version (None: not supervised by systemd):
    the process supervisor's launch line and environment, as a unit."""
    version, unit = state.install.current, state.unit
    if state.supervisor != "systemd" or unit is None or version is None:
        return None
    install_dir = state.install.install_dir
    argv, env = server_argv(host, install_dir, version), launch_env(host, install_dir)
    firewall = rules_path(host, install_dir) if host.firewalled and not unit.user else None
    return render_unit(host, install_dir, argv, env, user=unit.user, firewall=firewall)


def supervisor_drift(host: Host, state: NodeState) -> tuple[str, ...]:
    """How the running server's supervision differs from the inventory's: the unit's text, enabled."""
    text, unit = unit_text(host, state), state.unit
    if text is None or unit is None or not state.service.ours:
        return ()
    if unit.text != text:
        return (f"unit {unit.name} differs from the inventory's",)
    return () if unit.enabled else (f"unit {unit.name} is not enabled",)


def launch_drift(host: Host, state: NodeState) -> tuple[str, ...]:
    """How the running server differs from the inventory's launch: its command line and environment
    (process supervisor), its unit (systemd). The version is compared elsewhere."""
    svc, current = state.service, state.install.current
    if not svc.ours or current is None or svc.running_version != current:
        return ()
    if svc.launch is None:
        return supervisor_drift(host, state)
    user = run_as_user(host, state.systemd)
    return launch_diff(desired_launch(host, state.install.install_dir, current, user), svc.launch)


def run_as_warning(host: Host, state: NodeState) -> str | None:
    """A warning when the process supervisor runs the server as root (only when the inventory says so)."""
    if state.supervisor != "process" or run_as_user(host, state.systemd) != "root":
        return None
    return "the rpc-server runs as root (rpc_run_as: root): anyone who reaches its port drives a root process"


@dataclass(frozen=True)
class UnitControl:
    """The systemd unit a stop must stop too: this install's, whatever the supervisor. `disable`: the
    inventory says process now, so the unit must not start it again at boot."""

    name: str
    user: bool
    disable: bool = False


def unit_control(state: NodeState) -> UnitControl | None:
    unit = state.unit
    if unit is None or not unit.installed:
        return None
    return UnitControl(unit.name, unit.user, disable=state.supervisor != "systemd")


class BusyServerError(ServiceError):
    """A client is connected to the server: stopping it would kill that client's model mid-inference."""


def busy_script(port: int, busy_grace: float = BUSY_GRACE) -> str:
    """Shell lines that print `@busy <peers>` and exit when a client holds the server: a connection to
    `port` seen in every sample for `busy_grace` seconds (samples every 0.1 s).

    A model holds one connection, same peer port, for its whole life; probes come and go with new
    ports, so a stream of them (a monitor probing every 20 ms) never makes a server busy. Sampling ends
    at once when nothing is connected, and after `3 * busy_grace` of probes only. Every peer counts, one
    that `status` calls stale too: only `--force` stops a server that a client holds.
    """
    port = int(port)
    steps = max(1, round(busy_grace * 10))
    peers = f"ss -Htn state established '( sport = :{port} )' 2>/dev/null | awk '{{print $4}}'"
    # `seen` holds "peer count" lines: how many consecutive samples each peer has been connected.
    count = (
        'awk -v s="$seen" \'BEGIN{n=split(s,a,"\\n"); for(k=1;k<=n;k++){split(a[k],f," "); c[f[1]]=f[2]}} '
        "{print $1, c[$1]+1}'"
    )
    return "\n".join(
        [
            'seen=""; i=0',
            f'while now=$({peers}); [ -n "$now" ]; do',
            f'  seen=$(printf "%s\\n" "$now" | {count})',
            f'  held=$(printf "%s\\n" "$seen" | awk \'$2 >= {steps} {{printf "%s ", $1}}\')',
            '  if [ -n "$held" ]; then echo "@busy $held"; exit 0; fi',
            f"  [ $i -ge {3 * steps} ] && break",
            "  sleep 0.1; i=$((i+1))",
            "done",
        ]
    )


def stop_script(
    install_dir: str,
    port: int,
    *,
    force: bool = False,
    busy_grace: float = BUSY_GRACE,
    grace: float = STOP_GRACE,
    unit: UnitControl | None = None,
    server: str = "",
) -> str:
    """Stop our server, and any orphan of this install listening on its port, in one step on the node.

    With `unit` the server is systemd's: its MainPID is the tracked one and `systemctl stop` (or
    `disable --now`) stops it after the same busy check, so systemd does not start it again; a server of
    the other supervisor (a pid file's, while the inventory says systemd) is stopped as an orphan.

    The process supervisor's loop is stopped after the busy check and before the server, so it restarts
    nothing (supervise.py); a server it started meanwhile is stopped too.

    Only processes whose /proc/PID/cmdline is this install's server binary are signalled. Unless `force`,
    a server with a client connected is refused (`@busy`, see `busy_script`), and the check and the kill
    are one step on the node: no second round trip lets a client seen by the check slip through.

    `server`: which of the install's servers (`rpc_servers`): its own pid file and loop.
    """
    q = shlex.quote
    files = server_files(server)
    port = int(port)
    steps = max(1, int(grace * 10))
    listening = f"ss -Hltnp 'sport = :{port}' 2>/dev/null | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u"
    lines = [
        f"D={q(install_dir)}",
        f'pf="$D/{files.pid}"',
        "alive() {",
        f'  s=$({PS_STAT}) || return 1; case "$s" in Z*) return 1;; esac',
        "}",
        "ours() {",
        f"  a=$({PROC_ARGV0})",
        f'  case "$a" in "$D"/versions/*/bin/{SERVER_BINARY}) return 0;; esac; return 1',
        "}",
        'targets=""',
    ]
    unit_stop = ""
    if unit is not None:
        ctl, name = systemctl(unit.user), q(unit.name)
        unit_stop = f"{ctl} disable --now --quiet {name}" if unit.disable else f"{ctl} stop {name}"
        lines += [
            USER_ENV if unit.user else ":",
            f"pid=$({ctl} show -p MainPID --value {name} 2>/dev/null)",
            f'if {PID_IS_NUMBER} && [ "$pid" != 0 ] && alive && ours; then targets="$pid"; fi',
        ]
    lines += [
        "collect() {",
        '  if [ -f "$pf" ]; then',
        f"    {READ_PID}",
        f"    if {PID_IS_NUMBER} && alive && ours; then",
        '      case " $targets " in *" $pid "*) ;; *) targets="$targets $pid";; esac',
        '    else echo "@gone $pid"; fi',
        "  fi",
        # Orphans: this install's servers that hold the port without being the tracked one.
        f"  for pid in $({listening}); do",
        '    case " $targets " in *" $pid "*) continue;; esac',
        '    if alive && ours; then targets="$targets $pid"; echo "@orphan $pid $(' + PROC_ARGV0 + ')"; fi',
        "  done",
        "}",
        "collect",
    ]
    if not force:  # the check and the stop: one step on the node
        lines += ['if [ -n "$targets" ]; then', busy_script(port, busy_grace), "fi"]
    lines += [
        # The loop goes before the server, so it restarts nothing; then what it may have started since.
        *stop_loop_lines(files),
        "for pid in $loopkids; do",
        '  case " $targets " in *" $pid "*) ;; *) if alive; then targets="$targets $pid"; fi;; esac',
        "done",
        "collect",
        # Nothing runs: a unit between automatic restarts (or failed) is stopped all the same.
        f'if [ -z "$targets" ]; then {unit_stop + " 2>/dev/null; " if unit_stop else ""}rm -f "$pf"; '
        'echo "@none"; exit 0; fi',
    ]
    if unit_stop:
        lines.append(f'{unit_stop} || echo "@unit_stop_failed"')
    lines += [
        "kill -TERM $targets 2>/dev/null",
        "left() { for pid in $targets; do if alive; then echo $pid; fi; done; }",
        f'i=0; while [ -n "$(left)" ] && [ $i -lt {steps} ]; do sleep 0.1; i=$((i+1)); done',
        'if [ -n "$(left)" ]; then',
        '  kill -KILL $(left) 2>/dev/null; echo "@killed $targets"',
        '  i=0; while [ -n "$(left)" ] && [ $i -lt 30 ]; do sleep 0.1; i=$((i+1)); done',
        "fi",
        'if [ -n "$(left)" ]; then echo "@stuck $(left)"; exit 0; fi',
        'rm -f "$pf"',
        'echo "@stopped $targets"',
    ]
    return "\n".join(lines)


def server_script(name: str, text: str, timeout: float, what: str) -> NodeScript:
    """A node script about the server: its failures are ServiceErrors."""
    return NodeScript(name, text, timeout, what, ServiceScriptError)


@dataclass(frozen=True)
class StopResult:
    """What stopping did: "stopped", "killed" (needed SIGKILL) or "none" (nothing of ours was running)."""

    outcome: str
    pids: tuple[int, ...] = ()
    orphans: tuple[str, ...] = ()  # "pid path" of orphans that were stopped too


async def stop_server(
    conn: Connection,
    host: Host,
    state: NodeState,
    *,
    force: bool = False,
    busy_grace: float = BUSY_GRACE,
    action: str = "stop",
) -> StopResult:
    """Stop our server (and this install's orphans on its port, and its systemd unit); refuse a busy one
    unless `force`."""
    script = stop_node_script(host, state, force=force, busy_grace=busy_grace)
    return parse_stop_output(host, action, await run_script(conn, script))


def stop_node_script(
    host: Host,
    state: NodeState,
    *,
    force: bool = False,
    busy_grace: float = BUSY_GRACE,
) -> NodeScript:
    text = stop_script(
        state.install.install_dir,
        host.rpc_port,
        force=force,
        busy_grace=busy_grace,
        unit=unit_control(state),
        server=host.server,
    )
    return server_script("stop", text, STOP_GRACE + 15, "stopping the rpc-server")


def parse_stop_output(host: Host, action: str, out: ScriptOutput) -> StopResult:
    """Pure: what the stop script said, or the error it reported."""
    orphans = out.values("orphan")
    busy = out.get("busy")
    if busy is not None:
        raise _busy_error(host, action, busy)
    stuck = out.get("stuck")
    if stuck is not None:
        raise ServiceError(f"the rpc-server (pid {stuck}) survived SIGKILL", host=host.name)
    if "unit_stop_failed" in out:
        raise ServiceError("systemctl could not stop the server's unit", host=host.name, stderr=out.stdout)
    for key in ("killed", "stopped"):
        value = out.get(key)
        if value is not None:
            pids = tuple(int(p) for p in value.split() if p.isdigit())
            return StopResult(key, pids, orphans)
    if "none" in out:
        return StopResult("none")
    raise ServiceError(f"unexpected answer from the stop script: {tail(out.stdout)}", host=host.name)


def _busy_error(host: Host, action: str, peers: str) -> BusyServerError:
    return BusyServerError(
        f"refusing to {action} a busy server (clients: {peers.strip()}): its client would be killed "
        "mid-inference",
        host=host.name,
        hint="wait until it is idle, or force it (--force; in a playbook, force: true)",
    )


async def refuse_if_busy(
    conn: Connection, host: Host, action: str, *, busy_grace: float = BUSY_GRACE
) -> None:
    """Raise BusyServerError when a client holds the server (the node-side rule of `busy_script`), for a
    change that must not begin on a busy server (a deploy's version switch, a --check)."""
    script = server_script(
        "busy-check", busy_script(host.rpc_port, busy_grace), busy_grace * 3 + 15, "checking for clients"
    )
    busy = (await run_script(conn, script)).get("busy")
    if busy is not None:
        raise _busy_error(host, action, busy)


async def _log_tail(
    conn: Connection,
    install_dir: str,
    lines: int = 8,
    *,
    state: NodeState | None = None,
    log_file: str = LOG_FILE,
) -> str:
    """The server's last log lines: its log file, or its unit's journal under systemd."""
    if state is not None and state.supervisor == "systemd" and state.unit is not None:
        command = journal_command(state.unit.name, lines, user=state.unit.user)
        try:
            return (await conn.run(command, timeout=10)).stdout
        except Exception:
            return ""
    fact = LogTailFact(f"{install_dir}/{log_file}", lines)
    try:
        result = await conn.run(fact.command(), timeout=10)
    except Exception:
        return ""
    return fact.parse(result.stdout, result.stderr, result.exit_status) or ""


def taken_hint(listener: Listener | None, install_dir: str) -> str:
    """What to do about a taken port. Another rpc-server there is not the one rpcfleet supervises in
    `install_dir` (that one has no running pid, or start would not be here): say so, with its pid."""
    if listener is not None and listener.pid is not None and "rpc-server" in (listener.process or ""):
        return (
            f"it is another rpc-server (pid {listener.pid}), not the one rpcfleet runs from {install_dir}: "
            f"stop it (`kill {listener.pid}` on the node) or choose another rpc_port"
        )
    return "stop that process or choose another rpc_port"


def start_node_script(host: Host, state: NodeState) -> NodeScript:
    """The script that launches the current version: its systemd unit's start, or the supervisor loop."""
    version = state.install.current
    if version is None or not state.install.installed:
        raise ServiceError("no rpc-server is installed (run `rpcfleet deploy`)", host=host.name)
    text = unit_text(host, state)
    if text is not None and state.unit is not None:  # systemd: install (idempotent), enable, start
        name, user = state.unit.name, state.unit.user
        script = "\n".join(
            [
                f"D={shlex.quote(state.install.install_dir)}",
                *_retire_loop(server_files(host.server)),
                _taken_check(int(host.rpc_port)),
                install_unit_script(name, state.install.install_dir, text, user=user),
                control_script(name, "start", user=user),
            ]
        )
    else:
        login = state.systemd.login if state.systemd is not None else None
        run_as = run_as_user(host, state.systemd)
        script = launch_script(host, state.install.install_dir, version, user=run_as, login=login)
    return server_script("start", script, START_TIMEOUT, "starting the rpc-server")


def planned_start(host: Host, state: NodeState) -> list[NodeScript | Planned]:
    """Check mode: the scripts `start_server` would run."""
    firewall: list[NodeScript | Planned] = [*planned_firewall(host, state.install.install_dir, install=True)]
    if not state.install.installed:  # a version only the install would make: its files are not read yet
        return [*firewall, Planned(host.name, "start", "# start the version the install makes current")]
    return [*firewall, start_node_script(host, state)]


async def start_server(conn: Connection, host: Host, state: NodeState) -> int:
    """Install rpc_allow_from's rules, then launch the current version detached; returns its pid.
    Refuses a taken port, naming its owner."""
    await apply_firewall(conn, host, state.install.install_dir, install=True)  # before it listens
    out = await run_script(conn, start_node_script(host, state))
    log_file = server_files(host.server).log
    taken = out.get("taken")
    if taken is not None:
        listener = parse_listener(taken)
        who = listener.describe() if listener else taken
        raise ServiceError(
            f"port {host.rpc_port} is already taken: {who}",
            host=host.name,
            hint=taken_hint(listener, state.install.install_dir),
        )
    started = out.get("started") or out.get("pid") or ""
    if not started.isdigit() or started == "0":
        raise ServiceError(
            "the rpc-server did not start" if "pid" in out else "the launch script did not report a pid",
            host=host.name,
            stderr=await _log_tail(conn, state.install.install_dir, state=state, log_file=log_file)
            or out.stdout,
        )
    return int(started)


async def wait_ready(
    conn: Connection, host: Host, state: NodeState, pid: int, *, limit_s: float = READY_TIMEOUT
) -> ProbeResult | None:
    """Until HELLO answers with the expected protocol: the exit code proves nothing. Meanwhile, every
    half second, make sure the process still lives and read its log for a failed bind."""
    target = None if host.binds_own_loopback else host.endpoint
    expected = expected_protocol(state.install)
    install_dir = state.install.install_dir
    log_file = server_files(host.server).log
    started = time.monotonic()
    next_check = started + 0.3
    last: ProbeResult | None = None
    listening = False  # a loopback-only server on a remote node: listening is all we can see

    async def answered() -> ProbeResult | bool | None:
        nonlocal last, next_check, listening
        if target is not None:
            last = await probe_endpoint(
                await target_of(host),
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
            launching = svc.pid == pid and svc.alive and now < started + 3.0
            if (svc.pid != pid or not svc.ours) and not launching:
                log = await _log_tail(conn, install_dir, state=state, log_file=log_file)
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
                listening = True
                return True
        return None

    ready = await poll_async(answered, limit=limit_s, interval=0.02)
    if isinstance(ready, ProbeResult):
        return ready
    if ready is None and not listening:
        why = last.message if last else "no listener"
        raise ServiceError(
            f"the rpc-server did not answer HELLO within {limit_s:g} s ({why})",
            host=host.name,
            stderr=await _log_tail(conn, install_dir, state=state, log_file=log_file),
        )
    return None
