"""The host lock: one operator changes an install at a time.

The lock is a `flock` on `<install_dir>/run/lock`, taken by a shell that an SSH channel keeps alive
(`Connection.hold`): when the controller exits, is killed or loses its connection, the channel closes, the
shell's stdin reaches end of file, the shell exits and the kernel drops the lock. A lock file that outlives
a killed controller cannot happen. Who holds it is written to `run/lock.info` after taking it, so a second
operator learns "changed by root@ctl (pid 4242, deploy, since 12:01:03)".

Read-only commands never take it; every change to a node takes it through `operations.layer`.
"""

from __future__ import annotations

import getpass
import os
import shlex
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.connectors.base import Connection, HeldCommand, shell_path
from orchestrator.core.errors import CommandTimeoutError, ServiceError
from orchestrator.inventory.model import Host

LOCK_FILE = "run/lock"
LOCK_INFO = "run/lock.info"
LOCKED_EXIT = 3  # the CLI's exit status when a host is locked by someone else
_ANSWER_SLACK = 10.0  # beyond the wait: connecting the channel and the node's shell starting


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


def lock_script(install_dir: str, owner: LockOwner, wait_s: float) -> str:
    """Take the lock (waiting up to `wait_s`), record the owner, say `@locked`, then hold it until stdin
    closes. `@held <owner>` is printed first when someone else has it; `@timeout` when waiting ran out."""
    directory = shell_path(install_dir)
    info = shlex.quote(owner.describe())
    wait = max(0.0, float(wait_s))
    return "\n".join(
        [
            f"D={directory}",
            'mkdir -p "$D/run" || { echo "@error cannot create $D/run"; exit 1; }',
            "command -v flock >/dev/null 2>&1 ||",
            '  { echo "@error flock (util-linux) is not installed"; exit 1; }',
            f'exec 9>>"$D/{LOCK_FILE}" || {{ echo "@error cannot open $D/{LOCK_FILE}"; exit 1; }}',
            # The holder writes "<its shell's pid> <owner>" just after taking the lock: an info file whose
            # shell is gone is the previous holder's, so wait a moment for the new one to write its own.
            "who() {",
            "  i=0; while [ $i -lt 50 ]; do",
            f'    if read -r p rest < "$D/{LOCK_INFO}" 2>/dev/null && [ -d "/proc/$p" ]; then',
            '      echo "$rest"; return; fi',
            "    sleep 0.02; i=$((i+1))",
            "  done; echo another operator",
            "}",
            "if ! flock -n 9; then",
            '  echo "@held $(who)"',
            f'  flock -w {wait:g} 9 || {{ echo "@timeout"; exit {LOCKED_EXIT}; }}'
            if wait > 0
            else f'  echo "@timeout"; exit {LOCKED_EXIT}',
            "fi",
            f'printf "%s %s\\n" "$$" {info} > "$D/{LOCK_INFO}"',
            'echo "@locked"',
            "cat >/dev/null",  # hold: until the controller closes stdin, or its connection dies
        ]
    )


class HostLock:
    """A held lock; `release()` (idempotent) lets the next operator in."""

    def __init__(self, host: Host, held: HeldCommand, owner: LockOwner) -> None:
        self.host = host
        self.owner = owner
        self._held: HeldCommand | None = held

    async def release(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            await held.release()


async def acquire(
    conn: Connection,
    host: Host,
    operation: str,
    *,
    wait_s: float = 0.0,
    on_wait: Callable[[Host, str], None] | None = None,
) -> HostLock:
    """Take `host`'s lock for `operation`, or raise HostLockedError naming who has it."""
    owner = LockOwner.here(operation)
    held = await conn.hold(f"sh -c {shlex.quote(lock_script(host.install_dir, owner, wait_s))}")
    holder = "another operator"
    deadline = time.monotonic() + wait_s + _ANSWER_SLACK
    try:
        while True:
            try:
                line = await held.readline(max(0.1, deadline - time.monotonic()))
            except CommandTimeoutError:
                raise HostLockedError(
                    f"the lock did not answer within {wait_s + _ANSWER_SLACK:g} s", host=host.name
                ) from None
            if line is None:
                raise ServiceError("the lock command ended without taking the lock", host=host.name)
            key, _, value = line.partition(" ")
            if key == "@locked":
                return HostLock(host, held, owner)
            if key == "@held":
                holder = value.strip() or holder
                if on_wait is not None:
                    on_wait(host, holder)
            elif key == "@timeout":
                waited = f" after waiting {wait_s:g} s" if wait_s > 0 else ""
                raise HostLockedError(
                    f"{host.name} is being changed by {holder}{waited}",
                    host=host.name,
                    hint="wait for it to finish, or retry with --wait-lock SECONDS",
                )
            elif key == "@error":
                raise ServiceError(f"cannot take the host lock: {value}", host=host.name)
    except BaseException:
        await held.release()
        raise
