"""Starting and stopping the server process: launch line, scripts, readiness."""

from __future__ import annotations

import asyncio
import shlex
import time
from dataclasses import dataclass

from orchestrator.connectors.base import Connection
from orchestrator.connectors.tunnel import dial_endpoint
from orchestrator.core.errors import CommandTimeoutError, ServiceError, tail
from orchestrator.facts.server import (
    PID_IS_NUMBER,
    PROC_ARGV0,
    PS_STAT,
    READ_PID,
    Launch,
    Listener,
    ListenersFact,
    LogTailFact,
    parse_listener,
)
from orchestrator.inventory.model import Host
from orchestrator.operations import BUSY_GRACE
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


def launch_env(host: Host, install_dir: str) -> dict[str, str]:
    """The environment the launch line sets (the cache folder, the debug log when asked)."""
    env = {"LLAMA_CACHE": f"{install_dir}/{CACHE_DIR}"}
    if host.rpc_debug:
        env["GGML_RPC_DEBUG"] = "1"
    return env


def desired_launch(host: Host, install_dir: str, version: str) -> Launch:
    """What the inventory says the running server's command line and environment should be."""
    return Launch(
        tuple(server_argv(host, install_dir, version)), tuple(sorted(launch_env(host, install_dir).items()))
    )


_VALUED_FLAGS = ("-H", "-p", "-d", "-t")


def _flags(argv: tuple[str, ...]) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    args = list(argv[1:])
    while args:
        arg = args.pop(0)
        found[arg] = args.pop(0) if arg in _VALUED_FLAGS and args else None
    return found


def launch_diff(desired: Launch, actual: Launch) -> tuple[str, ...]:
    """Pure: how the running server's launch differs from the inventory's, as short phrases
    ("-c added", "-t 4 -> 2", "GGML_RPC_DEBUG=1 removed"). The binary (the version) is compared elsewhere."""
    changes: list[str] = []
    want, have = _flags(desired.argv), _flags(actual.argv)
    for flag in [*want, *(f for f in have if f not in want)]:
        if flag not in have:
            changes.append(f"{flag} {want[flag]} added" if want[flag] is not None else f"{flag} added")
        elif flag not in want:
            changes.append(f"{flag} {have[flag]} removed" if have[flag] is not None else f"{flag} removed")
        elif want[flag] != have[flag]:
            changes.append(f"{flag} {have[flag]} -> {want[flag]}")
    want_env, have_env = dict(desired.env), dict(actual.env)
    for key in sorted({*want_env, *have_env}):
        if key not in have_env:
            changes.append(f"{key}={want_env[key]} added")
        elif key not in want_env:
            changes.append(f"{key}={have_env[key]} removed")
        elif want_env[key] != have_env[key]:
            changes.append(f"{key} {have_env[key]} -> {want_env[key]}")
    return tuple(changes)


def launch_script(host: Host, install_dir: str, version: str) -> str:
    """The node-side script that starts the server detached and records its pid.

    `trap '' PIPE` before the launch: an ignored signal stays ignored across fork and exec, so a
    client that hangs up early costs a `send failed` line, not the server. `setsid nohup` with every
    stream redirected detaches it from the SSH session; `; ... & echo $!` (never `&&` before the `&`)
    keeps the SSH command from waiting on it. `stdbuf -oL` makes its stdout reach the log at once.
    """
    q = shlex.quote
    port = int(host.rpc_port)
    env = [f"{key}={value}" for key, value in launch_env(host, install_dir).items()]
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


class BusyServerError(ServiceError):
    """A client is connected to the server: stopping it would kill that client's model mid-inference."""


def busy_script(port: int, busy_grace: float = BUSY_GRACE) -> str:
    """Shell lines that print `@busy <peers>` and exit when a client holds the server: a connection to
    `port` seen in every sample for `busy_grace` seconds (samples every 0.1 s).

    A model holds one connection, same peer port, for its whole life; probes come and go with new
    ports, so a stream of them (a monitor probing every 20 ms) never makes a server busy. Sampling ends
    at once when nothing is connected, and after `3 * busy_grace` of probes only.
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
) -> str:
    """Stop our server, and any orphan of this install listening on its port, in one step on the node.

    Only processes whose /proc/PID/cmdline is this install's server binary are signalled. Unless `force`,
    a server with a client connected is refused (`@busy`, see `busy_script`), and the check and the kill
    are one step on the node: no second round trip lets a client seen by the check slip through.
    """
    q = shlex.quote
    port = int(port)
    steps = max(1, int(grace * 10))
    listening = f"ss -Hltnp 'sport = :{port}' 2>/dev/null | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u"
    lines = [
        f"D={q(install_dir)}",
        f'pf="$D/{PID_FILE}"',
        "alive() {",
        f'  s=$({PS_STAT}) || return 1; case "$s" in Z*) return 1;; esac',
        "}",
        "ours() {",
        f"  a=$({PROC_ARGV0})",
        f'  case "$a" in "$D"/versions/*/bin/{SERVER_BINARY}) return 0;; esac; return 1',
        "}",
        'targets=""',
        'if [ -f "$pf" ]; then',
        f"  {READ_PID}",
        f'  if {PID_IS_NUMBER} && alive && ours; then targets="$pid"; else echo "@gone $pid"; fi',
        "fi",
        # Orphans: this install's servers that hold the port without being the tracked one.
        f"for pid in $({listening}); do",
        '  case " $targets " in *" $pid "*) continue;; esac',
        '  if alive && ours; then targets="$targets $pid"; echo "@orphan $pid $(' + PROC_ARGV0 + ')"; fi',
        "done",
        'if [ -z "$targets" ]; then rm -f "$pf"; echo "@none"; exit 0; fi',
    ]
    if not force:
        lines.append(busy_script(port, busy_grace))  # the check and the stop: one step on the node
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


@dataclass(frozen=True)
class StopResult:
    """What stopping did: "stopped", "killed" (needed SIGKILL) or "none" (nothing of ours was running)."""

    outcome: str
    pids: tuple[int, ...] = ()
    orphans: tuple[str, ...] = ()  # "pid path" of orphans that were stopped too


async def stop_server(
    conn: Connection,
    host: Host,
    install_dir: str,
    *,
    force: bool = False,
    busy_grace: float = BUSY_GRACE,
    action: str = "stop",
) -> StopResult:
    """Stop our server (and this install's orphans on its port); refuse a busy one unless `force`."""
    try:
        stdout = await _sh(
            conn, stop_script(install_dir, host.rpc_port, force=force, busy_grace=busy_grace), STOP_GRACE + 15
        )
    except CommandTimeoutError as exc:
        raise ServiceError("stopping the rpc-server did not finish", host=host.name) from exc
    out = _keys(stdout)
    orphans = tuple(line[len("@orphan ") :] for line in stdout.splitlines() if line.startswith("@orphan "))
    if "busy" in out:
        raise _busy_error(host, action, out["busy"])
    if "stuck" in out:
        raise ServiceError(f"the rpc-server (pid {out['stuck']}) survived SIGKILL", host=host.name)
    for key in ("killed", "stopped"):
        if key in out:
            pids = tuple(int(p) for p in out[key].split() if p.isdigit())
            return StopResult(key, pids, orphans)
    if "none" in out:
        return StopResult("none")
    raise ServiceError(f"unexpected answer from the stop script: {tail(stdout)}", host=host.name)


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
    out = _keys(await _sh(conn, busy_script(host.rpc_port, busy_grace), busy_grace * 3 + 15))
    if "busy" in out:
        raise _busy_error(host, action, out["busy"])


async def _log_tail(conn: Connection, install_dir: str, lines: int = 8) -> str:
    fact = LogTailFact(f"{install_dir}/{LOG_FILE}", lines)
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
            hint=taken_hint(listener, state.install.install_dir),
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
                await dial_endpoint(host),
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
