"""serve's one HTTP client to its engines (llama-server on loopback): one `httpx.AsyncClient`, made on the
loop that serves and closed when serving ends, for the proxied requests (streams too: the body passes
through piece by piece as it comes), `/slots`, `/metrics` and the engine's liveness check.

Any failure of the connection (refused, reset, closed before the body's end) is `UpstreamError`; no
answer for `timeout` seconds is `UpstreamTimeout` (unless `alive()` says the engine is busy, not stuck).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import httpx

T = TypeVar("T")


class UpstreamError(Exception):
    """The engine's connection failed (refused, reset, closed early)."""


class UpstreamTimeout(UpstreamError):
    """The engine answered nothing for the timeout."""


@dataclass
class Answer:
    """The engine's answer: status, headers, and its body as it comes (`body`, `read`)."""

    status: int
    headers: httpx.Headers
    response: httpx.Response
    timeout: float
    alive: Callable[[], Awaitable[bool]] | None = None

    async def body(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive (silences judged as `patiently` does)."""
        pieces = self.response.aiter_raw()
        while True:
            try:
                piece = await patiently(anext(pieces), self.timeout, self.alive)
            except StopAsyncIteration:
                return
            except httpx.TransportError as exc:
                raise UpstreamError(f"the engine's answer broke off: {exc}") from exc
            yield piece

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.body()])


async def patiently(
    awaitable: Awaitable[T], silence: float, alive: Callable[[], Awaitable[bool]] | None
) -> T:
    """`awaitable`'s result. A silence of `silence` seconds asks `alive()` whether the engine still works
    (a whole answer is silent until it is complete): the wait goes on while it says yes, else it is
    `UpstreamTimeout`. The awaited read is never cancelled while the wait goes on, so nothing is lost."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=silence)
            if done:
                return task.result()
            if alive is None or not await alive():
                raise UpstreamTimeout(f"the engine answered nothing for {silence:g} s")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


class Upstream:
    """The client: `async with upstream.request(url, "POST", path, body, key=...) as answer: ...`."""

    def __init__(self) -> None:
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        """Made on first use, on the loop that serves (a client belongs to one loop)."""
        if self._client is None:
            self._client = httpx.AsyncClient(
                # no read timeout: the body's silences are judged by `Answer.body`; as many connections as
                # requests in flight (the router bounds them), kept alive between requests
                timeout=httpx.Timeout(10.0, read=None),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                trust_env=False,  # loopback: never through a proxy from the environment
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @contextlib.asynccontextmanager
    async def request(
        self,
        url: str,
        method: str,
        path: str,
        body: bytes = b"",
        *,
        key: str | None = None,
        silence: float,
        alive: Callable[[], Awaitable[bool]] | None = None,
    ) -> AsyncIterator[Answer]:
        """One request to the engine at `url` (its own API key `key`, sent as `Authorization: Bearer`);
        every silence (connecting, the head, the body) is judged by `patiently`."""
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        if method != "GET":
            headers["Content-Type"] = "application/json"
        built = self.client.build_request(
            method, url + path, content=body if method != "GET" else None, headers=headers
        )
        try:  # llama-server sends a whole answer's head only once it is complete: a silence, judged so
            response = await patiently(self.client.send(built, stream=True), silence, alive)
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"connecting to the engine took over {silence:g} s") from exc
        except httpx.TransportError as exc:
            raise UpstreamError(f"cannot reach the engine: {exc}") from exc
        try:
            yield Answer(response.status_code, response.headers, response, silence, alive)
        finally:
            await response.aclose()

    async def get(self, url: str, path: str, seconds: float, key: str | None) -> tuple[int, bytes]:
        """GET `path` of the engine at `url` (status, body), all of it within `seconds`."""

        async def whole() -> tuple[int, bytes]:
            async with self.request(url, "GET", path, key=key, silence=seconds) as answer:
                return answer.status, await answer.read()

        try:
            return await asyncio.wait_for(whole(), seconds)
        except TimeoutError as exc:
            raise UpstreamTimeout(f"the engine answered nothing for {seconds:g} s") from exc
