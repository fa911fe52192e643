"""The local connector: commands in a local bash, files copied on this machine."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from pathlib import Path

from orchestrator.connectors.base import (
    CHUNK,
    DRAIN_TIMEOUT,
    BaseConnection,
    ConnectOptions,
    Progress,
    ProgressReporter,
)
from orchestrator.core.errors import (
    TransferError,
    UnreachableError,
)
from orchestrator.engine.children import start_shell_child  # the runtime's (pyproject)
from orchestrator.inventory.model import Host


class LocalConnection(BaseConnection):
    """Commands through bash on this machine, files copied; same semantics as `SSHConnection`.

    Commands run in `home` (default: $HOME), as an SSH login would; `~/` and relative remote paths
    are relative to it.
    """

    def __init__(
        self, host: Host, options: ConnectOptions | None = None, *, home: Path | None = None
    ) -> None:
        self.host = host
        self.options = options or ConnectOptions()
        self.home = home or Path.home()

    def _path(self, remote: str) -> Path:
        if remote in ("~", "~/"):
            return self.home
        if remote.startswith("~/"):
            return self.home / remote[2:]
        return self.home / Path(remote).expanduser()  # an absolute path stays absolute

    async def _execute(self, command: str, limit: float, data: bytes | None) -> tuple[int, bytes, bytes]:
        env = None if self.home == Path.home() else {**os.environ, "HOME": str(self.home)}
        try:
            process = await start_shell_child(
                command,
                executable="/bin/bash",
                stdin=asyncio.subprocess.PIPE if data else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=self.home,
                env=env,
                start_new_session=True,  # its own process group, so a timeout can kill all of it
            )
        except OSError as exc:  # no bash, no home directory
            raise UnreachableError(
                f"cannot start bash in {self.home}: {exc.strerror or exc}", host=self.host.name
            ) from None
        stdout, stderr = bytearray(), bytearray()
        assert process.stdout is not None and process.stderr is not None
        readers = {
            asyncio.create_task(_read_into(process.stdout, stdout)),
            asyncio.create_task(_read_into(process.stderr, stderr)),
        }
        writer = asyncio.create_task(_feed(process.stdin, data))
        waiter = asyncio.create_task(process.wait())
        tasks = {*readers, writer, waiter}
        try:
            _done, pending = await asyncio.wait(tasks, timeout=limit)
        except BaseException:  # cancelled: do not leave the command behind
            _kill_group(process.pid)
            for task in tasks:
                task.cancel()
            raise
        if pending:
            _kill_group(process.pid)
            writer.cancel()
            # Whatever the command wrote before it was killed is still in the pipes.
            await asyncio.wait({*readers, waiter}, timeout=DRAIN_TIMEOUT)
            for task in tasks:
                task.cancel()
            raise self._timed_out(command, limit, bytes(stdout), bytes(stderr))
        code = waiter.result()
        return (128 - code if code < 0 else code), bytes(stdout), bytes(stderr)

    async def hold(self, command: str) -> _HeldLocalCommand:
        env = None if self.home == Path.home() else {**os.environ, "HOME": str(self.home)}
        try:
            process = await start_shell_child(
                command,
                executable="/bin/bash",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                cwd=self.home,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            raise UnreachableError(
                f"cannot start bash in {self.home}: {exc.strerror or exc}", host=self.host.name
            ) from None
        return _HeldLocalCommand(self, process)

    async def put(self, local: Path, remote: str, *, progress: Progress | None = None) -> None:
        await _copy(local, self._path(remote), progress, self.host, f"cannot upload {local} to {remote}")

    async def get(self, remote: str, local: Path) -> None:
        await _copy(self._path(remote), local, None, self.host, f"cannot download {remote} to {local}")

    async def another(self) -> LocalConnection:
        return LocalConnection(self.host, self.options, home=self.home)

    def abort(self) -> None:
        return None  # no link to drop: its commands are this machine's processes

    async def close(self) -> None:
        return None


_RELEASE_TIMEOUT = 1.0  # a held command that does not read its stdin is killed after this


class _HeldLocalCommand:
    def __init__(self, conn: LocalConnection, process: asyncio.subprocess.Process) -> None:
        self._conn = conn
        self._process = process

    async def readline(self, timeout: float) -> str | None:  # noqa: ASYNC109
        assert self._process.stdout is not None
        try:
            line = await asyncio.wait_for(self._process.stdout.readline(), timeout)
        except TimeoutError:
            raise self._conn._timed_out("(held command)", timeout, b"", b"") from None
        return line.decode("utf-8", errors="replace").rstrip("\n") if line else None

    async def send(self, data: str) -> bool:
        stdin = self._process.stdin
        if stdin is None or stdin.is_closing() or self._process.returncode is not None:
            return False
        try:
            stdin.write(data.encode())
            await stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    async def release(self) -> None:
        if self._process.stdin is not None:
            with contextlib.suppress(OSError):
                self._process.stdin.close()
        try:
            await asyncio.wait_for(self._process.wait(), _RELEASE_TIMEOUT)
        except TimeoutError:
            _kill_group(self._process.pid)
            await self._process.wait()


async def _read_into(stream: asyncio.StreamReader, buffer: bytearray) -> None:
    while chunk := await stream.read(65536):
        buffer += chunk


async def _feed(stdin: asyncio.StreamWriter | None, data: bytes | None) -> None:
    if stdin is None:
        return
    # The command may exit without reading all of its input.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        if data:
            stdin.write(data)
            await stdin.drain()
        stdin.close()
        await stdin.wait_closed()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def _copy(src: Path, dst: Path, progress: Progress | None, host: Host, action: str) -> None:
    reporter = ProgressReporter(progress)
    try:
        total = (await asyncio.to_thread(src.stat)).st_size
        # Files are read and written in chunks off the event loop; the callback runs on the loop.
        with src.open("rb") as fin, dst.open("wb") as fout:
            done = 0
            reporter.report(0, total)
            while chunk := await asyncio.to_thread(fin.read, CHUNK):
                await asyncio.to_thread(fout.write, chunk)
                done += len(chunk)
                reporter.report(done, total)
        shutil.copymode(src, dst)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise TransferError(f"{action}: {exc.strerror or exc}{where}", host=host.name) from None
