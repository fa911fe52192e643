"""The HTTP side of `rpcfleet serve`: OpenAI routes proxied to the backend's worker (FastAPI).

Requests are validated with the fields of llama-cpp-python's server models (`serve.requests`), answers
have the OpenAI shapes (`text_completion`, `chat.completion`, their `.chunk` streams as server-sent
events). llama.cpp never runs in this process: `Backend` holds the worker.

Errors are OpenAI error objects (`{"error": {"message", "type", "code"}}`): 401 (API key), 403 (an
admin route on a server started without a key), 400 (bad JSON or fields), 429 (queue full), 503 with
Retry-After (loading, recovering, draining, a lost node, named). A stream that loses its node ends with
one error event.

`/health` answers anyone with its state only; the model path, pids, plan and endpoints need the key (when
one is set). `/admin/*` always needs one: a server started without a key refuses them (SIGHUP reloads).
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from sse_starlette.sse import EventSourceResponse

from orchestrator.llama.worker import Done, Token
from orchestrator.observe.web import Exporter, RequestTimer, mount
from orchestrator.serve.backend import Backend, Failure, Job, Rejected
from orchestrator.serve.requests import ChatCompletionRequest, CompletionRequest

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    429: "rate_limit_exceeded",
}


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


def create_app(
    backend: Backend, *, api_key: str | None, model_name: str, exporter: Exporter | None = None
) -> FastAPI:
    app = FastAPI(title="rpcfleet serve", version="0.1.0", docs_url=None, redoc_url=None)
    metrics = backend.metrics

    def has_key(request: Request) -> bool:
        """The request carries the configured key (always true when none is configured)."""
        if api_key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())

    def authorize(request: Request) -> None:
        if not has_key(request):
            raise HTTPException(401, "invalid API key")

    def authorize_admin(request: Request) -> None:
        # Without a key anyone who reaches the port could drain and reload the fleet: refused outright.
        if api_key is None:
            raise HTTPException(
                403,
                "the admin routes need an API key: start serve with --api-key-file or RPCFLEET_API_KEY "
                "(without one, reload with SIGHUP)",
            )
        authorize(request)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        metrics.record_request(request.url.path, exc.status_code)
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.record_request(request.url.path, 400)
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
            for e in exc.errors()
        )
        return _error(400, f"invalid request: {problems}")

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        data = backend.health()
        code = 200 if data["status"] in ("ready", "degraded") else 503
        if not has_key(request):  # the model path, pids and endpoints are for the key's holders
            return JSONResponse({"status": data["status"]}, status_code=code)
        return JSONResponse(data, status_code=code)

    @app.get("/metrics", dependencies=[Depends(authorize)])
    async def prometheus() -> PlainTextResponse:
        text = metrics.render(backend.endpoint_up(), backend.state)
        if exporter is not None:  # the fleet's metrics after serve's own (orchestrator.observe)
            text += exporter.metrics()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        metrics.record_request("/v1/models", 200)
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "owned_by": "rpcfleet", "permissions": []}],
        }

    @app.post("/admin/reload", dependencies=[Depends(authorize_admin)])
    async def reload(request: Request) -> JSONResponse:
        body = await request.body()
        try:
            options = json.loads(body) if body.strip() else {}
        except ValueError:
            return _error(400, 'the body must be JSON: {"rolling_restart": true|false}')
        if not isinstance(options, dict) or not isinstance(options.get("rolling_restart", False), bool):
            return _error(400, 'the body must be {"rolling_restart": true|false}')
        backend.reload(rolling_restart=options.get("rolling_restart", False))
        metrics.record_request("/admin/reload", 202)
        return JSONResponse(
            {"status": "draining", "rolling_restart": options.get("rolling_restart", False)}, status_code=202
        )

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest) -> Any:
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                return _failed("/v1/completions", 400, "prompt: one string (or a list of one) is served")
            prompt = prompt[0]
        return await _answer(
            "/v1/completions",
            "text_completion",
            "prompt",
            prompt,
            body.max_tokens,
            body.temperature,
            body.seed,
            bool(body.stream),
        )

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(body: ChatCompletionRequest) -> Any:
        messages = [dict(m) for m in body.messages]
        return await _answer(
            "/v1/chat/completions",
            "chat.completion",
            "chat",
            messages,
            body.max_tokens,
            body.temperature,
            body.seed,
            bool(body.stream),
        )

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

    async def _answer(
        route: str,
        kind: str,
        op: str,
        payload: Any,
        max_tokens: int | None,
        temperature: float,
        seed: int | None,
        stream: bool,
    ) -> Any:
        n = 16 if max_tokens is None else max_tokens
        if n < 1:
            return _failed(route, 400, "max_tokens must be at least 1")
        try:
            job = backend.submit("chat" if op == "chat" else "complete", payload, n, temperature, seed)
        except Rejected as exc:
            return _failed(route, exc.status, exc.message, retry_after=exc.retry_after)
        ident = f"{'chatcmpl' if op == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if stream:
            return EventSourceResponse(_stream(route, kind, op, ident, job), ping=10)
        text: list[str] = []
        async for event in job.events():
            if isinstance(event, Failure):
                extra = {"lost": list(event.lost)} if event.lost else {}
                return _failed(route, event.status, event.message, event.kind, event.retry_after, **extra)
            if isinstance(event, Token):
                text.append(event.text)
            elif isinstance(event, Done):
                metrics.record_request(route, 200)
                return _whole(kind, op, ident, model_name, event)
        return _failed(route, 500, "the request ended without an answer")

    async def _stream(route: str, kind: str, op: str, ident: str, job: Job) -> AsyncIterator[str]:
        created = int(time.time())
        code = 499  # the client went away before the end
        try:
            if op == "chat":
                yield json.dumps(_chunk(kind, op, ident, created, {"role": "assistant"}, None))
            async for event in job.events():
                if isinstance(event, Token):
                    piece = {"content": event.text} if op == "chat" else event.text
                    yield json.dumps(_chunk(kind, op, ident, created, piece, None))
                elif isinstance(event, Done):
                    yield json.dumps(
                        _chunk(kind, op, ident, created, {} if op == "chat" else "", event.finish_reason)
                    )
                    yield "[DONE]"
                    code = 200
                else:
                    code = event.status
                    error = {"message": event.message, "type": event.kind, "code": event.status}
                    yield json.dumps({"error": error | ({"lost": list(event.lost)} if event.lost else {})})
        finally:
            job.cancelled.set()
            metrics.record_request(route, code)

    def _chunk(
        kind: str, op: str, ident: str, created: int, piece: Any, finish: str | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if op == "chat":
            choice["delta"] = piece
        else:
            choice |= {"text": piece, "logprobs": None}
        return {
            "id": ident,
            "object": f"{kind}.chunk" if op == "chat" else kind,
            "created": created,
            "model": model_name,
            "choices": [choice],
        }

    if exporter is not None:  # the live fleet page at `/`, behind the same key rules
        mount(app, exporter, api_key=api_key, has_key=has_key)
        app.add_middleware(RequestTimer, histogram=exporter.histogram(model_name, "latency"))
    return app


def _whole(kind: str, op: str, ident: str, model: str, done: Done) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": done.finish_reason, "logprobs": None}
    if op == "chat":
        choice["message"] = {"role": "assistant", "content": done.text}
    else:
        choice["text"] = done.text
    return {
        "id": ident,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
        },
    }
