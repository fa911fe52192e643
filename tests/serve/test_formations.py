"""Tier 1 for serve's formations (issue 24): the router's decisions, the models file, and the router
behind the real front with fake engines (two formations: least-loaded, 429, 503, 404, streams pinned, a
lost node ending only its formation's streams, reloads one formation at a time). The choice of the
formations is planning's: tests/planning/test_formations.py."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cli import main
from orchestrator.core.errors import UsageError
from orchestrator.core.target import Target
from orchestrator.inventory.model import Host
from orchestrator.planning.formations import (
    PlannedFormation,
    ServedModel,
    grow,
)
from orchestrator.planning.plan import Plan, PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.serve.formation import Formation, Roster
from orchestrator.serve.models_file import ModelEntry, parse_models_file
from orchestrator.serve.pool import SparePool
from orchestrator.serve.router import Router, overall
from orchestrator.serve.states import ServeConfig
from tests.plugins.llama import GiB, plan_devices
from tests.plugins.serve_rig import HttpEngine, PartFleet, Rig

# -- the router's decisions (pure)


def test_the_state_of_several_formations_is_the_one_closest_to_serving() -> None:
    # which formation takes a request (least-loaded, affine): tests/serve/test_affinity.py
    assert overall(["ready", "ready"]) == "ready"
    assert overall(["ready", "recovering"]) == "degraded"
    assert overall(["failed", "recovering"]) == "recovering"
    assert overall(["failed", "failed"]) == "failed"


# -- the models file


def test_a_models_file_is_read_and_its_errors_name_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "models.yml"
    text = (
        "models:\n"
        "  - model: a.gguf\n"
        "    name: alpha\n"
        "    context: 8k\n"
        "    parallel: 2\n"
        "    replicas: auto\n"
        "  - model: /m/b.gguf\n"
        "    replicas: 2\n"
        "    hosts: n1,n2\n"
        "    groups: [gpu]\n"
        "  - model: c.gguf\n"
        "    replicas: split\n"
    )
    entries = parse_models_file(path, text)
    assert entries == [
        ModelEntry(tmp_path / "a.gguf", "alpha", 8192, 2, "auto", None, 2),
        ModelEntry(Path("/m/b.gguf"), None, None, None, 2, "n1,n2,gpu", 7),
        ModelEntry(tmp_path / "c.gguf", None, None, None, "split", None, 11),
    ]
    bad = {
        "- model: a.gguf\n  replica: 2\n": (2, "unknown key 'replica' (did you mean 'replicas'?)"),
        "- model: a.gguf\n  replicas: many\n": (2, "replicas: expected auto, split or a number"),
        "- model: a.gguf\n- name: b\n": (2, "needs `model: FILE`"),
        "- model: a.gguf\n- model: x/a.gguf\n": (2, "the name 'a' is already the model's of line 1"),
        "- model: a.gguf\n  parallel: 0\n": (2, "parallel: expected an integer >= 1"),
        "models: 3\n": (1, "expected a list of models"),
        "- [a\n": (2, "not valid YAML"),
    }
    for body, (line, message) in bad.items():
        with pytest.raises(UsageError) as caught:
            parse_models_file(path, body)
        assert f"{path}:{line}" in str(caught.value) and message in str(caught.value), (
            body,
            str(caught.value),
        )


def test_serve_refuses_a_bad_models_file_and_bad_replicas_with_exit_2(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "models.yml"
    bad.write_text(f"- model: {tiny_model}\n  context: lots\n")
    assert main(["serve", "--models", str(bad)]) == 2
    assert f"{bad}:2" in capsys.readouterr().err
    bad.write_text("- model: missing.gguf\n")
    assert main(["serve", "--models", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:1" in err and "does not exist" in err, err
    assert main(["serve", "-m", str(tiny_model), "--replicas", "0"]) == 2
    assert main(["serve", "-m", str(tiny_model), "--replicas", "2", "--split"]) == 2
    assert main(["serve", "-m", str(tiny_model), "-m", str(tiny_model)]) == 2
    assert "two models named" in capsys.readouterr().err
    assert main(["serve"]) == 2
    assert "no model to serve" in capsys.readouterr().err
    from tests.plugins.servers import write_local_inventory

    inventory = write_local_inventory(tmp_path / "inv.yml", {"n1": {"rpc_port": 50052}})
    bad.write_text(f"- model: {tiny_model}\n- model: {tiny_model}\n  name: two\n  hosts: nowhere\n")
    assert main(["serve", "-i", str(inventory), "--models", str(bad)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{bad}:2: hosts:" in err and "nowhere" in err, err


# -- the router behind the front, with fake engines


PARTS = {"a": (("10.8.0.1:50052",), ("10.8.0.2:50052",)), "b": (("10.8.0.3:50052",),)}


@pytest.fixture
def routed(tiny_model: Path) -> Iterator[Callable[..., tuple[Any, dict[str, Rig]]]]:
    from fastapi.testclient import TestClient

    from orchestrator.serve.app import create_app

    made: list[tuple[Any, Router]] = []

    def make(
        parts: Mapping[str, tuple[tuple[str, ...], ...]] = PARTS, token_ids: bool = False, **config: Any
    ) -> tuple[Any, dict[str, Rig]]:
        rigs: dict[str, Rig] = {}
        formations = []
        roster = Roster()
        for model, groups in parts.items():
            for i, endpoints in enumerate(groups):
                fleet = PartFleet(tiny_model, endpoints)
                engines: list[Any] = []

                def factory(
                    plan: Plan,
                    targets: Mapping[str, Target],
                    fleet: PartFleet = fleet,
                    engines: list[Any] = engines,
                ) -> HttpEngine:
                    engines.append(HttpEngine(plan, fleet, len(engines), token_ids=token_ids))
                    return engines[-1]  # type: ignore[no-any-return]

                options = {"retry_interval": 0.005, "rejoin_interval": 0.0, **config}
                name = f"{model}#{i}"
                formation = Formation(name, model, fleet, ServeConfig(**options), factory, peers=roster)
                rigs[name] = Rig(formation, fleet, engines, None)
                formations.append(formation)
        router = Router(formations, roster=roster)
        client = TestClient(create_app(router, api_key="k", admin_key="adm"))
        client.__enter__()  # one loop for the routes and the formations, as in serve
        for rig_ in rigs.values():
            rig_.portal = client.portal
        client.portal.call(router.start)
        for rig_ in rigs.values():
            rig_.wait_state({"ready"})
        client.headers["Authorization"] = "Bearer k"
        client.router = router  # type: ignore[attr-defined]
        made.append((client, router))
        return client, rigs

    yield make
    for client, router in made:
        client.portal.call(router.stop)
        client.__exit__(None, None, None)


def _stream(client: Any, model: str, tokens: int, results: list[Any]) -> None:
    body = {"model": model, "prompt": "hi", "max_tokens": tokens, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
        results.append((s.status_code, events))


def _wait(check: Callable[[], bool], limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_requests_go_to_the_least_loaded_formation_of_their_model_and_streams_stay_there(
    routed: Callable[..., tuple[Any, dict[str, Rig]]],
) -> None:
    client, rigs = routed(parallel=2, queue_size=0)
    a0, a1, b0 = rigs["a#0"].engine, rigs["a#1"].engine, rigs["b#0"].engine
    for engine in (a0, a1, b0):
        engine.delay = 0.05
    results: list[Any] = []
    threads = [threading.Thread(target=_stream, args=(client, "a", 40, results)) for _ in range(4)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)  # admitted one after the other: each goes where the load is least
    _wait(lambda: a0.active + a1.active == 4)
    assert (a0.active, a1.active, b0.active) == (2, 2, 0)  # spread, and never on model b's
    refused = client.post("/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 1})
    assert refused.status_code == 429, refused.json()  # both formations' slots busy, no queue
    other = client.post("/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 2})
    assert other.status_code == 200 and b0.bodies[-1]["model"] == "b"
    health = client.get("/health").json()
    assert health["status"] == "ready" and health["models"] == ["a", "b"]
    busy = {f["name"]: f["slots_busy"] for f in health["formations"]}
    assert busy == {"a#0": 2, "a#1": 2, "b#0": 0}, health
    metrics = client.get("/metrics").text
    assert 'rpcfleet_formation_slots_busy{formation="a#1",model="a"} 2' in metrics
    assert 'rpcfleet_formation_node{formation="b#0",model="b",endpoint="10.8.0.3:50052"} 1' in metrics
    for thread in threads:
        thread.join(20)
    assert [code for code, _ in results] == [200] * 4
    assert all(len(events) == 41 for _, events in results)  # each stream whole, from one engine
    assert len(a0.bodies) == len(a1.bodies) == 2
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["a", "b"]


THREE = {"a": (("10.8.0.1:50052",), ("10.8.0.2:50052",), ("10.8.0.3:50052",))}


def _chat(client: Any, system: str, turns: int) -> list[dict[str, str]]:
    """One conversation of `turns` turns, one after the other, each repeating the history before it."""
    messages = [{"role": "system", "content": system}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn}"})
        answer = client.post(
            "/v1/chat/completions", json={"model": "a", "messages": messages, "max_tokens": 2}
        )
        assert answer.status_code == 200, answer.text
        messages.append({"role": "assistant", "content": answer.json()["choices"][0]["text"]})
    return messages


def _served_by(rigs: Mapping[str, Rig]) -> dict[str, list[str]]:
    """Each system prompt -> the formations that served its turns, in order."""
    served: dict[str, list[str]] = {}
    for name, rig_ in rigs.items():
        for body in rig_.engine.bodies:
            served.setdefault(body["messages"][0]["content"], []).append(name)
    return served


def _routed(text: str) -> dict[tuple[str, str], int]:
    found: dict[tuple[str, str], int] = {}
    for line in text.splitlines():
        if line.startswith("rpcfleet_formation_routed_total{"):
            labels, value = line.split("} ")
            formation = labels.split('formation="')[1].split('"')[0]
            found[(formation, labels.split('reason="')[1].split('"')[0])] = int(value)
    return found


def test_a_conversations_turns_all_land_on_one_formation_and_system_prompts_spread(
    routed: Callable[..., tuple[Any, dict[str, Rig]]],
) -> None:
    """--routing affine (the default): every turn of a chat goes to the formation of its first messages,
    different conversations spread over the three formations, and /metrics counts them as affine; with
    --routing least-loaded the same conversations' turns go round the formations."""
    client, rigs = routed(THREE)
    systems = [f"system prompt {i}: " + "be brief. " * 40 for i in range(12)]
    for system in systems:
        _chat(client, system, 4)
    served = _served_by(rigs)
    assert {system: len(set(names)) for system, names in served.items()} == dict.fromkeys(systems, 1)
    homes = Counter(names[0] for names in served.values())
    assert len(homes) == 3, homes  # 12 conversations over all three formations
    counted = _routed(client.get("/metrics").text)
    assert {k: v for k, v in counted.items() if v} == {(name, "affine"): 4 * n for name, n in homes.items()}

    client, rigs = routed(THREE, routing="least-loaded")
    for system in systems[:3]:
        _chat(client, system, 3)
    served = _served_by(rigs)
    assert all(len(set(names)) == 3 for names in served.values()), served  # idle formations in turns
    counted = _routed(client.get("/metrics").text)
    assert {k: v for k, v in counted.items() if v} == {(name, "least_loaded"): 3 for name in rigs}


def test_a_turn_whose_formation_is_saturated_goes_to_the_least_loaded_one(
    routed: Callable[..., tuple[Any, dict[str, Rig]]],
) -> None:
    client, rigs = routed(THREE, parallel=1, queue_size=1)
    system = "the one conversation"
    _chat(client, system, 1)
    (home,) = _served_by(rigs)[system]
    rigs[home].engine.delay = 0.05
    results: list[Any] = []
    body = {
        "model": "a",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "question 0"}],
    }

    def stream() -> None:
        with client.stream(
            "POST", "/v1/chat/completions", json={**body, "max_tokens": 20, "stream": True}
        ) as s:
            results.append((s.status_code, list(s.iter_lines())))

    holder = threading.Thread(target=stream)
    holder.start()
    _wait(lambda: rigs[home].engine.active == 1)  # its one slot busy: saturated
    answer = client.post("/v1/chat/completions", json={**body, "max_tokens": 2})
    holder.join(20)
    assert answer.status_code == 200 and results[0][0] == 200
    served = _served_by(rigs)[system]
    assert served[:2] == [home, home] and served[2] != home, served
    counted = _routed(client.get("/metrics").text)
    assert counted[(home, "affine")] == 2 and counted[(served[2], "fallback")] == 1


def test_an_unknown_model_is_404_naming_the_served_ones(
    routed: Callable[..., tuple[Any, dict[str, Rig]]],
) -> None:
    client, _ = routed()
    for body in ({"model": "c", "prompt": "x"}, {"prompt": "x"}):
        answer = client.post("/v1/completions", json=body)
        error = answer.json()["error"]
        assert answer.status_code == 404 and error["param"] == "model", error
        assert "served: a, b" in error["message"] and error["type"] == "not_found"
    chat = client.post(
        "/v1/chat/completions", json={"model": "zz", "messages": [{"role": "user", "content": "x"}]}
    )
    assert chat.status_code == 404 and "'zz' is not served" in chat.json()["error"]["message"]


def test_a_lost_nodes_streams_go_on_on_the_other_formation_and_read_as_one_stream(
    routed: Callable[..., tuple[Any, dict[str, Rig]]],
) -> None:
    """20 rounds: 3 streams on a#0 and 3 on a#1, engines that say each token's id; a#1's node dies: its
    streams go on on a#0 (issue 42: resumed, not failed), each one whole: one id, every token once and in
    order, the usage of the whole answer; a#0's finish; new requests go to a#0 while a#1 recovers."""
    client, rigs = routed({"a": PARTS["a"]}, token_ids=True, parallel=3, queue_size=4)
    for round_ in range(20):
        a0, a1 = rigs["a#0"].engine, rigs["a#1"].engine
        a0.delay = a1.delay = 0.01
        a1.streamed.clear()
        results: list[Any] = []
        threads = [threading.Thread(target=_stream, args=(client, "a", 60, results)) for _ in range(6)]
        for thread in threads:
            thread.start()
        _wait(lambda a1=a1: len(a1.streamed) == 3 and min(a1.streamed) >= 2)  # type: ignore[misc]
        rigs["a#1"].fleet.answering = set()
        a1.die()
        _wait(lambda: rigs["a#1"].formation.state == "recovering")
        served = client.post("/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 2})
        assert served.status_code == 200, (round_, served.json())  # a#0 answers meanwhile
        for thread in threads:
            thread.join(20)
        assert len(results) == 6 and all(code == 200 for code, _ in results), round_
        for _, events in results:
            assert "error" not in events[-1], (round_, events[-1])
            texts = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
            assert texts == "".join(f"t{i} " for i in range(60)), (round_, texts)
            assert len({e["id"] for e in events}) == 1, round_
            assert all(e["choices"][0].get("logprobs") is None for e in events)  # not asked: removed
            assert (
                events[-1]["usage"]["prompt_tokens"] == 3 and events[-1]["usage"]["completion_tokens"] == 60
            )
        health = client.get("/health").json()
        states = {f["name"]: f["state"] for f in health["formations"]}
        assert states == {"a#0": "ready", "a#1": "recovering"} and health["status"] == "degraded", health
        rigs["a#1"].fleet.answering = {"10.8.0.2:50052"}
        rigs["a#1"].wait_state({"ready"})
    assert [f["recoveries"] for f in client.get("/health").json()["formations"]] == [0, 20]
    metrics = client.get("/metrics").text
    assert 'rpcfleet_requests_resumed_total{route="/v1/completions",how="continued"} 60' in metrics
    # each told as it happened (the console's line, the page's events): where it was lost, where it went on
    told = [e for e in client.router.news.latest if e.kind == "resumed"]  # type: ignore[attr-defined]
    assert len(told) == 60 and {(e.model, e.formation) for e in told} == {("a", "a#0")}
    assert all(
        re.fullmatch(r"a request \(/v1/completions\) lost on a#1: continued after \d+ tokens", e.message)
        for e in told
    ), told[0].message


def test_a_stream_whose_engine_says_no_token_ids_ends_with_the_503_naming_the_lost_node(
    routed: Callable[..., tuple[Any, dict[str, Rig]]],
) -> None:
    """An engine that does not say its tokens' ids: a stream that sent text cannot go on (its tokens are
    not known, and serve never tokenizes text again); it ends with the 503 event naming the lost node."""
    client, rigs = routed({"a": PARTS["a"]}, parallel=3, queue_size=2)
    a1 = rigs["a#1"].engine
    results: list[Any] = []
    threads = [threading.Thread(target=_stream, args=(client, "a", 60, results)) for _ in range(6)]
    for thread in threads:
        thread.start()
    _wait(lambda: len(a1.streamed) == 3 and min(a1.streamed) >= 1)
    rigs["a#1"].fleet.answering = set()
    a1.die()
    for thread in threads:
        thread.join(20)
    lost = [events for code, events in results if "error" in events[-1]]
    whole = [events for code, events in results if "error" not in events[-1]]
    assert len(lost) == 3 and len(whole) == 3
    assert all(e[-1]["error"]["code"] == 503 and e[-1]["error"]["lost"] == ["10.8.0.2:50052"] for e in lost)
    assert all(len(e) == 61 for e in whole)


def test_none_serving_waits_for_a_recovery_then_503_with_retry_after(
    routed: Callable[..., tuple[Any, dict[str, Rig]]],
) -> None:
    """Both formations of a recover: a request waits (issue 42), at most --queue-timeout, for one of them
    to serve; then the 503 with Retry-After names them and their lost nodes."""
    client, rigs = routed({"a": PARTS["a"]}, retry_interval=60.0, queue_timeout=0.3)
    for name in ("a#0", "a#1"):
        rigs[name].fleet.answering = set()
        rigs[name].engine.die()
        rigs[name].wait_state({"recovering"})
    started = time.monotonic()
    answer = client.post("/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 1})
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "2", answer.json()
    assert time.monotonic() - started >= 0.3  # it waited its --queue-timeout
    error = answer.json()["error"]
    assert "not serving after 0.3 s (--queue-timeout): no formation of a is serving" in error["message"]
    assert error["lost"] == ["10.8.0.1:50052", "10.8.0.2:50052"], error
    assert client.get("/health").status_code == 503


def test_a_reload_goes_one_formation_at_a_time_and_the_model_never_answers_503(
    routed: Callable[..., tuple[Any, dict[str, Rig]]],
) -> None:
    client, rigs = routed({"a": PARTS["a"]}, parallel=2)
    codes: list[int] = []
    done = threading.Event()
    seen: list[tuple[str, str]] = []

    def ask() -> None:
        while not done.is_set():
            answer = client.post("/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 2})
            codes.append(answer.status_code)

    def look() -> None:
        while not done.is_set():
            seen.append((rigs["a#0"].formation.state, rigs["a#1"].formation.state))
            time.sleep(0.001)

    threads = [threading.Thread(target=ask) for _ in range(3)] + [threading.Thread(target=look)]
    for thread in threads:
        thread.start()
    _wait(lambda: len(codes) > 10)
    reload = client.post(
        "/admin/reload", json={"rolling_restart": True}, headers={"Authorization": "Bearer adm"}
    )
    assert reload.status_code == 202
    _wait(lambda: all(r.fleet.restarts == 1 and r.formation.state == "ready" for r in rigs.values()))
    time.sleep(0.1)
    done.set()
    for thread in threads:
        thread.join(20)
    assert codes and set(codes) == {200}, sorted(set(codes))
    assert not any(s0 not in ("ready", "degraded") and s1 not in ("ready", "degraded") for s0, s1 in seen)
    assert any(s0 != "ready" for s0, _ in seen) and any(s1 != "ready" for _, s1 in seen)  # both reloaded
    assert [r.formation.metrics.reloads for r in rigs.values()] == [1, 1]
    assert len(rigs["a#0"].engines) == len(rigs["a#1"].engines) == 2


def test_a_formation_whose_nodes_are_gone_takes_a_free_spare(
    routed: Callable[..., tuple[Any, dict[str, Rig]]],
) -> None:
    """a#1's only node is lost: it re-plans with the spare (ServeFleet.with_spare) and serves again;
    the spare is then no one else's."""
    from orchestrator.serve.pool import SparePool

    client, rigs = routed({"a": PARTS["a"]})
    spare = Host(name="spare", address="10.8.0.9", rpc_port=50052)
    pool = SparePool([spare])
    for rig_ in rigs.values():
        rig_.fleet.spares = pool
    fleet = rigs["a#1"].fleet
    fleet.answering = {"10.8.0.9:50052"}  # its own node is gone; the spare answers
    rigs["a#1"].engine.die()
    rigs["a#1"].wait_state({"degraded"})
    health = rigs["a#1"].formation.health()
    assert health["plan"]["endpoints"] == ["10.8.0.9:50052"] and health["lost"] == ["10.8.0.2:50052"], health
    assert pool.take() is None
    answer = client.post("/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 2})
    assert answer.status_code == 200


def _asking(client: Any, model: str, codes: list[int], done: threading.Event) -> threading.Thread:
    def ask() -> None:
        while not done.is_set():
            codes.append(
                client.post(
                    "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2}
                ).status_code
            )

    thread = threading.Thread(target=ask)
    thread.start()
    return thread


def test_a_formation_takes_its_own_node_back_and_gives_the_spare_back_without_a_503(
    routed: Callable[..., tuple[Any, dict[str, Rig]]],
) -> None:
    """20 rounds: a#1's node is lost, it re-plans on the free spare; its node returns: it takes it back
    (out of the router meanwhile: requests to `a` all go to a#0, none is 503) and the spare is back in
    the pool, free for the next loss."""
    client, rigs = routed({"a": PARTS["a"]}, rejoin_interval=0.01)
    own, free = "10.8.0.2:50052", "10.8.0.9:50052"
    pool = SparePool([Host(name="spare", address="10.8.0.9", rpc_port=50052)], order=[own, free])
    for rig_ in rigs.values():
        rig_.fleet.spares = pool
    rig = rigs["a#1"]
    for round_ in range(20):
        rig.fleet.answering = {free}  # its own node is gone; the spare answers
        rig.engine.die()
        _wait(lambda: rig.formation.state == "degraded" and rig.formation.plan.endpoints == (free,))  # type: ignore[union-attr]
        assert pool.snapshot() == [] and [h.endpoint for h in rig.fleet.borrowed] == [free], round_
        codes: list[int] = []
        done = threading.Event()
        askers = [_asking(client, "a", codes, done) for _ in range(3)]
        _wait(lambda codes=codes: len(codes) > 3)  # type: ignore[misc]
        rig.fleet.answering = {own, free}  # its node is back
        _wait(lambda: rig.formation.state == "ready" and rig.formation.plan.endpoints == (own,))  # type: ignore[union-attr]
        _wait(lambda codes=codes: len(codes) > 20)  # type: ignore[misc]
        done.set()
        for asker in askers:
            asker.join(20)
        assert codes and set(codes) == {200}, (round_, sorted(set(codes)))
        assert [h.endpoint for h in pool.snapshot()] == [free] and rig.fleet.borrowed == [], round_
        assert rig.fleet.endpoints == (own,) and free not in rig.formation.nodes, round_
    health = {f["name"]: f for f in client.get("/health").json()["formations"]}
    assert (health["a#1"]["recoveries"], health["a#1"]["rejoins"], health["a#1"]["nodes"]) == (20, 20, [own])
    assert health["a#0"]["recoveries"] == health["a#0"]["rejoins"] == 0


def test_a_node_silent_at_start_makes_a_new_formation_when_it_answers(
    routed: Callable[..., tuple[Any, dict[str, Rig]]], tiny_model: Path
) -> None:
    """--replicas auto with one node silent at start: it is a spare; once it answers (and holds the
    model) the spare watch makes a formation of it, and the router sends it requests once it serves. A
    spare too small for the model stays in the pool."""
    from orchestrator.serve.spares import SpareWatch

    client, rigs = routed({"a": (("10.8.0.1:50052",),)})
    router = client.router  # type: ignore[attr-defined]
    late = "10.8.0.2:50052"
    pool = SparePool([Host(name="late", address="10.8.0.2", rpc_port=50052)], order=["10.8.0.1:50052", late])
    answers: dict[str, int] = {}  # endpoint -> its usable bytes, for those that answer

    async def probe(hosts: Any) -> tuple[dict[str, str], list[Any]]:
        up = [h.endpoint for h in hosts if h.endpoint in answers]
        states = {h.endpoint: ("ok" if h.endpoint in answers else "refused") for h in hosts}
        return states, plan_devices(up, [answers[ep] for ep in up]) if up else []

    def make(one: PlannedFormation, name: str) -> Formation:
        fleet = PartFleet(tiny_model, one.choice.endpoints)
        engines: list[Any] = []

        def factory(plan: Plan, dial: Mapping[str, str]) -> HttpEngine:
            engines.append(HttpEngine(plan, fleet, 10 + len(engines)))
            return engines[-1]  # type: ignore[no-any-return]

        config = ServeConfig(retry_interval=0.005, rejoin_interval=0.0)
        formation = Formation(name, one.model.name, fleet, config, factory, peers=router.roster)
        rigs[name] = Rig(formation, fleet, engines, client.portal)
        return formation

    model = ServedModel(str(tiny_model), "a", profile_model(tiny_model), PlanOptions(n_ctx=512))
    watch = SpareWatch(router, pool, [model], probe, make, interval=0.0)
    assert client.portal.call(watch.round) == [] and len(router.formations) == 1  # silent: nothing to decide
    answers[late] = 1024 * 1024  # it answers, too small for the model: it stays a spare
    assert client.portal.call(watch.round) == [] and [h.endpoint for h in pool.snapshot()] == [late]
    assert client.portal.call(watch.round) == []  # nothing new: not decided again
    del answers[late]
    assert client.portal.call(watch.round) == []
    answers[late] = 8 * GiB  # back, and it holds the model
    added = client.portal.call(watch.round)
    assert [f.name for f in added] == ["a#1"] and pool.snapshot() == []
    assert [f.name for f in router.formations] == ["a#0", "a#1"]
    rigs["a#1"].wait_state({"ready"})
    assert rigs["a#1"].formation.plan.endpoints == (late,)  # type: ignore[union-attr]
    for i in range(8):  # 8 prompts: the new formation takes the keys it wins (rendezvous: 2 of these)
        answer = client.post("/v1/completions", json={"model": "a", "prompt": f"x{i}", "max_tokens": 2})
        assert answer.status_code == 200
    assert (len(rigs["a#0"].engine.bodies), len(rigs["a#1"].engine.bodies)) == (6, 2)
    health = client.get("/health").json()
    assert [(f["name"], f["nodes"], f["state"]) for f in health["formations"]] == [
        ("a#0", ["10.8.0.1:50052"], "ready"),
        ("a#1", [late], "ready"),
    ]
    assert client.portal.call(watch.round) == []  # no spare left
    # A formation takes the spare (a loss) between the watch's probe and its take: nothing is formed,
    # and the watch decides again once the spare is back.
    other = "10.8.0.3:50052"
    pool.put([Host(name="other", address="10.8.0.3", rpc_port=50052)])
    answers[other] = 8 * GiB
    taken: list[Any] = []

    async def probe_then_lose(hosts: Any) -> tuple[dict[str, str], list[Any]]:
        seen = await probe(hosts)
        taken.append(pool.take())  # the loss's `with_spare`, in the meantime
        return seen

    watch.probe = probe_then_lose
    assert (
        client.portal.call(watch.round) == []
        and [h.endpoint for h in taken] == [other]
        and pool.snapshot() == []
    )
    assert [f.name for f in router.formations] == ["a#0", "a#1"]
    watch.probe = probe
    pool.put(taken)  # given back
    assert [f.name for f in client.portal.call(watch.round)] == ["a#2"] and pool.snapshot() == []
    rigs["a#2"].wait_state({"ready"})
    # the pure rule: the spares in the inventory's order, one formation per model in turns, disjoint
    eps = ["10.8.0.3:50052", "10.8.0.4:50052", "10.8.0.5:50052"]
    hosts = [Host(name=f"s{i}", address=ep.split(":")[0], rpc_port=50052) for i, ep in enumerate(eps)]
    two = [model, dataclasses.replace(model, name="b"), dataclasses.replace(model, name="c", split=True)]
    grown = grow(two, hosts, plan_devices(eps))
    assert all(f.model in two for f in grown)  # the models as served (not the choice's copies)
    assert [(f.model.name, f.choice.endpoints) for f in grown] == [
        ("a", (eps[0],)),
        ("b", (eps[1],)),
        ("a", (eps[2],)),
    ]


LLAMA_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total {prompt}
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total {predicted}
# HELP llamacpp:n_tokens_max Largest observed sequence length (prompt + generation)
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 40
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 12.5
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing {processing}
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} 3
"""  # llama-server's to_metrics() text (tools/server/server-task.cpp), as 0.3.36's llama.cpp writes it


def test_metrics_show_every_formations_engine_counters_under_its_formation_label(
    routed: Callable[..., tuple[Any, dict[str, Rig]]],
) -> None:
    """Each engine's own counters (llama-server's /metrics) on serve's /metrics, one series per formation
    (labels formation and model); promtool accepts them. An engine that does not answer in time is left
    out of that scrape, which does not wait on it; a burst of scrapes asks each engine once."""
    import subprocess

    client, rigs = routed()
    values = {"a#0": (11, 21, 1), "a#1": (12, 22, 2), "b#0": (13, 23, 0)}
    for name, (prompt, predicted, processing) in values.items():
        rigs[name].engine.metrics_text = LLAMA_METRICS.format(
            prompt=prompt, predicted=predicted, processing=processing
        )
    slots = [{"id": 0, "n_ctx": 512, "n_prompt_tokens": 128}, {"id": 1, "n_ctx": 512}]
    rigs["a#0"].engine.slots_text = json.dumps(slots)  # a#1's /slots answers 404: no KV series
    rigs["b#0"].engine.slots_text = json.dumps(slots[1:])
    text = client.get("/metrics").text
    assert 'rpcfleet_formation_kv_used_ratio{formation="a#0",model="a"} 0.125\n' in text
    assert 'rpcfleet_formation_slot_kv_used_ratio{formation="a#0",model="a",slot="0"} 0.25\n' in text
    assert 'rpcfleet_formation_kv_used_ratio{formation="b#0",model="b"} 0\n' in text
    assert 'kv_used_ratio{formation="a#1"' not in text
    for name, (prompt, predicted, processing) in values.items():
        labels = f'formation="{name}",model="{name[0]}"'
        assert f"rpcfleet_engine_prompt_tokens_total{{{labels}}} {prompt}" in text, text
        assert f"rpcfleet_engine_tokens_predicted_total{{{labels}}} {predicted}" in text
        assert f"rpcfleet_engine_requests_processing{{{labels}}} {processing}" in text
        assert f"rpcfleet_engine_n_tokens_max_total{{{labels}}} 40" in text
        assert (
            f'rpcfleet_engine_spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="0"}} 3'
            in text
        )
    slots = sum(rig_.formation.config.parallel for rig_ in rigs.values())
    assert "rpcfleet_slots_busy 3\n" in text and f"rpcfleet_slots {slots}\n" in text  # 1 + 2 + 0
    assert text.count("# TYPE rpcfleet_engine_tokens_predicted_total counter") == 1
    checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr + checked.stdout
    asked = {name: rig_.engine.metrics_asked for name, rig_ in rigs.items()}
    client.get("/metrics")  # within the cache's second: no engine asked again
    assert {name: rig_.engine.metrics_asked for name, rig_ in rigs.items()} == asked
    time.sleep(1.1)  # past the cache (ENGINE_SCRAPE_CACHE)
    rigs["a#1"].engine.stuck = True  # its main loop answers no /metrics for 5 s
    started = time.monotonic()
    text = client.get("/metrics").text
    assert time.monotonic() - started < 4.5  # bounded by ENGINE_SCRAPE_TIMEOUT (2 s), not the engine's 5
    assert 'rpcfleet_engine_tokens_predicted_total{formation="a#0",model="a"} 21' in text
    assert 'formation="a#1",model="a"} 22' not in text and 'formation="b#0",model="b"} 23' in text


# -- plan and report --replicas, on real local servers


@pytest.mark.llama
def test_plan_and_report_with_replicas_print_the_formations_serve_would_choose(
    start_rpc_server: Callable[..., Any], tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.plugins.servers import write_local_inventory

    servers = [start_rpc_server() for _ in range(3)]
    inventory = write_local_inventory(
        tmp_path / "inv.yml", {f"n{i}": {"rpc_port": s.port} for i, s in enumerate(servers)}
    )
    base = ["-i", str(inventory), "-m", str(tiny_model), "--ctx", "512", "--local-devices", ""]
    assert main(["plan", *base, "--replicas", "auto", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [f["endpoints"] for f in data["formations"]] == [[s.endpoint] for s in servers]
    planned = [[d["endpoint"] for d in f["plan"]["devices"]] for f in data["formations"]]
    assert data["spares"] == [] and planned == [f["endpoints"] for f in data["formations"]]
    assert main(["plan", *base, "--replicas", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    held = [ep for f in data["formations"] for ep in f["endpoints"]]
    assert len(held) == 2 and sorted(held + data["spares"]) == sorted(s.endpoint for s in servers), data
    assert main(["plan", *base, "--replicas", "2"]) == 0
    out = capsys.readouterr().out
    assert "formations (--replicas 2): 2" in out and f"spares: {data['spares'][0]}" in out, out
    assert f"{tiny_model.stem}#1: 1 node(s) {data['formations'][1]['endpoints'][0]}" in out, out
    assert main(["plan", *base, "--replicas", "4"]) == 1
    assert "--replicas 4 asked, the nodes hold 3" in capsys.readouterr().err
    assert main(["plan", *base, "--replicas", "auto", "--format", "llama-cli"]) == 2
    base = base[:-2]  # report plans on the RPC servers only
    assert main(["report", *base, "--replicas", "auto", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (len(report["formations"]) == 3 and "models" in report) or "fleet" in report, list(report)
    assert main(["report", *base, "--replicas", "auto"]) == 0
    assert "formations (--replicas auto): 3" in capsys.readouterr().out
    # each format's own renderer draws the section (the report carries the formations)
    assert main(["report", *base, "--replicas", "auto", "--format", "md"]) == 0
    assert "\n## Formations\n\n```\nformations (--replicas auto): 3\n" in capsys.readouterr().out
    assert main(["report", *base, "--replicas", "auto", "--format", "html"]) == 0
    page = capsys.readouterr().out
    assert page.index("<h2>Formations</h2>") < page.index("</body></html>") and page.count("</body>") == 1


def test_the_exporter_gets_each_formation_with_its_own_requests_and_slots(
    routed: Callable[..., tuple[Any, dict[str, Rig]]],
) -> None:
    from orchestrator.serve.observed import formations_of

    client, rigs = routed(parallel=3)
    for model, prompt in (("a", "x0"), ("a", "x2"), ("b", "x")):  # x0's formation is a#0, x2's a#1
        answer = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2})
        assert answer.status_code == 200
    router = Router([rig_.formation for rig_ in rigs.values()])
    seen = {f.name: f for f in formations_of(router)}
    assert {n: (f.model, f.nodes, f.slots, f.state) for n, f in seen.items()} == {
        "a#0": ("a", ("10.8.0.1:50052",), 3, "ready"),
        "a#1": ("a", ("10.8.0.2:50052",), 3, "ready"),
        "b#0": ("b", ("10.8.0.3:50052",), 3, "ready"),
    }
    counts = {n: f.requests.get(("/v1/completions", 200), 0) for n, f in seen.items()}
    assert counts == {"a#0": 1, "a#1": 1, "b#0": 1}, counts  # a's two went one to each formation
    assert all(f.completion_tokens == 2 for f in seen.values())
