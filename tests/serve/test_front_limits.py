"""Tier 1: what serve's front bounds for its clients (issue 43): a key is resolved once per request, a
client that hangs up gives back its place, the answer's length and the slot are serve's, the schema and
every client's prompts are not open, and an engine proves who it is before it gets a request. serve's
real app over fake engines (`serve_rig.HttpEngine`); a real uvicorn where a client must hang up."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from orchestrator.core.target import Target
from orchestrator.observe.server import http_server
from orchestrator.planning.plan import Plan
from orchestrator.serve.app import create_app
from orchestrator.serve.engine import EngineError, EngineOptions, LlamaServer, listening_inodes
from orchestrator.serve.formation import Formation
from orchestrator.serve.keys import KeyRing, parse_keys_file, read_keys_file
from orchestrator.serve.router import Router
from orchestrator.serve.states import ServeConfig
from orchestrator.serve.upstream import Upstream
from tests.plugins.serve_rig import FakeFleet, HttpEngine

ALICE = "sk-alice-0123456789abcdef"  # inference on model a only
BOB = "sk-bob-0123456789abcdefgh"
KEYS = f"alice {ALICE} inference a\nbob {BOB} inference\n"
API_KEY, ADMIN_KEY = "sk-api-0123456789abcdef", "sk-admin-0123456789abcd"


def _router(tiny_model: Path, models: tuple[str, ...], config: ServeConfig, **engine: Any) -> Router:
    formations = []
    for model in models:
        fleet = FakeFleet(tiny_model)

        def factory(plan: Plan, targets: Mapping[str, Target], fleet: FakeFleet = fleet) -> HttpEngine:
            return HttpEngine(plan, fleet, 0, **engine)

        formations.append(Formation(f"{model}#0", model, fleet, config, factory))
    return Router(formations)


def _engine(router: Router, model: str) -> HttpEngine:
    formation = next(f for f in router.formations if f.model == model)
    assert formation.current is not None
    engine = formation.current.engine
    assert isinstance(engine, HttpEngine)
    return engine


@pytest.fixture
def front(tiny_model: Path, tmp_path: Path) -> Iterator[Callable[..., tuple[TestClient, Router]]]:
    """Factory: serve's app (create_app's keyword arguments) over models a and b, ready, in a TestClient."""
    made: list[tuple[TestClient, Router]] = []

    def make(parallel: int = 4, **keys: Any) -> tuple[TestClient, Router]:
        config = ServeConfig(parallel=parallel, retry_interval=0.005, rejoin_interval=0.0)
        router = _router(tiny_model, ("a", "b"), config)
        app = create_app(router, **{"api_key": None, **keys})
        client = TestClient(app, base_url="http://127.0.0.1")  # a loopback name: a key-less front asks one
        client.__enter__()  # one loop for the routes and the formations, as in serve
        made.append((client, router))
        assert client.portal is not None
        client.portal.call(router.start)
        deadline = time.monotonic() + 10
        while router.state != "ready":
            assert time.monotonic() < deadline, router.state
            time.sleep(0.005)
        return client, router

    yield make
    for client, router in made:
        assert client.portal is not None
        client.portal.call(router.stop)
        client.__exit__(None, None, None)


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_key_removed_while_its_body_arrives_is_the_key_checked_at_the_start(
    front: Callable[..., tuple[TestClient, Router]], tmp_path: Path
) -> None:
    """F11: the request's key is resolved once, by its route's check; a reload of the keys while its
    body arrives does not turn it into a key without a model list (any model)."""
    path = tmp_path / "keys"
    path.write_text(KEYS)
    ring = KeyRing(read_keys_file(path, ["a", "b"]))
    client, router = front(keys=ring)
    without_alice = parse_keys_file(path, f"bob {BOB} inference\n", ["a", "b"])
    body = json.dumps({"model": "b", "prompt": "hi", "max_tokens": 2}).encode()

    def arriving() -> Iterator[bytes]:  # read by the route, after its check
        yield body[:10]
        ring.keys = without_alice  # SIGHUP's reload, while the body arrives
        yield body[10:]

    headers = {**_as(ALICE), "Content-Type": "application/json", "Content-Length": str(len(body))}
    answer = client.post("/v1/completions", content=arriving(), headers=headers)
    assert answer.status_code == 403, answer.text
    assert answer.json()["error"]["message"] == "the key 'alice' may not use the model 'b'"
    assert _engine(router, "b").bodies == []  # nothing reached model b's engine
    # the next request is checked against the keys in force
    assert client.post("/v1/completions", content=body, headers=headers).status_code == 401


def test_the_answers_length_and_the_slot_are_bounded_by_serve(
    front: Callable[..., tuple[TestClient, Router]],
) -> None:
    """F12: llama-server reads `n_predict` before `max_tokens` (-1: no end) and takes `id_slot` modulo
    its slots (a negative one waits for ever): serve sets one bound everywhere and takes only -1 or one of
    the formation's slots."""
    client, router = front(parallel=4)
    engine = _engine(router, "a")

    def sent(**fields: Any) -> tuple[int, Any]:
        answer = client.post("/v1/completions", json={"model": "a", "prompt": "hi", **fields})
        return answer.status_code, answer.json()

    for fields in ({"n_predict": -1}, {"n_predict": 0}, {"n_predict": "64"}, {"max_completion_tokens": -1}):
        code, answer = sent(**fields)
        assert code == 400 and "must be at least 1" in answer["error"]["message"], (fields, answer)
    assert engine.bodies == []
    for fields, bound in (
        ({"max_tokens": 5, "n_predict": 100000}, 5),  # the smallest
        ({"n_predict": 7}, 7),  # n_predict alone is the bound
        ({}, 16),  # serve's default
        ({"max_tokens": 9, "max_completion_tokens": 3}, 3),
    ):
        code, _ = sent(**fields)
        assert code == 200
        seen = engine.bodies[-1]
        assert seen["n_predict"] == seen["max_tokens"] == bound, (fields, seen)
        assert seen.get("max_completion_tokens", bound) == bound
    for slot in (-2, 4, 1000, True, "0", 1.5):
        code, answer = sent(max_tokens=2, id_slot=slot)
        assert code == 400 and "id_slot must be" in answer["error"]["message"], (slot, answer)
    assert sent(max_tokens=2, id_slot=4)[1]["error"]["message"].endswith("4 slots: 0 to 3")
    for slot in (-1, 0, 3):
        assert sent(max_tokens=2, id_slot=slot)[0] == 200, slot
        assert engine.bodies[-1]["id_slot"] == slot


def _with_prompts(router: Router) -> None:
    for model in ("a", "b"):
        _engine(router, model).slots_text = '[{"id": 0, "prompt": "a client\'s prompt"}]'


def test_the_schema_is_not_served_and_slots_take_the_admin_key(
    front: Callable[..., tuple[TestClient, Router]],
) -> None:
    """F14: no /openapi.json (it was open without a key); with an admin key, /slots (every client's
    prompts) takes only it; with the API key alone, the API key."""
    client, router = front(api_key=API_KEY, admin_key=ADMIN_KEY)
    _with_prompts(router)
    for key in (None, API_KEY, ADMIN_KEY):
        assert client.get("/openapi.json", headers=_as(key) if key else {}).status_code == 404, key
    assert client.get("/slots").status_code == 401
    refused = client.get("/slots", headers=_as(API_KEY))
    assert refused.status_code == 403 and "admin key" in refused.json()["error"]["message"], refused.text
    assert client.get("/slots", headers=_as(ADMIN_KEY)).status_code == 200
    plain, plain_router = front(api_key=API_KEY)  # no admin key: the API key is the only one
    _with_prompts(plain_router)
    assert plain.get("/slots").status_code == 401
    assert plain.get("/slots", headers=_as(API_KEY)).status_code == 200


# -- a client that hangs up: a real uvicorn, serve's app, its formations on the server's loop


@pytest.fixture
def served(tiny_model: Path) -> Iterator[Callable[..., tuple[int, Router]]]:
    """Factory: serve's app over model a (one formation, fake engines with `engine`'s fields) on a real
    uvicorn (`http_server`) on 127.0.0.1, ready: (its port, its router)."""
    running: list[tuple[Any, threading.Thread]] = []

    def start(config: ServeConfig, **engine: Any) -> tuple[int, Router]:
        router = _router(tiny_model, ("a",), config, **engine)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = http_server(create_app(router, api_key=None), "127.0.0.1", port)

        async def main() -> None:
            router.start()
            try:
                await server.serve(sockets=[sock])
            finally:
                await router.stop()

        thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
        thread.start()
        running.append((server, thread))
        deadline = time.monotonic() + 10
        while not (server.started and router.state == "ready"):
            assert time.monotonic() < deadline, router.state
            time.sleep(0.01)
        return port, router

    yield start
    for server, thread in running:
        server.should_exit = True
        thread.join(10)


def _send(port: int, body: dict[str, Any]) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock


def _until(check: Callable[[], bool], limit: float, what: str) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < limit, what
        time.sleep(0.01)
    return time.monotonic() - started


def test_a_client_that_hangs_up_gives_back_its_slot_and_its_place_in_the_queue(
    served: Callable[..., tuple[int, Router]],
) -> None:
    """F12: a non-streamed request whose client hangs up frees its slot at once (it used to hold it until
    the engine's whole answer), and one waiting in the queue its place; the engine's connection closes."""
    port, router = served(ServeConfig(parallel=1, retry_interval=0.005, rejoin_interval=0.0), whole_delay=4.0)
    formation = router.formations[0]
    engine = _engine(router, "a")
    served_one = _send(port, {"prompt": "hi", "max_tokens": 3})
    _until(lambda: len(engine.bodies) == 1, 5, "the engine never got the request")
    queued = _send(port, {"prompt": "hello", "max_tokens": 3})
    _until(lambda: formation.admitted == 2, 5, "the second request was not queued")
    queued.close()
    took = _until(lambda: formation.admitted == 1, 1.0, "the queued request kept its place")
    served_one.close()
    took = max(
        took, _until(lambda: formation.admitted == 0 and formation.busy == 0, 1.0, "the slot was kept")
    )
    print(f"given back within {took:.2f} s (the engine answers after 4 s)")
    assert len(engine.bodies) == 1  # the queued one never reached it
    with _send(port, {"prompt": "again", "max_tokens": 2}) as again:  # the slot serves the next one
        assert again.recv(65536).startswith(b"HTTP/1.1 200")


# -- an engine proves who it is (F17)

FAKE_LLAMA_SERVER = """
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
argv = sys.argv[1:]
port, model = int(argv[argv.index("--port") + 1]), argv[argv.index("-m") + 1]
key = os.environ["LLAMA_API_KEY"]
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass
    def do_GET(self):
        if self.path != "/health" and self.headers.get("Authorization") != "Bearer " + key:
            code, body = 401, {"error": "Invalid API Key"}
        else:
            code, body = 200, ({"status": "ok"} if self.path == "/health" else {"model_path": model})
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def _fake_binary(tmp_path: Path, script: str) -> Path:
    (tmp_path / "server.py").write_text(script)
    binary = tmp_path / "llama-server"
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} {tmp_path / "server.py"} "$@"\n')
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return binary


def _llama_server(tiny_model: Path, binary: Path, tmp_path: Path) -> LlamaServer:
    plan = asyncio.run(FakeFleet(tiny_model).plan_round()).plan
    assert plan is not None
    options = EngineOptions(binary=binary, model_path=str(tiny_model), model_name="a", log_dir=tmp_path)
    return LlamaServer(plan, {}, options, Upstream())


async def _load(engine: LlamaServer, limit: float) -> float:
    try:
        return await engine.load(limit)
    finally:
        await engine.close()
        await engine.http.aclose()


def test_a_port_taken_before_the_engine_binds_it_is_no_engine(tiny_model: Path, tmp_path: Path) -> None:
    """F17: the engine's port is picked, then freed for llama-server to bind: a process that takes it
    meanwhile and answers /health is not taken for the engine. It never gets the engine's key; the engine
    is killed and the load fails naming the port."""
    asked: list[str | None] = []

    class Impostor(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            asked.append(self.headers.get("Authorization"))
            data = b'{"status": "ok", "model_path": "%s"}' % str(tiny_model).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    binary = _fake_binary(tmp_path, "import time\ntime.sleep(60)\n")  # a llama-server slow to bind
    engine = _llama_server(tiny_model, binary, tmp_path)
    impostor = ThreadingHTTPServer(("127.0.0.1", engine.port), Impostor)  # in the gap
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    try:
        with pytest.raises(EngineError) as raised:
            asyncio.run(_load(engine, 10.0))
    finally:
        impostor.shutdown()
        impostor.server_close()
    message = str(raised.value)
    assert f"127.0.0.1:{engine.port} is another process's, not llama-server's" in message, message
    assert asked and all(a is None for a in asked), asked  # /health only, and never the key
    assert engine.pid is not None
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(engine.pid, 0)


def test_an_engine_that_holds_its_port_and_knows_its_key_is_ready(tiny_model: Path, tmp_path: Path) -> None:
    """F17's other side: the engine's own listening socket and its /props with its key: ready."""
    engine = _llama_server(tiny_model, _fake_binary(tmp_path, FAKE_LLAMA_SERVER), tmp_path)

    assert asyncio.run(_load(engine, 20.0)) < 20.0


def test_the_listening_sockets_of_a_port_are_read_from_procs_table() -> None:
    table = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1\n"
        "   1: 0100007F:1F90 0100007F:C350 01 00000000:00000000 00:00000000 00000000  1000        0 4343 1\n"
        "   2: 00000000:1F91 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4444 1\n"
    )
    assert listening_inodes(table, 8080) == {4242}  # the listener, not a connection to it
    assert listening_inodes(table, 8081) == {4444}
    assert listening_inodes(table, 9000) == set()
