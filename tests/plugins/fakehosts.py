"""Tier 1 fake hosts: in-process asyncssh SSH servers on 127.0.0.N, each with its own HOME.

Each fake host is a real SSH server (key auth, host key, exec through `bash -c`, SFTP) listening on its
own loopback address. Commands really run, as the test user, with HOME and the working directory set to
the host's home; SFTP resolves relative paths (and so `~/x`, which the client sends as `x`) against that
home like sshd does, absolute paths are the real ones. The servers run on their own thread and event
loop so that a client bug (a blocked loop, a hang) cannot stall them.

What they cannot model (tier 2 does): a real network cut (`fake_host_loop.freeze(s)` comes close: the
TCP connection stays up and nothing answers), distinct hostnames or process spaces, a real sshd's
quirks. One leniency: when a client drops the channel of a running command, the command's process
group is killed (a real sshd leaves it to die of SIGPIPE), so tests leave no strays behind; background
jobs of a command that finished live on, as under sshd.

Fixtures:
- `fake_hosts(n, **host_fields) -> list[FakeHost]`: n fake hosts, ready to connect (their `.host`);
  `FakeHost.stop_listening()` (refused), `.abort_connections()` (connection lost),
  `.host_with_known_hosts("wrong" | "unknown")`, `.host_with(**fields)`.
- `silent_host() -> Host`: a TCP listener that accepts and never speaks (connect timeout).
- `client_key_path`, `other_client_key_path`: the session's authorised client key and a stranger's.
- `fake_host_loop`: the servers' thread and loop (session scope); `.freeze(seconds)` stalls them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import getpass
import itertools
import os
import posixpath
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import asyncssh
import pytest

from orchestrator.inventory.model import Host

T = TypeVar("T")
_CALL_TIMEOUT = 10.0


class ServerLoop:
    """An event loop on a daemon thread; `call` runs a coroutine there and waits for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="fakehosts", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = _CALL_TIMEOUT) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def freeze(self, seconds: float) -> None:
        """Block every fake host for `seconds` (TCP stays up, nothing answers: a stalled or cut peer)."""
        self.loop.call_soon_threadsafe(time.sleep, seconds)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(_CALL_TIMEOUT)
        if not self.thread.is_alive():
            self.loop.close()


def known_hosts_line(address: str, port: int, key: asyncssh.SSHKey) -> str:
    target = address if port == 22 else f"[{address}]:{port}"
    return f"{target} {key.export_public_key().decode().strip()}\n"


@dataclass
class FakeHost:
    """One fake SSH host. `host` connects to it; `home` is its HOME and working directory."""

    name: str
    address: str
    port: int
    home: Path
    host: Host
    host_key: asyncssh.SSHKey
    known_hosts: Path  # lists this host with its real key; `host.ssh_known_hosts` points here
    _server: asyncssh.SSHAcceptor
    _loop: ServerLoop
    _workdir: Path
    connections: list[asyncssh.SSHServerConnection] = field(default_factory=list)
    processes: set[asyncio.subprocess.Process] = field(default_factory=set)

    def stop_listening(self) -> None:
        """Close the listener: new connections are refused; open ones keep working."""

        async def stop() -> None:
            self._server.close()
            await self._server.wait_closed()

        self._loop.call(stop())

    def abort_connections(self) -> None:
        """Drop every open connection at once (the client sees the connection lost)."""

        async def abort() -> None:
            for conn in self.connections:
                conn.abort()

        self._loop.call(abort())

    def host_with(self, **changes: Any) -> Host:
        """`host` with some fields changed."""
        return dataclasses.replace(self.host, **changes)

    def host_with_known_hosts(self, kind: Literal["wrong", "unknown"]) -> Host:
        """`host` verified against a known_hosts file that lists another key for it, or not it at all."""
        path = self._workdir / f"known_hosts-{kind}"
        if kind == "wrong":
            other = asyncssh.generate_private_key("ssh-ed25519")
            path.write_text(known_hosts_line(self.address, self.port, other))
        else:
            path.write_text(known_hosts_line(self.address, self.port + 1, self.host_key))
        return self.host_with(ssh_known_hosts=str(path))


class _HomeSFTPServer(asyncssh.SFTPServer):
    """SFTP as sshd serves it: absolute paths as they are, relative ones from the user's home."""

    def __init__(self, chan: asyncssh.SSHServerChannel[bytes], home: Path) -> None:
        super().__init__(chan)
        self._home = os.fsencode(home)

    def map_path(self, path: bytes) -> bytes:
        return path if path.startswith(b"/") else posixpath.join(self._home, path)


def _process_handler(
    home: Path, processes: set[asyncio.subprocess.Process]
) -> Callable[[asyncssh.SSHServerProcess[bytes]], Awaitable[None]]:
    env = {**os.environ, "HOME": str(home)}

    async def handle(process: asyncssh.SSHServerProcess[bytes]) -> None:
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            process.command or "exec bash -l",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=home,
            env=env,
            start_new_session=True,
        )
        processes.add(proc)
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        pumps = [
            asyncio.create_task(_pump_out(proc.stdout, process.stdout)),
            asyncio.create_task(_pump_out(proc.stderr, process.stderr)),
        ]
        feeder = asyncio.create_task(_pump_in(process.stdin, proc.stdin, proc.pid))
        finished = asyncio.create_task(_finished(proc, pumps))
        closed = asyncio.create_task(process.wait_closed())
        exited = False
        try:
            await asyncio.wait({finished, closed}, return_when=asyncio.FIRST_COMPLETED)
            if finished.done() and not closed.done():
                code = finished.result()
                exited = True
                if code < 0:
                    process.exit_with_signal(signal.Signals(-code).name.removeprefix("SIG"))
                else:
                    process.exit(code)
        finally:
            if not exited:
                # The channel went away under a running command (client gave up, connection lost):
                # kill it so tests leave no strays. Background jobs of a finished command live on,
                # as under sshd.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            for task in (*pumps, feeder, finished, closed):
                task.cancel()
            with contextlib.suppress(Exception):
                await proc.wait()
            processes.discard(proc)

    return handle


async def _finished(proc: asyncio.subprocess.Process, pumps: list[asyncio.Task[None]]) -> int:
    """Like sshd: the exit status goes out once the command exited and its output reached EOF."""
    code = await proc.wait()
    await asyncio.gather(*pumps, return_exceptions=True)
    return code


async def _pump_out(source: asyncio.StreamReader, sink: asyncssh.SSHWriter[bytes]) -> None:
    with contextlib.suppress(OSError, asyncssh.Error):
        while chunk := await source.read(65536):
            sink.write(chunk)
            await sink.drain()


async def _pump_in(source: asyncssh.SSHReader[bytes], sink: asyncio.StreamWriter, pid: int) -> None:
    with contextlib.suppress(OSError, asyncssh.Error):
        while True:
            try:
                chunk = await source.read(65536)
            except asyncssh.SignalReceived as exc:
                with contextlib.suppress(ProcessLookupError, PermissionError, KeyError):
                    os.killpg(pid, signal.Signals["SIG" + exc.signal])
                continue
            except (asyncssh.BreakReceived, asyncssh.TerminalSizeChanged):
                continue
            if not chunk:
                break
            sink.write(chunk)
            await sink.drain()
        sink.close()


@pytest.fixture(scope="session")
def fake_host_loop() -> Iterator[ServerLoop]:
    loop = ServerLoop()
    yield loop
    loop.stop()


@pytest.fixture(scope="session")
def client_key_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's client key (ed25519), authorised on every fake host."""
    path = tmp_path_factory.mktemp("client-key") / "id_ed25519"
    asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(path))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="session")
def other_client_key_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid key that no fake host authorises."""
    path = tmp_path_factory.mktemp("other-key") / "id_ed25519"
    asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(path))
    path.chmod(0o600)
    return path


_address_counter = itertools.count()


def _next_address() -> str:
    # 127.0.0.2 .. 127.0.0.254, then around again (each listener has its own port anyway).
    return f"127.0.0.{2 + next(_address_counter) % 253}"


@pytest.fixture
def fake_hosts(
    fake_host_loop: ServerLoop, client_key_path: Path, tmp_path: Path
) -> Iterator[Callable[..., list[FakeHost]]]:
    """Factory: `fake_hosts(n, **host_fields)` starts n fake SSH hosts; all stopped at teardown."""
    started: list[FakeHost] = []
    authorized = asyncssh.import_authorized_keys(
        asyncssh.read_private_key(str(client_key_path)).export_public_key().decode()
    )

    async def start_one(index: int, host_fields: dict[str, Any]) -> FakeHost:
        name = f"fake{index}"
        address = _next_address()
        workdir = tmp_path / "fakehosts" / name
        home = workdir / "home"
        home.mkdir(parents=True)
        host_key = asyncssh.generate_private_key("ssh-ed25519")
        connections: list[asyncssh.SSHServerConnection] = []
        processes: set[asyncio.subprocess.Process] = set()
        server = await asyncssh.listen(
            host=address,
            port=0,
            server_host_keys=[host_key],
            authorized_client_keys=authorized,
            process_factory=_process_handler(home, processes),
            sftp_factory=lambda chan: _HomeSFTPServer(chan, home),
            encoding=None,
            acceptor=connections.append,
            keepalive_interval=0,
        )
        port = server.get_port()
        known_hosts = workdir / "known_hosts"
        known_hosts.write_text(known_hosts_line(address, port, host_key))
        # The host is this machine, its accounts this machine's: the server runs as the test user, and no
        # dedicated user is made here (tier 2 covers that, on nodes with their own accounts).
        host_fields.setdefault("rpc_run_as", getpass.getuser())
        host = Host(
            name=name,
            address=address,
            ssh_user=getpass.getuser(),
            ssh_port=port,
            ssh_key=str(client_key_path),
            rpc_host=address,
            ssh_known_hosts=str(known_hosts),
            **host_fields,
        )
        return FakeHost(
            name, address, port, home, host, host_key, known_hosts, server, fake_host_loop, workdir,
            connections, processes,
        )  # fmt: skip

    def start(n: int, **host_fields: Any) -> list[FakeHost]:
        first = len(started) + 1
        hosts = [fake_host_loop.call(start_one(first + i, dict(host_fields))) for i in range(n)]
        started.extend(hosts)
        return hosts

    yield start

    async def stop_all() -> None:
        for fake in started:
            fake._server.close()
            for conn in fake.connections:
                conn.abort()
            for proc in list(fake.processes):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.sleep(0)

    fake_host_loop.call(stop_all())


@pytest.fixture
def silent_host(tmp_path: Path) -> Iterator[Callable[[], Host]]:
    """Factory: a Host whose port accepts TCP connections and never says a word."""
    sockets: list[socket.socket] = []

    def make() -> Host:
        address = _next_address()
        sock = socket.socket()
        sock.bind((address, 0))
        sock.listen(16)  # the kernel completes handshakes into the backlog; nobody ever accepts
        sockets.append(sock)
        port = int(sock.getsockname()[1])
        known = tmp_path / f"known_hosts-silent-{port}"
        known.write_text("")
        return Host(
            name=f"silent{len(sockets)}",
            address=address,
            ssh_port=port,
            ssh_user=getpass.getuser(),
            ssh_known_hosts=str(known),
        )

    yield make
    for sock in sockets:
        sock.close()
