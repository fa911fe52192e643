"""The HTTP server of serve, the exporter and the live page: uvicorn, with the limits its defaults lack
(`web.HttpLimits`; the body's are `web.HttpGuard`'s).

- **Connections**: at most `max_connections` open at once; one more is answered 503 and closed as soon
  as it is accepted, so clients that hold connections cannot take every descriptor of the process.
- **A request's head** (its line and headers) must arrive within `header_timeout` of the connection's
  start or of the previous answer on it, else the connection is closed: uvicorn's h11 protocol has no
  deadline of its own, and a client sending a byte now and then held a connection for ever (slowloris).
  The deadline is a timer of the protocol (a subclass of uvicorn's, h11 or httptools as uvicorn picks),
  cancelled in effect once the head is in: from then on the body is the guard's (`body_timeout`) and
  the answer the app's.
- **Idle connections** close after `keep_alive` seconds; a head is at most `max_head` bytes (h11's
  bound, uvicorn's `h11_max_incomplete_event_size`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from typing import Any

import uvicorn

from orchestrator.observe.web import HttpLimits


def http_server(
    app: Any, host: str, port: int, *, limits: HttpLimits | None = None, **options: Any
) -> uvicorn.Server:
    """A uvicorn server of `app` on `host`:`port` (serve it on a socket bound before: `serve(sockets=)`)
    under `limits`; `options`: uvicorn.Config's others (log level, lifespan, graceful shutdown...)."""
    limits = limits or HttpLimits()
    options.setdefault("log_level", "warning")
    options.setdefault("lifespan", "off")
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=_deadline_protocol(_uvicorn_protocol(), limits),
        # A request past it is answered 503 by uvicorn; with the connections bounded below it, what it
        # still bounds is the requests in progress (a stream's included)
        limit_concurrency=limits.max_connections + 1,
        timeout_keep_alive=max(1, round(limits.keep_alive)),
        h11_max_incomplete_event_size=limits.max_head,
        **options,
    )
    return uvicorn.Server(config)


def _uvicorn_protocol() -> type[asyncio.Protocol]:
    """The protocol uvicorn's `auto` picks: httptools when installed, else h11."""
    if importlib.util.find_spec("httptools") is None:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return HttpToolsProtocol


def _busy_answer(limit: int) -> bytes:
    message = f"the server has {limit} connections open, the most it takes: try again later"
    body = json.dumps({"error": {"message": message, "type": "unavailable", "code": 503}}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\nretry-after: 1\r\n\r\n"
    )
    return head.encode() + body


def _deadline_protocol(base: Any, limits: HttpLimits) -> type[asyncio.Protocol]:
    """`base` (uvicorn's protocol) with the connection limit and the head's deadline."""
    busy = _busy_answer(limits.max_connections)

    class Deadlined(base):  # type: ignore[misc]
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                transport.write(busy)
                transport.close()
                return
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's head

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(limits.header_timeout, self._head_late)

        def _head_late(self) -> None:
            self._deadline = None
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                return  # a request's head is in: its body is the guard's, its answer the app's
            if not self.transport.is_closing():
                self.transport.close()

    return Deadlined
