"""The host lock: one operator changes an install at a time.

The lock is a `flock` on `<install_dir>/lock`, taken by a shell that an SSH channel keeps alive
(`Connection.hold`), on a connection of its own (`Connection.another`): on the step's connection its
heartbeats would queue behind an upload's 2 MiB SSH window, 17 s at 1 Mbit/s. A watchdog in that shell
reads the channel: the controller writes a heartbeat byte every `HEARTBEAT_S`; end of file (released, or
the connection closed) or `SILENCE_S` without a byte (the controller's link was cut, and sshd would keep
the session until TCP gives up, for hours) ends the whole command, a `flock` still waiting included, and
the kernel drops the lock. A lock that outlives its controller by more than `SILENCE_S` cannot happen,
whatever the node's sshd keepalive settings.

The holder must stop first: the watchdog acknowledges each heartbeat (`@ack <byte>`), and when the last
acknowledged one was sent `LOST_S` ago (less than `SILENCE_S`: the node cannot have given the lock away
yet) the lock counts as lost. `HostLock.guard` then cancels the host step and drops the step's connection
with a reset, so no command it queued can start on the node once the link is back (`LockLostError`).

The lock file is owner-only: whoever can open it can `flock` it and block every change. Who holds it is
written to `lock.info` after taking it, so a second operator learns "changed by root@ctl (pid 4242,
deploy, since 12:01:03)".

A run readies the lock command on all its hosts at once (`ready`: the connection, the shell, the lock
file open; nothing held) and then takes the locks one after the other in its order (`take`: one line
sent, `@locked` back), so the part that must be serial is a round trip per host.

Read-only commands never take it; every change to a node takes it through `operations.layer`.
"""

from __future__ import annotations

import asyncio
import getpass
import itertools
import os
import shlex
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from orchestrator.connectors.base import Connection, HeldCommand, shell_path
from orchestrator.connectors.nodescript import NodeScript, parse_key_line
from orchestrator.core.errors import CommandTimeoutError, RpcfleetError, ServiceError, ServiceScriptError
from orchestrator.inventory.model import Host

T = TypeVar("T")

# In the install dir itself, not in run/: run/ belongs to the server's user when rpcfleet connects as
# root, and a compromised server could plant a link there for root's chmod and truncation to follow.
LOCK_FILE = "lock"
LOCK_INFO = "lock.info"
LOCKED_EXIT = 3  # the CLI's exit status when a host is locked by someone else
_ANSWER_SLACK = 10.0  # beyond the wait: connecting the channel and the node's shell starting
# Heartbeat bytes, in turn, so that an acknowledgement names the heartbeat it answers. Not a newline:
# the watchdog's `$(...)` would strip it.
HEARTBEATS = "abcdefghijklmnopqrstuvwxyz"
HEARTBEAT_S = 2.0  # the controller writes a heartbeat this often
SILENCE_S = 15.0  # the holder gives up after this long without one (the SSH keepalive's 5 s x 3 alike)
LOST_S = 10.0  # the controller stops when its last acknowledged heartbeat was sent this long ago


class HostLockedError(ServiceError):
    """Another operator is changing this host (and `--wait-lock` ran out, or was 0); the CLI exits 3."""


class LockLostError(ServiceError):
    """This controller stopped hearing that the node holds its lock: the host step was stopped."""


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


def lock_script(install_dir: str, owner: LockOwner, turn_s: float, *, silence_s: float = SILENCE_S) -> str:
    """Get ready (the folder, the lock file open), say `@ready`, then wait up to `turn_s` for the
    controller's turn: a line with how long to wait for the lock. Take it (waiting that long), record
    the owner, say `@locked`, then hold it while the controller's heartbeats arrive (see the module
    docstring). `@held <owner>` is printed first when someone else has it; `@timeout` when waiting ran
    out. The slow part (the channel, the shell, its checks) comes before the turn, so a run readies all
    its hosts at once and takes their locks one after the other in a round trip each."""
    directory = shell_path(install_dir)
    info = shlex.quote(owner.describe())
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
            'echo "@ready"',
            # The turn: one line, read byte by byte (sh's `read` on a pipe), so that no heartbeat byte
            # after it is taken from the watchdog; end of file or no turn within `turn_s`: nothing held.
            f"w=$(timeout {max(1.0, turn_s):g} sh -c 'IFS= read -r w && echo \"$w\"') || exit 1",
            'case $w in ""|*[!0-9.]*) echo "@error the wait for the lock is not a number"; exit 1;; esac',
            # The watchdog: a heartbeat byte keeps it reading, and is acknowledged; end of file or silence
            # ends the command's whole process group (this shell, a waiting flock): `hold` starts it in a
            # group of its own (sshd's session, LocalConnection's new session). sh gives a background job
            # /dev/null as its stdin unless told otherwise: hence fd 3. It must not hold the lock's fd 9.
            "exec 3<&0",
            "( while b=$(timeout " + f"{silence_s:g}" + ' head -c 1 2>/dev/null) && [ -n "$b" ]; do',
            '    echo "@ack $b"; done',
            "  kill -TERM 0 ) <&3 2>/dev/null 9>&- &",
            "w_pid=$!",
            "trap 'kill $w_pid 2>/dev/null' EXIT",
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
            f'  [ "$w" != 0 ] && flock -w "$w" 9 || {{ echo "@timeout"; exit {LOCKED_EXIT}; }}',
            "fi",
            f'printf "%s %s\\n" "$$" {info} > "$D/{LOCK_INFO}"',
            'echo "@locked"',
            'wait "$w_pid"',  # hold: until the watchdog ends it all
        ]
    )


class _Heartbeats:
    """Writes heartbeats to the lock's command and reads their acknowledgements: `lost` is set (with why)
    once the last acknowledged heartbeat was sent `lost_s` ago, or the command ended."""

    def __init__(self, held: HeldCommand, every_s: float, lost_s: float) -> None:
        self._held = held
        self._every_s = every_s
        self._lost_s = lost_s
        self._sent: dict[str, float] = {}
        self.acked_sent_at = time.monotonic()  # taking the lock counts as a first acknowledgement
        self.lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def acknowledged(self, line_value: str) -> None:
        sent = self._sent.get(line_value[:1])
        if sent is not None and sent > self.acked_sent_at:
            self.acked_sent_at = sent

    async def send(self) -> None:
        """Until the command can no longer be written to."""
        for beat in itertools.cycle(HEARTBEATS):
            self._sent[beat] = time.monotonic()
            if not await self._held.send(beat):
                return
            await asyncio.sleep(self._every_s)

    async def watch(self) -> None:
        """Read acknowledgements once the lock is held; set `lost` when they stop or the command ends."""
        self.acked_sent_at = time.monotonic()
        while True:
            left = self.acked_sent_at + self._lost_s - time.monotonic()
            if left <= 0:
                return self._lose(f"no heartbeat acknowledged for {self._lost_s:g} s")
            try:
                line = await self._held.readline(left)
            except CommandTimeoutError:
                continue
            except RpcfleetError as exc:
                return self._lose(exc.message)
            if line is None:
                return self._lose("the lock's command ended")
            key, value = parse_key_line(line) or ("", "")
            if key == "ack":
                self.acknowledged(value)

    def _lose(self, why: str) -> None:
        if not self.lost.done():
            self.lost.set_result(why)


class HostLock:
    """A held lock; `guard` runs a host step under it, `release()` (idempotent) lets the next operator in."""

    def __init__(
        self,
        host: Host,
        conn: Connection,
        held: HeldCommand,
        owner: LockOwner,
        heartbeats: _Heartbeats,
        tasks: list[asyncio.Future[None]],
    ) -> None:
        self.host = host
        self.owner = owner
        self._conn: Connection | None = conn
        self._held = held
        self._heartbeats = heartbeats
        self._tasks = tasks

    @property
    def lost(self) -> asyncio.Future[str]:
        return self._heartbeats.lost

    @property
    def connection(self) -> Connection | None:
        """The lock's own connection (None once released): when it closes, as a dying controller's
        does, the node lets the lock go at once."""
        return self._conn

    async def guard(self, work: Awaitable[T], step_conn: Connection) -> T:
        """Await `work` (a host step on `step_conn`) while the lock holds. When it is lost first, the step
        is cancelled and `step_conn` dropped with a reset (nothing it queued reaches the node later), and
        LockLostError says so: the node gives the lock away only `SILENCE_S` after the last heartbeat it
        read, and this happens `LOST_S` after the last one it acknowledged was sent."""
        task = asyncio.ensure_future(work)
        either: list[asyncio.Future[Any]] = [task, self.lost]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        step_conn.abort()
        await _stop(task)
        raise LockLostError(
            f"lost the host lock: {self.lost.result()}; the step was stopped and its connection dropped, "
            f"before the node could give the lock to another operator ({SILENCE_S:g} s)",
            host=self.host.name,
            hint="the node may be half-changed: check it (`rpcfleet status`) and run the change again",
        )

    async def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            for task in self._tasks:
                await _stop(task)
            await self._held.release()
            await conn.close()


async def _stop(task: asyncio.Future[None] | asyncio.Future[Any]) -> None:
    task.cancel()
    await asyncio.wait([task])  # its cancellation is not this caller's: nothing is raised


class ReadyLock:
    """A host's lock command started on the node and `@ready` there, holding nothing yet: `take` takes the
    lock, `abandon` lets the command and its connection go unused (idempotent)."""

    def __init__(
        self, host: Host, owner: LockOwner, conn: Connection, held: HeldCommand, script: NodeScript
    ) -> None:
        self.host = host
        self.owner = owner
        self.conn = conn
        self.held = held
        self.script = script
        self._abandoned = False

    async def abandon(self) -> None:
        if not self._abandoned:
            self._abandoned = True
            await self.held.release()
            await self.conn.close()


async def ready(
    conn: Connection,
    host: Host,
    operation: str,
    *,
    turn_s: float = _ANSWER_SLACK,
    silence_s: float = SILENCE_S,
    lock_conn: Connection | None = None,
) -> ReadyLock:
    """Start `host`'s lock command for `operation` (on a connection of its own: `lock_conn`, opened
    already, or one opened from `conn`) and wait for it to be ready; it waits `turn_s` for `take`."""
    owner = LockOwner.here(operation)
    # Held, not run: the lock lives as long as the command, so its lines are read as they come.
    script = NodeScript(
        "lock",
        lock_script(host.install_dir, owner, turn_s, silence_s=silence_s),
        _ANSWER_SLACK,
        "cannot take the host lock",
        ServiceScriptError,
    )
    if lock_conn is None:
        lock_conn = await conn.another()
    try:
        held = await lock_conn.hold(script.shell_command)
    except BaseException:
        await lock_conn.close()
        raise
    prepared = ReadyLock(host, owner, lock_conn, held, script)
    try:
        line = await _answer(held, host, time.monotonic() + script.timeout)
        key, value = parse_key_line(line) or ("", "")
        if key == "error":
            raise script.reported(host.name, value)
        if key != "ready":
            raise ServiceError(f"the lock command said {line!r} before it was ready", host=host.name)
    except BaseException:
        await prepared.abandon()
        raise
    return prepared


async def take(
    prepared: ReadyLock,
    *,
    wait_s: float = 0.0,
    on_wait: Callable[[Host, str], None] | None = None,
    asked_wait_s: float | None = None,
    heartbeat_s: float = HEARTBEAT_S,
    lost_s: float = LOST_S,
) -> HostLock:
    """Take the lock `prepared` readied (waiting up to `wait_s`), or raise HostLockedError naming who has
    it. `asked_wait_s`: the wait the operator asked for, when `wait_s` is what is left of it (the message
    names it). Its round trip is the whole of it when the lock is free."""
    host, held = prepared.host, prepared.held
    wait = max(0.0, float(wait_s))
    heartbeats = _Heartbeats(held, heartbeat_s, lost_s)
    sender: asyncio.Future[None] | None = None
    holder = "another operator"
    deadline = time.monotonic() + wait + _ANSWER_SLACK
    try:
        if not await held.send(f"{wait:.3f}\n" if wait > 0 else "0\n"):
            raise ServiceError("the lock command ended before its turn", host=host.name)
        # From the start: the watchdog reads heartbeats while this waits for another operator, too.
        sender = asyncio.ensure_future(heartbeats.send())
        while True:
            line = await _answer(held, host, deadline)
            key, value = parse_key_line(line) or ("", "")
            if key == "locked":
                watcher = asyncio.ensure_future(heartbeats.watch())
                return HostLock(host, prepared.conn, held, prepared.owner, heartbeats, [sender, watcher])
            if key == "held":
                holder = value or holder
                if on_wait is not None:
                    on_wait(host, holder)
            elif key == "timeout":
                asked = wait if asked_wait_s is None else asked_wait_s
                waited = f" after waiting {asked:g} s" if asked > 0 else ""
                raise HostLockedError(
                    f"{host.name} is being changed by {holder}{waited}",
                    host=host.name,
                    hint="wait for it to finish, or retry with --wait-lock SECONDS",
                )
            elif key == "error":
                raise prepared.script.reported(host.name, value)
    except BaseException:
        if sender is not None:
            await _stop(sender)
        await prepared.abandon()
        raise


async def _answer(held: HeldCommand, host: Host, deadline: float) -> str:
    """The lock command's next line by `deadline`."""
    try:
        line = await held.readline(max(0.1, deadline - time.monotonic()))
    except CommandTimeoutError:
        raise ServiceError("the lock did not answer in time", host=host.name) from None
    if line is None:
        raise ServiceError("the lock command ended without taking the lock", host=host.name)
    return line


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
    lost_s: float = LOST_S,
    lock_conn: Connection | None = None,
) -> HostLock:
    """Take `host`'s lock for `operation` at once (`ready`, then `take`)."""
    prepared = await ready(conn, host, operation, silence_s=silence_s, lock_conn=lock_conn)
    return await take(
        prepared,
        wait_s=wait_s,
        on_wait=on_wait,
        asked_wait_s=asked_wait_s,
        heartbeat_s=heartbeat_s,
        lost_s=lost_s,
    )
