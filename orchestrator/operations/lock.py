"""The host lock: one operator changes an install at a time.

The lock is a `flock` on `<install_dir>/lock`, taken by a shell that an SSH channel keeps alive
(`Connection.hold`). A watchdog in that shell reads the channel: the controller writes a heartbeat byte
every `HEARTBEAT_S`; end of file (released, or the connection closed) or `SILENCE_S` without a byte (the
controller's link was cut, and sshd would keep the session until TCP gives up, for hours) ends the whole
command, a `flock` still waiting included, and the kernel drops the lock. A lock that outlives its
controller by more than `SILENCE_S` cannot happen, whatever the node's sshd keepalive settings.

The lock file is owner-only: whoever can open it can `flock` it and block every change. Who holds it is
written to `lock.info` after taking it, so a second operator learns "changed by root@ctl (pid 4242,
deploy, since 12:01:03)".

Read-only commands never take it; every change to a node takes it through `operations.layer`.
"""

from __future__ import annotations

import asyncio
import getpass
import os
import shlex
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.connectors.base import Connection, HeldCommand, shell_path
from orchestrator.connectors.nodescript import NodeScript, parse_key_line
from orchestrator.core.errors import CommandTimeoutError, ServiceError, ServiceScriptError
from orchestrator.inventory.model import Host

# In the install dir itself, not in run/: run/ belongs to the server's user when rpcfleet connects as
# root, and a compromised server could plant a link there for root's chmod and truncation to follow.
LOCK_FILE = "lock"
LOCK_INFO = "lock.info"
LOCKED_EXIT = 3  # the CLI's exit status when a host is locked by someone else
_ANSWER_SLACK = 10.0  # beyond the wait: connecting the channel and the node's shell starting
HEARTBEAT = "."  # not a newline: the watchdog's `$(...)` would strip it
HEARTBEAT_S = 2.0  # the controller writes a heartbeat this often
SILENCE_S = 15.0  # the holder gives up after this long without one (the SSH keepalive's 5 s x 3 alike)


class HostLockedError(ServiceError):
    """Another operator is changing this host (and `--wait-lock` ran out, or was 0); the CLI exits 3."""


@dataclass(frozen=True)
class LockOwner:
    """Who takes a lock: written on the node for the next operator to read."""

    user: str
    controller: str
    pid: int
    operation: str
    since: float

    @classmethod
    def here(cls, operation: str) -> LockOwner:
        return cls(getpass.getuser(), socket.gethostname(), os.getpid(), operation, time.time())

    def describe(self) -> str:
        since = time.strftime("%H:%M:%S", time.localtime(self.since))
        return f"{self.user}@{self.controller} (pid {self.pid}, {self.operation}, since {since})"


def lock_script(install_dir: str, owner: LockOwner, wait_s: float, *, silence_s: float = SILENCE_S) -> str:
    """Take the lock (waiting up to `wait_s`), record the owner, say `@locked`, then hold it while the
    controller's heartbeats arrive (see the module docstring). `@held <owner>` is printed first when
    someone else has it; `@timeout` when waiting ran out."""
    directory = shell_path(install_dir)
    info = shlex.quote(owner.describe())
    wait = max(0.0, float(wait_s))
    return "\n".join(
        [
            f"D={directory}",
            'mkdir -p "$D" || { echo "@error cannot create $D"; exit 1; }',
            "for c in flock/util-linux timeout/coreutils head/coreutils; do",
            '  command -v "${c%/*}" >/dev/null 2>&1 ||',
            '    { echo "@error ${c%/*} (${c#*/}) is not installed"; exit 1; }',
            "done",
            # Owner-only, also a file an older version made with the default umask.
            f'(umask 077 && : >>"$D/{LOCK_FILE}") && chmod 600 "$D/{LOCK_FILE}" ||',
            f'  {{ echo "@error cannot make $D/{LOCK_FILE} owner-only"; exit 1; }}',
            f'exec 9>>"$D/{LOCK_FILE}" || {{ echo "@error cannot open $D/{LOCK_FILE}"; exit 1; }}',
            # The watchdog: a heartbeat byte keeps it reading; end of file or silence ends the command's
            # whole process group (this shell, a waiting flock): `hold` starts it in a group of its own
            # (sshd's session, LocalConnection's new session). sh gives a background job /dev/null as
            # its stdin unless told otherwise: hence fd 3. It must not hold the lock's fd 9.
            "exec 3<&0",
            "( while b=$(timeout " + f"{silence_s:g}" + ' head -c 1 2>/dev/null) && [ -n "$b" ]; do :; done',
            "  kill -TERM 0 ) <&3 >/dev/null 2>&1 9>&- &",
            "w=$!",
            "trap 'kill $w 2>/dev/null' EXIT",
            # The holder writes "<its shell's pid> <owner>" just after taking the lock: an info file whose
            # shell is gone is the previous holder's, so wait a moment for the new one to write its own.
            # Still none alive: the holder may have let go meanwhile, and the last one written names it.
            "who() {",
            "  i=0; last=; while [ $i -lt 50 ]; do",
            f'    if read -r p rest < "$D/{LOCK_INFO}" 2>/dev/null; then',
            '      [ -d "/proc/$p" ] && { echo "$rest"; return; }; last=$rest; fi',
            "    sleep 0.02; i=$((i+1))",
            '  done; echo "${last:-another operator}"',
            "}",
            "if ! flock -n 9; then",
            '  echo "@held $(who)"',
            f'  flock -w {wait:g} 9 || {{ echo "@timeout"; exit {LOCKED_EXIT}; }}'
            if wait > 0
            else f'  echo "@timeout"; exit {LOCKED_EXIT}',
            "fi",
            f'printf "%s %s\\n" "$$" {info} > "$D/{LOCK_INFO}"',
            'echo "@locked"',
            'wait "$w"',  # hold: until the watchdog ends it all
        ]
    )


async def _heartbeat(held: HeldCommand, every_s: float) -> None:
    """Tell the holder this controller is alive, until the command can no longer be written to."""
    while True:
        if not await held.send(HEARTBEAT):
            return
        await asyncio.sleep(every_s)


class HostLock:
    """A held lock; `release()` (idempotent) lets the next operator in."""

    def __init__(
        self, host: Host, held: HeldCommand, owner: LockOwner, heartbeat: asyncio.Future[None]
    ) -> None:
        self.host = host
        self.owner = owner
        self._held: HeldCommand | None = held
        self._heartbeat = heartbeat

    async def release(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            await _stop(self._heartbeat)
            await held.release()


async def _stop(task: asyncio.Future[None]) -> None:
    task.cancel()
    await asyncio.wait([task])  # its cancellation is not this caller's: nothing is raised


async def acquire(
    conn: Connection,
    host: Host,
    operation: str,
    *,
    wait_s: float = 0.0,
    on_wait: Callable[[Host, str], None] | None = None,
    asked_wait_s: float | None = None,
    heartbeat_s: float = HEARTBEAT_S,
    silence_s: float = SILENCE_S,
) -> HostLock:
    """Take `host`'s lock for `operation`, or raise HostLockedError naming who has it. `asked_wait_s`:
    the wait the operator asked for, when `wait_s` is what is left of it (the message names it)."""
    owner = LockOwner.here(operation)
    # Held, not run: the lock lives as long as the command, so its lines are read as they come.
    script = NodeScript(
        "lock",
        lock_script(host.install_dir, owner, wait_s, silence_s=silence_s),
        wait_s + _ANSWER_SLACK,
        "cannot take the host lock",
        ServiceScriptError,
    )
    held = await conn.hold(script.shell_command)
    # From the start: the watchdog reads heartbeats while this waits for another operator, too.
    heartbeat = asyncio.ensure_future(_heartbeat(held, heartbeat_s))
    holder = "another operator"
    deadline = time.monotonic() + script.timeout
    try:
        while True:
            try:
                line = await held.readline(max(0.1, deadline - time.monotonic()))
            except CommandTimeoutError:
                raise HostLockedError(
                    f"the lock did not answer within {script.timeout:g} s", host=host.name
                ) from None
            if line is None:
                raise ServiceError("the lock command ended without taking the lock", host=host.name)
            key, value = parse_key_line(line) or ("", "")
            if key == "locked":
                return HostLock(host, held, owner, heartbeat)
            if key == "held":
                holder = value or holder
                if on_wait is not None:
                    on_wait(host, holder)
            elif key == "timeout":
                asked = wait_s if asked_wait_s is None else asked_wait_s
                waited = f" after waiting {asked:g} s" if asked > 0 else ""
                raise HostLockedError(
                    f"{host.name} is being changed by {holder}{waited}",
                    host=host.name,
                    hint="wait for it to finish, or retry with --wait-lock SECONDS",
                )
            elif key == "error":
                raise script.reported(host.name, value)
    except BaseException:
        await _stop(heartbeat)
        await held.release()
        raise
