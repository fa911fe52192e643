"""A small HTTP/1.1 client for serve's engine on loopback (asyncio and h11, uvicorn's own HTTP parser):
one connection per request, the answer's body read as it comes (a stream passes through piece by piece).

Any failure of the connection (refused, reset, closed before the body's end) is `UpstreamError`; no
answer for `timeout` seconds is `UpstreamTimeout`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType

import h11


class UpstreamError(Exception):
    """The engine's connection failed (refused, reset, closed early)."""


class UpstreamTimeout(UpstreamError):
    """The engine answered nothing for the timeout."""


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    _connection: Upstream

    async def body(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive."""
        while True:
            event = await self._connection.next_event()
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return
            else:
                raise UpstreamError(f"unexpected {type(event).__name__} from the engine")

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.body()])


class Upstream:
    """One request to the engine: `async with Upstream(host, port, timeout) as up: answer = await
    up.request(...)`."""

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float,
        alive: Callable[[], Awaitable[bool]] | None = None,
        key: str | None = None,
    ) -> None:
        """`timeout`: seconds of silence before `alive()` is asked whether the engine still works (a
        whole answer is silent until it is complete); without `alive`, or when it says no, the silence is
        `UpstreamTimeout`. `key`: the engine's own API key, sent as `Authorization: Bearer`."""
        self.host, self.port, self.timeout, self.alive, self.key = host, port, timeout, alive, key
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._h11 = h11.Connection(h11.CLIENT)

    async def __aenter__(self) -> Upstream:
        try:
            self._reader, self._writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port), self.timeout
            )
        except TimeoutError as exc:
            raise UpstreamTimeout(f"connecting to the engine took over {self.timeout:g} s") from exc
        except OSError as exc:
            raise UpstreamError(f"cannot connect to the engine: {exc.strerror or exc}") from exc
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(self._writer.wait_closed(), 1.0)

    async def request(self, method: str, path: str, body: bytes = b"", content_type: str = "") -> Answer:
        assert self._writer is not None
        headers = [("Host", f"{self.host}:{self.port}"), ("Connection", "close")]
        if self.key is not None:
            headers.append(("Authorization", f"Bearer {self.key}"))
        if method != "GET":
            headers += [
                ("Content-Length", str(len(body))),
                ("Content-Type", content_type or "application/json"),
            ]
        try:
            self._writer.write(
                self._h11.send(h11.Request(method=method, target=path, headers=headers)) or b""
            )
            if body:
                self._writer.write(self._h11.send(h11.Data(data=body)) or b"")
            self._writer.write(self._h11.send(h11.EndOfMessage()) or b"")
            await self._writer.drain()
        except OSError as exc:
            raise UpstreamError(f"sending to the engine failed: {exc.strerror or exc}") from exc
        event = await self.next_event()
        if not isinstance(event, h11.Response):
            raise UpstreamError(f"unexpected {type(event).__name__} from the engine")
        headers_out = {k.decode().lower(): v.decode("latin-1") for k, v in event.headers}
        return Answer(event.status_code, headers_out, self)

    async def next_event(self) -> h11.Event | type[h11.PAUSED]:
        assert self._reader is not None
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise UpstreamError(f"the engine's answer broke off: {exc}") from exc
            if event is not h11.NEED_DATA:
                return event  # type: ignore[return-value]
            try:
                data = await asyncio.wait_for(self._reader.read(65536), self.timeout)
            except TimeoutError as exc:
                if self.alive is not None and await self.alive():
                    continue  # busy, not stuck: wait on
                raise UpstreamTimeout(f"the engine answered nothing for {self.timeout:g} s") from exc
            except OSError as exc:
                raise UpstreamError(f"the engine's connection failed: {exc.strerror or exc}") from exc
            self._h11.receive_data(data)  # b"": the engine closed the connection
