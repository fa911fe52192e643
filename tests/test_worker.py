"""The worker process: real loads over real servers, a node killed mid-generation, a parent killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil
import pytest

from orchestrator.llama.placement import build_placement
from orchestrator.llama.worker import Done, NodeLostError, Token, Worker, WorkerError
from orchestrator.llama.worker_wire import decode, encode, placement_from_json, placement_to_json
from orchestrator.planning.plan import Plan, PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan
from tests.plugins.llama import DebugServer, plan_devices
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


def test_the_parent_side_imports_no_llama_cpp() -> None:
    code = "import sys, orchestrator.llama.worker; assert 'llama_cpp' not in sys.modules, 'llama_cpp'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.llama
def test_the_worker_generates_what_an_in_process_load_generates(
    debug_rpc_servers: list[DebugServer], tiny_model: Path
) -> None:
    from orchestrator.llama.loader import load_llama

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
    assert f"lost {servers[victim].endpoint} (refused) while generating" in err
    assert servers[1 - victim].endpoint not in err.split("hint")[0]
    assert "Remote RPC server crashed" in err  # llama.cpp's own word, from the worker's log
    assert "Traceback" not in err
    assert took < 10, took
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
    assert len(children) == 1 and "orchestrator.llama.worker_child" in children[0].cmdline()
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
