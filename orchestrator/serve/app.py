"""The HTTP front of `rpcfleet serve` (FastAPI): the API key, `/health`, `/metrics`, `/slots`, `/v1/models`
and `/admin/reload` of its own, the OpenAI routes (`serve.routes`) proxied to the formations' engines
(llama-server on loopback; llama.cpp never runs in this process), and the fleet's live page.

Errors of serve's own are OpenAI error objects (`{"error": {"message", "type", "code"}}`): 401 (API key),
403 (an admin route on a server started without a key), 400 (bad JSON or fields).

`/health` answers anyone with its state only; the model path, pids, plan and endpoints need the key (when
one is set). `/admin/*` always needs a key: a server started without one refuses them (SIGHUP reloads).
With an admin key (`--admin-key-file`) the admin routes and `/slots` (every client's prompts) take only
it; without one the API key may reload the engines, never with a rolling restart of the fleet's servers
(403). There is no `/openapi.json`.

Per-user keys (`--keys`, `serve.keys`) replace those: each key's scopes open its routes (`inference`:
`/v1/*`, limited to its models; `metrics`: `/metrics`, the live page, `/health`'s details; `admin`:
`/admin/*`, `/slots`); an unknown key is 401, a known one without the scope 403 naming the key's name.
The name, never the key, is logged and counted (`rpcfleet_key_requests_total`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from orchestrator.core.log import get_logger
from orchestrator.observe.web import Exporter, HttpGuard, PageGate, mount
from orchestrator.serve.formation import Formation
from orchestrator.serve.keys import KeyRing, UserKey
from orchestrator.serve.metrics import Metrics
from orchestrator.serve.router import Router
from orchestrator.serve.routes import error_response, openai_routes, problems
from orchestrator.serve.states import Rejected
from orchestrator.serve.upstream import UpstreamError


def create_app(
    served: Formation | Router,
    *,
    api_key: str | None,
    model_name: str,
    exporter: Exporter | None = None,
    admin_key: str | None = None,
    keys: KeyRing | None = None,
) -> FastAPI:
    """The front over `served` (one formation) or a router of formations (`serve.router`); `keys`: the
    per-user keys in force (then neither `api_key` nor `admin_key`)."""
    if keys is not None and (api_key is not None or admin_key is not None):
        raise ValueError("per-user keys replace the API key and the admin key")
    # No /openapi.json: the routes are OpenAI's (docs/serve.md), and a schema is no one's without a key
    app = FastAPI(title="rpcfleet serve", version="0.2.0", docs_url=None, redoc_url=None, openapi_url=None)
    router = served if isinstance(served, Router) else Router.single(served)
    metrics = router.metrics

    def token(request: Request) -> str | None:
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        return value.strip() if scheme.lower() == "bearer" else None

    def bearer(request: Request, key: str) -> bool:
        presented = token(request)
        return presented is not None and hmac.compare_digest(presented.encode(), key.encode())

    def user(request: Request) -> UserKey | None:
        """The per-user key the request presents (None: none, or not one of the keys in force)."""
        presented = token(request)
        return keys.keys.find(presented) if keys is not None and presented else None

    def has_key(request: Request) -> bool:
        """The request may see the details (/health's, the live page): the configured key, or a per-user
        key with the metrics scope (always true when no key is configured)."""
        if keys is not None:
            found = user(request)
            return found is not None and "metrics" in found.scopes
        return api_key is None or bearer(request, api_key)

    def scoped(scope: str) -> Callable[[Request], None]:
        """The check of a route that needs `scope`: the per-user keys', else the API and admin keys'."""
        if keys is None:
            return authorize_admin if scope == "admin" else authorize

        def check(request: Request) -> None:
            found = user(request)
            if found is None:
                get_logger().warning("serve_key_unknown", route=request.url.path)
                raise HTTPException(401, "invalid API key")
            request.state.key_name = found.name  # counted with the answer's code (KeyCounter)
            # The key as checked, for the request's later questions (its models): a reload meanwhile
            # must not change who the request is
            request.state.user_key = found
            if scope not in found.scopes:
                get_logger().warning("serve_key_refused", key=found.name, route=request.url.path, scope=scope)
                raise HTTPException(403, f"the key {found.name!r} has no {scope} scope: {request.url.path}")

        return check

    def model_refused(request: Request, model: str | None) -> str | None:
        """Why the request's key may not use `model` (None: it may). A request naming no model gets the
        one model served, or 404 from the router."""
        if keys is None:
            return None
        found: UserKey | None = getattr(request.state, "user_key", None)
        if found is None:  # fail closed: a request whose key was not checked uses no model
            return "the request's key was not checked"
        if found.models is None:
            return None
        served = router.models
        wanted = model if model is not None or len(served) != 1 else served[0]
        if wanted is None or found.allows_model(wanted):
            return None  # no model named among several: the router's 404 says so
        get_logger().warning("serve_key_refused", key=found.name, route=request.url.path, model=wanted)
        return f"the key {found.name!r} may not use the model {wanted!r}"

    def authorize(request: Request) -> None:
        if not has_key(request):
            raise HTTPException(401, "invalid API key")

    def authorize_admin(request: Request) -> None:
        # Without a key anyone who reaches the port could drain and reload the fleet: refused outright.
        if api_key is None and admin_key is None and keys is None:
            raise HTTPException(
                403,
                "the admin routes need an API key: start serve with --api-key-file or RPCFLEET_API_KEY "
                "(without one, reload with SIGHUP)",
            )
        if admin_key is None:
            authorize(request)
        elif not bearer(request, admin_key):
            if api_key is not None and bearer(request, api_key):
                raise HTTPException(403, "the API key may not use the admin routes: they take the admin key")
            raise HTTPException(401, "invalid admin key")

    @app.exception_handler(HTTPException)
    async def httperror_response(request: Request, exc: HTTPException) -> JSONResponse:
        metrics.record_request(request.url.path, exc.status_code)
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.record_request(request.url.path, 400)
        return error_response(400, f"invalid request: {problems(exc.errors())}")

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        data = router.health()
        code = 200 if data["status"] in ("ready", "degraded") else 503
        if not has_key(request):  # the model path, pids and endpoints are for the key's holders
            return JSONResponse({"status": data["status"]}, status_code=code)
        return JSONResponse(data, status_code=code)

    @app.get("/metrics", dependencies=[Depends(scoped("metrics"))])
    async def prometheus() -> PlainTextResponse:
        text = await router.prometheus(formations=exporter is None)  # else the exporter's formations
        if exporter is not None:  # the fleet's metrics after serve's own (orchestrator.observe)
            text += exporter.metrics()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(scoped("inference"))])
    async def models(request: Request) -> dict[str, Any]:
        metrics.record_request("/v1/models", 200)
        found: UserKey | None = getattr(request.state, "user_key", None)  # limited to some: only those
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "owned_by": "rpcfleet",
                    "permissions": [],
                    "state": router.model_state(name),  # loaded, loading, unloaded (on demand)...
                    "load": "on-demand" if router.demand and name in router.demand.models else "always",
                }
                for name in router.models
                if keys is None or (found is not None and found.allows_model(name))  # fail closed
            ],
        }

    # The prompts being served, every user's: the admin key's when there is one (the admin scope's with
    # per-user keys), else the API key's
    slots_check = scoped("admin") if keys is not None or admin_key is not None else authorize

    @app.get("/slots", dependencies=[Depends(slots_check)])
    async def slots() -> Response:
        try:
            status, body = await router.slots()
        except Rejected as exc:
            metrics.record_request("/slots", exc.status)
            return error_response(exc.status, exc.message, retry_after=exc.retry_after)
        except UpstreamError as exc:
            metrics.record_request("/slots", 502)
            return error_response(502, str(exc))
        metrics.record_request("/slots", status)
        return Response(body, status_code=status, media_type="application/json")

    @app.post("/admin/reload", dependencies=[Depends(scoped("admin"))])
    async def reload(request: Request) -> JSONResponse:
        body = await request.body()
        try:
            options = json.loads(body) if body.strip() else {}
        except ValueError:
            return error_response(400, 'the body must be JSON: {"rolling_restart": true|false}')
        if not isinstance(options, dict) or not isinstance(options.get("rolling_restart", False), bool):
            return error_response(400, 'the body must be {"rolling_restart": true|false}')
        # The fleet's servers: not the API key's (an admin-scoped per-user key is an admin key)
        if options.get("rolling_restart") and admin_key is None and keys is None:
            metrics.record_request("/admin/reload", 403)
            return error_response(
                403,
                "a rolling restart of the fleet's servers needs the admin key: start serve with "
                "--admin-key-file or RPCFLEET_ADMIN_KEY",
            )
        router.reload(rolling_restart=options.get("rolling_restart", False))
        metrics.record_request("/admin/reload", 202)
        return JSONResponse(
            {"status": "draining", "rolling_restart": options.get("rolling_restart", False)}, status_code=202
        )

    app.include_router(
        openai_routes(router, scoped("inference"), model_refused if keys is not None else None)
    )
    if exporter is not None:  # the live fleet page at `/`, behind the same key rules
        gate = UserKeysPage(keys) if keys is not None else None
        mount(app, exporter, api_key=api_key, has_key=has_key, gate=gate)
    if keys is not None:
        app.add_middleware(KeyCounter, metrics=metrics)
    # outermost: before any route's work
    app.add_middleware(HttpGuard, check_host=api_key is None and keys is None)
    return app


class UserKeysPage(PageGate):
    """The live page's sign-in with per-user keys: a key with the metrics scope opens it; its cookie is
    the key's name and an HMAC of its name and digest under a secret of this process, so it holds no key,
    and stops opening the page once the key is gone from the file or has lost the scope."""

    def __init__(self, keys: KeyRing) -> None:
        self.keys = keys
        self.secret = secrets.token_bytes(32)

    def _token(self, found: UserKey) -> str:
        mac = hmac.new(self.secret, found.name.encode() + b"\0" + found.digest, hashlib.sha256).hexdigest()
        return f"{found.name}:{mac}"

    @property
    def open(self) -> bool:
        return False

    def sign_in(self, key: str) -> str | None:
        found = self.keys.keys.find(key)
        return self._token(found) if found is not None and "metrics" in found.scopes else None

    def cookie_ok(self, cookie: str) -> bool:
        found = self.keys.keys.named(cookie.partition(":")[0])
        if found is None or "metrics" not in found.scopes:
            return False
        return hmac.compare_digest(cookie.encode(), self._token(found).encode())


class KeyCounter:
    """ASGI middleware: counts each answer under the name of the per-user key that made the request (set
    by the route's check in `request.state`), with its route and code; and logs it."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        code = 500
        scope.setdefault("state", {})  # the routes' request.state: one dict, read back here

        async def sent(message: Any) -> None:
            nonlocal code
            if message["type"] == "http.response.start":
                code = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            name = scope.get("state", {}).get("key_name")
            if name is not None:
                path = str(scope.get("path", ""))
                self.metrics.record_key_request(name, path, code)
                get_logger().info("serve_key_request", key=name, route=path, code=code)
