"""The HTTP front of `rpcfleet serve` (FastAPI): the API key, `/health`, `/metrics`, `/slots`, `/v1/models`
and `/admin/reload` of its own, the OpenAI routes (`serve.routes`) proxied to the formations' engines
(llama-server on loopback; llama.cpp never runs in this process), and the fleet's live page.

Errors of serve's own are OpenAI error objects (`{"error": {"message", "type", "code"}}`): 401 (API key),
403 (an admin route on a server started without a key), 400 (bad JSON or fields).

`/health` answers anyone with its state only; the model path, pids, plan and endpoints need the key (when
one is set). `/admin/*` always needs a key: a server started without one refuses them (SIGHUP reloads).
With an admin key (`--admin-key-file`) the admin routes take only it; without one the API key may
reload the engines, never with a rolling restart of the fleet's servers (403).
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from orchestrator.observe.web import Exporter, HttpGuard, RequestTimer, mount
from orchestrator.serve.backend import Backend
from orchestrator.serve.router import Router
from orchestrator.serve.routes import error_response, openai_routes, problems
from orchestrator.serve.states import Rejected
from orchestrator.serve.upstream import UpstreamError


def create_app(
    backend: Backend | Router,
    *,
    api_key: str | None,
    model_name: str,
    exporter: Exporter | None = None,
    admin_key: str | None = None,
) -> FastAPI:
    """The front over `backend` (one formation) or a router of formations (`serve.router`)."""
    app = FastAPI(title="rpcfleet serve", version="0.2.0", docs_url=None, redoc_url=None)
    router = backend if isinstance(backend, Router) else Router.single(backend, model_name)
    metrics = router.metrics

    def bearer(request: Request, key: str) -> bool:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    def has_key(request: Request) -> bool:
        """The request carries the configured key (always true when none is configured)."""
        return api_key is None or bearer(request, api_key)

    def authorize(request: Request) -> None:
        if not has_key(request):
            raise HTTPException(401, "invalid API key")

    def authorize_admin(request: Request) -> None:
        # Without a key anyone who reaches the port could drain and reload the fleet: refused outright.
        if api_key is None and admin_key is None:
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

    @app.get("/metrics", dependencies=[Depends(authorize)])
    async def prometheus() -> PlainTextResponse:
        text = await router.prometheus(formations=exporter is None)  # else the exporter's formations
        if exporter is not None:  # the fleet's metrics after serve's own (orchestrator.observe)
            text += exporter.metrics()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        metrics.record_request("/v1/models", 200)
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "owned_by": "rpcfleet", "permissions": []}
                for name in router.models
            ],
        }

    @app.get("/slots", dependencies=[Depends(authorize)])
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

    @app.post("/admin/reload", dependencies=[Depends(authorize_admin)])
    async def reload(request: Request) -> JSONResponse:
        body = await request.body()
        try:
            options = json.loads(body) if body.strip() else {}
        except ValueError:
            return error_response(400, 'the body must be JSON: {"rolling_restart": true|false}')
        if not isinstance(options, dict) or not isinstance(options.get("rolling_restart", False), bool):
            return error_response(400, 'the body must be {"rolling_restart": true|false}')
        if options.get("rolling_restart") and admin_key is None:  # the fleet's servers: not the API key's
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

    app.include_router(openai_routes(router, authorize))
    if exporter is not None:  # the live fleet page at `/`, behind the same key rules
        mount(app, exporter, api_key=api_key, has_key=has_key)
        app.add_middleware(RequestTimer, histogram=exporter.histogram(model_name, "latency"))
    app.add_middleware(HttpGuard, check_host=api_key is None)  # outermost: before any route's work
    return app
