"""Tier 2: serve's formations on a deployed lab (issue 24): real sshd, real rpc-servers, real llama-server
engines, the real Gemma 3 270M, each node with its own CPU share (`lab up --cpus 0.6`).

One 3-node lab for the module; node 1 runs two servers (ports 50052 and 50053, the second named `b`).
- `--replicas auto` on the 3 nodes (node 1's second server left out): 3 formations, 12 concurrent requests
  all answered, each formation served some;
- kill -9 of one node's server during 6 streams: only that formation's streams end (503 naming it), the
  others finish, the next 6 requests all succeed;
- two models at once on disjoint nodes (a models file): each answers by name, an unknown name is 404;
- node 1's two servers hold two formations;
- a rolling reload of 2 formations never answers 503;
- a node stopped at start, then started: a new formation of it (and its engine counters on /metrics);
- a formation that took the spare takes its own node back without a 503; the spare is free again;
- on-demand models (Gemma and the synthetic one on one node): each loaded by a request in turn, swapped
  out for the other, requests for both at once all answered, unloaded when idle, the node reused.
"""

from __future__ import annotations

import concurrent.futures
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from orchestrator.artifacts.manifest import Artifact
from orchestrator.lab.lifecycle import lab_down, lab_up
from orchestrator.lab.state import Lab
from tests.plugins.lab import require_lab_privileges, session_lab_name
from tests.plugins.servers import free_port

pytestmark = [pytest.mark.lab, pytest.mark.llama]

KEY = "f0rmations"
ADMIN_KEY = "f0rmations-admin"
SERVERS = "[50052, {port: 50053, name: b}]"
READY = 420.0  # seconds for every formation to load: Gemma on 0.6-CPU nodes of a busy machine


@pytest.fixture(scope="module")
def flab(cpu_artifact: Artifact) -> Iterator[Lab]:
    require_lab_privileges()
    name = session_lab_name("fm")
    made = lab_up(
        3, name=name, owner_pid=os.getpid(), cpus=0.6, node_variables={"1": {"rpc_servers": SERVERS}}
    )
    try:
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator", "deploy", "-i", str(made.inventory)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        yield made
    finally:
        lab_down(name)


@dataclass
class Served:
    process: subprocess.Popen[bytes]
    base: str
    log: Path

    def request(self, path: str, body: Any = None, timeout: float = 300) -> tuple[int, Any]:
        key = ADMIN_KEY if path.startswith("/admin/") else KEY
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                raw, status = answer.read(), answer.status
        except urllib.error.HTTPError as err:
            raw, status = err.read(), err.code
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode()

    def health(self) -> dict[str, Any]:
        status, data = self.request("/health", timeout=30)
        assert isinstance(data, dict), (status, data)
        return data

    def complete(self, model: str, tokens: int = 8) -> tuple[int, Any]:
        return self.request("/v1/completions", {"model": model, "prompt": "The sky is", "max_tokens": tokens})

    def stream(self, model: str, tokens: int, started: threading.Event | None = None) -> list[Any]:
        """A streamed completion's events (its error event included); `started` is set at the first text."""
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens, "stream": True}
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        request = urllib.request.Request(self.base + "/v1/completions", json.dumps(body).encode(), headers)
        events: list[Any] = []
        with urllib.request.urlopen(request, timeout=300) as answer:
            for raw in answer:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    if line == "data: [DONE]":
                        events.append("[DONE]")
                    continue
                events.append(json.loads(line[6:]))
                if started is not None and "choices" in events[-1]:
                    started.set()
        return events

    def formations(self) -> dict[str, dict[str, Any]]:
        return {f["name"]: f for f in self.health()["formations"]}

    def wait(self, check: Callable[[dict[str, Any]], bool], limit: float = READY) -> dict[str, Any]:
        deadline = time.monotonic() + limit
        health: dict[str, Any] = {}
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-4000:]
            try:
                health = self.health()
            except (urllib.error.URLError, ConnectionError, AssertionError):
                time.sleep(0.2)
                continue
            if check(health):
                return health
            time.sleep(0.2)
        raise AssertionError(f"not reached in {limit} s: {health}\n{self.log.read_text()[-4000:]}")


def all_ready(health: dict[str, Any]) -> bool:
    return bool(health.get("formations")) and all(f["state"] == "ready" for f in health["formations"])


@pytest.fixture
def serve(flab: Lab, tmp_path: Path) -> Iterator[Callable[..., Served]]:
    started: list[Served] = []

    def start(*argv: str, ready: Callable[[dict[str, Any]], bool] = all_ready) -> Served:
        port = free_port()
        log = tmp_path / f"serve-{port}.log"
        command = [sys.executable, "-m", "orchestrator", "serve", "-i", str(flab.inventory)]
        command += ["--port", str(port), "--ctx", "1024", "--parallel", "2", "--rejoin-interval", "1", *argv]
        env = {
            **os.environ,
            "RPCFLEET_HOME": str(tmp_path / "home"),
            "RPCFLEET_API_KEY": KEY,
            "RPCFLEET_ADMIN_KEY": ADMIN_KEY,
        }
        with log.open("wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        served = Served(process, f"http://127.0.0.1:{port}", log)
        started.append(served)
        served.wait(ready)
        return served

    yield start
    for served in started:
        if served.process.poll() is None:
            served.process.send_signal(signal.SIGINT)
            try:
                served.process.wait(30)
            except subprocess.TimeoutExpired:
                served.process.kill()
                served.process.wait()


def node_name(lab: Lab, index: int) -> str:
    return lab.nodes[index].name


def endpoint(lab: Lab, index: int, port: int = 50052) -> str:
    return f"{lab.nodes[index].address}:{port}"


def test_replicas_auto_makes_one_formation_per_node_and_each_serves_some_of_12_requests(
    flab: Lab, serve: Callable[..., Served], gemma_model: Path
) -> None:
    served = serve("-m", str(gemma_model), "--model-name", "gemma", "-l", f"!{node_name(flab, 0)}/b")
    formations = served.formations()
    assert sorted(f["nodes"][0] for f in formations.values()) == sorted(endpoint(flab, i) for i in range(3))
    assert all(len(f["nodes"]) == 1 and f["model"] == "gemma" for f in formations.values()), formations
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda _: served.complete("gemma"), range(12)))
    assert [status for status, _ in answers] == [200] * 12, answers
    assert all(body["choices"][0]["text"] for _, body in answers)
    routed = {name: f["requests"] for name, f in served.formations().items()}
    assert sum(routed.values()) == 12 and all(n > 0 for n in routed.values()), routed
    status, metrics = served.request("/metrics")  # the exporter's formation label: each formation
    assert status == 200
    for name in formations:
        assert any(
            line.startswith("rpcfleet_formation_state{")
            and f'formation="{name}"' in line
            and 'state="ready"' in line
            and line.endswith(" 1")
            for line in metrics.splitlines()
        ), (name, metrics)


def _server_pid(lab: Lab, index: int) -> int:
    for pid in lab.node_pids(lab.nodes[index].name):
        try:
            if "rpc-server" in psutil.Process(pid).name():
                return pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no rpc-server on {lab.nodes[index].name}")


def test_a_killed_servers_streams_go_on_on_the_other_formations_and_the_next_requests_succeed(
    flab: Lab, serve: Callable[..., Served], gemma_model: Path
) -> None:
    """Three formations, two streams on each; a node's server killed: its formation's two streams go on
    on the others (issue 42: none ends with an error), each of the six whole, with one id."""
    served = serve("-m", str(gemma_model), "--model-name", "gemma", "-l", f"!{node_name(flab, 0)}/b")
    victim = 2
    lost = endpoint(flab, victim)
    starts = [threading.Event() for _ in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(served.stream, "gemma", 64, started) for started in starts]
        for started in starts:
            assert started.wait(240), served.log.read_text()[-3000:]
        busy = {name: f["slots_busy"] for name, f in served.formations().items()}
        assert list(busy.values()) == [2, 2, 2], busy  # every stream in flight, two per formation
        os.kill(_server_pid(flab, victim), signal.SIGKILL)
        results = [s.result(timeout=600) for s in streams]
    assert [events[-1] for events in results] == ["[DONE]"] * 6, [events[-1] for events in results]
    for events in results:
        texts = [e for e in events[:-1] if e.get("choices")]
        assert len({e["id"] for e in texts}) == 1 and len(texts) > 2, events
        assert [c["finish_reason"] for e in texts for c in e["choices"] if c["finish_reason"]] == ["length"]
    status, metrics = served.request("/metrics")
    assert status == 200
    continued = 'rpcfleet_requests_resumed_total{route="/v1/completions",how="continued"}'
    resumed = next(line for line in metrics.splitlines() if line.startswith(continued))
    assert float(resumed.split()[-1]) >= 2, resumed  # the lost formation's two streams
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: served.complete("gemma"), range(6)))
    assert [status for status, _ in answers] == [200] * 6, answers
    # the process supervisor restarts the server: the formation takes its node back
    health = served.wait(all_ready)
    recovered = [f for f in health["formations"] if f["recoveries"]]
    assert [f["nodes"] for f in recovered] == [[lost]] and len(recovered) == 1, health


def test_two_models_on_disjoint_nodes_answer_by_name_and_an_unknown_one_is_404(
    flab: Lab, serve: Callable[..., Served], gemma_model: Path, tiny_model: Path, tmp_path: Path
) -> None:
    models = tmp_path / "models.yml"
    models.write_text(
        f"models:\n"
        f"  - model: {gemma_model}\n    name: gemma\n    hosts: {node_name(flab, 1)}\n"
        f"  - model: {tiny_model}\n    name: tiny\n    groups: [{node_name(flab, 2)}]\n    parallel: 1\n"
    )
    served = serve("--models", str(models))
    formations = served.formations()
    assert {name: f["nodes"] for name, f in formations.items()} == {
        "gemma#0": [endpoint(flab, 1)],
        "tiny#0": [endpoint(flab, 2)],
    }
    status, listed = served.request("/v1/models")
    assert status == 200 and [m["id"] for m in listed["data"]] == ["gemma", "tiny"]
    for model in ("gemma", "tiny"):
        status, body = served.complete(model)
        assert status == 200 and body["choices"][0]["text"] and body["model"], body
    assert {name: f["requests"] for name, f in served.formations().items()} == {"gemma#0": 1, "tiny#0": 1}
    status, body = served.complete("llama-70b")
    assert status == 404 and body["error"]["param"] == "model", body
    assert "'llama-70b' is not served (served: gemma, tiny)" in body["error"]["message"]


def test_a_host_with_two_servers_holds_two_formations(
    flab: Lab, serve: Callable[..., Served], gemma_model: Path
) -> None:
    served = serve("-m", str(gemma_model), "--model-name", "gemma", "-l", node_name(flab, 0))
    nodes = sorted(f["nodes"][0] for f in served.formations().values())
    assert nodes == [endpoint(flab, 0), endpoint(flab, 0, 50053)], served.formations()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: served.complete("gemma"), range(4)))
    assert [status for status, _ in answers] == [200] * 4, answers
    assert all(f["requests"] > 0 for f in served.formations().values()), served.formations()


def test_a_rolling_reload_of_two_formations_never_answers_503(
    flab: Lab, serve: Callable[..., Served], gemma_model: Path
) -> None:
    pattern = f"{node_name(flab, 1)},{node_name(flab, 2)}"
    served = serve("-m", str(gemma_model), "--model-name", "gemma", "-l", pattern)
    assert len(served.formations()) == 2
    codes: list[int] = []
    done = threading.Event()

    def ask() -> None:
        while not done.is_set():
            codes.append(served.complete("gemma", 4)[0])

    askers = [threading.Thread(target=ask) for _ in range(2)]
    for asker in askers:
        asker.start()
    try:
        status, _ = served.request("/admin/reload", {"rolling_restart": True})
        assert status == 202
        served.wait(lambda h: all_ready(h) and all(f["reloads"] == 1 for f in h["formations"]))
    finally:
        done.set()
        for asker in askers:
            asker.join(300)
    assert len(codes) > 4 and set(codes) == {200}, codes


def _rpcfleet(lab: Lab, home: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """`rpcfleet ARGV -i LAB` (stop, start...) as an operator would run it while serve serves."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *argv, "-i", str(lab.inventory)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RPCFLEET_HOME": str(home)},
        check=False,
    )


def _by_name(health: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["name"]: f for f in health.get("formations") or []}


def test_a_node_stopped_at_start_makes_a_new_formation_once_it_is_started(
    flab: Lab, serve: Callable[..., Served], gemma_model: Path, tmp_path: Path
) -> None:
    """--replicas auto on two nodes, one's rpc-server stopped: one formation and a spare; `rpcfleet
    start` on that node: serve's spare watch makes a second formation of it, the router sends it requests
    once it serves, and /metrics has each formation's engine counters."""
    late = node_name(flab, 2)
    stopped = _rpcfleet(flab, tmp_path, "stop", "-l", late, "--force")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    try:
        served = serve("-m", str(gemma_model), "--model-name", "gemma", "-l", f"{node_name(flab, 1)},{late}")
        health = served.health()
        assert {n: f["nodes"] for n, f in _by_name(health).items()} == {"gemma": [endpoint(flab, 1)]}, health
        assert health["spares"] == [endpoint(flab, 2)], health
        started = _rpcfleet(flab, tmp_path, "start", "-l", late)
        assert started.returncode == 0, started.stdout + started.stderr
        health = served.wait(lambda h: len(_by_name(h)) == 2 and all_ready(h))
        assert {n: f["nodes"] for n, f in _by_name(health).items()} == {
            "gemma": [endpoint(flab, 1)],
            "gemma#1": [endpoint(flab, 2)],
        }, health
        assert health["spares"] == [], health
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: served.complete("gemma"), range(4)))
        assert [status for status, _ in answers] == [200] * 4, answers
        routed = {name: f["requests"] for name, f in served.formations().items()}
        assert all(n > 0 for n in routed.values()), routed
        status, metrics = served.request("/metrics")
        assert status == 200
        for name in ("gemma", "gemma#1"):
            assert f'rpcfleet_engine_tokens_predicted_total{{formation="{name}",model="gemma"}}' in metrics, (
                name
            )
    finally:
        _rpcfleet(flab, tmp_path, "start", "-l", late)


def test_a_formation_takes_its_node_back_from_the_spare_it_took_without_a_503(
    flab: Lab, serve: Callable[..., Served], gemma_model: Path, tmp_path: Path
) -> None:
    """--replicas 2 on three nodes: two formations and a spare. One formation's rpc-server is stopped: it
    re-plans on the spare. Its server is started again: it takes its node back while requests keep
    coming (the other formation answers them: none is 503), and the spare is free again."""
    served = serve(
        "-m", str(gemma_model), "--model-name", "gemma", "-l", f"!{node_name(flab, 0)}/b", "--replicas", "2"
    )
    health = served.health()
    spare = health["spares"]
    assert len(spare) == 1 and len(_by_name(health)) == 2, health
    own = _by_name(health)["gemma#1"]["nodes"]
    victim = next(n for n in range(3) if endpoint(flab, n) == own[0])
    try:
        stopped = _rpcfleet(flab, tmp_path, "stop", "-l", node_name(flab, victim), "--force")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr

        def on_the_spare(h: dict[str, Any]) -> bool:
            if _by_name(h)["gemma#1"]["state"] == "ready":  # an idle engine meets its lost node on a request
                served.complete("gemma", 2)
            return (
                _by_name(h)["gemma#1"]["state"] == "degraded"
                and _by_name(h)["gemma#1"]["nodes"] == spare
                and h["spares"] == []
            )

        served.wait(on_the_spare)
        codes: list[int] = []
        done = threading.Event()

        def ask() -> None:
            while not done.is_set():
                codes.append(served.complete("gemma", 4)[0])

        askers = [threading.Thread(target=ask) for _ in range(2)]
        for asker in askers:
            asker.start()
        try:
            started = _rpcfleet(flab, tmp_path, "start", "-l", node_name(flab, victim))
            assert started.returncode == 0, started.stdout + started.stderr
            health = served.wait(
                lambda h: all_ready(h) and _by_name(h)["gemma#1"]["nodes"] == own and h["spares"] == spare
            )
        finally:
            done.set()
            for asker in askers:
                asker.join(300)
        assert len(codes) > 4 and set(codes) == {200}, codes
        assert _by_name(health)["gemma#1"]["rejoins"] == 1, health
    finally:
        _rpcfleet(flab, tmp_path, "start", "-l", node_name(flab, victim))


def test_on_demand_models_load_swap_and_unload_on_a_shared_node_without_a_failed_request(
    flab: Lab, serve: Callable[..., Served], gemma_model: Path, tiny_model: Path, tmp_path: Path
) -> None:
    node = node_name(flab, 2)  # both may use node 3 only: they cannot be loaded together
    models = tmp_path / "models.yml"
    models.write_text(
        f"models:\n"
        f"  - model: {gemma_model}\n    name: gemma\n    hosts: {node}\n    load: on-demand\n"
        f"    idle_unload: 8s\n"
        f"  - model: {tiny_model}\n    name: tiny\n    hosts: {node}\n    load: on-demand\n"
        f"    idle_unload: 8s\n    parallel: 1\n"
    )

    def listed(health: dict[str, Any]) -> bool:
        return health.get("status") == "ready"

    served = serve("--models", str(models), "--queue-timeout", "300", ready=listed)

    def states() -> dict[str, str]:
        status, body = served.request("/v1/models")
        assert status == 200, body
        return {m["id"]: m["state"] for m in body["data"]}

    assert states() == {"gemma": "unloaded", "tiny": "unloaded"}
    assert endpoint(flab, 2) in served.health()["spares"]
    for model in ("gemma", "tiny", "gemma"):  # each in turn: the other one swapped out
        status, body = served.complete(model)
        assert status == 200 and body["choices"][0]["text"], (model, body)
        assert states()[model] == "loaded"
        assert [(f["model"], f["nodes"]) for f in served.health()["formations"]] == [
            (model, [endpoint(flab, 2)])
        ]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # both at once: each waits its turn on the node
        answers = list(pool.map(served.complete, ["tiny", "gemma", "tiny", "gemma"]))
    assert [status for status, _ in answers] == [200] * 4, answers
    on_demand = served.wait(lambda h: not h["formations"], 120)  # idle past 8 s: unloaded
    assert on_demand["on_demand"]["gemma"]["unloads"] >= 2 and on_demand["on_demand"]["tiny"]["unloads"] >= 1
    assert endpoint(flab, 2) in on_demand["spares"] and states() == {"gemma": "unloaded", "tiny": "unloaded"}
    status, body = served.complete("tiny")  # the node reused
    assert status == 200 and body["choices"][0]["text"], body
    log = served.log.read_text()
    assert "Traceback" not in log, log[-4000:]


def test_report_models_predicts_the_nodes_serve_forms_for_each_model(
    flab: Lab, serve: Callable[..., Served], tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """`report --models FILE` (issue 46) before serving, then `serve --models FILE` on the same lab: each
    model is formed on the nodes the report said."""
    from orchestrator.cli import main

    a, b = tiny_model_factory(), tiny_model_factory(n_layer=6)
    models = tmp_path / "models.yml"
    models.write_text(
        f"models:\n  - model: {a}\n    name: a\n    context: 1k\n    parallel: 1\n    replicas: 1\n"
        f"  - model: {b}\n    name: b\n    context: 1k\n    parallel: 2\n    replicas: 1\n"
    )
    out = tmp_path / "report.json"
    argv = ["report", "-i", str(flab.inventory), "--models", str(models), "--format", "json", "-o", str(out)]
    assert main(argv) == 0
    predicted = {f["model"]: sorted(f["endpoints"]) for f in json.loads(out.read_text())["formations"]}
    assert sorted(predicted) == ["a", "b"]
    health = serve("--models", str(models)).health()
    formed = {f["name"].split("#")[0]: sorted(f["nodes"]) for f in health["formations"]}
    assert formed == predicted, (formed, predicted)
