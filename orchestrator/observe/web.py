"""The exporter's HTTP side: the live fleet page at `/`, its JSON, its login, and (alone) `/metrics`.

Key rules (serve's): without a configured key everything is open (the listener is then on loopback);
with one, `/fleet.json` and `/metrics` need `Authorization: Bearer KEY` or the page's cookie, and `/`
shows a login form until the browser has that cookie. The form posts the key to `/login`, the only way
in: a key never travels in an address (no `/?key=`), so it stays out of logs, history and Referer. The
cookie (`rpcfleet_page`, HttpOnly, SameSite=Strict) holds an HMAC of the key, not the key: it opens
the page and its JSON, never the API.

`HttpGuard`, in front of serve's and the exporter's apps: without a key (the loopback default), a
request must name a loopback host (`localhost`, 127.0.0.0/8, ::1) in its Host header, so a web page
that rebinds its DNS name to 127.0.0.1 cannot drive the API from a browser; and every request body is
bounded (the OpenAI routes' by `max_body`, the others' by 4 KiB): 413 beyond, counted as it arrives
whatever the headers say (a Content-Length and a Transfer-Encoding together are refused: 400), and it
must arrive within `body_timeout` (408). Each refusal closes the connection: the rest of the body is
never read. `observe.server` adds the limits of the connections themselves.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse

from orchestrator.observe.collect import Collector
from orchestrator.observe.prometheus import RequestTimes, render
from orchestrator.observe.snapshot import FormationView, Snapshot, with_held

COOKIE = "rpcfleet_page"


class Exporter:
    """A collector, the formations of whoever serves, and their request histograms (`times`)."""

    def __init__(
        self,
        collector: Collector,
        formations: Callable[[], Sequence[FormationView]] = tuple,
        times: RequestTimes | None = None,
    ) -> None:
        self.collector = collector
        self.formations = formations
        self.times = times or RequestTimes()

    def snapshot(self) -> Snapshot:
        """The last round's nodes with the formations as they are now: never waits on the fleet."""
        snap = self.collector.snapshot
        formations = tuple(self.formations())
        return replace(snap, nodes=with_held(snap.nodes, formations), formations=formations)

    def metrics(self) -> str:
        snap = self.snapshot()
        return render(snap, snap.formations, self.times.histograms)


def page_token(api_key: str) -> str:
    return hmac.new(api_key.encode(), b"rpcfleet fleet page", hashlib.sha256).hexdigest()


def page_html() -> str:
    return resources.files("orchestrator.observe").joinpath("page.html").read_text(encoding="utf-8")


_LOGIN = """<!doctype html><html><head><meta charset="utf-8"><title>rpcfleet: sign in</title>
<style>body{font-family:system-ui,sans-serif;margin:24px;color:#222}input{font-size:14px;padding:4px}
.nofit{color:#b00020}</style></head><body><h1>rpcfleet fleet</h1>%s
<form method="post" action="login"><label>API key <input type="password" name="key" autofocus></label>
<button type="submit">Open</button></form></body></html>"""


class PageGate:
    """Who signs in to the page: one key (`api_key`; None: the page is open to all), its cookie an HMAC
    of it. Serve's per-user keys bring their own (`serve.access.UserKeysPage`)."""

    def __init__(self, api_key: str | None = None) -> None:
        self.api_key = api_key

    @property
    def open(self) -> bool:
        return self.api_key is None

    def sign_in(self, key: str) -> str | None:
        """The cookie `key` opens the page with (None: it does not)."""
        if self.api_key is None or hmac.compare_digest(key.encode(), self.api_key.encode()):
            return page_token(self.api_key) if self.api_key is not None else ""
        return None

    def cookie_ok(self, cookie: str) -> bool:
        return self.api_key is None or hmac.compare_digest(cookie.encode(), page_token(self.api_key).encode())


def mount(
    app: FastAPI,
    exporter: Exporter,
    *,
    api_key: str | None,
    has_key: Callable[[Request], bool] | None = None,
    metrics: bool = False,
    gate: PageGate | None = None,
) -> None:
    """Add `/`, `/login`, `/fleet.json` (and `/metrics` when `metrics`) to `app`. `has_key`: the app's
    own check of a request's key (default: `Authorization: Bearer` against `api_key`); `gate`: who signs
    in to the page (default: `api_key`)."""
    gate = gate or PageGate(api_key)

    def bearer(request: Request) -> bool:
        if api_key is None:
            return True
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), api_key.encode())

    check = has_key or bearer

    def allowed(request: Request) -> bool:
        if gate.open or check(request):
            return True
        return gate.cookie_ok(request.cookies.get(COOKIE, ""))

    def signed_in(target: str, token: str) -> Response:
        response = RedirectResponse(target, status_code=303)
        if not gate.open:
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict", path="/")
        return response

    def login(message: str = "", status: int = 401) -> HTMLResponse:
        note = f'<p class="nofit">{message}</p>' if message else ""
        return HTMLResponse(_LOGIN % note, status_code=status)

    @app.get("/", response_model=None)
    async def page(request: Request) -> Response:
        if not allowed(request):
            return login()
        return HTMLResponse(page_html(), headers={"Cache-Control": "no-store"})

    @app.post("/login", response_model=None)
    async def post_login(request: Request) -> Response:
        form = urllib.parse.parse_qs((await request.body()).decode(errors="replace"))
        token = gate.sign_in((form.get("key") or [""])[0])
        if token is not None:
            return signed_in("./", token)
        return login("wrong key")

    @app.get("/fleet.json")
    async def fleet_json(request: Request) -> JSONResponse:
        if not allowed(request):
            return JSONResponse({"error": {"message": "invalid API key", "code": 401}}, status_code=401)
        data: dict[str, Any] = exporter.snapshot().to_json()
        data["now"] = round(time.time(), 3)
        return JSONResponse(data, headers={"Cache-Control": "no-store"})

    if metrics:

        @app.get("/metrics")
        async def prometheus(request: Request) -> Response:
            if not allowed(request):
                return JSONResponse({"error": {"message": "invalid API key", "code": 401}}, status_code=401)
            return PlainTextResponse(exporter.metrics(), media_type="text/plain; version=0.0.4")


SMALL_BODY = 4096  # bytes: /login, /admin and every route but the OpenAI ones
DEFAULT_MAX_BODY = 16 * 1024 * 1024  # bytes of an OpenAI request: long prompts, base64 images


@dataclass(frozen=True)
class HttpLimits:
    """What one client may hold of an HTTP server (serve's, the exporter's): `observe.server` applies
    the connections' limits, `HttpGuard` the body's deadline."""

    max_connections: int = 256  # open at once; one more is answered 503 and closed
    header_timeout: float = 10.0  # seconds for a request's head, from the connection or the last answer
    body_timeout: float = 60.0  # seconds for a whole body: 16 MiB at 280 kB/s
    keep_alive: float = 5.0  # seconds an idle connection stays open between two requests
    max_head: int = 16 * 1024  # bytes of a request's line and headers


def is_loopback_name(host_header: str) -> bool:
    """Pure: the Host header names this machine's loopback (`localhost`, 127.0.0.0/8, [::1]), port or
    not."""
    host = host_header.strip().lower()
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else ""
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    if host in ("localhost", "localhost.") or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HttpGuard:
    """ASGI middleware: the Host check of a key-less server (`check_host`) and the body's bounds, its size
    and its deadline (see the module's docstring). The body is counted through `receive` as the app reads
    it, never buffered here: a route that refuses a request unread (401) reads none of it."""

    def __init__(
        self,
        app: Any,
        *,
        check_host: bool,
        max_body: int = DEFAULT_MAX_BODY,
        large_prefix: str = "/v1/",
        body_timeout: float = HttpLimits.body_timeout,
    ) -> None:
        self.app, self.check_host, self.max_body, self.large_prefix = app, check_host, max_body, large_prefix
        self.body_timeout = body_timeout

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", [])
        host = next((v for k, v in headers if k.lower() == b"host"), b"").decode("latin-1")
        if self.check_host and not is_loopback_name(host):
            message = (
                f"Host {host or '(none)'!r} is not a loopback name: a server without an API key answers "
                "only requests to localhost or 127.0.0.1 (start it with a key to serve other names)"
            )
            await _refuse(send, 403, "permission_denied", message)
            return
        path = str(scope.get("path", ""))
        limit = self.max_body if path.startswith(self.large_prefix) else SMALL_BODY
        lengths = [v for k, v in headers if k.lower() == b"content-length"]
        if lengths and any(k.lower() == b"transfer-encoding" for k, _ in headers):
            # Which one frames the body depends on who reads it (request smuggling): neither is trusted
            message = "a request may have a Content-Length or a Transfer-Encoding, not both"
            await _refuse(send, 400, "invalid_request_error", message)
            return
        too_large = f"the request body is over {limit} bytes, the most {path} takes"
        if lengths and (not lengths[0].isdigit() or int(lengths[0]) > limit):
            await _refuse(send, 413, "invalid_request_error", too_large)
            return
        body = _BoundedBody(receive, send, limit, self.body_timeout, too_large)
        try:
            await self.app(scope, body.receive, body.send)
        except Exception:
            # An app that read on after a refusal (`http.disconnect`) fails: that is the refusal, answered
            if body.refusal is None:
                raise


class _BoundedBody:
    """One request's `receive` and `send` as `HttpGuard` hands them to the app: the body's bytes counted
    and its deadline kept until its last part; past either the guard answers (413, 408), the app reads
    `http.disconnect` and its own answer is dropped. After the body, `receive` waits for the client's
    hang-up as it did."""

    def __init__(self, receive: Any, send: Any, limit: int, timeout: float, too_large: str) -> None:
        self._receive, self._send = receive, send
        self.limit, self.timeout, self.too_large = limit, timeout, too_large
        self.deadline = asyncio.get_running_loop().time() + timeout
        self.received = 0
        self.whole = False  # its last part read
        self.started = False  # the app's answer begun
        self.refusal: int | None = None  # the guard's answer (413, 408)

    async def receive(self) -> Any:
        if self.refusal is not None:
            return {"type": "http.disconnect"}
        if self.whole:
            return await self._receive()
        try:
            async with asyncio.timeout_at(self.deadline):
                message = await self._receive()
        except TimeoutError:
            message = f"the request body did not arrive within {self.timeout:g} s"
            return await self._refused(408, "request_timeout", message)
        if message["type"] != "http.request":
            return message
        self.received += len(message.get("body", b""))
        if self.received > self.limit:
            return await self._refused(413, "invalid_request_error", self.too_large)
        self.whole = not message.get("more_body", False)
        return message

    async def send(self, message: Any) -> None:
        if self.refusal is not None:
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)

    async def _refused(self, status: int, kind: str, message: str) -> Any:
        self.refusal = status
        if not self.started:
            await _refuse(self._send, status, kind, message)
        return {"type": "http.disconnect"}


async def _refuse(send: Any, status: int, kind: str, message: str) -> None:
    """An error answer of the guard's; the connection closes after it (a body left unread is dropped)."""
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
