"""serve's proxy: an OpenAI request, checked by the routes (`serve.routes`), is admitted by the router
on a serving formation of its model (the one its prompt's prefix maps to, or the least-loaded:
`serve.affinity`), given a slot of that formation's engine, and sent to the engine (llama-server on
loopback) as the client wrote it, so every llama-server field (tools, grammars, response formats...)
works; answers, streams (server-sent events, piece by piece) and the engine's own errors pass through.
Router -> formation -> engine: nothing here climbs back.

A request whose engine is lost (a node, or the engine itself) is finished, not failed: once a formation
of the model serves again within --queue-timeout of the loss (another replica at once, or this one
re-formed), a whole answer is asked again and a stream goes on from where it stopped (`serve.resume`).
Else it gets the loss's 503 naming the lost nodes (a stream: its last event). A client that hangs up
gives back its place at once, queued, served or waiting: its engine connection is closed, and
llama-server stops the task.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from orchestrator.core.log import get_logger
from orchestrator.serve import resume
from orchestrator.serve.formation import Formation
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


class Usage:
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


class Proxy:
    """Requests on their way to a formation's engine and back: admitted on a serving formation of the
    model, holding one of its engine's slots, sent, answered; and, when the engine is lost, finished on a
    formation that serves the model again (`serve.resume`)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.metrics = router.metrics
        self.config = router.config
        self.upstream = router.upstream

    def failed(
        self,
        route: str,
        status: int,
        message: str,
        kind: str | None = None,
        retry_after: int | None = None,
        **extra: Any,
    ) -> JSONResponse:
        """serve's own error answer, counted."""
        self.metrics.record_request(route, status)
        return error_response(status, message, kind, retry_after, **extra)

    def failure(self, route: str, failure: Failure) -> JSONResponse:
        extra = {"lost": list(failure.lost)} if failure.lost else {}
        return self.failed(route, failure.status, failure.message, failure.kind, failure.retry_after, **extra)

    async def answer(
        self, route: str, data: dict[str, Any], model_id: str | None, key: str | None, slot: int | None
    ) -> Any:
        """The engine's answer to `data`. An engine lost before its answer began (a whole answer, or a
        stream's head) is asked again on a formation that serves the model again, within --queue-timeout
        of the loss: the client has received nothing yet."""
        arrived = time.monotonic()  # its formation's request duration counts from here
        placed = await self._slot(route, model_id, key, slot, arrived + self.config.queue_timeout)
        if isinstance(placed, Response):
            return placed
        edit = _stream_edit(route, data) if data.get("stream") else None
        while True:
            try:
                return await self._answered(route, data, model_id, key, arrived, placed, edit)
            except UpstreamError as exc:
                failure = await self._lost(placed[0], placed[2], exc)
            again = await self._again(failure, model_id, key) if resumes(failure) else None
            if again is None:
                return self.failure(route, failure)
            lost, placed = placed[0], again
            self._went_on(route, lost, placed[0])

    def _went_on(
        self,
        route: str,
        lost: Formation,
        now: Formation,
        continued: bool = False,
        prompt: int = 0,
        streamed: int = 0,
        replayed: int = 0,
    ) -> None:
        """A request whose engine (on `lost`) was lost goes on on `now`: asked again as it was (nothing
        sent yet), or `continued` from the `streamed` tokens sent (`prompt` tokens with them processed
        again, `replayed` of them checked one at a time). Counted (`/metrics`), logged and told (the
        console, the page's events)."""
        self.metrics.record_resumed(
            route, restarted=not continued, tokens=prompt + streamed if continued else 0
        )
        get_logger().info("serve_request_resumed", route=route, streamed=streamed, replayed=replayed)
        how = f"continued after {streamed} tokens" if continued else "asked again (nothing sent yet)"
        checked = f", {replayed} replayed" if replayed else ""
        self.router.news.tell(
            "resumed", now.model, now.name, f"a request ({route}) lost on {lost.name}: {how}{checked}"
        )

    async def _answered(
        self,
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
        formation, ticket, got = placed
        body = json.dumps(resume.engine_body(route, data) if edit is not None else data).encode()
        handed = False  # to the stream, which then releases the ticket
        try:
            held = contextlib.AsyncExitStack()  # the engine's answer, open until its body is read
            try:
                answer = await held.enter_async_context(self._ask(got, route, body))
                formation.answered()
                if data.get("stream") and answer.status == 200:
                    handed = True
                    flow = Flow(self.router, route, data, model_id, key, *placed, arrived, edit)
                    return StreamingResponse(
                        self._stream(flow, held, answer),
                        media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                    )
                whole = await answer.read()
            finally:
                if not handed:
                    await held.aclose()
            formation.answered()
            if answer.status == 200:
                usage = Usage()
                with contextlib.suppress(ValueError):
                    usage.whole(json.loads(whole))
                ticket.saw_text()
                self.router.counters(formation).record_done(
                    usage.prompt, usage.completion, usage.tokens_per_second, ticket.first_token
                )
            self.router.counters(formation, arrived).record_request(route, answer.status)
            media = answer.headers.get("content-type", "application/json")
            return Response(whole, status_code=answer.status, media_type=media)
        finally:
            if not handed:
                formation.release(ticket)

    def _ask(
        self, running: Running, route: str, body: bytes
    ) -> contextlib.AbstractAsyncContextManager[Answer]:
        """`body` sent to `running`'s engine on `route`: its answer, as it comes."""
        engine_url, engine_key = running.engine.url, running.engine.api_key

        async def alive() -> bool:
            """Its main loop still takes tasks (/metrics is one): busy generating, not stuck. The loop
            takes one between two decode steps, and one step of a slow device (llvmpipe on a loaded
            machine: seconds a token) may outlast any short wait: the same `event_timeout` bounds it."""
            try:
                return (
                    await self.upstream.get(engine_url, "/metrics", self.config.event_timeout, engine_key)
                )[0] == 200
            except UpstreamError:
                return False

        return self.upstream.request(
            engine_url, "POST", route, body, key=engine_key, silence=self.config.event_timeout, alive=alive
        )

    async def _slot(
        self, route: str, model_id: str | None, key: str | None, slot: int | None, deadline: float
    ) -> tuple[Formation, Ticket, Running] | Response:
        """Admitted on a formation of the model (the one of the prompt's prefix, or the least-loaded; a
        stream stays on it) and holding one of its engine's slots, waiting until `deadline` (its arrival
        and --queue-timeout): while the model's formations recover, for one to serve again (a request
        queued on a formation that stops serving waits so too). Else the error's answer."""
        try:
            held = await self._held(model_id, key, deadline, slot)
        except Rejected as exc:
            extra: dict[str, Any] = {"param": "model"} if exc.status == 404 else {}
            if exc.lost:
                extra["lost"] = list(exc.lost)
            return self.failed(route, exc.status, exc.message, retry_after=exc.retry_after, **extra)
        return self.failure(route, held) if isinstance(held, Failure) else held

    async def _held(
        self, model_id: str | None, key: str | None, deadline: float, slot: int | None = None
    ) -> tuple[Formation, Ticket, Running] | Failure:
        """A slot of a serving formation of the model, waited for until `deadline` (Rejected when the
        router refuses the request), or the Failure to answer."""
        while True:
            await self.router.loaded(model_id)  # an on-demand model: loaded first (nothing awaited after it)
            formation, ticket = await self.router.admit_or_wait(model_id, key, deadline)
            got: Running | Failure | None = None
            try:
                slots = formation.config.parallel
                if slot is not None and not -1 <= slot < slots:
                    message = f"id_slot must be -1 (any slot) or one of the engine's {slots} slots"
                    return Failure(400, f"{message}: 0 to {slots - 1}", "invalid_request_error")
                got = await formation.acquire(ticket, deadline)
                if isinstance(got, Running):
                    return formation, ticket, got
            finally:
                if not isinstance(got, Running):  # its place given back: an error, a hang-up, or to wait
                    formation.release(ticket)
            if not self.router.recovering(model_id) or time.monotonic() >= deadline:
                return got

    async def _again(
        self, failure: Failure, model_id: str | None, key: str | None
    ) -> tuple[Formation, Ticket, Running] | None:
        """After `failure` (its engine lost), a slot of a formation that serves the model again within
        --queue-timeout (another replica at once, or this one re-formed), else None."""
        try:
            held = await self._held(model_id, key, time.monotonic() + self.config.queue_timeout)
        except Rejected:
            return None
        return None if isinstance(held, Failure) else held

    async def _lost(self, formation: Formation, running: Running, exc: UpstreamError) -> Failure:
        if isinstance(exc, UpstreamTimeout):
            formation.stalled(running)
        return await formation.failure_of(running, str(exc))

    async def _prompt_tokens(self, running: Running, route: str, data: dict[str, Any]) -> list[int]:
        """The request's prompt as token ids, by `running`'s engine: a chat's template applied
        (/apply-template), then tokenized as llama-server tokenizes a completion's prompt (/tokenize
        with the special tokens added and parsed)."""
        prompt = data.get("prompt")
        if route == resume.CHAT:
            prompt = json.loads(await self._engine_json(running, "/apply-template", data))["prompt"]
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        asked = {"content": prompt, "add_special": True, "parse_special": True}
        return [int(t) for t in json.loads(await self._engine_json(running, "/tokenize", asked))["tokens"]]

    async def _engine_json(self, running: Running, path: str, data: dict[str, Any]) -> bytes:
        """`path`'s answer to `data`; CannotResume when the engine refuses it (it is not lost)."""
        async with self._ask(running, path, json.dumps(data).encode()) as answer:
            whole = await answer.read()
        if answer.status != 200:
            raise CannotResume(f"{path} answered {answer.status}: {whole[:200]!r}")
        return whole

    async def _stream(
        self, flow: Flow, held: contextlib.AsyncExitStack, answer: Answer
    ) -> AsyncIterator[bytes]:
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
                    failure = await self._lost(flow.formation, flow.running, exc)
                await held.aclose()
                went_on = await self._resumed(flow, failure)
                if went_on is None:
                    flow.settle(failure.status)
                    yield b"data: " + json.dumps(failure_body(failure)).encode() + b"\n\n"
                    return
                held, answer = went_on
        finally:
            await held.aclose()
            flow.settle(499)  # the client went away before the end

    async def _resumed(self, flow: Flow, failure: Failure) -> tuple[contextlib.AsyncExitStack, Answer] | None:
        """The continuation of `flow` after `failure`: its engine's answer, open, or None when the stream
        cannot go on (it cannot be continued, or no formation serves again in time)."""
        while resumes(failure) and (not flow.texted or (flow.edit is not None and flow.edit.resumable())):
            lost = flow.formation
            flow.formation.release(flow.ticket)
            flow.released = True
            again = await self._again(failure, flow.model_id, flow.key)
            if again is None:
                return None
            flow.formation, flow.ticket, flow.running = again
            flow.released = False
            held = contextlib.AsyncExitStack()
            prompt: list[int] = []
            replayed = 0
            try:
                if flow.texted and flow.edit is not None:  # continued from the tokens streamed
                    prompt = await self._prompt_tokens(flow.running, flow.route, flow.data)
                    if resume.greedy(flow.data):
                        replayed = await self._replayed(flow.running, flow.data, prompt, flow.edit.generated)
                    body = resume.continuation_body(flow.route, flow.data, prompt, flow.edit.generated)
                    path = resume.COMPLETIONS
                else:  # no text sent yet: asked again as it was
                    body = flow.data if flow.edit is None else resume.engine_body(flow.route, flow.data)
                    path = flow.route
                answer = await held.enter_async_context(
                    self._ask(flow.running, path, json.dumps(body).encode())
                )
                if answer.status != 200:
                    raise CannotResume(f"{path} was answered {answer.status}")
            except CannotResume as exc:
                await held.aclose()
                get_logger().warning("serve_resume_refused", route=flow.route, error=str(exc))
                return None
            except UpstreamError as exc:
                await held.aclose()
                failure = await self._lost(flow.formation, flow.running, exc)
                continue
            streamed = len(flow.edit.generated) if flow.edit is not None else 0
            if flow.texted:
                assert flow.edit is not None
                flow.edit.resume(len(prompt))
            self._went_on(flow.route, lost, flow.formation, flow.texted, len(prompt), streamed, replayed)
            return held, answer
        return None

    async def _replayed(
        self, running: Running, data: dict[str, Any], prompt: list[int], generated: list[int]
    ) -> int:
        """Decodes `prompt`, then each of `generated` but the last (the continuation's), one at a time on
        `running`'s engine, so that a greedy continuation goes on as the lost engine would have
        (`serve.resume`), for at most REPLAY_SECONDS. Returns the steps taken: an engine that refuses
        one stops the replay, and the continuation prefills what is left."""
        deadline = time.monotonic() + resume.REPLAY_SECONDS
        upto = 0
        while upto < len(generated) and time.monotonic() < deadline:
            try:
                await self._engine_json(
                    running, "/completion", resume.replay_body(data, prompt, generated, upto)
                )
            except CannotResume as exc:
                get_logger().warning("serve_replay_refused", error=str(exc))
                break
            upto += 1
        return upto


class CannotResume(Exception):
    """The engine that would continue a stream refused a step of it (it is alive: not a loss)."""


def resumes(failure: Failure) -> bool:
    """Pure: whether a request whose engine ended so may go on elsewhere: the engine was lost (a node, or
    the engine itself), not stopped on purpose (a drain past its timeout), nor the request refused or broken
    off by an engine that runs on (it would be asked again, and break it off again, without end)."""
    return (
        not failure.engine_alive
        and failure.kind in ("node_lost", "server_error")
        and failure.status in (502, 503)
    )


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
class Flow:
    """One stream on its way to the client, across the engines that serve it: where it is served now
    (formation, ticket, running), how it is edited (`edit`, None: passed as it is), and its end, counted
    once (`settle`)."""

    router: Router
    route: str
    data: dict[str, Any]
    model_id: str | None
    key: str | None
    formation: Formation
    ticket: Ticket
    running: Running
    arrived: float
    edit: resume.StreamEdit | None
    usage: Usage = field(default_factory=lambda: Usage())
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
                self.formation.release(self.ticket)
            self.router.counters(self.formation, self.arrived).record_request(self.route, code)

    async def pipe(self, answer: Answer) -> AsyncIterator[bytes]:
        """The client's bytes of `answer`'s stream, to its [DONE]; UpstreamError if it ends before."""
        async for piece in answer.body():
            self.formation.answered()
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
                self.router.counters(self.formation).record_done(
                    self.usage.prompt, completion, self.usage.tokens_per_second, self.ticket.first_token
                )
                self.settle(200)
            yield out
            if self.settled:
                return  # the answer is whole; what follows [DONE] is the connection's end
        raise UpstreamError("the engine's stream ended before [DONE]")
