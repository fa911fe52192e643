"""serve's OpenAI routes (`/v1/completions`, `/v1/chat/completions`, `/v1/embeddings`): a request is
checked with the fields of llama-cpp-python's server models (`serve.requests`: a bad field is a 400 here),
admitted by the router on a serving formation of its model (the one its prompt's prefix maps to, or the
least-loaded: `serve.affinity`), given a slot of that
formation's backend, and sent to its engine (llama-server on loopback) as the client wrote it, so every
llama-server field (tools, grammars, response formats...) works; answers, streams (server-sent events,
piece by piece) and the engine's own errors pass through as they are. Router → formation → engine: nothing
here climbs back.

Errors of serve's own are OpenAI error objects (`{"error": {"message", "type", "code"}}`): 400 (bad JSON or
fields), 404 (a model not served), 429 (queue full), 503 with Retry-After (loading, draining, recovery
given up, a lost node, named; while a formation of the model recovers a request waits for it in the
model's bounded queue, the 503 at --queue-timeout). A stream whose engine is lost ends with one error event
naming the lost node.

Two llama-server fields are serve's to bound: the answer's length (`n_predict`, which llama-server reads
before `max_tokens`, -1 meaning no end: every field it reads gets one bound, `bound_answer`) and the slot
(`id_slot`, which it takes modulo its slots, a negative one waiting for ever: -1 or one of the
formation's slots, else 400). A client that hangs up gives back its place at once, queued or served,
whole or streamed: its engine connection is closed, and llama-server stops the task.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from orchestrator.core.log import get_logger
from orchestrator.serve import resume
from orchestrator.serve.affinity import affinity_key
from orchestrator.serve.formation import Formation
from orchestrator.serve.requests import ChatCompletionRequest, CompletionRequest
from orchestrator.serve.router import Router
from orchestrator.serve.states import Failure, Rejected, Running, Ticket
from orchestrator.serve.upstream import Answer, UpstreamError, UpstreamTimeout

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    429: "rate_limit_exceeded",
}

DEFAULT_MAX_TOKENS = 16  # OpenAI's for completions; llama-server's own default is unlimited
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict")  # llama-server's names of one bound
_TEXT = re.compile(rb'"(?:content|text)":"[^"]')  # a chunk with text in it (the time to first token)


def error_response(
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


def failure_body(failure: Failure) -> dict[str, Any]:
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


def openai_routes(
    router: Router,
    authorize: Callable[[Request], None],
    model_refused: Callable[[Request, str | None], str | None] | None = None,
) -> APIRouter:
    """The OpenAI routes over `router`'s formations, behind `authorize` (the API key); `model_refused`:
    why the request's key may not use the model it names (a per-user key's list: 403), None if it may."""
    api = APIRouter(dependencies=[Depends(authorize)])
    metrics = router.metrics
    config = router.config
    upstream = router.upstream

    @api.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _openai(request, "/v1/completions", CompletionRequest)

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await _openai(request, "/v1/chat/completions", ChatCompletionRequest)

    @api.post("/v1/embeddings")
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
        return error_response(status, message, kind, retry_after, **extra)

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
                return _failed(route, 400, f"invalid request: {problems(exc.errors())}")
            unbounded = bound_answer(data)
            if unbounded is not None:
                return _failed(route, 400, unbounded)
            if data.get("seed") is None:
                data["seed"] = config.seed
        slot = data.get("id_slot")
        if slot is not None and (isinstance(slot, bool) or not isinstance(slot, int)):
            return _failed(route, 400, "id_slot must be a whole number: -1 (any slot) or a slot's number")
        model_id = data.get("model") if isinstance(data.get("model"), str) else None
        refused = model_refused(request, model_id) if model_refused is not None else None
        if refused is not None:
            return _failed(route, 403, refused, param="model")
        key = affinity_key(route, data)
        work = _proxy(route, data, model_id, key, slot)
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
            metrics.record_request(route, 499)
            return Response(status_code=499)  # no one reads it
        return answer.result()

    async def _proxy(
        route: str, data: dict[str, Any], model_id: str | None, key: str | None, slot: int | None
    ) -> Any:
        """The engine's answer to `data`. An engine lost before its answer began (a whole answer, or a
        stream's head) is asked again on a formation that serves the model again, within --queue-timeout
        of the loss: the client has received nothing yet."""
        arrived = time.monotonic()  # its formation's request duration counts from here
        placed = await _slot(route, model_id, key, slot, arrived + config.queue_timeout)
        if isinstance(placed, Response):
            return placed
        edit = _stream_edit(route, data) if data.get("stream") else None
        backend, ticket, got = placed
        while True:
            try:
                return await _answered(route, data, model_id, key, arrived, (backend, ticket, got), edit)
            except UpstreamError as exc:
                failure = await _lost(backend, got, exc)
            again = await _again(failure, model_id, key) if resumes(failure) else None
            if again is None:
                return _failure(route, failure)
            backend, ticket, got = again
            metrics.record_resumed(route, restarted=True, tokens=0)
            get_logger().info("serve_request_resumed", route=route, streamed=0)

    async def _answered(
        route: str,
        data: dict[str, Any],
        model_id: str | None,
        key: str | None,
        arrived: float,
        placed: tuple[Formation, Ticket, Running],
        edit: resume.StreamEdit | None,
    ) -> Response:
        """The engine's answer on the slot `placed` holds (given back here, or by the stream it hands
        on); UpstreamError when the engine is lost before its answer began."""
        backend, ticket, got = placed
        body = json.dumps(resume.engine_body(route, data) if edit is not None else data).encode()
        handed = False  # to the stream, which then releases the ticket
        try:
            held = contextlib.AsyncExitStack()  # the engine's answer, open until its body is read
            try:
                answer = await held.enter_async_context(_ask(got, route, body))
                backend.answered()
                if data.get("stream") and answer.status == 200:
                    handed = True
                    flow = _Flow(router, route, data, model_id, key, backend, ticket, got, arrived, edit)
                    return StreamingResponse(
                        _stream(flow, held, answer),
                        media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                    )
                whole = await answer.read()
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
            router.counters(backend, arrived).record_request(route, answer.status)
            media = answer.headers.get("content-type", "application/json")
            return Response(whole, status_code=answer.status, media_type=media)
        finally:
            if not handed:
                backend.release(ticket)

    def _ask(running: Running, route: str, body: bytes) -> contextlib.AbstractAsyncContextManager[Answer]:
        """`body` sent to `running`'s engine on `route`: its answer, as it comes."""
        engine_url, engine_key = running.engine.url, running.engine.api_key

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

        return upstream.request(
            engine_url, "POST", route, body, key=engine_key, silence=config.event_timeout, alive=alive
        )

    async def _slot(
        route: str, model_id: str | None, key: str | None, slot: int | None, deadline: float
    ) -> tuple[Formation, Ticket, Running] | Response:
        """Admitted on a formation of the model (the one of the prompt's prefix, or the least-loaded; a
        stream stays on it) and holding one of its engine's slots, waiting until `deadline` (its arrival
        and --queue-timeout): while the model's formations recover, for one to serve again (a request
        queued on a formation that stops serving waits so too). Else the error's answer."""
        try:
            held = await _held(model_id, key, deadline, slot)
        except Rejected as exc:
            extra: dict[str, Any] = {"param": "model"} if exc.status == 404 else {}
            if exc.lost:
                extra["lost"] = list(exc.lost)
            return _failed(route, exc.status, exc.message, retry_after=exc.retry_after, **extra)
        return _failure(route, held) if isinstance(held, Failure) else held

    async def _held(
        model_id: str | None, key: str | None, deadline: float, slot: int | None = None
    ) -> tuple[Formation, Ticket, Running] | Failure:
        """A slot of a serving formation of the model, waited for until `deadline` (Rejected when the
        router refuses the request), or the Failure to answer."""
        while True:
            await router.loaded(model_id)  # an on-demand model: loaded first (nothing awaited after it)
            backend, ticket = await router.admit_or_wait(model_id, key, deadline)
            got: Running | Failure | None = None
            try:
                slots = backend.config.parallel
                if slot is not None and not -1 <= slot < slots:
                    message = f"id_slot must be -1 (any slot) or one of the engine's {slots} slots"
                    return Failure(400, f"{message}: 0 to {slots - 1}", "invalid_request_error")
                got = await backend.acquire(ticket, deadline)
                if isinstance(got, Running):
                    return backend, ticket, got
            finally:
                if not isinstance(got, Running):  # its place given back: an error, a hang-up, or to wait
                    backend.release(ticket)
            if not router.recovering(model_id) or time.monotonic() >= deadline:
                return got

    async def _again(
        failure: Failure, model_id: str | None, key: str | None
    ) -> tuple[Formation, Ticket, Running] | None:
        """After `failure` (its engine lost), a slot of a formation that serves the model again within
        --queue-timeout (another replica at once, or this one re-formed), else None."""
        try:
            held = await _held(model_id, key, time.monotonic() + config.queue_timeout)
        except Rejected:
            return None
        return None if isinstance(held, Failure) else held

    async def _lost(backend: Formation, running: Running, exc: UpstreamError) -> Failure:
        if isinstance(exc, UpstreamTimeout):
            backend.stalled(running)
        return await backend.failure_of(running, str(exc))

    async def _prompt_tokens(running: Running, route: str, data: dict[str, Any]) -> list[int]:
        """The request's prompt as token ids, by `running`'s engine: a chat's template applied
        (/apply-template), then tokenized as llama-server tokenizes a completion's prompt (/tokenize
        with the special tokens added and parsed)."""
        prompt = data.get("prompt")
        if route == resume.CHAT:
            prompt = json.loads(await _engine_json(running, "/apply-template", data))["prompt"]
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        asked = {"content": prompt, "add_special": True, "parse_special": True}
        return [int(t) for t in json.loads(await _engine_json(running, "/tokenize", asked))["tokens"]]

    async def _engine_json(running: Running, path: str, data: dict[str, Any]) -> bytes:
        """`path`'s answer to `data`; CannotResume when the engine refuses it (it is not lost)."""
        async with _ask(running, path, json.dumps(data).encode()) as answer:
            whole = await answer.read()
        if answer.status != 200:
            raise CannotResume(f"{path} answered {answer.status}: {whole[:200]!r}")
        return whole

    async def _stream(flow: _Flow, held: contextlib.AsyncExitStack, answer: Answer) -> AsyncIterator[bytes]:
        """The engine's stream to the client. A stream whose engine is lost goes on, when it can
        (`serve.resume`), on a formation that serves the model again within --queue-timeout: the same
        stream, from where it stopped. Else it ends with the loss's error event."""
        try:
            while True:
                try:
                    async for out in flow.pipe(answer):
                        yield out
                    return
                except UpstreamError as exc:
                    failure = await _lost(flow.backend, flow.running, exc)
                await held.aclose()
                went_on = await _resumed(flow, failure)
                if went_on is None:
                    flow.settle(failure.status)
                    yield b"data: " + json.dumps(failure_body(failure)).encode() + b"\n\n"
                    return
                held, answer = went_on
        finally:
            await held.aclose()
            flow.settle(499)  # the client went away before the end

    async def _resumed(flow: _Flow, failure: Failure) -> tuple[contextlib.AsyncExitStack, Answer] | None:
        """The continuation of `flow` after `failure`: its engine's answer, open, or None when the stream
        cannot go on (it cannot be continued, or no formation serves again in time)."""
        while resumes(failure) and (not flow.texted or (flow.edit is not None and flow.edit.resumable())):
            flow.backend.release(flow.ticket)
            flow.released = True
            again = await _again(failure, flow.model_id, flow.key)
            if again is None:
                return None
            flow.backend, flow.ticket, flow.running = again
            flow.released = False
            held = contextlib.AsyncExitStack()
            prompt: list[int] = []
            try:
                if flow.texted and flow.edit is not None:  # continued from the tokens streamed
                    prompt = await _prompt_tokens(flow.running, flow.route, flow.data)
                    body = resume.continuation_body(flow.route, flow.data, prompt, flow.edit.generated)
                    path = resume.COMPLETIONS
                else:  # no text sent yet: asked again as it was
                    body = flow.data if flow.edit is None else resume.engine_body(flow.route, flow.data)
                    path = flow.route
                answer = await held.enter_async_context(_ask(flow.running, path, json.dumps(body).encode()))
                if answer.status != 200:
                    raise CannotResume(f"{path} was answered {answer.status}")
            except CannotResume as exc:
                await held.aclose()
                get_logger().warning("serve_resume_refused", route=flow.route, error=str(exc))
                return None
            except UpstreamError as exc:
                await held.aclose()
                failure = await _lost(flow.backend, flow.running, exc)
                continue
            streamed = len(flow.edit.generated) if flow.edit is not None else 0
            if not flow.texted:
                metrics.record_resumed(flow.route, restarted=True, tokens=0)
            else:
                assert flow.edit is not None
                flow.edit.resume(len(prompt))
                metrics.record_resumed(flow.route, restarted=False, tokens=len(prompt) + streamed)
            get_logger().info("serve_request_resumed", route=flow.route, streamed=streamed)
            return held, answer
        return None

    return api


class CannotResume(Exception):
    """The engine that would continue a stream refused a step of it (it is alive: not a loss)."""


def resumes(failure: Failure) -> bool:
    """Pure: whether a request whose engine ended so may go on elsewhere: the engine was lost (a node, or
    the engine itself), not stopped on purpose (a drain past its timeout) nor the request refused."""
    return failure.kind in ("node_lost", "server_error") and failure.status in (502, 503)


def _stream_edit(route: str, data: dict[str, Any]) -> resume.StreamEdit | None:
    """The edit that lets a stream go on elsewhere, None for one that cannot (`resume.not_resumable`)."""
    if resume.not_resumable(route, data) is not None:
        return None
    options = data.get("stream_options")
    return resume.StreamEdit(
        route,
        client_logprobs=resume.asks_logprobs(route, data),
        client_timings=bool(data.get("timings_per_token")),
        client_usage=isinstance(options, dict) and bool(options.get("include_usage")),
    )


@dataclass(eq=False)
class _Flow:
    """One stream on its way to the client, across the engines that serve it: where it is served now
    (backend, ticket, running), how it is edited (`edit`, None: passed as it is), and its end, counted
    once (`settle`)."""

    router: Router
    route: str
    data: dict[str, Any]
    model_id: str | None
    key: str | None
    backend: Formation
    ticket: Ticket
    running: Running
    arrived: float
    edit: resume.StreamEdit | None
    usage: _Usage = field(default_factory=lambda: _Usage())
    settled: bool = False
    released: bool = False  # its ticket given back while it waits for another formation
    texted: bool = False  # text was sent to the client
    _last: bytes = b""

    def settle(self, code: int) -> None:
        """Counted and released before the client can read the end, so a client that has its answer
        also sees it in /metrics and /health."""
        if not self.settled:
            self.settled = True
            if not self.released:
                self.backend.release(self.ticket)
            self.router.counters(self.backend, self.arrived).record_request(self.route, code)

    async def pipe(self, answer: Answer) -> AsyncIterator[bytes]:
        """The client's bytes of `answer`'s stream, to its [DONE]; UpstreamError if it ends before."""
        async for piece in answer.body():
            self.backend.answered()
            if self.ticket.first_token is None and _TEXT.search(piece):
                self.ticket.saw_text()
            self.usage.feed(piece)
            out = piece if self.edit is None else self.edit.feed(piece)
            self.texted = self.texted or _TEXT.search(out) is not None
            self._last = (self._last + out)[-32:]
            if b"data: [DONE]" in self._last:
                completion = (
                    len(self.edit.generated) if self.edit and self.edit.resumes else self.usage.completion
                )
                self.router.counters(self.backend).record_done(
                    self.usage.prompt, completion, self.usage.tokens_per_second, self.ticket.first_token
                )
                self.settle(200)
            yield out
            if self.settled:
                return  # the answer is whole; what follows [DONE] is the connection's end
        raise UpstreamError("the engine's stream ended before [DONE]")


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
