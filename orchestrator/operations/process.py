"""Starting and stopping the server process: launch line, scripts, readiness."""

from __future__ import annotations

import asyncio
import shlex
import time

from orchestrator.connectors.base import Connection
from orchestrator.core.errors import CommandTimeoutError, ServiceError, tail
from orchestrator.facts.server import (
    PID_IS_NUMBER,
    PROC_ARGV0,
    PS_STAT,
    READ_PID,
    ListenersFact,
    LogTailFact,
    parse_listener,
)
from orchestrator.inventory.model import Host
from orchestrator.operations.server import (
    BIND_FAILED,
    CACHE_DIR,
    LOG_FILE,
    LOG_MARKER,
    LOG_ROTATE_BYTES,
    PID_FILE,
    READY_TIMEOUT,
    SERVER_BINARY,
    START_TIMEOUT,
    STOP_GRACE,
    NodeState,
    _expected,
    read_node_state,
)
from orchestrator.operations.systemd import (
    control_script,
    install_unit_script,
    journal_command,
    render_unit,
)
from orchestrator.rpc.client import probe_endpoint
from orchestrator.rpc.protocol import Outcome, ProbeResult


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
            _taken_check(port),
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


def _taken_check(port: int) -> str:
    """Shell: print `@taken <listener>` and exit when something listens on the port already."""
    listeners = ListenersFact(port).command()
    return (
        f'taken=$({{ {listeners}; }} 2>/dev/null)\nif [ -n "$taken" ]; then echo "@taken $taken"; exit 0; fi'
    )


def unit_text(host: Host, state: NodeState) -> str | None:
    """The systemd unit the inventory asks for the installed version (None: not supervised by systemd)."""
    version, unit = state.install.current, state.unit
    if state.supervisor != "systemd" or unit is None or version is None:
        return None
    install_dir = state.install.install_dir
    return render_unit(host, install_dir, server_argv(host, install_dir, version), user=unit.user)


def supervisor_drift(host: Host, state: NodeState) -> str:
    """Why the running server's supervision differs from the inventory's ("" when it does not)."""
    text, unit = unit_text(host, state), state.unit
    if text is None or unit is None:
        return ""
    if unit.text != text:
        return f"unit {unit.name} differs from the inventory's"
    return "" if unit.enabled else f"unit {unit.name} is not enabled"


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


async def stop_server(
    conn: Connection, host: Host, install_dir: str, *, state: NodeState | None = None
) -> str:
    """Stop our server; returns what happened ("stopped", "killed", "gone", "none")."""
    if state is not None and state.supervisor == "systemd" and state.unit is not None:
        if not state.unit.installed:
            return "none"
        await _sh(conn, control_script(state.unit.name, "stop", user=state.unit.user), STOP_GRACE + 15)
        return "stopped"
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


async def _log_tail(
    conn: Connection, install_dir: str, lines: int = 8, *, state: NodeState | None = None
) -> str:
    """The server's last log lines: its log file, or its unit's journal under systemd."""
    if state is not None and state.supervisor == "systemd" and state.unit is not None:
        command = journal_command(state.unit.name, lines, user=state.unit.user)
        try:
            return (await conn.run(command, timeout=10)).stdout
        except Exception:
            return ""
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
    text = unit_text(host, state)
    if text is not None and state.unit is not None:  # systemd: install (idempotent), enable, start
        name, user = state.unit.name, state.unit.user
        script = "\n".join(
            [
                _taken_check(int(host.rpc_port)),
                install_unit_script(name, state.install.install_dir, text, user=user),
                control_script(name, "start", user=user),
            ]
        )
    else:
        script = launch_script(host, state.install.install_dir, version)
    out = _keys(await _sh(conn, script, START_TIMEOUT))
    if "taken" in out:
        listener = parse_listener(out["taken"])
        who = listener.describe() if listener else out["taken"]
        raise ServiceError(
            f"port {host.rpc_port} is already taken: {who}",
            host=host.name,
            hint="stop that process or choose another rpc_port",
        )
    started = out.get("started") or out.get("pid", "")
    if not started.isdigit() or started == "0":
        raise ServiceError(
            "the rpc-server did not start" if "pid" in out else "the launch script did not report a pid",
            host=host.name,
            stderr=await _log_tail(conn, state.install.install_dir, state=state) or str(out),
        )
    return int(started)


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
                log = await _log_tail(conn, install_dir, state=state)
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
                stderr=await _log_tail(conn, install_dir, state=state),
            )
        await asyncio.sleep(0.02)
