"""Tier 1 for serve's engine layer: the formation's state machine (slots, queue, a lost node, recovery,
rejoin, reload, a stalled engine) driven by a fake engine and a fake fleet (tests/plugins/serve_rig.py) in
milliseconds (the real llama-server and real nodes are in test_serve*.py), and the pure parts:
llama-server's arguments from a plan, the chat template's choice, the engine's metrics passed through."""

from __future__ import annotations

import contextlib
import functools
import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from anyio.from_thread import start_blocking_portal

from orchestrator.cli import _planning, parse_args
from orchestrator.core.errors import UsageError
from orchestrator.core.target import Target
from orchestrator.planning.plan import Plan, PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan
from orchestrator.serve.engine import EngineOptions, engine_args, lost_message
from orchestrator.serve.formation import Formation, FormationHooks
from orchestrator.serve.metrics import EngineScrape, engine_metrics
from orchestrator.serve.states import Failure, Running, ServeConfig
from orchestrator.serve.templates import BUILTIN_TEMPLATES, resolve_chat_template
from tests.plugins.llama import plan_devices
from tests.plugins.serve_rig import ENDPOINTS, FakeEngine, FakeFleet, HttpEngine, Rig


@pytest.fixture
def rig(tiny_model: Path) -> Iterator[Callable[..., Rig]]:
    made: list[Rig] = []
    loops = contextlib.ExitStack()

    def make(hooks: FormationHooks | None = None, **config: Any) -> Rig:
        fleet = FakeFleet(tiny_model)
        engines: list[FakeEngine] = []

        def factory(plan: Plan, targets: Mapping[str, Target]) -> FakeEngine:
            engines.append(FakeEngine(plan, fleet, len(engines)))
            return engines[-1]

        options = {"retry_interval": 0.005, "rejoin_interval": 0.0, "diagnose_timeout": 5.0, **config}
        formation = Formation("fake#0", "fake", fleet, ServeConfig(**options), factory, hooks=hooks)
        made_rig = Rig(formation, fleet, engines, loops.enter_context(start_blocking_portal()))
        made.append(made_rig)
        made_rig.call(formation.start)
        made_rig.wait_state({"ready"})
        return made_rig

    with loops:
        yield make
        for made_rig in made:
            made_rig.call(made_rig.formation.stop)


def _acquire(r: Rig) -> tuple[Any, Running | Failure]:
    ticket = r.call(r.formation.admit)
    return ticket, r.call(r.formation.acquire, ticket)


def test_the_slots_serve_parallel_requests_and_the_queue_waits_then_429(rig: Callable[..., Rig]) -> None:
    r = rig(parallel=2, queue_size=1, queue_timeout=5.0)
    formation = r.formation
    served = [_acquire(r) for _ in range(2)]
    assert all(isinstance(got, Running) for _, got in served)
    waiting = r.call(formation.admit)  # the queue's one place
    with pytest.raises(Exception, match="the queue is full") as refused:
        r.call(formation.admit)
    assert getattr(refused.value, "status", None) == 429
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(r.call(formation.acquire, waiting)))
    thread.start()
    time.sleep(0.05)
    assert not got  # both slots are held
    r.call(formation.release, served[0][0])
    thread.join(5)
    assert isinstance(got[0], Running) and got[0] is served[1][1]
    assert formation.health()["queue"] == {"admitted": 2, "served": 2, "parallel": 2, "size": 1}


def test_a_request_waits_at_most_the_queue_timeout_for_a_slot(rig: Callable[..., Rig]) -> None:
    r = rig(parallel=1, queue_size=1, queue_timeout=0.1)
    _acquire(r)
    started = time.monotonic()
    _, got = _acquire(r)
    assert isinstance(got, Failure) and got.status == 503 and "waited 0.1 s for a slot" in got.message
    assert 0.05 < time.monotonic() - started < 10  # its 0.1 s, not forever (headroom for a busy machine)


def test_a_lost_node_ends_every_request_in_flight_with_a_503_naming_it_and_serving_resumes(
    rig: Callable[..., Rig],
) -> None:
    """20 rounds: four requests hold slots and two wait when the engine dies with a node; each gets the
    503 naming the node (or, waiting, the 503 of recovering); the engine restarts on the nodes that
    answer; the node's return is a rejoin once the watch sees it (here: off)."""
    r = rig(parallel=4, queue_size=2)
    formation = r.formation
    for round_ in range(20):
        victim = ENDPOINTS[round_ % 3]
        r.fleet.answering = set(ENDPOINTS)
        if formation.plan is None or len(formation.plan.endpoints) != 3:
            r.call(formation.reload)
            r.wait_state({"ready"})
        before = r.engine
        held = [_acquire(r) for _ in range(4)]
        assert all(isinstance(got, Running) for _, got in held), (round_, held, formation.state)
        waiting = [r.call(formation.admit) for _ in range(2)]
        results: list[Any] = []
        threads = [
            threading.Thread(target=lambda t=t, out=results: out.append(r.call(formation.acquire, t)))
            for t in waiting
        ]
        for thread in threads:
            thread.start()
        r.fleet.answering = set(ENDPOINTS) - {victim}
        before.die()
        failures = [r.call(formation.failure_of, got, "reset by peer") for _, got in held]
        for failure in failures:
            assert failure.status == 503 and failure.lost == (victim,), (round_, failure)
            assert f"lost {victim} (refused) while serving" in failure.message
        for thread in threads:  # each gets a 503 (recovering) or, once recovered, a slot of the new engine
            thread.join(5)
        assert len(results) == 2 and all(isinstance(x, Failure) or x.engine is not before for x in results)
        for ticket, _ in held:
            r.call(formation.release, ticket)
        for ticket in waiting:
            r.call(formation.release, ticket)
        r.wait_state({"degraded"})
        assert formation.plan is not None and victim not in formation.plan.endpoints, round_
        assert r.engine is not before and formation.lost == (victim,)
        assert formation.health()["queue"]["admitted"] == 0
        assert formation.metrics.recoveries[-1].lost == (victim,)
    assert len(formation.metrics.recoveries) == 20


def test_a_stalled_engine_is_killed_and_diagnosed(rig: Callable[..., Rig]) -> None:
    r = rig()
    ticket, got = _acquire(r)
    assert isinstance(got, Running)
    r.fleet.answering = {ENDPOINTS[0], ENDPOINTS[1]}  # a cut link: the third does not answer
    stuck = r.engine
    r.call(r.formation.stalled, got)
    failure = r.call(r.formation.failure_of, got, "the engine answered nothing for 120 s")
    assert stuck.killed and failure.lost == (ENDPOINTS[2],) and "signal SIGKILL" in failure.message
    r.call(r.formation.release, ticket)
    r.wait_state({"degraded"})


def test_the_engines_death_with_every_node_answering_is_a_server_error(rig: Callable[..., Rig]) -> None:
    r = rig()
    ticket, got = _acquire(r)
    r.engine.die("exit status 1")
    failure = r.call(r.formation.failure_of, got, "closed")
    assert failure.status == 503 and failure.kind == "server_error" and failure.lost == ()
    assert "every node still answers" in failure.message
    r.call(r.formation.release, ticket)
    r.wait_state({"ready"})  # restarted on all three


def test_a_returned_node_is_taken_back_once_the_requests_being_served_end(rig: Callable[..., Rig]) -> None:
    r = rig(parallel=2, rejoin_interval=0.01)
    formation = r.formation
    r.fleet.answering = set(ENDPOINTS[:2])
    r.engine.die()
    r.wait_state({"degraded"})
    ticket, got = _acquire(r)
    assert isinstance(got, Running)
    r.fleet.answering = set(ENDPOINTS)  # back
    deadline = time.monotonic() + 5
    while (formation.rejoin.under_way or {}).get("phase") != "waiting for the engine":
        assert time.monotonic() < deadline
        time.sleep(0.001)
    queued = r.call(formation.admit)
    later: list[Any] = []
    thread = threading.Thread(target=lambda: later.append(r.call(formation.acquire, queued)))
    thread.start()
    time.sleep(0.05)
    assert not later and formation.state == "degraded"  # held: the new request waits for the new engine
    r.call(formation.release, ticket)  # the request being served ends: the rejoin goes on
    thread.join(5)
    assert isinstance(later[0], Running) and later[0].plan.endpoints == ENDPOINTS
    assert formation.state == "ready" and formation.metrics.rejoins[-1].back == (ENDPOINTS[2],)
    r.call(formation.release, queued)


def test_a_reload_drains_restarts_the_fleet_and_starts_a_new_engine(rig: Callable[..., Rig]) -> None:
    r = rig(parallel=2)
    formation = r.formation
    ticket, _ = _acquire(r)
    first = r.engine
    reload = r.portal.start_task_soon(functools.partial(formation.reload, rolling_restart=True))
    r.wait_state({"draining"})
    with pytest.raises(Exception, match="draining") as refused:
        r.call(formation.admit)
    assert getattr(refused.value, "status", None) == 503
    time.sleep(0.05)
    assert not first.ended.is_set()  # the request in flight is served to its end
    r.call(formation.release, ticket)
    reload.result(5)
    r.wait_state({"ready"})
    assert first.ended.is_set() and r.engine is not first and r.fleet.restarts == 1
    assert formation.metrics.reloads == 1 and not formation.metrics.recoveries  # on purpose: no recovery


def test_a_drain_past_its_timeout_stops_the_engine_under_the_request_and_the_reload_goes_on(
    rig: Callable[..., Rig],
) -> None:
    """A request that outlives `drain_timeout` does not hold the reload: the engine is stopped under it
    (its answer: 503 "the engine was stopped", not a lost node), the new engine serves, no recovery."""
    r = rig(parallel=2, drain_timeout=0.05)
    formation = r.formation
    ticket, got = _acquire(r)
    assert isinstance(got, Running)
    first = r.engine
    reload = r.portal.start_task_soon(formation.reload)
    reload.result(5)  # the reload ended although the request still holds its slot
    r.wait_state({"ready"})
    assert first.ended.is_set() and r.engine is not first
    failure = r.call(formation.failure_of, got, "reset by peer")
    assert (failure.status, failure.message) == (503, "the engine was stopped"), failure
    r.call(formation.release, ticket)
    assert formation.health()["queue"]["admitted"] == 0
    assert formation.metrics.reloads == 1 and not formation.metrics.recoveries
    again, served = _acquire(r)
    assert isinstance(served, Running) and served.engine is r.engine
    r.call(formation.release, again)


def test_a_recovery_that_outlasts_its_timeout_gives_up_failed_and_says_so(rig: Callable[..., Rig]) -> None:
    """No node answers for `recover_timeout`: the formation is `failed` (serve exits through `on_failed`),
    a request is refused with the reason, and a node coming back afterwards changes nothing."""
    told: list[str] = []
    r = rig(FormationHooks(on_failed=lambda formation: told.append(formation.state)), recover_timeout=0.05)
    formation = r.formation
    r.fleet.answering = set()
    r.engine.die()
    r.wait_state({"failed"})
    assert told == ["failed"] and r.fleet.rounds >= 2  # it retried before giving up
    assert formation.reason.startswith("gave up after 0.05 s: waiting for the fleet: no node answers")
    with pytest.raises(Exception, match="the model is failed: gave up") as refused:
        r.call(formation.admit)
    assert getattr(refused.value, "status", None) == 503
    rounds = r.fleet.rounds
    r.fleet.answering = set(ENDPOINTS)
    time.sleep(0.05)
    assert formation.state == "failed" and r.fleet.rounds == rounds  # given up: no more rounds


def test_a_load_that_fails_is_retried_until_the_fleet_holds_the_model(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.fleet.answering = set()
    r.engine.die()
    r.wait_state({"recovering"})
    time.sleep(0.05)
    assert "no node answers" in r.formation.reason
    r.fleet.answering = set(ENDPOINTS)
    r.wait_state({"ready"})


# -- the pure parts


def test_llama_server_gets_the_plans_devices_split_context_slots_and_template(tiny_model: Path) -> None:
    plan = make_plan(
        plan_devices(list(ENDPOINTS)),
        profile_model(tiny_model),
        PlanOptions(n_ctx=2048, type_k="q8_0", type_v="q8_0", flash_attn=True, parallel=6),
    )
    options = EngineOptions(Path("/x/llama-server"), str(tiny_model), "tiny", parallel=6)
    args = engine_args(plan, {ENDPOINTS[1]: Target(ENDPOINTS[1], "127.0.0.1:41001")}, options, 8181)
    joined = " ".join(args)
    assert f"--rpc {ENDPOINTS[0]},127.0.0.1:41001,{ENDPOINTS[2]}" in joined  # the dialed forward
    assert "--device RPC0,RPC1,RPC2" in joined and "--split-mode layer" in joined
    assert f"--tensor-split {','.join(str(int(x)) for x in plan.tensor_split)}" in joined
    assert f"-ngl {plan.n_gpu_layers}" in joined and f"-c {plan.n_ctx}" in joined
    assert "-ctk q8_0 -ctv q8_0 -fa on --fit off" in joined and "-b 512" in joined
    assert "--parallel 6" in joined and "--kv-unified" not in joined
    assert "--host 127.0.0.1 --port 8181" in joined and "--alias tiny" in joined and "--metrics" in joined
    assert args[-1] == "--jinja"


@pytest.mark.parametrize(
    ("flags", "planned", "passed"),
    [
        ([], True, "on"),
        (["-fa", "auto"], True, "on"),
        (["--flash-attn"], True, "on"),
        (["-fa", "off"], False, "off"),
    ],
    ids=["default", "auto", "bare", "off"],
)
def test_serve_follows_llama_servers_flash_attention_default_and_runs_what_it_plans(
    tiny_model: Path, flags: list[str], planned: bool, passed: str
) -> None:
    """serve, plan, run and report take llama.cpp's `-fa on|off|auto`, default auto as llama-server: the
    plan assumes flash attention on and llama-server is given `-fa on`. serve gave `-fa off` (the old
    default): measured by bench/serve.py at 0.31x llama-server by hand at 8 clients."""
    for command in (["serve"], ["plan"], ["run", "-p", "hi"], ["report"]):
        args = parse_args([*command, "-m", str(tiny_model), *flags])
        assert args.flash_attn == ("on" if flags == ["--flash-attn"] else flags[-1] if flags else "auto")
        assert _planning.planning_args(args, n_ctx=4096).options.flash_attn is planned
    opts = _planning.planning_args(parse_args(["serve", "-m", str(tiny_model), *flags])).options
    plan = make_plan(plan_devices(list(ENDPOINTS)), profile_model(tiny_model), opts)
    args = engine_args(plan, {}, EngineOptions(Path("/x/llama-server"), str(tiny_model), "tiny"), 8181)
    assert args[args.index("-fa") + 1] == passed and args.count("-fa") == 1


def test_the_chat_template_is_the_gguf_s_an_override_or_the_architecture_s_with_a_warning(
    tmp_path: Path,
) -> None:
    assert resolve_chat_template("llama", True, None).args == ("--jinja",)
    gemma = resolve_chat_template("gemma3", False, None)
    assert gemma.args == ("--no-jinja", "--chat-template", "gemma") and gemma.warning
    assert "gemma3" in gemma.warning and "'gemma'" in gemma.warning
    unknown = resolve_chat_template("llama", False, None)
    assert unknown.args[-1] == "chatml" and "may not be the model's format" in (unknown.warning or "")
    named = resolve_chat_template("gemma3", True, "llama3")
    assert named.args == ("--no-jinja", "--chat-template", "llama3") and named.warning is None
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{{ messages }}")
    assert resolve_chat_template("gemma3", False, str(jinja)).args == (
        "--jinja",
        "--chat-template-file",
        str(jinja),
    )
    with pytest.raises(UsageError, match="neither a file nor one of llama-server's template names"):
        resolve_chat_template("gemma3", False, "gemmma")
    assert "gemma" in BUILTIN_TEMPLATES and "chatml" in BUILTIN_TEMPLATES


def test_the_engines_counters_pass_through_renamed_with_the_slots_busy() -> None:
    text = (
        "# HELP llamacpp:tokens_predicted_total Number of generation tokens processed\n"
        "# TYPE llamacpp:tokens_predicted_total counter\n"
        "llamacpp:tokens_predicted_total 96\n"
        "# TYPE llamacpp:requests_processing gauge\n"
        "llamacpp:requests_processing 3\n"
    )
    out = engine_metrics([EngineScrape("m", "m", text, served=4)], parallel=4, admitted=6)
    assert (
        'rpcfleet_engine_tokens_predicted_total{formation="m",model="m"} 96' in out and "llamacpp:" not in out
    )
    assert "rpcfleet_slots_busy 3\n" in out and "rpcfleet_slots 4\n" in out
    assert "rpcfleet_requests_admitted 6" in out
    assert "rpcfleet_slots_busy 4\n" in engine_metrics([EngineScrape("m", "m", "", 4)], 4, 4)  # no engine


def test_the_lost_message_names_each_endpoint_and_how_the_engine_ended() -> None:
    lost = ((ENDPOINTS[1], "refused"), (ENDPOINTS[2], "timeout"))
    message = lost_message(lost, "serving", "signal SIGABRT")
    assert message == (
        f"lost {ENDPOINTS[1]} (refused), {ENDPOINTS[2]} (timeout) while serving: llama-server ended "
        "(signal SIGABRT)"
    )


# -- serve's front over a fake engine that speaks HTTP (the proxy: streams, errors, metrics)


@pytest.fixture
def front(tiny_model: Path) -> Iterator[Callable[..., tuple[Any, Rig]]]:
    from fastapi.testclient import TestClient

    from orchestrator.serve.app import create_app

    made: list[tuple[Any, Rig]] = []

    def make(**config: Any) -> tuple[Any, Rig]:
        fleet = FakeFleet(tiny_model)
        engines: list[FakeEngine] = []

        def factory(plan: Plan, targets: Mapping[str, Target]) -> HttpEngine:
            engines.append(HttpEngine(plan, fleet, len(engines)))
            return engines[-1]  # type: ignore[return-value]

        options = {"retry_interval": 0.005, "rejoin_interval": 0.0, **config}
        formation = Formation("fake#0", "fake", fleet, ServeConfig(**options), factory)
        client = TestClient(create_app(formation, api_key="k"))
        client.__enter__()  # one loop for the routes and the formation, as in serve
        client.headers["Authorization"] = "Bearer k"
        rig_ = Rig(formation, fleet, engines, client.portal)
        made.append((client, rig_))
        rig_.call(formation.start)
        rig_.wait_state({"ready"})
        return client, rig_

    yield make
    for client, rig_ in made:
        rig_.call(rig_.formation.stop)
        client.__exit__(None, None, None)


def _events(lines: Iterator[str]) -> list[Any]:
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]


def test_a_stream_passes_through_and_its_tokens_count(front: Callable[..., tuple[Any, Rig]]) -> None:
    client, r = front()
    with client.stream(
        "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stream": True}
    ) as s:
        assert s.status_code == 200
        events = _events(s.iter_lines())
    assert [e["choices"][0]["text"] for e in events] == ["t0 ", "t1 ", "t2 ", "t3 ", "t4 ", ""]
    sent = r.engine.bodies[-1]  # as the client wrote it, with serve's seed
    assert sent["prompt"] == "hi" and sent["seed"] == 0 and sent["max_tokens"] == 5
    whole = client.post("/v1/completions", json={"prompt": "hi", "grammar": "root ::= x"}).json()
    assert whole["choices"][0]["text"] == "x" * 16  # serve's default max_tokens
    assert r.engine.bodies[-1]["grammar"] == "root ::= x"  # a llama-server field passes through
    refused = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5000})
    assert (
        refused.status_code == 400 and refused.json()["error"]["message"] == "too many tokens"
    )  # the engine's
    metrics = client.get("/metrics").text
    assert 'rpcfleet_tokens_total{kind="completion"} 21' in metrics
    assert 'rpcfleet_requests_total{route="/v1/completions",code="400"} 1' in metrics
    assert (
        "rpcfleet_slots_busy 0" in metrics
        and 'rpcfleet_engine_requests_processing{formation="fake#0",model="fake"} 0' in metrics
    )
    bad = client.post("/v1/completions", content=b"{nope", headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    bad = client.post("/v1/completions", json={"prompt": "x", "max_tokens": "many"})
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
    assert r.formation.health()["queue"]["admitted"] == 0
    assert client.get("/slots").status_code == 404  # the fake's own answer, passed through
    # Every request to the engine carried the engine's own key (llama-server asks it of all but /health).
    assert r.engine.refused == []


def test_streams_whose_engine_dies_end_with_the_error_naming_the_lost_node(
    front: Callable[..., tuple[Any, Rig]],
) -> None:
    client, r = front(parallel=4)
    engine = r.engine
    results: list[list[Any]] = []

    def one() -> None:
        body = {"prompt": "hi", "max_tokens": 1000, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as s:
            results.append(_events(s.iter_lines()))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while engine.active < 4:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert "rpcfleet_slots_busy 4" in client.get("/metrics").text
    r.fleet.answering = set(ENDPOINTS[:2])
    engine.die()
    for thread in threads:
        thread.join(10)
    assert len(results) == 4
    for events in results:
        error = events[-1]["error"]
        assert error["code"] == 503 and error["lost"] == [ENDPOINTS[2]] and ENDPOINTS[2] in error["message"]
    r.wait_state({"degraded"})
    answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert answer.status_code == 200 and r.engine is not engine
    assert 'rpcfleet_requests_total{route="/v1/completions",code="503"} 4' in client.get("/metrics").text


def test_beyond_the_slots_and_the_queue_a_request_is_refused_with_429(
    front: Callable[..., tuple[Any, Rig]],
) -> None:
    client, r = front(parallel=1, queue_size=1)
    r.engine.delay = 0.05
    codes: list[int] = []

    def one() -> None:
        with client.stream(
            "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 20, "stream": True}
        ) as s:
            codes.append(s.status_code)
            list(s.iter_lines())

    threads = [threading.Thread(target=one) for _ in range(2)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while r.formation.health()["queue"]["admitted"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    refused = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 429 and "queue is full" in refused.json()["error"]["message"]
    for thread in threads:
        thread.join(10)
    assert codes == [200, 200]


def test_a_whole_answer_slower_than_the_event_timeout_is_waited_for_while_the_engine_works(
    front: Callable[..., tuple[Any, Rig]],
) -> None:
    """A whole (non-streamed) answer is silent until complete: past `event_timeout` serve asks the
    engine's /metrics (its main loop) and waits on while it answers; a stuck engine is killed, and the
    answer is asked again of the formation re-formed on the nodes left (issue 42: finished, not failed)."""
    client, r = front(event_timeout=0.2)
    busy = r.engine
    busy.whole_delay = 1.0
    answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert answer.status_code == 200 and not busy.killed and r.formation.state == "ready"
    busy.stuck = True
    r.fleet.answering = set(ENDPOINTS[1:])
    answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert answer.status_code == 200 and busy.killed, answer.json()
    assert answer.json()["choices"][0]["text"] == "xxx"
    r.wait_state({"degraded"})
    nodes = {n["endpoint"]: n["state"] for n in r.formation.health()["nodes"]}
    assert nodes[ENDPOINTS[0]] == "refused" and r.formation.plan is not None
    assert ENDPOINTS[0] not in r.formation.plan.endpoints  # answered by the formation re-formed without it


def test_the_engines_counters_pass_through_with_prometheus_names() -> None:
    """llama-server declares `n_tokens_max` a counter without `_total`: renamed, promtool accepts it."""
    engine = (
        "# HELP llamacpp:n_tokens_max Largest observed n_tokens.\n"
        "# TYPE llamacpp:n_tokens_max counter\n"
        "llamacpp:n_tokens_max 3\n"
        "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
        "# TYPE llamacpp:prompt_tokens_total counter\n"
        "llamacpp:prompt_tokens_total 5\n"
        "# HELP llamacpp:requests_processing Requests processing.\n"
        "# TYPE llamacpp:requests_processing gauge\n"
        "llamacpp:requests_processing 2\n"
    )
    text = engine_metrics([EngineScrape("m#0", "m", engine, 1), EngineScrape("m#1", "m", engine, 0)], 8, 2)
    assert 'rpcfleet_engine_n_tokens_max_total{formation="m#0",model="m"} 3' in text
    assert 'rpcfleet_engine_prompt_tokens_total{formation="m#1",model="m"} 5' in text
    assert text.count("# TYPE rpcfleet_engine_prompt_tokens_total counter") == 1  # one family, two series
    assert "rpcfleet_slots_busy 4" in text  # 2 + 2
    checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
