"""Tier 1 for serve's on-demand models (issue 34): the models file's `load:` and `idle_unload:`, the
swap's decision (pure), and on-demand models behind the real front with fake engines: loaded by their first
request, listed with their state, swapped out for a model that needs their node, unloaded when idle, and a
503 naming the holders when the nodes cannot hold the model. The lab test with real engines and the real
Gemma: tests/serve/test_formations_lab.py."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from orchestrator.core.errors import UsageError
from orchestrator.core.target import Target
from orchestrator.inventory.model import Host
from orchestrator.planning.formations import PlannedFormation, ServedModel
from orchestrator.planning.plan import Plan, PlanDevice, PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.serve.formation import Formation, FormationHooks
from orchestrator.serve.models_file import parse_models_file
from orchestrator.serve.on_demand import OnDemand
from orchestrator.serve.pool import SparePool
from orchestrator.serve.router import Router
from orchestrator.serve.states import ServeConfig
from orchestrator.serve.swap import Occupant, swap
from tests.plugins.llama import plan_devices
from tests.plugins.serve_rig import HttpEngine, PartFleet

NODES = ("10.8.0.1:50052", "10.8.0.2:50052", "10.8.0.3:50052")


def _host(endpoint: str) -> Host:
    return Host(name=f"h-{endpoint}", address=endpoint.split(":")[0], rpc_port=50052)


# -- the models file


def test_load_and_idle_unload_are_read_and_their_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "models.yml"
    entries = parse_models_file(
        path,
        "- model: a.gguf\n  load: on-demand\n  idle_unload: 10m\n"
        "- model: b.gguf\n  load: on-demand\n"
        "- model: c.gguf\n  load: always\n",
    )
    assert [(e.on_demand, e.idle_unload) for e in entries] == [(True, 600.0), (True, None), (False, None)]
    assert (
        parse_models_file(path, "- model: a.gguf\n  load: on-demand\n  idle_unload: 90\n")[0].idle_unload
        == 90
    )
    bad = {
        "- model: a.gguf\n  load: sometimes\n": (2, "load: expected one of always, on-demand"),
        "- model: a.gguf\n  load: on-demand\n  idle_unload: soon\n": (3, "expected a duration"),
        "- model: a.gguf\n  idle_unload: 5m\n": (1, "idle_unload is for a model with `load: on-demand`"),
        "- model: a.gguf\n  load: on-demand\n  idle_unload: 0.5\n": (3, "at least 1 s"),
        "- model: a.gguf\n  load: on-demand\n  replicas: 2\n": (1, "loaded as one formation"),
    }
    for body, (line, message) in bad.items():
        with pytest.raises(UsageError) as caught:
            parse_models_file(path, body)
        assert f"{path}:{line}" in str(caught.value) and message in str(caught.value), (
            body,
            str(caught.value),
        )


# -- the swap (pure)


def _model(tiny_model: Path, name: str, endpoints: tuple[str, ...] | None = None) -> ServedModel:
    return ServedModel(
        str(tiny_model),
        name,
        profile_model(tiny_model),
        PlanOptions(n_ctx=512),
        endpoints=endpoints,
        on_demand=True,
    )


def test_the_swap_frees_the_least_recently_used_idle_formation_waits_for_busy_ones_and_names_holders(
    tiny_model: Path,
) -> None:
    hosts = [_host(ep) for ep in NODES]
    known = {d.endpoint or "": [d] for d in plan_devices(list(NODES))}
    only_3 = _model(tiny_model, "c", (NODES[2],))
    assert swap(only_3, [hosts[2]], [], hosts, known).unload == ()  # fits on the free node: nothing to do
    older = Occupant("a#0", "a", (NODES[2],), True, True, last_used=1.0)
    newer = Occupant("b#0", "b", (NODES[1],), True, True, last_used=2.0)
    anywhere = _model(tiny_model, "c")
    assert swap(anywhere, [], [newer, older], hosts, known).unload == ("a#0",)  # least recently used
    busy = dataclasses.replace(older, idle=False, admitted=2)
    waited = swap(only_3, [], [busy, newer], hosts, known)
    assert (
        waited.unload == () and waited.wait is not None and "a#0 (2 request(s)) holds 10.8.0.3" in waited.wait
    )
    always = Occupant("z#0", "z", (NODES[2],), False, False, last_used=0.0)
    never = swap(only_3, [hosts[0]], [always], hosts, known)
    assert never.never is not None and "always loaded: z#0 holds 10.8.0.3:50052" in never.never, never
    small = {
        ep: [dataclasses.replace(d, usable=1024, free=1024, total=1024) for d in ds]
        for ep, ds in known.items()
    }
    assert swap(anywhere, hosts, [], hosts, small).never is not None  # no node large enough: at once


# -- behind the front, with fake engines


@pytest.fixture
def started() -> Counter[str]:
    """Engines started by `on_demand`'s formations, by model: one per load."""
    return Counter()


@pytest.fixture
def on_demand(tiny_model: Path, started: Counter[str]) -> Iterator[Callable[..., tuple[Any, Router]]]:
    from fastapi.testclient import TestClient

    from orchestrator.serve.app import create_app

    made: list[tuple[Any, Router]] = []

    def make(
        models: Sequence[ServedModel],
        always: Mapping[str, tuple[str, ...]] = {},
        *,
        engine: Mapping[str, type[HttpEngine]] = {},
        backoff: tuple[float, float] = (5.0, 300.0),
        **config: Any,
    ) -> tuple[Any, Router]:
        """`engine`: the engine class of some models (default HttpEngine); `config`: ServeConfig's fields
        (residency and swap cooldown 0 unless given: a swap at once)."""
        options = ServeConfig(
            **{
                "retry_interval": 0.005,
                "rejoin_interval": 0.0,
                "queue_timeout": 10.0,
                "min_resident": 0.0,
                "swap_cooldown": 0.0,
                **config,
            }
        )
        hosts = [_host(ep) for ep in NODES]

        def formation_on(
            name: str, model: str, endpoints: tuple[str, ...], engine_of: str = "", **made: Any
        ) -> Formation:
            fleet = PartFleet(tiny_model, endpoints)
            engines: list[Any] = []
            kind = engine.get(engine_of, HttpEngine)

            def factory(plan: Plan, targets: Mapping[str, Target]) -> HttpEngine:
                engines.append(kind(plan, fleet, len(engines)))
                started[engine_of] += 1
                return engines[-1]  # type: ignore[no-any-return]

            return Formation(name, model, fleet, options, factory, **made)

        formations = [formation_on(f"{m}#0", m, eps) for m, eps in always.items()]
        held = {ep for eps in always.values() for ep in eps}
        pool = SparePool([h for h in hosts if h.endpoint not in held], order=NODES)

        async def probe(free: Sequence[Host]) -> tuple[dict[str, str], list[PlanDevice]]:
            return {h.endpoint: "ok" for h in free}, plan_devices([h.endpoint for h in free])

        def formation(one: PlannedFormation, name: str, failed: Callable[[Formation], None]) -> Formation:
            model, endpoints = one.model.name, one.choice.endpoints
            hooks = FormationHooks(on_failed=failed)
            return formation_on(name, model, endpoints, model, hooks=hooks, recover_first_load=False)

        known = {d.endpoint or "": [d] for d in plan_devices(list(NODES))}
        router = Router(
            formations,
            None,
            config=options,
            models=[*always, *(m.name for m in models)],
            spares=lambda: [h.endpoint for h in pool.snapshot()],
            demand=lambda router: OnDemand(
                router,
                pool,
                models,
                hosts,
                probe,
                formation,
                known,
                backoff_first=backoff[0],
                backoff_max=backoff[1],
            ),
        )
        client = TestClient(create_app(router, api_key="k", admin_key="adm"))
        client.__enter__()  # one loop for the routes and the formations, as in serve
        client.portal.call(router.start)
        client.portal.call(router.demand.start)
        client.headers["Authorization"] = "Bearer k"
        made.append((client, router))
        return client, router

    yield make
    for client, router in made:
        assert router.demand is not None
        client.portal.call(router.demand.stop)
        client.portal.call(router.stop)
        client.__exit__(None, None, None)


def _states(client: Any) -> dict[str, str]:
    listed = client.get("/v1/models").json()["data"]
    return {m["id"]: m["state"] for m in listed}


def _ask(client: Any, model: str) -> Any:
    return client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})


def test_a_request_loads_its_model_another_swaps_it_out_and_idle_ones_are_unloaded(
    on_demand: Callable[..., tuple[Any, Router]], tiny_model: Path
) -> None:
    one_node = (NODES[0],)  # both may use node 1 only: they cannot be loaded together
    a = _model(tiny_model, "a", one_node)
    b = dataclasses.replace(_model(tiny_model, "b", one_node), idle_unload=0.3)
    client, router = on_demand([a, b])
    assert _states(client) == {"a": "unloaded", "b": "unloaded"}
    assert client.get("/health").json()["status"] == "ready"  # nothing loaded: ready to load on demand
    answer = _ask(client, "a")
    assert answer.status_code == 200, answer.text
    assert _states(client) == {"a": "loaded", "b": "unloaded"}
    assert [(f.name, f.fleet.endpoints) for f in router.formations] == [("a#0", one_node)]
    answer = _ask(client, "b")  # a is idle: swapped out for b on the same node
    assert answer.status_code == 200, answer.text
    assert [f.name for f in router.formations] == ["b#0"]
    assert router.demand is not None and router.demand.unloads["a"] == 1
    health = client.get("/health").json()
    assert health["on_demand"]["a"]["state"] == "unloaded" and health["on_demand"]["b"]["state"] == "loaded"
    deadline = time.monotonic() + 10
    while _states(client)["b"] != "unloaded":  # idle past 0.3 s: unloaded, its node back in the pool
        assert time.monotonic() < deadline, client.get("/health").json()
        time.sleep(0.05)
    assert router.formations == [] and NODES[0] in client.get("/health").json()["spares"]
    assert _ask(client, "a").status_code == 200  # the pool reused
    assert _ask(client, "unknown").status_code == 404


def test_a_model_the_open_nodes_cannot_hold_is_503_at_once_naming_who_holds_what(
    on_demand: Callable[..., tuple[Any, Router]], tiny_model: Path
) -> None:
    only_3 = _model(tiny_model, "c", (NODES[2],))
    client, _router = on_demand([only_3], always={"z": (NODES[2],)})
    started = time.monotonic()
    answer = _ask(client, "c")
    assert answer.status_code == 503 and answer.headers["Retry-After"], answer.text
    assert "always loaded: z#0 holds 10.8.0.3:50052" in answer.json()["error"]["message"], answer.text
    assert time.monotonic() - started < 5  # not a wait for the queue timeout
    assert _states(client) == {"z": "loaded", "c": "unloaded"}
    assert _ask(client, "z").status_code == 200


def test_a_request_waits_for_a_busy_model_to_finish_then_swaps_it_out(
    on_demand: Callable[..., tuple[Any, Router]], tiny_model: Path
) -> None:
    import concurrent.futures

    one_node = (NODES[0],)
    client, router = on_demand([_model(tiny_model, "a", one_node), _model(tiny_model, "b", one_node)])
    assert _ask(client, "a").status_code == 200
    engine = router.formations[0].engine
    assert isinstance(engine, HttpEngine)
    engine.whole_delay = 1.0  # a's next answer takes a second: a is busy meanwhile
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        slow = pool.submit(_ask, client, "a")
        time.sleep(0.3)
        waiting = pool.submit(_ask, client, "b")
        assert slow.result().status_code == 200
        answer = waiting.result()
    assert answer.status_code == 200, answer.text
    assert [f.name for f in router.formations] == ["b#0"]


# -- under pressure: residency, swap cooldown, backoff, bounded waiters


@dataclasses.dataclass(eq=False)
class ExitingEngine(HttpEngine):
    """llama-server that exits while loading its model (a bad file, a node's server gone)."""

    async def load(self, limit: float, on_progress: Any, cache_hits: Mapping[str, int]) -> float:
        from orchestrator.serve.engine import EngineError

        raise EngineError("llama-server exited with status 1 while loading the model")


@dataclasses.dataclass(eq=False)
class SlowEngine(HttpEngine):
    """An engine whose load takes a second."""

    async def load(self, limit: float, on_progress: Any, cache_hits: Mapping[str, int]) -> float:
        import asyncio

        await asyncio.sleep(1.0)
        return 1.0


def _metric(client: Any, sample: str) -> float | None:
    """The value of the `/metrics` line that starts with `sample` (None: no such line)."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rpartition(" ")[2])
    return None


def test_requests_alternating_between_two_models_that_cannot_both_be_loaded_swap_once_a_residency(
    on_demand: Callable[..., tuple[Any, Router]], started: Counter[str], tiny_model: Path
) -> None:
    one_node = (NODES[0],)
    a, b = _model(tiny_model, "a", one_node), _model(tiny_model, "b", one_node)
    # a swap's unload takes a fake engine up to 0.5 s (its HTTP server's shutdown): a wait of 1.5 s
    client, router = on_demand([a, b], min_resident=4.0, queue_timeout=1.5)
    answers = [_ask(client, "ab"[i % 2]) for i in range(20)]
    assert [r.status_code for r in answers[::2]] == [200] * 10  # a, loaded first, keeps its node
    for refused in answers[1::2]:  # b: refused at once, told when a may go
        assert refused.status_code == 503 and 2 <= int(refused.headers["Retry-After"]) <= 4, refused.text
        assert "a#0 holds 10.8.0.1:50052, kept" in refused.json()["error"]["message"], refused.text
    assert started == {"a": 1}  # not 20 loads
    assert router.demand is not None
    time.sleep(max(0.0, router.demand.loaded_at["a"] + 4.05 - time.monotonic()))  # a's residency over
    assert _ask(client, "b").status_code == 200  # swapped in once
    assert _ask(client, "a").status_code == 503  # b's residency now
    assert started == {"a": 1, "b": 1}
    kinds = [(e.kind, e.formation) for e in router.news.latest]
    assert kinds == [("load", "a#0"), ("loaded", "a#0"), ("swap", "a#0"), ("load", "b#0"), ("loaded", "b#0")]
    assert _metric(client, 'rpcfleet_model_unloads_total{model="a",reason="swap"}') == 1
    assert _metric(client, 'rpcfleet_model_loads_total{model="b"}') == 1
    assert _metric(client, 'rpcfleet_model_state{model="b",state="loaded"}') == 1
    assert _metric(client, 'rpcfleet_model_state{model="a",state="unloaded"}') == 1


def test_a_model_used_within_its_swap_cooldown_stays_for_its_users_next_turn(
    on_demand: Callable[..., tuple[Any, Router]], started: Counter[str], tiny_model: Path
) -> None:
    one_node = (NODES[0],)
    a, b = _model(tiny_model, "a", one_node), _model(tiny_model, "b", one_node)
    client, _router = on_demand([a, b], swap_cooldown=2.0, queue_timeout=1.5)
    assert _ask(client, "b").status_code == 200  # a user of b's turn
    other = _ask(client, "a")  # another key's request, between two turns of b's user
    assert other.status_code == 503 and other.headers["Retry-After"] == "2", other.text
    assert _ask(client, "b").status_code == 200  # the next turn finds b loaded
    time.sleep(2.1)  # b unused past its cooldown
    assert _ask(client, "a").status_code == 200
    assert started == {"b": 1, "a": 1}


def test_a_model_whose_load_fails_is_loaded_once_then_answers_its_failure_in_a_growing_backoff(
    on_demand: Callable[..., tuple[Any, Router]], started: Counter[str], tiny_model: Path
) -> None:
    one_node = (NODES[0],)
    a, c = _model(tiny_model, "a", one_node), _model(tiny_model, "c", one_node)
    client, router = on_demand([a, c], engine={"c": ExitingEngine}, backoff=(1.0, 60.0))
    assert _ask(client, "a").status_code == 200
    first = _ask(client, "c")  # its one try: a (idle) swapped out for it, then its engine exits
    assert first.status_code == 503 and first.headers["Retry-After"] == "1", first.text
    assert "exited with status 1 while loading the model" in first.json()["error"]["message"], first.text
    assert _ask(client, "a").status_code == 200  # a back on the node
    for _ in range(5):  # c in backoff: its failure at once, no load, a stays
        again = _ask(client, "c")
        assert again.status_code == 503 and "exited with status 1" in again.json()["error"]["message"]
        assert again.headers["Retry-After"] == "1"
    assert started == {"a": 2, "c": 1}
    health = client.get("/health").json()["on_demand"]
    assert health["c"]["state"] == "backoff" and "exited with status 1" in health["c"]["last_failure"]
    assert health["a"]["state"] == "loaded"
    assert _metric(client, 'rpcfleet_model_load_failures_total{model="c"}') == 1
    assert _metric(client, 'rpcfleet_model_state{model="c",state="backoff"}') == 1
    time.sleep(1.1)  # the backoff over: one more try, failing again, and a longer backoff
    second = _ask(client, "c")
    assert second.status_code == 503 and second.headers["Retry-After"] == "2", second.text
    assert started == {"a": 2, "c": 2}
    assert router.demand is not None
    kinds = [e.kind for e in router.news.latest]
    assert kinds.count("load_failed") == 2 and "resume" in kinds  # a loaded again after its swap


def test_requests_waiting_for_a_load_are_bounded_by_its_slots_and_queue(
    on_demand: Callable[..., tuple[Any, Router]], started: Counter[str], tiny_model: Path
) -> None:
    import concurrent.futures

    a = _model(tiny_model, "a")
    client, _router = on_demand([a], engine={"a": SlowEngine}, queue_size=1)
    bound = a.options.parallel + 1
    with concurrent.futures.ThreadPoolExecutor(bound + 6) as pool:
        answers = list(pool.map(lambda _: _ask(client, "a"), range(bound + 6)))
    codes = Counter(r.status_code for r in answers)
    assert codes == {200: bound, 429: 6}, [r.text for r in answers]
    refused = next(r for r in answers if r.status_code == 429)
    assert (
        f"wait for a to load: its {a.options.parallel} slot(s) and --queue 1"
        in refused.json()["error"]["message"]
    )
    assert started == {"a": 1}


# -- issue 42 (item 2): a stream of an on-demand model goes on when its formation loses a node


@dataclasses.dataclass(eq=False)
class SayingEngine(HttpEngine):
    """An engine that says its tokens' ids, as llama-server does (`serve.resume` continues its streams)."""

    token_ids: bool = True
    delay: float = 0.02


def test_a_stream_of_an_on_demand_model_goes_on_once_its_formation_is_re_formed(
    on_demand: Callable[..., tuple[Any, Router]], tiny_model: Path
) -> None:
    import json
    import threading

    two = (NODES[0], NODES[1])
    client, router = on_demand([_model(tiny_model, "a", two)], engine={"a": SayingEngine})
    assert _ask(client, "a").status_code == 200  # loaded
    formation = router.formations[0]
    engine = formation.engine
    assert isinstance(engine, SayingEngine)
    events: list[dict[str, Any]] = []

    def stream() -> None:
        body = {"model": "a", "prompt": "hi", "max_tokens": 40, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as answer:
            for line in answer.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    deadline = time.monotonic() + 10
    while engine.chunks < 5:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.01)
    assert isinstance(formation.fleet, PartFleet)
    formation.fleet.answering = {NODES[0]}  # node 2 lost: the formation is re-formed on node 1
    engine.die()
    reader.join(30)
    assert not reader.is_alive() and "error" not in events[-1], events[-1]
    assert "".join(e["choices"][0]["text"] for e in events) == "".join(f"t{i} " for i in range(40))
    assert len({e["id"] for e in events}) == 1
    assert formation.plan is not None and formation.plan.endpoints == (NODES[0],)
    assert router.metrics.resumed[("/v1/completions", "continued")] == 1
