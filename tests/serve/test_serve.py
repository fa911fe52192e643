"""Tier 1 for `rpcfleet serve`: the Prometheus text, the refusals made before anything is served, the
API key (from a file or the environment) guarding /health's details and the admin routes, on a real
serve over a real local rpc-server, and a long stream of a random model on a local server."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from orchestrator.planning.plan import PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan
from orchestrator.serve.metrics import Metrics, Recovery
from tests.plugins.llama import DebugServer, completion_bytes, plan_devices
from tests.plugins.servers import LocalServer, free_port, launch_rpc_server, write_local_inventory

KEY = "k3y-from-elsewhere"


def _serve(*argv: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "serve", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RPCFLEET_HOME": str(home)},
    )


def test_the_metrics_are_prometheus_text_with_every_family() -> None:
    metrics = Metrics()
    metrics.record_request("/v1/completions", 200)
    metrics.record_request("/v1/completions", 200)
    metrics.record_request("/v1/completions", 429)
    metrics.record_done(5, 16, 42.5, 0.25)
    metrics.record_recovery(Recovery(("10.0.0.2:50052",), 0.1, 0.3, 1.5, 1.9, 0.0))
    text = metrics.render({"10.0.0.1:50052": True, '10.0.0.2:50052"': False}, "degraded")
    assert 'rpcfleet_requests_total{route="/v1/completions",code="200"} 2' in text
    assert 'rpcfleet_requests_total{route="/v1/completions",code="429"} 1' in text
    assert 'rpcfleet_tokens_total{kind="completion"} 16' in text
    assert (
        "rpcfleet_time_to_first_token_seconds_sum 0.25\nrpcfleet_time_to_first_token_seconds_count 1" in text
    )
    assert 'rpcfleet_endpoint_up{endpoint="10.0.0.2:50052\\""} 0' in text  # a quote in a label is escaped
    assert 'rpcfleet_state{state="degraded"} 1' in text and 'rpcfleet_state{state="ready"} 0' in text
    assert 'rpcfleet_recovery_seconds{phase="total"} 1.9' in text
    for line in text.splitlines():  # every sample line: name{labels} value
        assert line.startswith("#") or (len(line.rsplit(" ", 1)) == 2 and float(line.rsplit(" ", 1)[1]) >= 0)


def test_a_public_bind_without_a_key_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    done = _serve("-m", str(tiny_model), "--host", "0.0.0.0", home=tmp_path)
    assert done.returncode == 2 and "without an API key is refused" in done.stderr, done.stderr
    key = tmp_path / "empty.key"
    key.write_text("\n")
    done = _serve("-m", str(tiny_model), "--api-key-file", str(key), home=tmp_path)
    assert done.returncode == 2 and f"{key}:1: the first line is empty" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_rejoin_interval_that_is_no_number_of_seconds_is_refused(tmp_path: Path) -> None:
    for bad in ("-1", "soon", "nan"):
        done = _serve("-m", "model.gguf", "--rejoin-interval", bad, home=tmp_path)
        assert done.returncode == 2, done.stderr
        assert f"--rejoin-interval: expected 0 (never) or a positive number of seconds, got '{bad}'" in (
            done.stderr
        )
        assert "Traceback" not in done.stderr


def test_an_unknown_chat_template_or_parallel_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    done = _serve("-m", str(tiny_model), "--chat-template", "gemmma", home=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "--chat-template gemmma: neither a file nor one of llama-server's template names" in done.stderr
    assert "gemma, " in done.stderr and "Traceback" not in done.stderr
    done = _serve("-m", str(tiny_model), "--parallel", "0", home=tmp_path)
    assert done.returncode == 2 and "--parallel" in done.stderr and "Traceback" not in done.stderr


def test_a_fleet_that_cannot_hold_the_model_is_an_error_at_start(tiny_model: Path, tmp_path: Path) -> None:
    inventory = write_local_inventory(tmp_path / "inv.yml", {"gone": {"rpc_port": free_port()}})
    done = _serve("-i", str(inventory), "-m", str(tiny_model), "--port", str(free_port()), home=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "cannot serve" in done.stderr and "no node answers" in done.stderr and "refused" in done.stderr
    assert "Traceback" not in done.stderr


def _http(url: str, key: str | None = None, body: bytes | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(url, data=body, headers=headers, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _start_serve(
    inventory: Path, model: Path, home: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """`rpcfleet serve -i INVENTORY -m MODEL --ctx 512` (extra argv, extra environment: no
    RPCFLEET_API_KEY but the one given), its log in `home`, once /health says ready."""
    port = free_port()
    argv = [sys.executable, "-m", "orchestrator", "serve", "-i", str(inventory), "-m", str(model)]
    argv += ["--ctx", "512", "--port", str(port), *extra]
    log = home / f"serve-{port}.log"
    environment = {k: v for k, v in os.environ.items() if k != "RPCFLEET_API_KEY"}
    environment |= {"RPCFLEET_HOME": str(home), **(env or {})}
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=environment)
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 90
    try:
        while time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()
            try:
                if _http(f"{base}/health")[1]["status"] == "ready":
                    return process, base
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"serve not ready in 90 s: {log.read_text()}")
    except BaseException:
        _stop_serve(process)
        raise


def _stop_serve(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def local_serve(
    start_rpc_server: Callable[..., LocalServer], tiny_model: Path, tmp_path: Path
) -> Iterator[Callable[..., tuple[subprocess.Popen[bytes], str]]]:
    """Factory: `rpcfleet serve` (extra argv, extra environment) on one real local rpc-server, ready: a
    serve of the test's own, for a test that reloads, signals or reconfigures it, or needs it unused."""
    server = start_rpc_server()
    inventory = write_local_inventory(tmp_path / "inv.yml", {"n1": {"rpc_port": server.port}})
    started: list[subprocess.Popen[bytes]] = []

    def start(*extra: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
        for process in started:  # one client at a time on the server: the previous serve goes first
            process.send_signal(signal.SIGINT)
            process.wait(20)
        process, base = _start_serve(inventory, tiny_model, tmp_path, *extra, env=env)
        started.append(process)
        return process, base

    yield start
    for process in started:
        _stop_serve(process)


@pytest.fixture(scope="module")
def _keyed_serve(
    rpc_server_binary: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """One serve for the module, its API key from the environment, on a server of its own."""
    home = tmp_path_factory.mktemp("keyed-serve")
    server = launch_rpc_server(rpc_server_binary, home)
    try:
        inventory = write_local_inventory(home / "inv.yml", {"n1": {"rpc_port": server.port}})
        process, base = _start_serve(inventory, tiny_model, home, env={"RPCFLEET_API_KEY": KEY})
        try:
            yield process, base
        finally:
            _stop_serve(process)
    finally:
        server.stop()


@pytest.fixture
def keyed_serve(
    _keyed_serve: tuple[subprocess.Popen[bytes], str],
) -> tuple[subprocess.Popen[bytes], str]:
    """The module's serve with `RPCFLEET_API_KEY=KEY` and serve's defaults, shared by the tests that only
    ask it (none reloads, signals, restarts or stops it): at each test's start still the same process,
    ready, never reloaded, its queue empty and its engine's slots idle."""
    process, base = _keyed_serve
    assert process.poll() is None, "the module's serve ended"
    code, health = _http(f"{base}/health", KEY)
    assert code == 200 and health["status"] == "ready" and health["pid"] == process.pid, health
    assert health["reloads"] == 0 and health["queue"]["admitted"] == 0, health
    code, slots = _http(f"{base}/slots", KEY)
    assert code == 200 and not any(slot["is_processing"] for slot in slots), slots
    return process, base


@pytest.mark.llama
def test_a_key_from_the_environment_guards_the_health_details_and_the_admin_routes(
    local_serve: Callable[..., tuple[subprocess.Popen[bytes], str]],
) -> None:
    process, base = local_serve(env={"RPCFLEET_API_KEY": f"  {KEY}  "})
    assert KEY not in Path(f"/proc/{process.pid}/cmdline").read_text()  # not on argv, where `ps` shows it
    for key in (None, "wrong"):
        code, health = _http(f"{base}/health", key)
        assert code == 200 and health == {"status": "ready"}, health  # no model path, pid, endpoint
    code, health = _http(f"{base}/health", KEY)
    assert code == 200 and health["pid"] == process.pid and health["model"].endswith(".gguf"), health
    assert health["plan"]["endpoints"] and health["worker_pid"], health
    assert _http(f"{base}/v1/models", KEY)[0] == 200 and _http(f"{base}/v1/models")[0] == 401
    assert _http(f"{base}/metrics")[0] == 401
    code, answer = _http(f"{base}/admin/reload", None, b"{}")
    assert code == 401 and answer["error"]["message"] == "invalid API key", answer
    code, answer = _http(f"{base}/admin/reload", KEY, b"{}")
    assert code == 202 and answer["status"] == "draining", answer
    deadline = time.monotonic() + 60
    while _http(f"{base}/health", KEY)[1]["reloads"] != 1 or _http(f"{base}/health")[1]["status"] != "ready":
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.1)


@pytest.mark.llama
def test_the_engine_behind_serve_answers_no_one_without_its_own_key(
    keyed_serve: tuple[subprocess.Popen[bytes], str],
) -> None:
    """llama-server listens on loopback, where any local user can reach it: without a key of its own its
    completions, /slots (the prompts being served) and /props (the model path) would bypass serve's."""
    process, base = keyed_serve
    engine = _http(f"{base}/health", KEY)[1]["engine"]
    url, pid = engine["url"], engine["pid"]
    assert psutil.Process(pid).ppid() == process.pid and url.startswith("http://127.0.0.1:"), engine
    for path, body in [
        ("/slots", None),
        ("/props", None),
        ("/metrics", None),
        ("/v1/models", None),
        ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}).encode()),
    ]:
        for key in (None, KEY):  # serve's key is not the engine's either
            code, answer = _http(url + path, key, body)
            assert code == 401 and answer["error"]["type"] == "authentication_error", (path, key, answer)
    code, answer = _http(f"{url}/health")  # llama-server's public route: its state only
    assert code == 200 and answer == {"status": "ok"}, answer
    secret = psutil.Process(pid).environ()["LLAMA_API_KEY"]
    assert len(secret) >= 32 and secret not in " ".join(psutil.Process(pid).cmdline())  # not where ps shows
    # Through serve, with serve's key: answered (serve sends the engine's key).
    code, answer = _http(
        f"{base}/v1/completions", KEY, json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    )
    assert code == 200 and answer["usage"]["completion_tokens"] == 2, answer
    assert _http(f"{base}/slots", KEY)[0] == 200
    assert "rpcfleet_engine_tokens_predicted_total" in _get_text(
        f"{base}/metrics", KEY
    )  # the engine's counters, read with its key


@pytest.mark.llama
def test_the_kv_cache_in_use_is_read_from_the_engines_slots_after_a_long_prompt(
    local_serve: Callable[..., tuple[subprocess.Popen[bytes], str]],
) -> None:
    """rpcfleet_formation_kv_used_ratio comes from llama-server's own /slots (its fields as the pinned
    llama.cpp writes them): 0 before any request, the prompt and answer's share of the context after
    one, and promtool accepts the text."""
    _, base = local_serve("--parallel", "1", env={"RPCFLEET_API_KEY": KEY})
    before = _get_text(f"{base}/metrics", KEY)
    assert 'rpcfleet_formation_kv_used_ratio{formation="tiny-default",model="tiny-default"} 0\n' in before
    prompt = " ".join(f"word{i}" for i in range(40))  # about 240 tokens of this model's
    body = json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    code, answer = _http(f"{base}/v1/completions", KEY, body)
    assert code == 200, answer
    tokens = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
    slots = _http(f"{base}/slots", KEY)[1]
    assert [s["n_ctx"] for s in slots] == [512] and slots[0]["n_prompt_tokens"] >= tokens - 1, slots
    time.sleep(1.1)  # past the scrape cache (ENGINE_SCRAPE_CACHE)
    text = _get_text(f"{base}/metrics", KEY)
    ratio = [float(line.rpartition(" ")[2]) for line in text.splitlines() if "_kv_used_ratio{" in line]
    assert len(ratio) == 2 and ratio[0] == ratio[1] == pytest.approx(slots[0]["n_prompt_tokens"] / 512), ratio
    assert ratio[0] > 0.1  # a long prompt: a good share of the 512 cells
    checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr + checked.stdout


def _get_text(url: str, key: str) -> str:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return str(answer.read().decode())


@pytest.mark.llama
def test_a_key_from_a_file_is_the_one_clients_send(
    local_serve: Callable[..., tuple[subprocess.Popen[bytes], str]], tmp_path: Path
) -> None:
    key_file = tmp_path / "serve.key"
    key_file.write_text(f"{KEY}\nthe second line is not read\n")
    _, base = local_serve("--api-key-file", str(key_file), env={"RPCFLEET_API_KEY": "not-this-one"})
    assert _http(f"{base}/v1/models", KEY)[0] == 200
    assert _http(f"{base}/v1/models", "not-this-one")[0] == 401  # the file wins over the environment
    assert set(_http(f"{base}/health")[1]) == {"status"} and "plan" in _http(f"{base}/health", KEY)[1]


@pytest.mark.llama
def test_without_a_key_the_admin_routes_are_refused_and_sighup_reloads(
    local_serve: Callable[..., tuple[subprocess.Popen[bytes], str]],
) -> None:
    process, base = local_serve()
    code, answer = _http(f"{base}/admin/reload", "anything", b"{}")
    assert code == 403 and "need an API key" in answer["error"]["message"], answer
    assert "SIGHUP" in answer["error"]["message"]
    assert _http(f"{base}/health")[1]["reloads"] == 0  # refused: nothing drained
    process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    while (health := _http(f"{base}/health")[1])["reloads"] != 1 or health["status"] != "ready":
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.1)


def test_an_empty_key_in_the_environment_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "serve", "-m", str(tiny_model), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RPCFLEET_HOME": str(tmp_path), "RPCFLEET_API_KEY": " "},
    )
    assert done.returncode == 2 and "RPCFLEET_API_KEY is set but empty" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    done = _serve("-m", str(tiny_model), "--api-key", " ", home=tmp_path)
    assert done.returncode == 2 and "--api-key is empty" in done.stderr, done.stderr


def _stream_events(base: str, key: str, tokens: int, first: threading.Event) -> list[dict[str, Any]]:
    """A streamed completion's events, as they come (`first` set at the first one)."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    body = {"prompt": "hello", "max_tokens": tokens, "temperature": 0, "stream": True}
    request = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), headers, method="POST"
    )
    events = []
    with urllib.request.urlopen(request, timeout=60) as answer:
        for line in answer:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                events.append(json.loads(line[len(b"data: ") :]))
                first.set()
    return events


@pytest.mark.llama
def test_a_reload_serves_the_queued_requests_it_waits_for(
    local_serve: Callable[..., tuple[subprocess.Popen[bytes], str]],
) -> None:
    """The drain waits for every admitted request: one streaming and two queued behind it; the queued two
    are served when their turn comes during the drain, not ended with a 503."""
    key = "drain-key"
    # one slot: the two others wait in the queue behind the stream (with more, they would be served)
    _, base = local_serve("--queue", "4", "--parallel", "1", env={"RPCFLEET_API_KEY": key})
    results: list[list[dict[str, Any]]] = []
    firsts = [threading.Event() for _ in range(3)]

    def one(i: int) -> None:
        results.append(_stream_events(base, key, 300 if i == 0 else 8, firsts[i]))

    threads = [threading.Thread(target=one, args=(0,))]
    threads[0].start()
    assert firsts[0].wait(30)
    threads += [threading.Thread(target=one, args=(i,)) for i in (1, 2)]
    for thread in threads[1:]:
        thread.start()
    deadline = time.monotonic() + 10
    while _http(f"{base}/health", key)[1]["queue"]["admitted"] < 3:
        assert time.monotonic() < deadline, "the two requests were not queued"
        time.sleep(0.01)
    code, answer = _http(f"{base}/admin/reload", key, b"{}")
    assert code == 202, answer
    health = _http(f"{base}/health", key)[1]
    assert health["status"] == "draining" and health["queue"]["admitted"] >= 2, health  # they still wait
    for thread in threads:
        thread.join(60)
    assert len(results) == 3
    for events in results:
        assert "error" not in events[-1], events[-1]
        assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
    deadline = time.monotonic() + 60
    while (health := _http(f"{base}/health", key)[1])["reloads"] != 1 or health["status"] != "ready":
        assert time.monotonic() < deadline, health
        time.sleep(0.1)


KEY = "s3cret"
LONG = 2000  # tokens of a random model: mostly bytes that are no UTF-8 (llama-cpp-python's stream: hours)
BOUND = 150.0  # seconds for one request of LONG tokens (5-25 s here)


def _post(base: str, path: str, body: dict[str, Any], started: float) -> tuple[str, str | None, Any]:
    """POST `body`; for a stream, read its events as they come (past BOUND seconds from `started`: fail;
    a stalled stream still gets serve's ping every 10 s). Returns the text, the finish reason, the usage."""
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    request = urllib.request.Request(base + path, json.dumps(body).encode(), headers, method="POST")
    with urllib.request.urlopen(request, timeout=30) as answer:
        if not body.get("stream"):
            whole = json.loads(answer.read())
            choice = whole["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            return text, choice["finish_reason"], whole["usage"]
        pieces, finish = [], None
        for line in answer:
            assert time.monotonic() - started < BOUND, f"the stream took over {BOUND:g} s"
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            choice = json.loads(line[len(b"data: ") :])["choices"][0]
            piece = choice["delta"].get("content", "") if "delta" in choice else choice["text"]
            pieces.append(piece)
            finish = choice["finish_reason"] or finish
        assert len([p for p in pieces if p]) > 20  # it streamed, not one piece at the end
        return "".join(pieces), finish, None


@pytest.mark.llama
def test_a_random_models_long_stream_is_its_whole_answer_in_bounded_time(
    debug_rpc_servers: list[DebugServer], tiny_model: Path, tmp_path: Path
) -> None:
    from orchestrator.llama.native.loader import load_llama

    node = debug_rpc_servers[0]
    # The expected texts: llama-cpp-python's, of the same tokens on the same server, for the same two
    # requests in the same order (the second reuses the first's prompt cache: other batches, other floats).
    # flash attention on: serve's default (-fa auto), the same arithmetic
    opts = PlanOptions(n_ctx=4096, flash_attn=True)
    plan = make_plan(plan_devices([node]), profile_model(tiny_model), opts)
    llm = load_llama(plan, tiny_model, seed=0)
    try:
        expected = [completion_bytes(llm, "hello world", LONG, 0.0, 0) for _ in range(2)]
    finally:
        llm.close()
    for raw in expected:  # far from UTF-8: the case that was cubic
        assert len(raw.decode("utf-8", "ignore").encode()) < 0.9 * len(raw)
    inventory = write_local_inventory(tmp_path / "inv.yml", {"node": {"rpc_port": node.port}})
    port = free_port()
    argv = [sys.executable, "-m", "orchestrator", "serve", "-i", str(inventory), "-m", str(tiny_model)]
    argv += [
        "--ctx",
        "4096",
        "--port",
        str(port),
        "--api-key",
        KEY,
        "--parallel",
        "1",
    ]  # one slot: all of --ctx
    env = {**os.environ, "RPCFLEET_HOME": str(tmp_path / "home")}
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    ready, lines = threading.Event(), []

    def drain() -> None:  # serve's stderr: the line that says it serves, and the pipe kept empty
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line.decode(errors="replace"))
            if line.startswith(b"ready on"):
                ready.set()

    threading.Thread(target=drain, daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    try:
        # Loaded after uvicorn bound its port (the worker's start alone takes longer than the bind).
        assert ready.wait(120), "".join(lines)
        body = {"prompt": "hello world", "max_tokens": LONG, "temperature": 0, "seed": 0}
        started = time.monotonic()
        streamed, finish, _ = _post(base, "/v1/completions", {**body, "stream": True}, started)
        took = time.monotonic() - started
        # llama-server writes each byte that is no UTF-8 as U+FFFD where llama-cpp-python drops it: the
        # same tokens, the same valid text
        assert streamed.replace("\ufffd", "") == expected[0].decode("utf-8", "ignore") and finish == "length"
        whole, finish, usage = _post(base, "/v1/completions", body, time.monotonic())
        assert whole.replace("\ufffd", "") == expected[1].decode("utf-8", "ignore") and finish == "length"
        assert usage["completion_tokens"] == LONG  # not one more
        print(f"{LONG} tokens streamed in {took:.1f} s")
    finally:
        process.terminate()
        process.wait(30)


def _wait_status(
    base: str, process: subprocess.Popen[bytes], log: Path, states: set[str], limit: float
) -> Any:
    """Poll /health until its status is in `states` (serve still running); returns it."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            health = _http(f"{base}/health")[1]
        except (urllib.error.URLError, ConnectionError):
            health = {"status": None}
        if health["status"] in states:
            return health
        time.sleep(0.1)
    raise AssertionError(f"/health never reached {states} in {limit} s: {log.read_text()[-3000:]}")


def _status(base: str) -> str:
    return str(_http(f"{base}/health")[1]["status"])


def _up(base: str) -> dict[str, int]:
    """rpcfleet_endpoint_up of /metrics: endpoint -> 0 or 1."""
    request = urllib.request.Request(f"{base}/metrics")
    with urllib.request.urlopen(request, timeout=30) as answer:
        text = answer.read().decode()
    up = {}
    for line in text.splitlines():
        if line.startswith("rpcfleet_endpoint_up{"):
            up[line.split('"')[1]] = int(line.rsplit(" ", 1)[1])
    return up


@pytest.mark.llama
def test_a_node_down_at_start_is_taken_back_once_its_server_answers(
    start_rpc_server: Callable[..., LocalServer], tiny_model: Path, tmp_path: Path
) -> None:
    """Two real local servers, the second not started yet: serve is degraded on one; once the second
    server answers, the watch takes it back without an operator (no reload)."""
    first = start_rpc_server()
    later = free_port()
    hosts = {"n1": {"rpc_port": first.port}, "n2": {"rpc_port": later}}
    inventory = write_local_inventory(tmp_path / "inv.yml", hosts)
    port, log = free_port(), tmp_path / "serve.log"
    argv = [sys.executable, "-m", "orchestrator", "serve", "-i", str(inventory), "-m", str(tiny_model)]
    argv += ["--ctx", "512", "--port", str(port), "--rejoin-interval", "1", "--split"]
    environment = {k: v for k, v in os.environ.items() if k != "RPCFLEET_API_KEY"}
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=environment | {"RPCFLEET_HOME": str(tmp_path)}
        )
    base, missing = f"http://127.0.0.1:{port}", f"127.0.0.1:{later}"
    try:
        health = _wait_status(base, process, log, {"degraded", "ready"}, 90)
        assert health["status"] == "degraded" and health["plan"]["endpoints"] == [first.endpoint], health
        assert health["lost"] == [missing] and {"endpoint": missing, "state": "refused"} in health["nodes"]
        assert _up(base) == {first.endpoint: 1, missing: 0}
        time.sleep(2.5)  # two watch rounds find nothing: still degraded, nothing reloaded
        health = _http(f"{base}/health")[1]
        assert health["status"] == "degraded" and health["last_rejoin"] is None, health
        # Requests one after the other, with short gaps (the idle moments the rejoin takes) throughout:
        # each one is served, before, during (waiting in the queue) or after the rejoin, none cut.
        done, answers = threading.Event(), []

        def ask() -> None:
            while not done.is_set() or len(answers) < 20:
                body = {"prompt": "hello", "max_tokens": 2}
                answers.append((_post(base, "/v1/completions", body, time.monotonic()), _status(base)))
                time.sleep(0.05)

        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        start_rpc_server(port=later)
        started = time.monotonic()
        health = _wait_status(base, process, log, {"ready"}, 60)
        took = time.monotonic() - started
        done.set()
        asking.join(120)
        assert not asking.is_alive() and len(answers) >= 20, answers
        assert all(text and finish == "length" for (text, finish, _), _ in answers), answers
        assert {status for _, status in answers} == {"degraded", "ready"}, answers  # asked all along
        assert health["plan"]["endpoints"] == [first.endpoint, missing] and health["lost"] == [], health
        assert all(n["state"] == "serving" for n in health["nodes"]), health
        assert health["last_rejoin"]["back"] == [missing] and health["reloads"] == 0, health
        assert _up(base) == {first.endpoint: 1, missing: 1}
        text, finish, _ = _post(base, "/v1/completions", {"prompt": "hello", "max_tokens": 4}, started)
        assert text and finish == "length", text  # served on both nodes
        assert took < 30, took
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.llama
def test_a_node_back_is_taken_back_under_continuous_load(
    start_rpc_server: Callable[..., LocalServer], tiny_model: Path, tmp_path: Path
) -> None:
    """Three clients asking back to back (the slots never all free: never an idle moment): once the
    missing server answers, serve takes it back between two requests, and every request is served."""
    first = start_rpc_server()
    later = free_port()
    inventory = write_local_inventory(
        tmp_path / "inv.yml", {"n1": {"rpc_port": first.port}, "n2": {"rpc_port": later}}
    )
    port, log = free_port(), tmp_path / "serve.log"
    argv = [sys.executable, "-m", "orchestrator", "serve", "-i", str(inventory), "-m", str(tiny_model)]
    argv += ["--ctx", "512", "--port", str(port), "--rejoin-interval", "1", "--split"]
    environment = {k: v for k, v in os.environ.items() if k != "RPCFLEET_API_KEY"}
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=environment | {"RPCFLEET_HOME": str(tmp_path)}
        )
    base = f"http://127.0.0.1:{port}"
    done, answers, busy = threading.Event(), [], []
    try:
        assert _wait_status(base, process, log, {"degraded", "ready"}, 90)["status"] == "degraded"

        def ask(tokens: int) -> None:
            while not done.is_set():
                body = {"prompt": "hello", "max_tokens": tokens}
                answers.append(_post(base, "/v1/completions", body, time.monotonic()))

        # Three lengths: three equal requests batched in the engine's slots end together, and a look
        # between their answers and the next requests would see no request at all.
        clients = [threading.Thread(target=ask, args=(tokens,), daemon=True) for tokens in (24, 32, 40)]
        for client in clients:
            client.start()
        while len(answers) < 3:
            time.sleep(0.05)
        while len(busy) < 20:  # the load is continuous: requests admitted at every look
            busy.append(_http(f"{base}/health")[1]["queue"]["admitted"])
            time.sleep(0.05)
        # Nearly every look finds requests admitted (a look can fall between one client's answer and its
        # next request on a busy machine): the rejoin below must happen under that load.
        assert sum(1 for admitted in busy if admitted >= 1) >= 15, busy
        start_rpc_server(port=later)
        health = _wait_status(base, process, log, {"ready"}, 30)
        assert health["plan"]["endpoints"] == [first.endpoint, f"127.0.0.1:{later}"], health
        assert health["last_rejoin"]["back"] == [f"127.0.0.1:{later}"] and health["reloads"] == 0, health
        settled = len(answers)
        while len(answers) < max(10, settled + 3):  # and more are served on both nodes
            time.sleep(0.05)
        done.set()
        for client in clients:
            client.join(60)
        assert len(answers) >= 10 and all(text and finish == "length" for text, finish, _ in answers), answers
    finally:
        done.set()
        process.send_signal(signal.SIGINT)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.llama
def test_gemma_answers_a_chat_with_a_sensible_message_in_the_architectures_template(
    start_rpc_server: Callable[..., LocalServer], gemma_model: Path, tmp_path: Path
) -> None:
    """The Gemma 3 270M of PyPI has no chat template in its GGUF: serve warns at start-up and uses
    gemma3's known one ('gemma'), and the chat answers with the sentence asked for (not an empty
    message, as llama-cpp-python's fallback gave)."""
    server = start_rpc_server()
    inventory = write_local_inventory(tmp_path / "inv.yml", {"n1": {"rpc_port": server.port}})
    port, log = free_port(), tmp_path / "serve.log"
    argv = [sys.executable, "-m", "orchestrator", "serve", "-i", str(inventory), "-m", str(gemma_model)]
    argv += ["--ctx", "2048", "--port", str(port), "--model-name", "gemma"]
    environment = {k: v for k, v in os.environ.items() if k != "RPCFLEET_API_KEY"}
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=environment | {"RPCFLEET_HOME": str(tmp_path)}
        )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_status(base, process, log, {"ready"}, 120)
        said = log.read_text()
        assert "warning: the model has no chat template in its GGUF" in said and "'gemma'" in said, said
        assert _http(f"{base}/health")[1]["engine"]["chat_template"]["source"] == "name:gemma"
        # The Gemma 3 270M of PyPI is the base model (no instruction tuning): one example exchange shows it
        # the turns, which only a right template puts where the model expects them.
        messages = [
            {"role": "user", "content": "What is the capital of Germany?"},
            {"role": "assistant", "content": "The capital of Germany is Berlin."},
            {"role": "user", "content": "What is the capital of France?"},
        ]
        body = {"messages": messages, "max_tokens": 24, "temperature": 0}
        request = urllib.request.Request(
            f"{base}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            chat = json.loads(answer.read())
        message = chat["choices"][0]["message"]
        assert message["role"] == "assistant", chat
        assert message["content"].startswith("The capital of France is Paris."), chat
        assert chat["usage"]["completion_tokens"] > 0 and chat["model"] == "gemma", chat
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _local_host(name: str, port: int, memory_limit: int | None = None) -> Any:
    from orchestrator.inventory.model import Host

    return Host(
        name=name,
        address="127.0.0.1",
        connection="local",
        rpc_host="127.0.0.1",
        rpc_port=port,
        memory_limit=memory_limit,
    )


@pytest.mark.llama
def test_a_plan_that_does_not_fit_is_no_plan_to_load_until_a_spare_joins(
    start_rpc_server: Callable[..., LocalServer], tiny_model: Path
) -> None:
    """serve's round is `workflows.plan_for_fleet` with the one fit policy: on a real server whose usable
    memory (`memory_limit`, 4 MiB beyond the 256 MiB margin) cannot hold the model, the plan is made but
    is no plan to load (`fitting` None); the reason names the binding server in serve's words (`--ctx`,
    no `--force`), the formation waits for the fleet and starts no engine; a spare no formation holds then
    joins and the model fits on both."""
    from orchestrator.core.errors import RpcfleetError
    from orchestrator.serve.formation import Formation
    from orchestrator.serve.pool import SparePool
    from orchestrator.serve.states import ServeConfig
    from orchestrator.workflows.serving import ServeFleet

    small, spare = start_rpc_server(), start_rpc_server()
    options = PlanOptions(n_ctx=512)
    made: list[object] = []

    def engines(plan: Any, dial: Any) -> Any:
        made.append(plan)
        raise RpcfleetError("no engine may start for a plan that does not fit")

    async def rounds() -> tuple[Any, Formation, Any, ServeFleet, SparePool]:
        alone = ServeFleet([_local_host("small", small.port, 260 << 20)], str(tiny_model), options)
        misfit = await alone.plan_round()
        config = ServeConfig(recover_timeout=1.0, retry_interval=0.2, rejoin_interval=0)
        formation = Formation("tiny", "tiny", alone, config, engines)
        await asyncio.wait_for(formation.start(), 60)
        pool = SparePool([_local_host("spare", spare.port)])
        joined = ServeFleet(
            [_local_host("small", small.port, 260 << 20)], str(tiny_model), options, spares=pool
        )
        fitting = (await joined.plan_round()).fitting
        for fleet in (alone, joined):
            assert fleet.shared is not None
            await fleet.shared.close()
        return misfit, formation, fitting, joined, pool

    misfit, formation, fitting, joined, pool = asyncio.run(rounds())
    assert misfit.plan is not None and misfit.fitting is None and misfit.misfit is not None, misfit
    assert misfit.reason.startswith("the model does not fit") and small.endpoint in misfit.reason
    assert misfit.misfit.host == small.endpoint and "--ctx" in (misfit.misfit.hint or "")
    assert "--force" not in (misfit.misfit.hint or "")
    assert formation.state == "failed" and made == [], (formation.state, made)
    assert "waiting for the fleet: the model does not fit" in formation.reason, formation.reason
    assert fitting is not None and fitting.fit.fits and spare.endpoint in fitting.endpoints
    assert joined.endpoints == (small.endpoint, spare.endpoint) and pool.hosts == []


def _raw(
    base: str,
    method: str,
    path: str,
    headers: dict[str, str],
    body: bytes | None = None,
    chunks: list[bytes] | None = None,
) -> tuple[int, Any]:
    """One request as written: any Host header, a body as given or sent in chunks (no Content-Length)."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.putrequest(method, path, skip_host="Host" in headers, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        if chunks is not None:
            conn.putheader("Transfer-Encoding", "chunked")
        elif body and "Content-Length" not in headers:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        if body:
            conn.send(body)
        for chunk in chunks or []:
            conn.send(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        if chunks is not None:
            conn.send(b"0\r\n\r\n")
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read() or b"null")
    finally:
        conn.close()


@pytest.mark.llama
def test_a_keyless_serve_answers_only_loopback_names_and_bounds_every_body(
    local_serve: Callable[..., tuple[subprocess.Popen[bytes], str]],
) -> None:
    """DNS rebinding: a page whose name now resolves to 127.0.0.1 sends its own name as Host; the
    key-less loopback default refuses it. Every route's body is bounded, /login and /admin included."""
    _, base = local_serve()
    port = base.rsplit(":", 1)[1]
    for host in ("attacker.example", f"attacker.example:{port}", "10.0.0.1", ""):
        code, answer = _raw(base, "GET", "/health", {"Host": host})
        assert code == 403 and "not a loopback name" in answer["error"]["message"], (host, answer)
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "127.0.0.2", "[::1]"):
        assert _raw(base, "GET", "/health", {"Host": host})[0] == 200, host
    local = {"Host": f"127.0.0.1:{port}", "Content-Type": "application/json"}
    huge = {**local, "Content-Length": str(17 * 1024 * 1024)}  # refused on the header: nothing is read
    code, answer = _raw(base, "POST", "/v1/completions", huge)
    assert code == 413 and "over 16777216 bytes" in answer["error"]["message"], answer
    code, answer = _raw(base, "POST", "/admin/reload", local, b"{" + b" " * 5000 + b"}")
    assert code == 413 and "/admin/reload" in answer["error"]["message"], answer
    code, answer = _raw(base, "POST", "/login", local, chunks=[b"key=" + b"x" * 3000, b"x" * 3000])
    assert code == 413, answer  # chunked: counted as it comes
    prompt = json.dumps({"prompt": "hi " * 20000, "max_tokens": 1}).encode()  # 60 kB: an API body
    code, answer = _raw(base, "POST", "/v1/completions", local, prompt)
    assert code != 413, answer


@pytest.mark.llama
def test_the_api_key_cannot_restart_the_fleet_and_an_admin_key_is_the_only_admin_one(
    keyed_serve: tuple[subprocess.Popen[bytes], str],
    local_serve: Callable[..., tuple[subprocess.Popen[bytes], str]],
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    _, base = keyed_serve  # the refused restart leaves it as it was: the module's serve
    code, answer = _http(f"{base}/admin/reload", KEY, json.dumps({"rolling_restart": True}).encode())
    assert code == 403 and "needs the admin key" in answer["error"]["message"], answer
    assert _http(f"{base}/health", KEY)[1]["reloads"] == 0  # refused: nothing drained
    code, _ = _raw(base, "GET", "/health", {"Host": "attacker.example"})
    assert code == 200  # with a key the Host is free (a key is what guards it then)
    admin = tmp_path / "admin.key"
    admin.write_text("4dm1n-key\n")
    process, base = local_serve("--admin-key-file", str(admin), env={"RPCFLEET_API_KEY": KEY})
    code, answer = _http(f"{base}/admin/reload", KEY, b"{}")
    assert code == 403 and "may not use the admin routes" in answer["error"]["message"], answer
    assert _http(f"{base}/admin/reload", "wrong", b"{}")[0] == 401
    assert _http(f"{base}/v1/models", "4dm1n-key")[0] == 401  # the admin key is not an API key
    code, answer = _http(f"{base}/admin/reload", "4dm1n-key", b"{}")
    assert code == 202, answer
    assert "4dm1n-key" not in Path(f"/proc/{process.pid}/cmdline").read_text()
    same = tmp_path / "same.key"
    same.write_text(f"{KEY}\n")
    inventory = str(tmp_path / "inv.yml")  # local_serve's
    keys = ["--api-key-file", str(same), "--admin-key-file", str(same)]
    refused = _serve("-i", inventory, "-m", str(tiny_model), *keys, home=tmp_path)
    assert refused.returncode == 2 and "the admin key is the API key" in refused.stderr, refused.stderr


def _wait_code(url: str, key: str, code: int, process: subprocess.Popen[bytes], limit: float = 30) -> None:
    deadline = time.monotonic() + limit
    while _http(url, key)[0] != code:
        assert time.monotonic() < deadline and process.poll() is None, (url, code)
        time.sleep(0.02)


@pytest.mark.llama
def test_per_user_keys_scope_the_routes_and_sighup_rereads_them_without_reloading_the_engine(
    local_serve: Callable[..., tuple[subprocess.Popen[bytes], str]], tiny_model: Path, tmp_path: Path
) -> None:
    """A real serve with --keys: each scope's routes, the name (never the key) in the metrics and the log;
    SIGHUP re-reads the file (a new key works, a removed one is 401, a broken file keeps the keys in
    force) and reloads no engine; 20 rounds of re-reads under requests never refuse a valid key; an
    admin-scoped key reloads the engines."""
    from orchestrator.serve.keys import hashed

    model = tiny_model.stem
    alice, bob, carol = "sk-alice-0123456789abcdef", "sk-bob-0123456789abcdefgh", "sk-carol-0123456789abcd"
    ops, grafana = "sk-ops-0123456789abcdefgh", "sk-grafana-0123456789ab"
    keys = tmp_path / "serve.keys"
    head = f"ops {hashed(ops)} admin,metrics\ngrafana {grafana} metrics\n"

    def write(text: str) -> None:  # renamed over, as an editor does: serve never reads half a file
        new = tmp_path / "serve.keys.new"
        new.write_text(text)
        new.chmod(0o600)
        new.replace(keys)

    write(head + f"alice {alice} inference {model}\n")
    process, base = local_serve("--keys", str(keys), "-v")
    log = tmp_path / f"serve-{base.rsplit(':', 1)[1]}.log"
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    code, answer = _http(f"{base}/v1/completions", alice, body)
    assert code == 200 and answer["usage"]["completion_tokens"] == 2, answer
    assert [m["id"] for m in _http(f"{base}/v1/models", alice)[1]["data"]] == [model]
    code, answer = _http(f"{base}/metrics", alice)
    assert code == 403 and answer["error"]["message"] == "the key 'alice' has no metrics scope: /metrics"
    assert _http(f"{base}/v1/models", grafana)[0] == 403 and _http(f"{base}/v1/models", bob)[0] == 401
    assert _http(f"{base}/admin/reload", grafana, b"{}")[0] == 403
    assert _http(f"{base}/health", grafana)[1]["plan"]["endpoints"]  # the details: metrics scope
    # SIGHUP: bob in, alice out; the engine is not reloaded
    write(head + f"bob {bob} inference\n")
    process.send_signal(signal.SIGHUP)
    _wait_code(f"{base}/v1/models", bob, 200, process)
    assert _http(f"{base}/v1/models", alice)[0] == 401
    write(head + f"bob {bob} inference\ncarol {carol} inferense\n")  # broken: line 4
    process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while "serve_keys_reload_refused" not in log.read_text():
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.02)
    assert f"{keys}:4: carol: unknown scope 'inferense'" in log.read_text()
    assert _http(f"{base}/v1/models", bob)[0] == 200 and _http(f"{base}/v1/models", carol)[0] == 401
    # 20 rounds: carol comes and goes while bob's requests go on, none refused
    codes: list[int] = []
    stop = threading.Event()

    def ask() -> None:
        while not stop.is_set():
            codes.append(_http(f"{base}/v1/models", bob)[0])

    asking = [threading.Thread(target=ask) for _ in range(2)]
    for thread in asking:
        thread.start()
    try:
        for round_ in range(20):
            write(head + f"bob {bob} inference\n" + (f"carol {carol} inference\n" if round_ % 2 == 0 else ""))
            process.send_signal(signal.SIGHUP)
            _wait_code(f"{base}/v1/models", carol, 200 if round_ % 2 == 0 else 401, process)
    finally:
        stop.set()
        for thread in asking:
            thread.join(30)
    assert len(codes) >= 20 and set(codes) == {200}, sorted(set(codes))
    health = _http(f"{base}/health", grafana)[1]
    assert health["reloads"] == 0 and health["status"] == "ready", health  # SIGHUP reloaded no engine
    metrics = _get_text(f"{base}/metrics", grafana)
    assert 'rpcfleet_key_requests_total{key="alice",route="/v1/completions",code="200"} 1' in metrics
    assert 'rpcfleet_key_requests_total{key="alice",route="/metrics",code="403"} 1' in metrics
    code, answer = _http(f"{base}/admin/reload", ops, json.dumps({"rolling_restart": False}).encode())
    assert code == 202, answer
    deadline = time.monotonic() + 60
    while (health := _http(f"{base}/health", ops)[1])["reloads"] != 1 or health["status"] != "ready":
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.1)
    logged = log.read_text()
    assert "serve_key_request key=alice route=/v1/completions code=200" in logged, logged[-3000:]
    for secret in (alice, bob, carol, ops, grafana):
        assert secret not in logged and secret not in metrics, secret
