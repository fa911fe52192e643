"""Small scriptable fake ggml RPC servers, for what a real server cannot be made to do.

Each `FakeRpcServer` listens on 127.0.0.1 and a free port and runs on its own thread and event loop, so
a client bug cannot stall it (and sync tests, e.g. hypothesis ones, can use it too). Its behaviour is a
`Handler`: a coroutine given a `FakeConnection` per accepted client. Builders below cover the usual
scripts: a correct server of any version and device list, raw bytes after HELLO, a dripping reply, a
reply cut short, silence. The server records what it saw (commands, how each connection ended).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field

HELLO, DEVICE_COUNT, GET_DEVICE_MEMORY, GET_ALIGNMENT, GET_MAX_SIZE = 14, 15, 11, 1, 2
GiB = 1 << 30


@dataclass
class Seen:
    """What one connection did, as the server saw it."""

    commands: list[int] = field(default_factory=list)
    ended: str = "open"  # "eof" (client closed), "reset" (client aborted), "server" (we closed)


class FakeConnection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Seen) -> None:
        self.reader = reader
        self.writer = writer
        self.seen = seen

    async def read_request(self) -> tuple[int, bytes] | None:
        """The next request (cmd, payload), or None at EOF. Trusts sizes: the peer is our own client."""
        try:
            head = await self.reader.readexactly(9)
            cmd, size = struct.unpack("<BQ", head)
            payload = await self.reader.readexactly(min(size, 1 << 16))
        except asyncio.IncompleteReadError:
            self.seen.ended = "eof"
            return None
        except ConnectionResetError:
            self.seen.ended = "reset"
            return None
        self.seen.commands.append(cmd)
        return cmd, payload

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def reply(self, payload: bytes) -> None:
        await self.send(struct.pack("<Q", len(payload)) + payload)

    async def wait_client_close(self, limit: float = 30.0) -> None:
        """Read until the client goes away, recording how."""
        try:
            async with asyncio.timeout(limit):
                while await self.reader.read(4096):
                    pass
            self.seen.ended = "eof"
        except ConnectionResetError:
            self.seen.ended = "reset"
        except TimeoutError:
            pass


Handler = Callable[[FakeConnection], Awaitable[None]]


def hello_payload(version: tuple[int, int, int]) -> bytes:
    return bytes([*version, 0]) + bytes(24)


def protocol(
    version: tuple[int, int, int] = (7, 0, 0),
    devices: Sequence[tuple[int, int]] = ((6 * GiB, 8 * GiB),),
    *,
    device_count: int | None = None,
    alignment: int = 32,
    max_size: int = (1 << 64) - 1,
) -> Handler:
    """A correct server: `devices` are (free, total), each with `alignment` and `max_size` (a CPU's:
    32, SIZE_MAX). `device_count` may claim more devices than exist; asking for a missing one makes it
    close without a reply, as the real server does."""

    async def handle(conn: FakeConnection) -> None:
        while (request := await conn.read_request()) is not None:
            cmd, payload = request
            if cmd == HELLO:
                await conn.reply(hello_payload(version))
            elif cmd == DEVICE_COUNT:
                count = len(devices) if device_count is None else device_count
                await conn.reply(struct.pack("<I", count))
            elif cmd == GET_DEVICE_MEMORY:
                (index,) = struct.unpack("<I", payload)
                if index >= len(devices):
                    return
                await conn.reply(struct.pack("<QQ", *devices[index]))
            elif cmd in (GET_ALIGNMENT, GET_MAX_SIZE):
                (index,) = struct.unpack("<I", payload)
                if index >= len(devices):
                    return
                await conn.reply(struct.pack("<Q", alignment if cmd == GET_ALIGNMENT else max_size))
            else:
                return

    return handle


def raw_after_hello(data: bytes, *, then: str = "close") -> Handler:
    """Read HELLO, send `data` verbatim, then close (`then="close"`) or wait for the client."""

    async def handle(conn: FakeConnection) -> None:
        if await conn.read_request() is None:
            return
        await conn.send(data)
        if then != "close":
            await conn.wait_client_close()

    return handle


def drip(data: bytes, interval: float) -> Handler:
    """Read HELLO, then send `data` one byte every `interval` seconds."""

    async def handle(conn: FakeConnection) -> None:
        if await conn.read_request() is None:
            return
        for i in range(len(data)):
            await conn.send(data[i : i + 1])
            await asyncio.sleep(interval)
        await conn.wait_client_close()

    return handle


def silent() -> Handler:
    """Accept and never answer (what a busy server looks like from the client)."""

    async def handle(conn: FakeConnection) -> None:
        await conn.wait_client_close()

    return handle


class FakeRpcServer:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections: list[Seen] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fakerpc", daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> FakeRpcServer:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(5)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _listen(self) -> asyncio.Server:
        return await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen = Seen()
        self.connections.append(seen)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self.handler(FakeConnection(reader, writer, seen))
            if seen.ended == "open":
                seen.ended = "server"
        except (ConnectionError, OSError):
            seen.ended = "reset"
        finally:
            self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def wait_idle(self, limit: float = 5.0) -> None:
        """Wait until every connection's handler has finished (so `connections` is final)."""

        async def idle() -> None:
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=limit)

        asyncio.run_coroutine_threadsafe(idle(), self._loop).result(limit + 1)

    def stop(self) -> None:
        async def shutdown() -> None:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._server is not None:
                self._server.close()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self._loop.close()


@contextlib.contextmanager
def fake_rpc_server(handler: Handler) -> Iterator[FakeRpcServer]:
    server = FakeRpcServer(handler).start()
    try:
        yield server
    finally:
        server.stop()
