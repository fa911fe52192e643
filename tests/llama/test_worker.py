"""The worker process: real loads over real servers, a node killed mid-generation, a parent killed."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil
import pytest

from orchestrator.core.target import Target
from orchestrator.llama.native.libllama import local_gpus
from orchestrator.llama.observed_placement import build_placement
from orchestrator.llama.worker.load_progress import LoadProgress
from orchestrator.llama.worker.parent import Done, NodeLostError, Token, Worker, WorkerError, list_local_gpus
from orchestrator.llama.worker.text_stream import TextStream
from orchestrator.llama.worker.wire import (
    decode,
    devices_from_json,
    devices_to_json,
    encode,
    placement_from_json,
    placement_to_json,
)
from orchestrator.planning.plan import Plan, PlanDevice, PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan
from tests.plugins.llama import DebugServer, completion_bytes, plan_devices
from tests.plugins.servers import LocalServer
from tests.procs import wait_gone

PROMPT = "hello world"


def _plan(servers: Sequence[LocalServer | str], model: Path, n_ctx: int = 512) -> Plan:
    endpoints = [s if isinstance(s, str) else s.endpoint for s in servers]
    return make_plan(plan_devices(endpoints), profile_model(model), PlanOptions(n_ctx=n_ctx))


def test_messages_and_placements_cross_the_pipe_unchanged(tiny_model: Path) -> None:
    assert decode(encode({"text": "a\nb", "n": 1})) == {"text": "a\nb", "n": 1}
    assert encode({"x": "\n"}).count(b"\n") == 1  # one line per message
    with pytest.raises(ValueError, match="must be an object"):
        decode(b"[1]")
    with pytest.raises(ValueError, match="not JSON"):
        decode(b"{")
    plan = _plan(["127.0.0.1:1", "127.0.0.1:2"], tiny_model)
    lines = ["load_tensors: layer   0 assigned to device RPC0, is_swa = 0"]
    placement = build_placement(plan, ["RPC0", "RPC1"], lines, 0.5)
    assert placement_from_json(json.loads(json.dumps(placement_to_json(placement)))) == placement


def test_local_gpus_cross_the_pipe_unchanged_and_malformed_ones_are_refused() -> None:
    gpus = [PlanDevice(None, 0, "CUDA0", "NVIDIA H200", 141 << 30, 140 << 30, 140 << 30, 128)]
    assert devices_from_json(json.loads(json.dumps(devices_to_json(gpus)))) == gpus
    assert devices_from_json({"devices": []}) == []
    one = devices_to_json(gpus)["devices"][0]
    for bad in (None, [one], {"devices": [{"name": "CUDA0"}]}, {"devices": [{**one, "free": "lots"}]}):
        with pytest.raises(ValueError):
            devices_from_json(bad)
    with pytest.raises(ValueError, match="no endpoint"):  # an RPC device is no local GPU
        devices_from_json({"devices": [{**one, "endpoint": "10.0.0.1:50052"}]})


def test_the_worker_lists_the_gpus_llama_cpp_sees_here() -> None:
    """The child's listing is the in-process one (this test's process may load libllama; rpcfleet's don't)."""
    here = [(d.name, d.description, d.total) for d in local_gpus()]
    with Worker.spawn() as worker:
        assert [(d.name, d.description, d.total) for d in worker.local_gpus()] == here
        assert worker.alive  # listing leaves the worker ready to load
    assert [(d.name, d.description, d.total) for d in list_local_gpus()] == here


def test_the_parent_side_imports_no_llama_cpp() -> None:
    code = "import sys, orchestrator.llama.worker.parent; assert 'llama_cpp' not in sys.modules, 'llama_cpp'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_text_stream_decodes_each_byte_once_as_the_whole_text_decodes() -> None:
    # A character split across tokens waits for its last byte; then it goes at once.
    text = TextStream()
    assert [text.feed(b) for b in (b"a\xe2", b"\x82", b"\xac!")] == ["a", "", "€!"]
    # Tokens of random bytes (a random-weight model): what streams is, at every step, the beginning of
    # the whole text decoded at once (invalid bytes dropped), and at the end all of it.
    rng = random.Random(0)
    alphabet = [bytes([b]) for b in range(256)] + [c.encode() for c in "é€𝄞 ab"]
    for _ in range(200):
        pieces = [b"".join(rng.choices(alphabet, k=rng.randint(0, 3))) for _ in range(rng.randint(0, 40))]
        text = TextStream()
        streamed = ""
        for i, piece in enumerate(pieces):
            streamed += text.feed(piece)
            assert b"".join(pieces[: i + 1]).decode("utf-8", "ignore").startswith(streamed)
        streamed += text.finish()
        assert streamed == text.sent == b"".join(pieces).decode("utf-8", "ignore")
    # After a BOS (an empty prompt) llama-cpp-python drops the text's first space, once.
    text = TextStream(strip_leading_space=True)
    assert [text.feed(b) for b in (b"", b" a", b" b")] == ["", "a", " b"]


def test_the_text_stream_never_sends_a_stop_sequence_nor_what_follows() -> None:
    text = TextStream(["<|end|>", "STOP"])
    out = [text.feed(p.encode()) for p in ("Hel", "lo <", "|e", "nd|> more", "x")]
    assert out == ["Hel", "lo ", "", "", ""] and text.stopped and text.finish() == ""
    assert text.sent == "Hello "
    # Text that only began like a stop sequence goes once it is clear it is not one, or at the end.
    text = TextStream(["<|end|>"])
    assert [text.feed(p) for p in (b"a <|", b"x", b" <|en")] == ["a ", "<|x", " "]
    assert text.finish() == "<|en" and text.sent == "a <|x <|en" and not text.stopped
    # The earliest stop cuts, whichever the order of the list; a chat template's stops come later.
    text = TextStream()
    text.set_stops(["zz", "b"])
    assert text.feed(b"abczz") == "a" and text.stopped


@pytest.mark.llama
def test_the_worker_generates_what_an_in_process_load_generates(
    debug_rpc_servers: list[DebugServer], tiny_model: Path
) -> None:
    from orchestrator.llama.native.loader import load_llama

    plan = _plan(debug_rpc_servers[:2], tiny_model)
    llm = load_llama(plan, tiny_model, seed=0)
    try:
        expected = llm(PROMPT, max_tokens=12, temperature=0.0, seed=0)["choices"][0]["text"]
    finally:
        llm.close()
    with Worker.start(plan, tiny_model, {"seed": 0}) as worker:
        assert worker.placement is not None and worker.placement.layers_as_planned
        events = list(worker.complete(PROMPT, max_tokens=12, temperature=0.0, seed=0))
        done = events[-1]
        assert isinstance(done, Done) and all(isinstance(e, Token) for e in events[:-1])
        assert done.text == expected == "".join(e.text for e in events[:-1])
        assert (done.completion_tokens, done.finish_reason) == (12, "length")
        assert done.prompt_tokens > 0 and done.tokens_per_second > 0
        # -n counts what was generated, also on a second request whose prompt is cached.
        again = list(worker.complete(PROMPT, max_tokens=4, temperature=0.0, seed=0, stream=False))
        assert len(again) == 1 and isinstance(again[0], Done) and again[0].completion_tokens == 4
        assert again[0].text == expected[: len(again[0].text)]
        chat = list(worker.chat([{"role": "user", "content": "hi"}], max_tokens=3))[-1]
        assert isinstance(chat, Done) and chat.completion_tokens == 3
        # A request llama.cpp refuses is an error for that request only: the worker keeps serving.
        with pytest.raises(WorkerError, match="exceed context window"):
            list(worker.complete("word " * 600, max_tokens=4))
        # Stopping the iteration early cancels the generation; the next request starts clean.
        stream = worker.complete(PROMPT, max_tokens=400)
        next(stream)
        with pytest.raises(WorkerError, match="one at a time"):
            worker.complete(PROMPT)
        stream.close()
        final = list(worker.complete(PROMPT, max_tokens=12, temperature=0.0, seed=0))[-1]
        assert isinstance(final, Done) and final.text == expected
        pid = worker.pid
    wait_gone(pid)
    # The servers are free again: an in-process load gets them at once.
    load_llama(plan, tiny_model).close()


LONG = 2000  # tokens: llama-cpp-python's own streaming took hours on these (cubic in held-back tokens)
BOUND = 150.0  # seconds for one request of LONG tokens (5-25 s here; before the fix, hours)


@pytest.mark.llama
def test_a_random_model_streams_thousands_of_tokens_in_bounded_time_and_the_whole_text(
    debug_rpc_servers: list[DebugServer], tiny_model: Path
) -> None:
    from orchestrator.llama.native.loader import load_llama

    plan = _plan(debug_rpc_servers[:2], tiny_model, n_ctx=4096)
    # Greedy, then sampled with a seed; each streamed, then not. The same requests in-process give the
    # expected bytes: a request after another reuses its prompt's cache (other batches: other floats), so
    # only the same sequence of requests samples the same tokens.
    runs = [
        (n, temperature, seed, stream)
        for n, temperature, seed in ((LONG, 0.0, 0), (300, 1.0, 7))
        for stream in (True, False)
    ]
    llm = load_llama(plan, tiny_model, seed=0)
    try:
        expected = [completion_bytes(llm, PROMPT, n, temperature, seed) for n, temperature, seed, _ in runs]
    finally:
        llm.close()
    for raw in expected:  # the random model's bytes are far from UTF-8: the case that was cubic
        assert len(raw.decode("utf-8", "ignore").encode()) < 0.9 * len(raw)
    texts = []
    with Worker.start(plan, tiny_model, {"seed": 0}) as worker:
        for (n, temperature, seed, stream), raw in zip(runs, expected, strict=True):
            # Past the bound the worker is killed: the request ends with an error at once.
            killer = threading.Timer(BOUND, worker.kill)
            killer.start()
            started = time.monotonic()
            try:
                events = list(worker.complete(PROMPT, n, temperature, seed, stream=stream))
            except WorkerError as exc:
                raise AssertionError(f"{n} tokens took over {BOUND:g} s ({exc})") from None
            finally:
                killer.cancel()
            took = time.monotonic() - started
            done, tokens = events[-1], [e.text for e in events[:-1] if isinstance(e, Token)]
            assert isinstance(done, Done)
            assert (done.completion_tokens, done.finish_reason) == (n, "length")  # not one token more
            # The text of the completion's tokens decoded at once (llama-cpp-python's non-streamed
            # text), streamed as it came.
            assert done.text == raw.decode("utf-8", "ignore"), (n, temperature, stream)
            if stream:
                assert "".join(tokens) == done.text and len(tokens) > n / 100
                assert done.first_token_seconds < took / 4
            else:
                assert tokens == []
            texts.append(done.text)
            print(f"{n} tokens, temperature {temperature}, stream {stream}: {took:.1f} s")
    # The same request streamed or not, from the same cache state (both follow a request with the same
    # prompt): the same text.
    assert texts[2] == texts[3]


@pytest.mark.llama
def test_a_refused_load_keeps_its_error_type(tiny_model: Path) -> None:
    from orchestrator.llama.errors import EndpointUnreachableError
    from tests.plugins.servers import free_port

    plan = _plan([f"127.0.0.1:{free_port()}"], tiny_model)
    with pytest.raises(EndpointUnreachableError, match="refused before loading"):
        Worker.start(plan, tiny_model)


def _run_cli(model: Path, servers: list[LocalServer], tmp_path: Path, *extra: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "orchestrator", "run", "-m", str(model), "-p", PROMPT, "--ctx", "4096"]
    for server in servers:
        argv += ["--endpoint", server.endpoint]
    env = {**os.environ, "RPCFLEET_HOME": str(tmp_path / "home"), "COLUMNS": "200"}
    return subprocess.Popen(
        [*argv, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path
    )


def _wait_for_output(process: subprocess.Popen[bytes], limit: float = 60.0) -> None:
    """Block until the run prints its first generated text (the model is loaded and generating)."""
    assert process.stdout is not None
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process.stdout.read1(1):  # type: ignore[attr-defined]
            return
        if process.poll() is not None:
            raise AssertionError(f"run exited {process.returncode}: {process.stderr.read()!r}")  # type: ignore[union-attr]
    raise AssertionError("no output")


@pytest.mark.llama
@pytest.mark.parametrize("victim", [0, 1])
def test_a_node_killed_mid_generation_is_named_and_run_exits_1(
    start_rpc_server: Callable[..., LocalServer], tiny_model: Path, tmp_path: Path, victim: int
) -> None:
    servers = [start_rpc_server(), start_rpc_server()]
    run = _run_cli(tiny_model, servers, tmp_path, "-n", "4000")
    _wait_for_output(run)
    servers[victim].process.kill()
    killed = time.monotonic()
    _, err_bytes = run.communicate(timeout=30)
    took = time.monotonic() - killed
    err = err_bytes.decode()
    assert run.returncode == 1, err  # not 134 (SIGABRT), not a signal
    # refused once the killed server's socket is gone; closed when the probe's connect met its listening
    # socket still being torn down (both: nothing serves there)
    named = re.escape(servers[victim].endpoint)
    assert re.search(rf"lost {named} \((refused|closed)\) while generating", err), err
    assert servers[1 - victim].endpoint not in err.split("hint")[0]
    assert "Remote RPC server crashed" in err  # llama.cpp's own word, from the worker's log
    assert "Traceback" not in err
    assert took < 20, took  # at once (refused, not the link timeout: see above); headroom for load
    log = next((tmp_path / "home" / "logs").glob("worker-*.log"))
    assert str(log) in err and "ggml-rpc.cpp" in log.read_text()
    assert not list(tmp_path.glob("core*"))  # no core dump
    assert servers[1 - victim].alive()


@pytest.mark.llama
def test_the_worker_dies_with_its_parent(
    start_rpc_server: Callable[..., LocalServer], tiny_model: Path, tmp_path: Path
) -> None:
    servers = [start_rpc_server(), start_rpc_server()]
    run = _run_cli(tiny_model, servers, tmp_path, "-n", "4000")
    _wait_for_output(run)
    children = psutil.Process(run.pid).children()
    assert len(children) == 1 and "orchestrator.llama.worker.child" in children[0].cmdline()
    os.kill(run.pid, signal.SIGKILL)
    run.wait(10)
    wait_gone(children[0].pid, 5.0)
    # Its connections are closed: both servers take a new client.
    plan = _plan(servers, tiny_model)
    with Worker.start(plan, tiny_model) as worker:
        assert isinstance(list(worker.complete(PROMPT, max_tokens=2))[-1], Done)


@pytest.mark.llama
def test_a_lost_node_during_a_request_fails_every_later_call(
    start_rpc_server: Callable[..., LocalServer], tiny_model: Path
) -> None:
    servers = [start_rpc_server(), start_rpc_server()]
    worker = Worker.start(_plan(servers, tiny_model), tiny_model)
    try:
        servers[0].process.kill()
        servers[0].process.wait()
        with pytest.raises(NodeLostError) as info:
            list(worker.complete(PROMPT, max_tokens=8))
        assert info.value.endpoints == (servers[0].endpoint,)
        assert info.value.log_path is not None and info.value.log_path.exists()
        assert not worker.alive
        with pytest.raises(NodeLostError):
            list(worker.complete(PROMPT))
    finally:
        worker.close()


@pytest.mark.llama
def test_a_load_through_targets_names_the_plans_endpoints_in_placement_progress_and_errors(
    start_rpc_server: Callable[..., LocalServer], tiny_model: Path
) -> None:
    from orchestrator.llama.errors import EndpointUnreachableError
    from tests.plugins.servers import free_port

    # The plan names endpoints this machine cannot dial; the targets dial local servers instead, as
    # `rpc_transport: ssh` dials forwards. Nothing renames anything afterwards.
    servers = [start_rpc_server(), start_rpc_server()]
    names = ["node-a.invalid:50052", "node-b.invalid:50052"]
    targets = {name: Target(name, s.endpoint) for name, s in zip(names, servers, strict=True)}
    seen: list[LoadProgress] = []
    worker = Worker.spawn()
    try:
        plan = _plan(names, tiny_model)
        placement = worker.load(plan, tiny_model, targets=targets, on_progress=seen.append)
        assert {d.endpoint for d in placement.devices if d.endpoint} == set(names)
        assert [d.label for d in placement.devices] == [d.label for d in plan.devices]
        assert seen and [n.endpoint for n in seen[-1].nodes] == names and seen[-1].fraction == 1.0
        assert all(n.sent > 0 for n in seen[-1].nodes)  # each forward's bytes under its endpoint
        servers[0].process.kill()
        servers[0].process.wait()
        with pytest.raises(NodeLostError) as info:
            list(worker.complete(PROMPT, max_tokens=8))
        assert info.value.endpoints == (names[0],) and f"lost {names[0]} (refused)" in info.value.message
    finally:
        worker.close()
    gone = Target(names[1], f"127.0.0.1:{free_port()}")
    refused = Worker.spawn()
    try:
        with pytest.raises(EndpointUnreachableError) as why:
            refused.load(_plan([names[1]], tiny_model), tiny_model, targets={names[1]: gone})
    finally:
        refused.close()
    assert why.value.host == names[1] and why.value.target == gone
    assert str(why.value).startswith(f"{names[1]} (via {gone.dial}): refused before loading: refused")
