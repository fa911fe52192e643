"""serve's fast rig: a fake fleet whose nodes answer or not as a test says (`FakeFleet.answering`), fake
engines that load in a moment and end when told, one that speaks HTTP as llama-server does (`HttpEngine`),
and `Rig`, a formation with its fleet and engines (test_serve_engine.py, test_formations.py).

The formation runs on one event loop, as in serve: a test on another thread reaches it through an anyio
portal (`Rig.call`: a function, async or not, run on that loop; the portal of the app's TestClient when
the front is tested, so that the routes and the formation share the loop)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from orchestrator.core.poll import poll_async
from orchestrator.core.target import Target
from orchestrator.inventory.model import Host
from orchestrator.llama.worker.load_progress import LoadProgress
from orchestrator.planning.plan import Plan, PlanOptions
from orchestrator.planning.recovery import Attempt, next_spare
from orchestrator.planning.strategy import make_plan
from orchestrator.serve.formation import Formation
from orchestrator.workflows.plan import PlanRound
from orchestrator.workflows.serving import ServeFleet
from tests.plugins.llama import plan_devices

ENDPOINTS = ("10.9.0.1:50052", "10.9.0.2:50052", "10.9.0.3:50052")


class FakeFleet(ServeFleet):
    """The fleet as the formation sees it; `answering` says which nodes answer a probe."""

    def __init__(self, model: Path) -> None:
        hosts = [
            Host(name=f"n{i}", address=ep.split(":")[0], rpc_port=50052) for i, ep in enumerate(ENDPOINTS)
        ]
        super().__init__(hosts, str(model), PlanOptions(n_ctx=512))
        self.answering = set(ENDPOINTS)
        self.rounds = 0
        self.restarts = 0

    async def plan_round(self, *, spare: bool = True) -> PlanRound:
        self.rounds += 1
        states = {ep: ("ok" if ep in self.answering else "refused") for ep in ENDPOINTS}
        up = [ep for ep in ENDPOINTS if ep in self.answering]
        if not up:
            return PlanRound(None, states, 0.0, 0.0, "no node answers")
        plan = make_plan(plan_devices(up), self.profile(), self.options)
        return PlanRound(plan, states, 0.0, 0.0)

    async def watch(self, endpoints: Sequence[str]) -> dict[str, str]:
        return {ep: ("ok" if ep in self.answering else "refused") for ep in endpoints}

    async def prepare_cache(self, plan: Plan) -> None:
        return None

    def targets(self) -> dict[str, Target]:
        return {}

    async def rolling_restart(self, *, serial: int = 1, force: bool = False) -> list[str]:
        self.restarts += 1
        return []


@dataclass(eq=False)
class FakeEngine:
    """An engine that loads in a moment, ends when told (`die`), and diagnoses with the fake fleet."""

    plan: Plan
    fleet: FakeFleet
    number: int
    ended: threading.Event = field(default_factory=threading.Event)
    how: str = ""
    killed: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{40000 + self.number}"

    @property
    def api_key(self) -> str | None:
        return None

    @property
    def pid(self) -> int | None:
        return 90000 + self.number

    @property
    def log_path(self) -> Path | None:
        return None

    async def load(
        self,
        limit: float,
        on_progress: Callable[[LoadProgress], None] | None,
        cache_hits: Mapping[str, int],
    ) -> float:
        if any(ep not in self.fleet.answering for ep in self.plan.endpoints):
            from orchestrator.serve.engine import EngineError

            raise EngineError("lost a node while loading the model")
        return 0.001

    def die(self, how: str = "signal SIGABRT") -> None:
        self.how = how
        self.ended.set()

    async def wait(self) -> str:
        async def ended() -> bool | None:  # set by `die`, from any thread
            return True if self.ended.is_set() else None

        await poll_async(ended, limit=3600, interval=0.001)
        return self.how

    async def diagnose(self) -> tuple[tuple[str, str], ...]:
        return tuple((ep, "refused") for ep in self.plan.endpoints if ep not in self.fleet.answering)

    async def kill(self) -> None:
        self.killed = True
        self.die("signal SIGKILL")

    async def close(self) -> None:
        self.die("exit status 0")

    def log_tail(self) -> str | None:
        return None


@dataclass
class Rig:
    formation: Formation
    fleet: FakeFleet
    engines: list[FakeEngine]
    portal: Any  # anyio's BlockingPortal of the loop the formation runs on

    def call(self, function: Callable[..., Any], *args: Any) -> Any:
        """`function(*args)` on the formation's loop (awaited when async), from this thread."""
        return self.portal.call(function, *args)

    def wait_state(self, states: set[str], limit: float = 5.0) -> None:
        deadline = time.monotonic() + limit
        while self.formation.state not in states:
            assert time.monotonic() < deadline, (self.formation.state, self.formation.reason)
            time.sleep(0.001)

    @property
    def engine(self) -> FakeEngine:
        return self.engines[-1]


FIRST_ID = 1000  # the id of a fake engine's token i is FIRST_ID + i
PROMPT_TOKENS = [1, 2, 3]  # any prompt, tokenized by a fake engine


class _FakeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends with the connection, as a stream's may
    engine: HttpEngine

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.end_headers()
        self.wfile.write(body)

    def _refused(self) -> bool:
        """llama-server's rule with --api-key: every route but /health asks for the key."""
        if self.headers.get("Authorization") == f"Bearer {self.engine.api_key}":
            return False
        self.engine.refused.append(self.path)
        self._send(401, b'{"error":{"code":401,"message":"Invalid API Key","type":"authentication_error"}}')
        return True

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, b'{"status":"ok"}')
        elif self._refused():
            return
        elif self.path == "/metrics":
            self.engine.metrics_asked += 1
            if self.engine.stuck:
                self.engine.ended.wait(5)  # its main loop takes no task
            gauge = "llamacpp:requests_processing"
            text = self.engine.metrics_text or f"# TYPE {gauge} gauge\n{gauge} {self.engine.active}\n"
            self._send(200, text.encode(), "text/plain")
        elif self.path == "/slots" and self.engine.slots_text:
            self._send(200, self.engine.slots_text.encode())
        else:
            self._send(404, b'{"error":{"code":404,"message":"not found","type":"not_found_error"}}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self._refused():
            return
        self.engine.bodies.append(body)
        if self.path in ("/tokenize", "/apply-template"):
            self._tokenize_or_template(body)
            return
        if self.path == "/completion":  # llama-server's own route: a greedy stream's replay, step by step
            self.engine.replays.append(body["prompt"])
            self._send(200, json.dumps({"content": "x", "id_slot": 0, "stop": True}).encode())
            return
        if body.get("max_tokens", 0) > 1000:
            self._send(
                400, b'{"error":{"code":400,"message":"too many tokens","type":"invalid_request_error"}}'
            )
            return
        n = int(body["max_tokens"])
        # A continuation's prompt is the prompt's tokens, then the ids streamed (`FIRST_ID + i`)
        prompt = body.get("prompt")
        start = sum(1 for t in prompt if t >= FIRST_ID) if isinstance(prompt, list) else 0
        if not body.get("stream"):
            time.sleep(self.engine.whole_delay)
            if self.engine.ended.is_set():
                self.connection.shutdown(socket.SHUT_RDWR)  # died while answering: nothing comes
                return
            whole = {"choices": [{"text": "x" * n}], "usage": {"prompt_tokens": 3, "completion_tokens": n}}
            self._send(200, json.dumps(whole).encode())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.engine.active += 1
        mine = len(self.engine.streamed)
        self.engine.streamed.append(0)
        try:
            for i in range(n):
                if self.engine.ended.wait(self.engine.delay):
                    self.connection.shutdown(socket.SHUT_RDWR)  # the engine aborts: the stream breaks off
                    return
                self.wfile.write(
                    b"data: " + json.dumps(self._chunk(body, start + i, i + 1)).encode() + b"\n\n"
                )
                self.wfile.flush()
                self.engine.chunks += 1
                self.engine.streamed[mine] += 1
            end = {
                "id": f"cmpl-{self.engine.number}",
                "choices": [{"text": "", "finish_reason": "length", "index": 0}],
                "timings": {"prompt_n": 3, "predicted_n": n},
                "usage": {"prompt_tokens": 3 + start, "completion_tokens": n, "total_tokens": 3 + start + n},
            }
            self.wfile.write(b"data: " + json.dumps(end).encode() + b"\n\ndata: [DONE]\n\n")
        finally:
            self.engine.active -= 1

    def _chunk(self, body: dict[str, Any], i: int, decoded: int) -> dict[str, Any]:
        """The event of token `i`: its text `t{i} `, and when the engine says ids (`token_ids`) and the
        request asks (logprobs, n_probs), its id and the count decoded, as llama-server does."""
        choice: dict[str, Any] = {"text": f"t{i} ", "index": 0, "finish_reason": None}
        chunk: dict[str, Any] = {"id": f"cmpl-{self.engine.number}", "choices": [choice]}
        if self.engine.token_ids and (body.get("n_probs") or body.get("logprobs")):
            choice["logprobs"] = {"content": [{"id": FIRST_ID + i, "token": f"t{i} "}]}
        if self.engine.token_ids and body.get("timings_per_token"):
            chunk["timings"] = {"predicted_n": decoded}
        return chunk

    def _tokenize_or_template(self, body: dict[str, Any]) -> None:
        if not self.engine.token_ids:
            self._send(404, b'{"error":{"code":404,"message":"not found","type":"not_found_error"}}')
        elif self.path == "/tokenize":
            self._send(200, json.dumps({"tokens": PROMPT_TOKENS}).encode())
        else:
            self._send(200, json.dumps({"prompt": "templated"}).encode())


@dataclass(eq=False)
class HttpEngine(FakeEngine):
    delay: float = 0.01
    whole_delay: float = 0.0
    chunks: int = 0  # stream events with text sent so far
    streamed: list[int] = field(default_factory=list)  # each stream's events with text, in arrival order
    token_ids: bool = False  # says each token's id (logprobs) and answers /tokenize, /apply-template
    stuck: bool = False
    active: int = 0
    metrics_text: str = ""  # its /metrics (default: requests_processing only)
    metrics_asked: int = 0
    slots_text: str = ""  # its /slots (default: none, a 404)
    bodies: list[Any] = field(default_factory=list)
    replays: list[list[int]] = field(default_factory=list)  # the prompts of /completion's replay steps
    refused: list[str] = field(default_factory=list)  # paths asked without the engine's key
    server: ThreadingHTTPServer | None = None

    def __post_init__(self) -> None:
        handler = type("Handler", (_FakeHandler,), {"engine": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        # A stream cut on purpose (the engine "aborts") fails the handler's last flush: socketserver would
        # print that traceback to stderr, later, into whichever test captures it then.
        self.server.handle_error = lambda request, address: None  # type: ignore[method-assign]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def api_key(self) -> str | None:
        return f"engine-key-{self.number}"

    def die(self, how: str = "signal SIGABRT") -> None:
        super().die(how)
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


class PartFleet(FakeFleet):
    """A fake fleet of some of the endpoints (one formation's)."""

    def __init__(self, model: Path, endpoints: tuple[str, ...]) -> None:
        super().__init__(model)
        self.hosts = [Host(name=f"h-{ep}", address=ep.split(":")[0], rpc_port=50052) for ep in endpoints]
        self.answering = set(endpoints)

    async def plan_round(self, *, spare: bool = True) -> Any:
        from orchestrator.planning.strategy import make_plan
        from orchestrator.workflows.plan import PlanRound

        self.rounds += 1
        states = {ep: ("ok" if ep in self.answering else "refused") for ep in self.endpoints}
        up = [ep for ep in self.endpoints if ep in self.answering]
        if not up:  # as ServeFleet's: the recovery rule's spare, when there is one
            chosen = next_spare(Attempt(None), self.spares.snapshot() if self.spares else [])
            taken = await self.with_spare(chosen) if spare and chosen is not None else None
            return taken or PlanRound(None, states, 0.0, 0.0, "no node answers")
        return PlanRound(make_plan(plan_devices(up), self.profile(), self.options), states, 0.0, 0.0)

    async def watch(self, endpoints: Any) -> dict[str, str]:
        return {ep: ("ok" if ep in self.answering else "refused") for ep in endpoints}
