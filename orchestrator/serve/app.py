"""The HTTP front of `rpcfleet serve` (FastAPI): the API key, `/health`, `/metrics`, `/slots`, `/v1/models`
and `/admin/reload` of its own, the OpenAI routes (`serve.routes`) proxied to the formations' engines
(llama-server on loopback; llama.cpp never runs in this process), and the fleet's live page.

Errors of serve's own are OpenAI error objects (`{"error": {"message", "type", "code"}}`): 401 (API key),
403 (an admin route on a server started without a key), 400 (bad JSON or fields).

`/health` answers anyone with its state only; the model path, pids, plan and endpoints need the key (when
one is set). Who may call which route, the API and admin keys or the per-user keys and their scopes, is
`serve.access`'s (`Access`).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from orchestrator.observe.web import Exporter, HttpGuard, mount
from orchestrator.serve.access import Access, KeyCounter, UserKeysPage
from orchestrator.serve.formation import Formation
from orchestrator.serve.keys import KeyRing
from orchestrator.serve.proxy import error_response
from orchestrator.serve.router import Router
from orchestrator.serve.routes import openai_routes, problems
from orchestrator.serve.states import Rejected
from orchestrator.serve.upstream import UpstreamError


def create_app(
    served: Formation | Router,
    *,
    api_key: str | None,
    exporter: Exporter | None = None,
    admin_key: str | None = None,
    keys: KeyRing | None = None,
) -> FastAPI:
    """The front over `served` (one formation) or a router of formations (`serve.router`); `keys`: the
    per-user keys in force (then neither `api_key` nor `admin_key`: `serve.access` says who may call what)."""
    router = served if isinstance(served, Router) else Router.single(served)
    access = Access(api_key=api_key, admin_key=admin_key, keys=keys, served=lambda: router.models)
    # No /openapi.json: the routes are OpenAI's (docs/serve.md), and a schema is no one's without a key
    app = FastAPI(title="rpcfleet serve", version="0.2.0", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = router.metrics
    has_key, scoped = access.has_key, access.scoped

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
                if access.lists_model(request, name)  # a key limited to some models: only those
            ],
        }

    @app.get("/slots", dependencies=[Depends(access.slots_check())])
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
        if options.get("rolling_restart") and not access.may_restart_fleet:
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
        openai_routes(router, scoped("inference"), access.model_refused if keys is not None else None)
    )
    if exporter is not None:  # the live fleet page at `/`, behind the same key rules
        gate = UserKeysPage(keys) if keys is not None else None
        mount(app, exporter, api_key=api_key, has_key=has_key, gate=gate)
    if keys is not None:
        app.add_middleware(KeyCounter, metrics=metrics)
    # outermost: before any route's work
    app.add_middleware(HttpGuard, check_host=access.open_to_any_host)
    return app
