"""Tier 1 for issue 42 (item 3): a request that comes while its model's only formation recovers waits in
the model's bounded queue and is answered once the formation serves again; the 503 with Retry-After is
for what cannot come back in time (recovery given up: at once; --queue-timeout run out). serve's real app
on a real uvicorn (a client must be able to hang up) over fake engines and a fake fleet
(`serve_rig`): the fleet's nodes answer as the test says, so a recovery lasts as long as the test wants."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.core.target import Target
from orchestrator.observe.server import http_server
from orchestrator.planning.plan import Plan
from orchestrator.serve import resume
from orchestrator.serve.app import create_app
from orchestrator.serve.formation import Formation
from orchestrator.serve.router import Router
from orchestrator.serve.states import ServeConfig
from tests.plugins.serve_rig import ENDPOINTS, FIRST_ID, PROMPT_TOKENS, FakeFleet, HttpEngine

Served = tuple[str, Router, FakeFleet, list[HttpEngine]]


@pytest.fixture
def served(tiny_model: Path) -> Iterator[Callable[..., Served]]:
    """Factory: model a, one formation split over the fake fleet's 3 nodes, behind serve's app on a
    uvicorn of 127.0.0.1, ready: (its URL, its router, the fleet, the engines started so far)."""
    running: list[tuple[Any, threading.Thread]] = []

    def start(token_ids: bool = False, **config: Any) -> Served:
        fleet = FakeFleet(tiny_model)
        engines: list[HttpEngine] = []

        def factory(plan: Plan, targets: Mapping[str, Target]) -> HttpEngine:
            engines.append(HttpEngine(plan, fleet, len(engines), delay=0.05, token_ids=token_ids))
            return engines[-1]

        options = {"retry_interval": 0.005, "rejoin_interval": 0.0, "parallel": 1, "queue_size": 1, **config}
        router = Router([Formation("a#0", "a", fleet, ServeConfig(**options), factory)])
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = http_server(create_app(router, api_key=None), "127.0.0.1", port)

        async def main() -> None:
            LOOPS[id(router)] = asyncio.get_running_loop()
            router.start()
            try:
                await server.serve(sockets=[sock])
            finally:
                await router.stop()

        thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
        thread.start()
        running.append((server, thread))
        _until(lambda: server.started and router.state == "ready", 10, "serve never got ready")
        return f"http://127.0.0.1:{port}", router, fleet, engines

    yield start
    for server, thread in running:
        server.should_exit = True
        thread.join(10)


LOOPS: dict[int, asyncio.AbstractEventLoop] = {}  # each served router's loop, by id(router)


def _until(check: Callable[[], bool], limit: float, what: str) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < limit, what
        time.sleep(0.005)
    return time.monotonic() - started


class Ask(threading.Thread):
    """One completion request on its own thread: its answer (status, headers, body) and its time."""

    def __init__(self, base: str, **body: Any) -> None:
        super().__init__(daemon=True)
        self.base, self.body = base, {"prompt": "hi", "max_tokens": 2, **body}
        self.answer: httpx.Response | None = None
        self.took = 0.0
        self.start()

    def run(self) -> None:
        started = time.monotonic()
        self.answer = httpx.post(f"{self.base}/v1/completions", json=self.body, timeout=60)
        self.took = time.monotonic() - started

    def result(self, limit: float = 20) -> httpx.Response:
        self.join(limit)
        assert self.answer is not None, "no answer"
        return self.answer


def _waiting(base: str, count: int, *asks: Ask) -> None:
    """Until /health counts `count` requests waiting for model a's recovery; none of `asks` answered."""

    def check() -> bool:
        for ask in asks:
            got = ask.answer
            assert got is None, f"answered instead of waiting: {got.status_code} {got.text}"
        health = httpx.get(f"{base}/health", timeout=10).json()
        return bool(health.get("waiting", {}).get("a") == count)

    _until(check, 5, f"{count} request(s) never waited for the recovery")


def _lose_every_node(router: Router, fleet: FakeFleet, engines: list[HttpEngine]) -> None:
    """The engine dies and no node answers: the formation recovers until the test gives them back."""
    fleet.answering = set()
    engines[-1].die()
    _until(lambda: router.formations[0].state == "recovering", 5, "never recovering")


def _error(answer: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = answer.json()["error"]
    return error


def test_a_request_during_the_recovery_waits_and_is_answered_once_the_formation_serves(
    served: Callable[..., Served],
) -> None:
    base, router, fleet, engines = served(queue_timeout=30.0)
    formation = router.formations[0]
    _lose_every_node(router, fleet, engines)
    ask = Ask(base)
    _waiting(base, 1, ask)
    time.sleep(0.2)
    assert ask.answer is None and formation.state == "recovering"  # still waiting, not refused
    fleet.answering = set(ENDPOINTS)  # the nodes are back: the formation is formed again
    answer = ask.result()
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == "xx" and len(engines) == 2  # the new engine's
    assert router.waiting["a"] == 0 and formation.admitted == 0
    assert formation.metrics.recoveries[-1].lost == ENDPOINTS


def test_a_request_queued_when_the_engine_dies_waits_for_the_recovery_too(
    served: Callable[..., Served],
) -> None:
    """Queued for the one slot (not yet at the engine) when the engine dies: it waits as a new one would,
    while the stream holding the slot, which has sent text without its tokens' ids (this engine does not
    say them: `serve.resume`), cannot go on and ends with the 503 naming the lost node."""
    base, router, fleet, engines = served(queue_timeout=30.0)
    formation = router.formations[0]
    stream = Ask(base, stream=True, max_tokens=400)
    _until(lambda: engines[-1].chunks >= 1, 5, "the stream never started")
    queued = Ask(base)
    _until(lambda: formation.admitted == 2, 5, "the second request was not queued")
    _lose_every_node(router, fleet, engines)
    _waiting(base, 1, queued)
    assert b'"lost"' in stream.result().content  # the stream in flight: its 503 event names the nodes
    fleet.answering = set(ENDPOINTS)
    answer = queued.result()
    assert answer.status_code == 200 and len(engines) == 2, answer.text


def test_a_recovery_that_gives_up_refuses_its_waiters_and_later_requests_at_once(
    served: Callable[..., Served],
) -> None:
    base, router, fleet, engines = served(queue_timeout=30.0, recover_timeout=4.0)
    _lose_every_node(router, fleet, engines)
    waiting = Ask(base)
    _waiting(base, 1, waiting)
    answer = waiting.result()  # given up after 4 s (a loaded machine queues it first), not at 30 s
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "2", answer.text
    assert router.formations[0].state == "failed" and waiting.took < 15
    error = _error(answer)
    assert "the model is failed: gave up after 4 s" in error["message"], error
    assert error["lost"] == list(ENDPOINTS) and ENDPOINTS[0] in error["message"], error
    later = Ask(base)
    answer = later.result()
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "2", answer.text
    assert later.took < 5 and _error(answer)["lost"] == list(ENDPOINTS)  # at once: nothing comes back
    assert router.waiting["a"] == 0


def test_the_wait_ends_with_a_503_at_the_queue_timeout_naming_the_lost_nodes(
    served: Callable[..., Served],
) -> None:
    base, router, fleet, engines = served(queue_timeout=0.5)
    _lose_every_node(router, fleet, engines)
    ask = Ask(base)
    answer = ask.result()
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "2", answer.text
    assert 0.4 < ask.took < 10, ask.took  # its --queue-timeout, not at once
    error = _error(answer)
    assert "not serving after 0.5 s (--queue-timeout): the model is recovering" in error["message"], error
    assert error["lost"] == list(ENDPOINTS) and ENDPOINTS[0] in error["message"], error
    assert router.waiting["a"] == 0


def test_the_waiters_are_bounded_by_the_models_queue_and_one_that_hangs_up_frees_its_place(
    served: Callable[..., Served],
) -> None:
    """One slot and --queue 1: two requests wait for the recovery, a third is refused (429, the full
    queue's); one of the two hangs up, and a new one takes its place; both are answered once it serves."""
    base, router, fleet, engines = served(queue_timeout=30.0)
    _lose_every_node(router, fleet, engines)
    first = Ask(base)
    data = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}\r\n\r\n"
    port = int(base.rpartition(":")[2])
    leaving = socket.create_connection(("127.0.0.1", port), timeout=10)
    leaving.sendall(head.encode() + data)
    _waiting(base, 2, first)
    refused = Ask(base).result()
    assert refused.status_code == 429, refused.text
    assert "the queue is full: 2 request(s) wait for a to recover" in _error(refused)["message"]
    leaving.close()
    _waiting(base, 1, first)  # the request that hung up gave back its place
    second = Ask(base)
    _waiting(base, 2, first, second)
    fleet.answering = set(ENDPOINTS)
    assert [first.result().status_code, second.result().status_code] == [200, 200]
    assert router.waiting["a"] == 0 and router.formations[0].admitted == 0


def test_a_request_during_a_reloads_drain_waits_and_is_answered_by_the_reloaded_engine(
    served: Callable[..., Served],
) -> None:
    """A reload (or a rejoin) drains, then restarts the formation: a request that comes meanwhile waits
    in the queue for it, as for a recovery (issue 42: a rolling restart through serve refused them)."""
    base, router, _, engines = served(queue_timeout=30.0)
    formation = router.formations[0]
    stream = Streamed(base, 40)  # holds the drain for about 2 s (the engine's 0.05 s a token)
    _until(lambda: engines[-1].chunks >= 2, 5, "the stream never started")
    reload = asyncio.run_coroutine_threadsafe(formation.reload(rolling_restart=False), LOOPS[id(router)])
    _until(lambda: formation.state == "draining", 5, "never draining")
    ask = Ask(base)
    _waiting(base, 1, ask)
    assert formation.state == "draining"
    answer = ask.result(30)
    assert answer.status_code == 200, answer.text
    assert len(engines) == 2 and engines[-1].bodies[-1]["prompt"] == "hi"  # the reloaded engine's
    _whole(stream, 40)  # the request in flight finished on the first engine
    reload.result(10)
    assert formation.metrics.reloads == 1 and router.waiting["a"] == 0


# -- issue 42 (item 2): a stream in flight waits for the recovery too, then goes on from where it stopped


class Streamed(threading.Thread):
    """One streamed completion on its own thread: its events as they come, or its hang-up (`leave`)."""

    def __init__(self, base: str, tokens: int, **sampling: Any) -> None:
        super().__init__(daemon=True)
        self.base, self.tokens, self.sampling = base, tokens, sampling
        self.events: list[dict[str, Any]] = []
        self.leave = threading.Event()
        self.start()

    def run(self) -> None:
        body = {"prompt": "hi", "max_tokens": self.tokens, "stream": True, **self.sampling}
        with httpx.stream("POST", f"{self.base}/v1/completions", json=body, timeout=60) as answer:
            for line in answer.iter_lines():
                if self.leave.is_set():
                    return
                if line.startswith("data: ") and line != "data: [DONE]":
                    self.events.append(json.loads(line[6:]))

    def text(self) -> str:
        return "".join(e["choices"][0]["text"] for e in self.events if e.get("choices"))


def _whole(stream: Streamed, tokens: int) -> None:
    stream.join(30)
    assert not stream.is_alive(), "the stream never ended"
    assert "error" not in stream.events[-1], stream.events[-1]
    assert stream.text() == "".join(f"t{i} " for i in range(tokens)), stream.text()
    assert len({e.get("id") for e in stream.events}) == 1


def test_a_stream_waits_for_the_recovery_and_goes_on_from_where_it_stopped(
    served: Callable[..., Served],
) -> None:
    base, router, fleet, engines = served(token_ids=True, queue_timeout=30.0)
    stream = Streamed(base, 40)
    _until(lambda: engines[-1].chunks >= 5, 5, "the stream never started")
    _lose_every_node(router, fleet, engines)
    _waiting(base, 1)
    fleet.answering = set(ENDPOINTS)
    _whole(stream, 40)
    assert len(engines) == 2 and engines[-1].bodies[-1]["prompt"][:3] == [1, 2, 3]  # the prompt's tokens
    assert engines[-1].replays == []  # not greedy: nothing replayed


@pytest.mark.parametrize("budget", [resume.REPLAY_SECONDS, 0.0])
def test_a_greedy_stream_is_replayed_token_by_token_within_its_budget_before_it_goes_on(
    served: Callable[..., Served], monkeypatch: pytest.MonkeyPatch, budget: float
) -> None:
    """Greedy (temperature 0): the new engine decodes the prompt, then each streamed token but the last on
    its own, as the lost engine did, then the continuation (the last one, and on); for at most
    REPLAY_SECONDS (none at 0: the continuation prefills them all)."""
    monkeypatch.setattr(resume, "REPLAY_SECONDS", budget)
    base, router, fleet, engines = served(token_ids=True, queue_timeout=30.0)
    stream = Streamed(base, 40, temperature=0)
    _until(lambda: engines[-1].chunks >= 5, 5, "the stream never started")
    _lose_every_node(router, fleet, engines)
    fleet.answering = set(ENDPOINTS)
    _whole(stream, 40)
    sent = engines[-1].bodies[-1]["prompt"][len(PROMPT_TOKENS) :]  # the continuation's: prompt, streamed
    assert len(sent) >= 5 and sent == [FIRST_ID + i for i in range(len(sent))]
    steps = [PROMPT_TOKENS + sent[:upto] for upto in range(len(sent))]
    assert engines[-1].replays == (steps if budget else [])


def test_a_kill_during_the_resume_itself_is_waited_out_too(served: Callable[..., Served]) -> None:
    """The re-formed formation's engine dies while it continues the stream: the stream waits for the
    next one and goes on again, every token once."""
    base, router, fleet, engines = served(token_ids=True, queue_timeout=30.0)
    stream = Streamed(base, 60)
    _until(lambda: engines[-1].chunks >= 5, 5, "the stream never started")
    _lose_every_node(router, fleet, engines)
    _waiting(base, 1)
    fleet.answering = set(ENDPOINTS)
    _until(lambda: len(engines) == 2 and engines[-1].chunks >= 3, 10, "the continuation never started")
    _lose_every_node(router, fleet, engines)
    _waiting(base, 1)
    fleet.answering = set(ENDPOINTS)
    _whole(stream, 60)
    assert len(engines) == 3 and router.metrics.resumed[("/v1/completions", "continued")] == 2


def test_a_stream_that_nothing_serves_again_in_time_ends_with_the_503_event_naming_the_lost_nodes(
    served: Callable[..., Served],
) -> None:
    base, router, fleet, engines = served(token_ids=True, queue_timeout=0.5)
    stream = Streamed(base, 40)
    _until(lambda: engines[-1].chunks >= 5, 5, "the stream never started")
    started = time.monotonic()
    _lose_every_node(router, fleet, engines)
    stream.join(20)
    error = stream.events[-1]["error"]
    assert error["code"] == 503 and error["lost"] == list(ENDPOINTS), error
    assert time.monotonic() - started < 10 and router.waiting["a"] == 0


def test_a_client_that_hangs_up_while_its_stream_waits_frees_its_place(
    served: Callable[..., Served],
) -> None:
    base, router, fleet, engines = served(token_ids=True, queue_timeout=30.0)
    data = json.dumps({"prompt": "hi", "max_tokens": 40, "stream": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}\r\n\r\n"
    leaving = socket.create_connection(("127.0.0.1", int(base.rpartition(":")[2])), timeout=10)
    leaving.sendall(head.encode() + data)
    _until(lambda: engines[-1].chunks >= 5, 5, "the stream never started")
    _lose_every_node(router, fleet, engines)
    _waiting(base, 1)
    leaving.close()
    _waiting(base, 0)
    _until(lambda: router.formations[0].admitted == 0, 5, "its place was not given back")
