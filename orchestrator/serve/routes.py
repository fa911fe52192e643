"""serve's OpenAI routes (`/v1/completions`, `/v1/chat/completions`, `/v1/embeddings`): a request is
checked with the fields of llama-cpp-python's server models (`serve.requests`: a bad field is a 400 here),
its key's models (403) and its bounds, then handed to the proxy (`serve.proxy`), which admits it on a
formation, sends it to that formation's engine and answers, a lost engine's requests included.

Errors of serve's own are OpenAI error objects (`{"error": {"message", "type", "code"}}`): 400 (bad JSON or
fields), 403 (a model the key may not use), 404 (a model not served), 429 (queue full), 503 with
Retry-After (loading, draining, recovery given up, no formation serving again within --queue-timeout,
naming the lost nodes).

Two llama-server fields are serve's to bound: the answer's length (`n_predict`, which llama-server reads
before `max_tokens`, -1 meaning no end: every field it reads gets one bound, `bound_answer`) and the slot
(`id_slot`, which it takes modulo its slots, a negative one waiting for ever: -1 or one of the
formation's slots, else 400). A client that hangs up before its answer gives back its place at once
(499 in /metrics); a stream, once answered, watches its client itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from orchestrator.serve.affinity import affinity_key
from orchestrator.serve.proxy import Proxy
from orchestrator.serve.requests import ChatCompletionRequest, CompletionRequest
from orchestrator.serve.router import Router

DEFAULT_MAX_TOKENS = 16  # OpenAI's for completions; llama-server's own default is unlimited
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict")  # llama-server's names of one bound


def openai_routes(
    router: Router,
    authorize: Callable[[Request], None],
    model_refused: Callable[[Request, str | None], str | None] | None = None,
) -> APIRouter:
    """The OpenAI routes over `router`'s formations, behind `authorize` (the API key); `model_refused`:
    why the request's key may not use the model it names (a per-user key's list: 403), None if it may."""
    api = APIRouter(dependencies=[Depends(authorize)])
    proxy = Proxy(router)

    @api.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _openai(request, "/v1/completions", CompletionRequest)

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await _openai(request, "/v1/chat/completions", ChatCompletionRequest)

    @api.post("/v1/embeddings")
    async def embeddings(request: Request) -> Any:
        return await _openai(request, "/v1/embeddings", None)

    async def _openai(request: Request, route: str, model: type[BaseModel] | None) -> Any:
        raw = await request.body()
        try:
            data = json.loads(raw)
        except ValueError as exc:
            return proxy.failed(route, 400, f"invalid request: the body is not JSON: {exc}")
        if not isinstance(data, dict):
            return proxy.failed(route, 400, "invalid request: the body must be a JSON object")
        if model is not None:
            try:
                model.model_validate(data)
            except ValidationError as exc:
                return proxy.failed(route, 400, f"invalid request: {problems(exc.errors())}")
            unbounded = bound_answer(data)
            if unbounded is not None:
                return proxy.failed(route, 400, unbounded)
            if data.get("seed") is None:
                data["seed"] = router.config.seed
        slot = data.get("id_slot")
        if slot is not None and (isinstance(slot, bool) or not isinstance(slot, int)):
            return proxy.failed(
                route, 400, "id_slot must be a whole number: -1 (any slot) or a slot's number"
            )
        model_id = data.get("model") if isinstance(data.get("model"), str) else None
        refused = model_refused(request, model_id) if model_refused is not None else None
        if refused is not None:
            return proxy.failed(route, 403, refused, param="model")
        key = affinity_key(route, data)
        work = proxy.answer(route, data, model_id, key, slot)
        return await _until_hung_up(request, route, work)

    async def _until_hung_up(request: Request, route: str, work: Any) -> Any:
        """`work`'s answer, or 499 once the client hangs up first: `work` is cancelled, which gives back
        its place (queued or served) and closes its engine connection. A stream, once answered, watches
        its client itself (starlette's StreamingResponse)."""
        answer = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_hung_up(request))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not answer.done():
                answer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await answer
        if answer.cancelled():
            router.metrics.record_request(route, 499)
            return Response(status_code=499)  # no one reads it
        return answer.result()

    return api


def bound_answer(data: dict[str, Any]) -> str | None:
    """Pure: one bound on the answer's tokens in every field llama-server reads for it (`n_predict` wins
    there over `max_tokens`, and -1 is no bound): the smallest the request gives, else
    DEFAULT_MAX_TOKENS. Why not (a 400's message) when one given is not a whole number of 1 or more."""
    given = []
    for name in LENGTH_FIELDS:
        value = data.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{name} must be at least 1: serve bounds every answer"
        given.append(value)
    limit = min(given, default=DEFAULT_MAX_TOKENS)
    data["max_tokens"] = data["n_predict"] = limit
    if "max_completion_tokens" in data:
        data["max_completion_tokens"] = limit
    return None


async def _hung_up(request: Request) -> None:
    """Until the client hangs up (after the body, `receive` has nothing else to say)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass  # uvicorn's `receive` waits for a message; after the body, only this one comes


def problems(errors: Any) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
        for e in errors
    )
