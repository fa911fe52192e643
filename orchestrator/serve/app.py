"""The HTTP side of `rpcfleet serve`: its own front (API key, /health, /metrics, /admin) over the engine,
llama-server on loopback, to which the OpenAI routes are proxied (FastAPI).

Requests are checked with the fields of llama-cpp-python's server models (`serve.requests`: a bad
field is a 400 here, as before) and then sent to the engine as the client wrote them, so every
llama-server field (tools, grammars, response formats...) works; answers, streams (server-sent events,
piece by piece) and the engine's own errors pass through as they are. llama.cpp never runs in this
process: the engine (llama-server) is a child process.

Errors of serve's own are OpenAI error objects (`{"error": {"message", "type", "code"}}`): 401 (API key),
403 (an admin route on a server started without a key), 400 (bad JSON or fields), 429 (queue full), 503
with Retry-After (loading, recovering, draining, a lost node, named). A stream whose engine is lost ends
with one error event naming the lost node.

`/health` answers anyone with its state only; the model path, pids, plan and endpoints need the key (when
one is set). `/admin/*` always needs a key: a server started without one refuses them (SIGHUP reloads).
With an admin key (`--admin-key-file`) the admin routes take only it; without one the API key may
reload the engines, never with a rolling restart of the fleet's servers (403).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from orchestrator.engine.threads import thread_pool
from orchestrator.observe.web import Exporter, HttpGuard, RequestTimer, mount
from orchestrator.serve.backend import Backend, Failure, Rejected, Running, Ticket
from orchestrator.serve.requests import ChatCompletionRequest, CompletionRequest
from orchestrator.serve.router import Router
from orchestrator.serve.upstream import Answer, UpstreamError, UpstreamTimeout

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    429: "rate_limit_exceeded",
}

DEFAULT_MAX_TOKENS = 16  # OpenAI's for completions; llama-server's own default is unlimited
_TEXT = re.compile(rb'"(?:content|text)":"[^"]')  # a chunk with text in it (the time to first token)


def _error(
    status: int, message: str, kind: str | None = None, retry_after: int | None = None, **extra: Any
) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": kind or _ERROR_TYPES.get(status, "server_error"),
            "code": status,
            **extra,
        }
    }
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


def _failure_body(failure: Failure) -> dict[str, Any]:
    error: dict[str, Any] = {"message": failure.message, "type": failure.kind, "code": failure.status}
    if failure.lost:
        error["lost"] = list(failure.lost)
    return {"error": error}


class _Usage:
    """Token counts from the engine's answers: `usage` of a whole answer, `timings` of a stream's end."""

    def __init__(self) -> None:
        self.prompt = 0
        self.completion = 0
        self.tokens_per_second = 0.0
        self._rest = b""

    def whole(self, data: Any) -> None:
        if not isinstance(data, dict):
            return
        usage, timings = data.get("usage") or {}, data.get("timings") or {}
        self.prompt = int(usage.get("prompt_tokens") or timings.get("prompt_n") or 0)
        self.completion = int(usage.get("completion_tokens") or timings.get("predicted_n") or 0)
        self.tokens_per_second = float(timings.get("predicted_per_second") or 0.0)

    def feed(self, piece: bytes) -> None:
        """A piece of a stream: the event that carries `timings` (the last) is read."""
        lines = (self._rest + piece).split(b"\n")
        self._rest = lines.pop()[-65536:]
        for line in lines:
            if line.startswith(b"data: ") and b'"timings"' in line:
                with contextlib.suppress(ValueError):
                    self.whole(json.loads(line[len(b"data: ") :]))


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
    config = router.config
    upstream = router.upstream
    # Threads that wait for a slot (a blocking wait on the backend's condition): one per admitted request.
    waiters = thread_pool(router.capacity + 2, "serve-slot")

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
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        metrics.record_request(request.url.path, exc.status_code)
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.record_request(request.url.path, 400)
        return _error(400, f"invalid request: {_problems(exc.errors())}")

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
            return _failed("/slots", exc.status, exc.message, retry_after=exc.retry_after)
        except UpstreamError as exc:
            return _failed("/slots", 502, str(exc))
        metrics.record_request("/slots", status)
        return Response(body, status_code=status, media_type="application/json")

    @app.post("/admin/reload", dependencies=[Depends(authorize_admin)])
    async def reload(request: Request) -> JSONResponse:
        body = await request.body()
        try:
            options = json.loads(body) if body.strip() else {}
        except ValueError:
            return _error(400, 'the body must be JSON: {"rolling_restart": true|false}')
        if not isinstance(options, dict) or not isinstance(options.get("rolling_restart", False), bool):
            return _error(400, 'the body must be {"rolling_restart": true|false}')
        if options.get("rolling_restart") and admin_key is None:  # the fleet's servers: not the API key's
            metrics.record_request("/admin/reload", 403)
            return _error(
                403,
                "a rolling restart of the fleet's servers needs the admin key: start serve with "
                "--admin-key-file or RPCFLEET_ADMIN_KEY",
            )
        router.reload(rolling_restart=options.get("rolling_restart", False))
        metrics.record_request("/admin/reload", 202)
        return JSONResponse(
            {"status": "draining", "rolling_restart": options.get("rolling_restart", False)}, status_code=202
        )

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Any:
        return await _openai(request, "/v1/completions", CompletionRequest)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(request: Request) -> Any:
        return await _openai(request, "/v1/chat/completions", ChatCompletionRequest)

    @app.post("/v1/embeddings", dependencies=[Depends(authorize)])
    async def embeddings(request: Request) -> Any:
        return await _openai(request, "/v1/embeddings", None)

    def _failed(
        route: str,
        status: int,
        message: str,
        kind: str | None = None,
        retry_after: int | None = None,
        **extra: Any,
    ) -> JSONResponse:
        metrics.record_request(route, status)
        return _error(status, message, kind, retry_after, **extra)

    def _failure(route: str, failure: Failure) -> JSONResponse:
        extra = {"lost": list(failure.lost)} if failure.lost else {}
        return _failed(route, failure.status, failure.message, failure.kind, failure.retry_after, **extra)

    async def _openai(request: Request, route: str, model: type[BaseModel] | None) -> Any:
        raw = await request.body()
        try:
            data = json.loads(raw)
        except ValueError as exc:
            return _failed(route, 400, f"invalid request: the body is not JSON: {exc}")
        if not isinstance(data, dict):
            return _failed(route, 400, "invalid request: the body must be a JSON object")
        if model is not None:
            try:
                model.model_validate(data)
            except ValidationError as exc:
                return _failed(route, 400, f"invalid request: {_problems(exc.errors())}")
            if data.get("max_tokens") is None and data.get("max_completion_tokens") is None:
                data["max_tokens"] = DEFAULT_MAX_TOKENS
            limit = data.get("max_tokens", data.get("max_completion_tokens"))
            if isinstance(limit, int) and limit < 1:
                return _failed(route, 400, "max_tokens must be at least 1")
            if data.get("seed") is None:
                data["seed"] = config.seed
        model_id = data.get("model") if isinstance(data.get("model"), str) else None
        return await _proxy(route, json.dumps(data).encode(), bool(data.get("stream")), model_id)

    async def _proxy(route: str, body: bytes, stream: bool, model_id: str | None) -> Any:
        try:  # the least-loaded serving formation of the model; a stream stays on it
            backend, ticket = router.admit(model_id)
        except Rejected as exc:
            extra = {"param": "model"} if exc.status == 404 else {}
            return _failed(route, exc.status, exc.message, retry_after=exc.retry_after, **extra)
        handed = False  # to the stream, which then releases the ticket
        try:
            got = await asyncio.get_running_loop().run_in_executor(waiters, backend.acquire, ticket)
            if isinstance(got, Failure):
                return _failure(route, got)
            engine_url, engine_key = got.engine.url, got.engine.api_key

            async def alive() -> bool:
                """Its main loop still takes tasks (/metrics is one): busy generating, not stuck. The loop
                takes one between two decode steps, and one step of a slow device (llvmpipe on a loaded
                machine: seconds a token) may outlast any short wait: the same `event_timeout` bounds it."""
                try:
                    return (await upstream.get(engine_url, "/metrics", config.event_timeout, engine_key))[
                        0
                    ] == 200
                except UpstreamError:
                    return False

            held = contextlib.AsyncExitStack()  # the engine's answer, open until its body is read
            try:
                answer = await held.enter_async_context(
                    upstream.request(
                        engine_url,
                        "POST",
                        route,
                        body,
                        key=engine_key,
                        silence=config.event_timeout,
                        alive=alive,
                    )
                )
                backend.answered()
                if stream and answer.status == 200:
                    handed = True
                    return StreamingResponse(
                        _stream(route, backend, ticket, got, held, answer),
                        media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                    )
                whole = await answer.read()
            except UpstreamError as exc:
                return _failure(route, await _lost(backend, got, exc))
            finally:
                if not handed:
                    await held.aclose()
            backend.answered()
            if answer.status == 200:
                usage = _Usage()
                with contextlib.suppress(ValueError):
                    usage.whole(json.loads(whole))
                ticket.saw_text()
                router.counters(backend).record_done(
                    usage.prompt, usage.completion, usage.tokens_per_second, ticket.first_token
                )
            router.counters(backend).record_request(route, answer.status)
            media = answer.headers.get("content-type", "application/json")
            return Response(whole, status_code=answer.status, media_type=media)
        finally:
            if not handed:
                backend.release(ticket)

    async def _lost(backend: Backend, running: Running, exc: UpstreamError) -> Failure:
        if isinstance(exc, UpstreamTimeout):
            backend.stalled(running)
        return await asyncio.get_running_loop().run_in_executor(
            waiters, backend.failure_of, running, str(exc)
        )

    async def _stream(
        route: str,
        backend: Backend,
        ticket: Ticket,
        running: Running,
        held: contextlib.AsyncExitStack,
        answer: Answer,
    ) -> AsyncIterator[bytes]:
        code = 499  # the client went away before the end
        usage = _Usage()
        last = b""  # the stream's end so far: an OpenAI stream of llama-server's ends with [DONE]
        try:
            try:
                async for piece in answer.body():
                    backend.answered()
                    if ticket.first_token is None and _TEXT.search(piece):
                        ticket.saw_text()
                    usage.feed(piece)
                    last = (last + piece)[-32:]
                    yield piece
                if b"data: [DONE]" not in last:  # closed early, whatever its framing said
                    raise UpstreamError("the engine's stream ended before [DONE]")
                code = 200
                router.counters(backend).record_done(
                    usage.prompt, usage.completion, usage.tokens_per_second, ticket.first_token
                )
            except UpstreamError as exc:
                failure = await _lost(backend, running, exc)
                code = failure.status
                yield b"data: " + json.dumps(_failure_body(failure)).encode() + b"\n\n"
        finally:
            await held.aclose()
            backend.release(ticket)
            router.counters(backend).record_request(route, code)

    if exporter is not None:  # the live fleet page at `/`, behind the same key rules
        mount(app, exporter, api_key=api_key, has_key=has_key)
        app.add_middleware(RequestTimer, histogram=exporter.histogram(model_name, "latency"))
    app.add_middleware(HttpGuard, check_host=api_key is None)  # outermost: before any route's work
    return app


def _problems(errors: Any) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
        for e in errors
    )
