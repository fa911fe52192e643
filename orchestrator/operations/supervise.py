"""The process supervisor's loop: a POSIX sh script on the node (no Python there) that runs the
rpc-server in the foreground and restarts it when it fails, as the systemd unit's `Restart=on-failure`
with its start limit does.

`launch_script` (server/process.py) writes it to `run/rpc-supervise.sh` and starts it detached; it writes
its own pid to `run/rpc-supervisor.pid`, the server's to `run/rpc-server.pid` (so the busy check, the
launch-line drift and orphan detection see the real server, as before) and its state to
`run/rpc-supervisor.state`. A server that ends with status 0 or SIGTERM/SIGHUP/SIGINT is not restarted;
any other end is, after 1 s, 2 s, 4 s ... (at most 30 s; a run of 10 s or more starts over at 1 s),
until the 5th failure within 60 s: then the loop gives up and says `crash-looping`.

A failed bind (the servers rpcfleet builds end it with status 1, `exit-status` patch; the log says
`Failed to create server socket`) is one of two things. Another program listening on the port: a clear
state, `exited` with that reason, never a loop. Else the address is not up yet (a late network at boot):
retried with the same backoff for as long as it takes, never counted as a crash.

A stop removes the loop's pid file and kills the loop before the server, so nothing restarts a server
that was stopped on purpose (`stop_loop_lines`).
"""

from __future__ import annotations

from orchestrator.facts.server import PID_IS_NUMBER, SUPERVISOR_SCRIPT_ARG
from orchestrator.operations.server.state import BIND_FAILED, LOG_MARKER, ServerFiles, server_files
from orchestrator.operations.systemd import RESTART_SEC, START_LIMIT_BURST, START_LIMIT_INTERVAL

MAX_DELAY = 30  # seconds: the backoff's cap


STEADY_RUN = 10  # seconds: a run at least this long starts the backoff over


def supervise_sh(files: ServerFiles | None = None) -> str:
    """The loop's script for one server (`files`: its own, `server_files`). Arguments: INSTALL_DIR
    VERSION COMMAND... (the launch line)."""
    f = files or server_files()
    return f"""# rpcfleet's process supervisor (rewritten at each start): runs the rpc-server, restarts it
# when it fails.
# Usage: sh {f.supervisor_script} INSTALL_DIR VERSION COMMAND...
D=$1 V=$2
shift 2
pf="$D/{f.pid}" sp="$D/{f.supervisor_pid}" st="$D/{f.supervisor_state}" log="$D/{f.log}"
echo $$ > "$sp"
# Not the recorded loop any more (stopped, or replaced by a newer start): restart nothing.
mine() {{ [ "$(head -n 1 "$sp" 2>/dev/null)" = "$$" ]; }}
note() {{ echo "=== rpcfleet supervisor: $* ===" >> "$log"; }}
state() {{ printf '%s\\n' "$@" > "$st.tmp" && {{ sync "$st.tmp" 2>/dev/null; mv -f "$st.tmp" "$st"; }}; }}
fails="" delay={RESTART_SEC} restarts=0 last="" port="" prev=""
for a in "$@"; do [ "$prev" = -p ] && port=$a; prev=$a; done
while :; do
  started=$(date +%s)
  "$@" &
  pid=$!
  echo "$pid" > "$pf"
  state "state running" "restarts $restarts" "last $last"
  wait "$pid"
  rc=$?
  mine || exit 0
  if [ "$rc" -gt 128 ]; then why="killed by signal $((rc - 128))"; else why="exited with status $rc"; fi
  case $rc in
    0|129|130|143)  # a clean end for on-failure (status 0: an old, unpatched server's failed bind too)
      note "the rpc-server $why: not restarted"
      state "state exited" "restarts $restarts" "last $why"
      exit 0;;
  esac
  unbound=""
  if [ "$rc" = 1 ] && tail -n 5 "$log" | grep -q "{BIND_FAILED}"; then
    if [ -n "$port" ] && ss -Htln "sport = :$port" 2>/dev/null | grep -q .; then
      why="could not bind: port $port is taken by another program"
      note "the rpc-server $why: not restarted"
      state "state exited" "restarts $restarts" "last $why"
      exit 0
    fi
    unbound=1 why="could not bind its address (not up yet?)"
  fi
  now=$(date +%s) kept="" n=0
  for t in $fails $now; do
    if [ $((now - t)) -lt {START_LIMIT_INTERVAL} ]; then kept="$kept $t" n=$((n + 1)); fi
  done
  fails=$kept
  if [ -n "$unbound" ]; then fails=${{fails% $now}}; n=0; fi  # waiting for the address: no crash
  if [ "$n" -ge {START_LIMIT_BURST} ]; then
    note "the rpc-server $why, $n failures within {START_LIMIT_INTERVAL} s: not restarted (crash-looping)"
    state "state crash-looping" "restarts $restarts" "last $why" "failures $n"
    exit 0
  fi
  if [ $((now - started)) -ge {STEADY_RUN} ]; then delay={RESTART_SEC}; fi
  note "the rpc-server $why: restarting in $delay s"
  state "state restarting" "restarts $restarts" "last $why" "delay $delay"
  sleep "$delay"
  mine || exit 0
  restarts=$((restarts + 1)) last=$why delay=$((delay * 2))
  if [ "$delay" -gt {MAX_DELAY} ]; then delay={MAX_DELAY}; fi
  echo "{LOG_MARKER} $V at $(date -u +%Y-%m-%dT%H:%M:%SZ) (restart $restarts: $why) ===" >> "$log"
done
"""


def stop_loop_lines(files: ServerFiles | None = None) -> list[str]:
    """Shell ($D set): stop this install's loop so that it restarts nothing, and leave in `$loopkids` the
    server it may have forked but not yet recorded (a restart racing this stop).

    The pid file goes first: a loop that wakes finds it is no longer the recorded one and exits. The loop
    is frozen (SIGSTOP) while its children are read, its backoff `sleep` killed, then it is killed."""
    f = files or server_files()
    return [
        f'sp="$D/{f.supervisor_pid}"',
        'loopkids=""',
        'if [ -f "$sp" ]; then',
        '  pid=$(head -n 1 "$sp"); rm -f "$sp"',
        f'  if {PID_IS_NUMBER} && [ "$({SUPERVISOR_SCRIPT_ARG})" = "$D/{f.supervisor_script}" ]; then',
        '    loop=$pid; kill -STOP "$loop" 2>/dev/null',
        '    for kid in $(pgrep -P "$loop" 2>/dev/null); do',
        '      if [ "$(cat /proc/$kid/comm 2>/dev/null)" = sleep ]; then kill -KILL "$kid" 2>/dev/null; '
        'else loopkids="$loopkids $kid"; fi',
        "    done",
        '    kill -KILL "$loop" 2>/dev/null',
        '    i=0; while s=$(ps -o stat= -p "$loop" 2>/dev/null) && [ "${s#Z}" = "$s" ] && [ $i -lt 30 ]; do',
        "      sleep 0.1; i=$((i+1))",
        "    done",
        '    echo "@loop_stopped $loop"',
        "  fi",
        "fi",
        f'rm -f "$D/{f.supervisor_state}"',
    ]
