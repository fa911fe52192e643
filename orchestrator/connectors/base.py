"""Connections to hosts: run shell commands, copy files; over SSH (asyncssh) or locally (subprocess).

This is the only module that imports asyncssh. Every await is bounded: connecting by the connect
timeout, commands by their timeout, and transfers (and everything else on an open connection) by SSH
keepalive, which is the only thing that notices a link cut on an idle-looking connection.

Failures become `RpcfleetError`s carrying the host: `UnreachableError` (refused, timed out, lost),
`AuthenticationError`, `HostKeyError`, `CommandError` (only with `check=True`), `CommandTimeoutError`
(with the output received before the timeout) and `TransferError`.
"""

from __future__ import annotations

import shlex
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Protocol, Self

from orchestrator.core.errors import (
    CommandError,
    CommandTimeoutError,
)
from orchestrator.core.log import get_logger
from orchestrator.inventory.model import Host

CLOSE_TIMEOUT = 5.0  # closing never waits longer than this


DRAIN_TIMEOUT = 1.0  # after killing a timed-out local command: collect what is left in its pipes


CHUNK = 1 << 20


SFTP_BLOCK = 256 * 1024


Progress = Callable[[int, int], None]  # (bytes done, bytes total)


@dataclass(frozen=True)
class CommandResult:
    """What a finished command left: exit status (128+N when killed by signal N) and decoded output."""

    host: str
    command: str
    exit_status: int
    stdout: str
    stderr: str
    duration: float  # seconds

    @property
    def ok(self) -> bool:
        return self.exit_status == 0


@dataclass(frozen=True)
class ConnectOptions:
    """Timeouts for one connection.

    `connect_timeout=None` means the host's own `ssh_connect_timeout` (10 s unless the inventory says
    otherwise); a number given here overrides every host's.
    """

    connect_timeout: float | None = None
    keepalive_interval: float = 5.0
    keepalive_count_max: int = 3
    command_timeout: float = 60.0  # default for run()

    def connect_timeout_for(self, host: Host) -> float:
        if self.connect_timeout is not None:
            return float(self.connect_timeout)
        return float(host.ssh_connect_timeout)


class HeldCommand(Protocol):
    """A command started by `Connection.hold`: read its output line by line, then release it."""

    async def readline(self, timeout: float) -> str | None:  # noqa: ASYNC109 (a per-call limit)
        """The next line of its stdout without the newline; None at end of file (it exited)."""
        ...

    async def send(self, data: str) -> bool:
        """Write `data` to its stdin; False once it can no longer be written (the command or the
        connection is gone)."""
        ...

    async def release(self) -> None:
        """Close its stdin and let it exit (killed if it does not within a few seconds)."""
        ...


class Connection(Protocol):
    """An open connection to one host."""

    host: Host

    async def run(
        self,
        command: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the API: a per-call limit)
        check: bool = False,
        input: str | bytes | None = None,
    ) -> CommandResult:
        """Run `command` through a POSIX shell (in the user's home directory)."""
        ...

    async def put(self, local: Path, remote: str, *, progress: Progress | None = None) -> None:
        """Upload a file to `remote` (may start with ~/); the parent directory must exist."""
        ...

    async def get(self, remote: str, local: Path) -> None:
        """Download the file `remote` to `local`."""
        ...

    async def hold(self, command: str) -> HeldCommand:
        """Start `command` with its stdin kept open; it lives until `release()` or until this connection
        dies (its stdin then reaches end of file): what a lock that must die with its holder needs."""
        ...

    async def another(self) -> Connection:
        """A second connection to the same host with the same options: its own TCP connection, so that
        nothing queued on this one (an upload filling the SSH window) delays what is sent on it."""
        ...

    def abort(self) -> None:
        """Drop the connection at once: what is still queued for the host is never sent (a TCP reset),
        so no command of it can start there later, when a cut link comes back."""
        ...

    async def close(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


def local_home(host: Host) -> Path | None:
    """A local host may have its own HOME (the local-connection lab gives each node one)."""
    home = host.vars.get("home")
    return Path(str(home)).expanduser() if home else None


def shell_path(path: str) -> str:
    """`path` for a POSIX shell: a leading `~` becomes "$HOME", everything else is quoted."""
    if path in ("~", "~/"):
        return '"$HOME"'
    if path.startswith("~/"):
        rest = path[2:].rstrip("/")
        return '"$HOME"/' + shlex.quote(rest) if rest else '"$HOME"'
    return shlex.quote(path.rstrip("/") or "/")


def decode(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode("utf-8", errors="replace")


def _encode(data: str | bytes | None) -> bytes | None:
    return data.encode() if isinstance(data, str) else data


def signal_status(name: str) -> int:
    """Shell convention for a process killed by signal `name` ("KILL" or "SIGKILL")."""
    try:
        return 128 + signal.Signals["SIG" + name.removeprefix("SIG")].value
    except KeyError:
        return 255


class BaseConnection:
    host: Host
    options: ConnectOptions

    async def run(
        self,
        command: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the API: a per-call limit)
        check: bool = False,
        input: str | bytes | None = None,
    ) -> CommandResult:
        limit = self.options.command_timeout if timeout is None else timeout
        started = time.monotonic()
        status, stdout, stderr = await self._execute(command, limit, _encode(input))
        return self._finish(command, status, stdout, stderr, started, check)

    async def _execute(self, command: str, limit: float, data: bytes | None) -> tuple[int, bytes, bytes]:
        """Run `command` within `limit` seconds: (exit status, stdout, stderr)."""
        raise NotImplementedError

    def _finish(
        self, command: str, status: int, stdout: bytes, stderr: bytes, started: float, check: bool
    ) -> CommandResult:
        result = CommandResult(
            host=self.host.name,
            command=command,
            exit_status=status,
            stdout=decode(stdout),
            stderr=decode(stderr),
            duration=time.monotonic() - started,
        )
        get_logger(host=self.host.name).debug(
            "command_finished", command=command, exit_status=status, duration=round(result.duration, 3)
        )
        if check and not result.ok:
            raise CommandError(
                "command failed",
                host=self.host.name,
                command=command,
                exit_status=status,
                stderr=result.stderr,
            )
        return result

    def _timed_out(self, command: str, limit: float, stdout: bytes, stderr: bytes) -> CommandTimeoutError:
        return CommandTimeoutError(
            f"command timed out after {limit:g} s",
            host=self.host.name,
            command=command,
            stdout=decode(stdout),
            stderr=decode(stderr),
        )

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class ProgressReporter:
    """Adapts a (done, total) callback and makes sure the last call reports completion."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress = progress
        self.last: tuple[int, int] | None = None

    def report(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.last = (done, total)
            self.progress(done, total)

    def sftp_handler(self, _src: bytes, _dst: bytes, done: int, total: int) -> None:
        self.report(done, total)

    def finish(self, size: int) -> None:
        if self.last != (size, size):
            self.report(size, size)
