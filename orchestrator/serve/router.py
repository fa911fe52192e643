"""serve's router: the formations behind the front, and which one takes a request.

Each formation is one `Formation` (one engine on its own servers: slots, queue, recovery, rejoin, reload).
A request goes to a serving formation of its model, skipping those that are loading, recovering or
draining: with `--routing affine` (the default) the one its prompt's prefix maps to while that one has a
free slot, so that a conversation's turns find their prefix in its engine's KV cache, else the least-loaded
(admitted = slots busy + queue; `serve.affinity`). A stream stays on the formation that admitted it
(the route holds that formation). When every serving formation's queue is full: 429. When none serves but
one recovers, the request waits (`admit_or_wait`: woken by the formations' changes, no polling) in the
model's bounded queue (its formations' slots and `--queue`, past it 429) until one serves, at most
`--queue-timeout`; when none serves nor recovers (recovery given up, draining, stopping): 503 with
Retry-After. A model the front does not serve: 404 naming the served ones (with a single model
served, any name goes to it, as llama-server itself does).

Reloads and rolling restarts go one formation at a time: the next starts once the previous serves again,
so a model served by two formations or more always has one answering. The decisions (`serve.affinity`,
`overall`) are pure; the rest reads the formations.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from orchestrator.core.log import get_logger
from orchestrator.engine.shared import Pulse
from orchestrator.serve.affinity import AFFINE, FALLBACK, LEAST_LOADED, Load, reason, route
from orchestrator.serve.demand import Demand
from orchestrator.serve.formation import Formation, Roster
from orchestrator.serve.metrics import (
    EngineScrape,
    Metrics,
    engine_metrics,
    kv_used,
    label_value,
    model_metrics,
)
from orchestrator.serve.news import News
from orchestrator.serve.states import SERVING, FormationState, Rejected, ServeConfig, Ticket
from orchestrator.serve.upstream import Upstream, UpstreamError

ENGINE_SCRAPE_TIMEOUT = 2.0  # seconds a scrape waits for one engine's /metrics
ENGINE_SCRAPE_CACHE = 1.0  # seconds one engine's /metrics text serves the scrapes that follow
STATES = tuple(FormationState)


def overall(states: Sequence[str]) -> str:
    """One state for several formations: ready when all are, degraded when some serve, else the one
    closest to serving (loading, recovering, draining), failed when all failed."""
    if states and all(s == "ready" for s in states):
        return "ready"
    if any(s in SERVING for s in states):
        return "degraded"
    for state in ("loading", "recovering", "draining"):
        if state in states:
            return state
    return "failed"


class Router:
    """The formations of every model served, in the order given (each model's formations together)."""

    def __init__(
        self,
        formations: Sequence[Formation],
        metrics: Metrics | None = None,
        upstream: Upstream | None = None,
        *,
        config: ServeConfig | None = None,
        models: Sequence[str] = (),
        roster: Roster | None = None,
        spares: Callable[[], list[str]] | None = None,
        demand: Callable[[Router], Demand] | None = None,
        observe: Callable[[str, str, float], None] | None = None,
        news: News | None = None,
    ) -> None:
        """`models`: every model served, in order (default: those of `formations`); with on-demand models
        there may be no formation yet (`config` then says the serving limits). `roster`: the one the
        formations were made with (their peers), which then holds them; `spares`: the free spares'
        endpoints (for /health); `demand`: makes the on-demand models' loads and unloads over this router
        (`serve.on_demand.OnDemand`), when some are served; `observe`: each formation's request times,
        (formation, "ttft" | "latency", seconds), into the exporter's histograms (`RequestTimes`); `news`:
        what serve tells as it happens (the on-demand models' events, resumed requests)."""
        if not formations and config is None:
            raise ValueError("a router needs one formation at least, or its config")
        self.roster = roster if roster is not None else Roster()
        self.roster.formations = list(formations)
        self.metrics = metrics or Metrics()  # the front's: requests, tokens, time to first token
        self.config: ServeConfig = config if config is not None else formations[0].config
        self.configured = list(models)
        self._reloading = asyncio.Lock()
        self._reload: asyncio.Task[None] | None = None
        self.routed: Counter[str] = Counter()  # requests admitted, by formation name
        self.routed_by: Counter[tuple[str, str]] = Counter()  # (formation name, why: serve.affinity.reason)
        self._turn = -1  # ties between formations go in turns
        self._scraped: dict[str, tuple[float, str, str]] = {}  # engine url -> (when, /metrics, /slots)
        self.waiting: Counter[str] = Counter()  # by model: requests waiting for a formation to recover
        self.changed = Pulse()  # a formation added or removed (those waiting for a recovery look again)
        self.spares = spares
        self.upstream = upstream or Upstream()  # the one HTTP client to the engines (closed at the end)
        self.observe = observe
        self.news = news if news is not None else News()
        # the on-demand models' loads and unloads, if any: made last, over this router as it is now
        self.demand: Demand | None = demand(self) if demand is not None else None

    @classmethod
    def single(cls, formation: Formation) -> Router:
        """One formation (made alone): the front counts on the formation's own metrics."""
        return cls([formation], formation.metrics)

    @property
    def formations(self) -> list[Formation]:
        """The formations served now (the roster's list: a new one at each change)."""
        return self.roster.formations

    def add(self, formation: Formation, plan: Any = None) -> None:
        """A new formation (made while serving, on spares that answered): after its model's others, and
        started (`plan`: its first load's; requests reach it once it serves)."""
        after = max((i for i, f in enumerate(self.formations) if f.model == formation.model), default=-1)
        at = after + 1 if after >= 0 else len(self.formations)
        # a new list, not a change of the one a request may be reading
        self.roster.formations = [*self.formations[:at], formation, *self.formations[at:]]
        formation.start(plan)
        self.changed.notify()

    def remove(self, formation: Formation) -> None:
        """Take `formation` out: no request reaches it from now on (stopping it is the caller's)."""
        self.roster.formations = [f for f in self.formations if f is not formation]  # a new list, as `add`
        self.changed.notify()

    def next_index(self, model: str) -> int:
        """The number of the next formation of `model` (`MODEL#N`)."""
        taken = [f.name.rpartition("#")[2] for f in self.formations if f.model == model]
        return max((int(n) + 1 for n in taken if n.isdigit()), default=len(taken))

    @property
    def models(self) -> list[str]:
        return self.configured or list(dict.fromkeys(f.model for f in self.formations))

    def model_state(self, model: str) -> str:
        """A model as /v1/models shows it: an on-demand one loaded, loading or unloaded; one loaded at
        start loaded while a formation of it serves, else its formations' state (recovering...)."""
        if self.demand is not None and model in self.demand.models:
            return self.demand.state(model)
        state = overall([f.state for f in self.formations if f.model == model])
        return "loaded" if state in SERVING else state

    @property
    def capacity(self) -> int:
        """Requests the formations admit at most (served and waiting), all together."""
        return sum(f.config.parallel + f.config.queue_size for f in self.formations)

    def of_model(self, model: str | None) -> list[Formation]:
        """The formations serving `model` (Rejected 404 when it is not served)."""
        models = self.models
        if len(models) == 1:
            return self.formations
        chosen = [f for f in self.formations if f.model == model]
        if not chosen and model not in models:
            named = "the request names no model" if model is None else f"the model {model!r} is not served"
            raise Rejected(404, f"{named} (served: {', '.join(models)})")
        return chosen

    async def loaded(self, model: str | None) -> None:
        """Before `admit`: an on-demand model the request names is loaded if no formation serves it (the
        request waits, at most --queue-timeout; Rejected 503 with the reason when it cannot be)."""
        if self.demand is None:
            return
        models = self.models
        name = models[0] if len(models) == 1 else model
        if name in self.demand.models:
            await self.demand.ensure(name, self.config.queue_timeout)

    def admit(self, model: str | None, key: str | None = None) -> tuple[Formation, Ticket]:
        """Admit a request of `model` (affinity `key`: `serve.affinity.affinity_key`) on the formation
        routing picks (`--routing`: affine, else the least-loaded serving one): that formation and the ticket.
        Rejected: 404 (model), 429 (every queue full), 503 (none serving)."""
        formations = self.of_model(model)
        if not formations:  # an on-demand model unloaded since `OnDemand.ensure`
            raise Rejected(503, f"the model {model!r} is not loaded", self.config.retry_after)
        self._turn += 1
        loads = [Load(f.name, f.state, f.admitted, f.config.parallel) for f in formations]
        order, best = route(loads, key, self.config.routing, self._turn)
        full: Rejected | None = None
        for index in order:
            formation = formations[index]
            try:
                ticket = formation.admit()
                self.routed[formations[index].name] += 1
                self.routed_by[(formations[index].name, reason(index, best))] += 1
                return formation, ticket
            except Rejected as exc:  # it stopped serving or filled up meanwhile: the next one
                if exc.status == 429:
                    full = exc
        if full is not None:
            raise full
        raise Rejected(503, self._unavailable(formations), self.config.retry_after)

    def recovering(self, model: str | None) -> bool:
        """Whether a formation of `model` recovers (it should serve again: a request may wait for it)."""
        try:
            return any(f.recovers for f in self.of_model(model))
        except Rejected:
            return False

    async def admit_or_wait(
        self, model: str | None, key: str | None, deadline: float
    ) -> tuple[Formation, Ticket]:
        """`admit`; when no formation of `model` serves but one recovers, wait for one to serve (until
        `deadline`, time.monotonic()) in the model's queue: its formations' slots and `--queue` together,
        past them the 429 of a full queue. Each change of a formation's state wakes the waiters (no
        polling); a waiter cancelled (its client hung up) leaves the queue. Rejected 503 with Retry-After,
        naming the lost nodes: at once when none recovers (given up, draining, stopping), or at
        `deadline`."""
        waiting = False
        try:
            while True:
                try:
                    return self.admit(model, key)
                except Rejected as exc:
                    if exc.status != 503:
                        raise
                    formations = self.of_model(model)
                    if not any(f.recovers for f in formations):
                        raise Rejected(exc.status, exc.message, exc.retry_after, _lost(formations)) from None
                    name = formations[0].model
                    if not waiting:
                        self._queue_place(name, formations)
                        self.waiting[name] += 1
                        waiting = True
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise Rejected(
                            503,
                            f"not serving after {self.config.queue_timeout:g} s (--queue-timeout): "
                            f"{self._unavailable(formations)}",
                            self.config.retry_after,
                            _lost(formations),
                        ) from None
                    await self._any_change(formations, left)
        finally:
            if waiting:
                self.waiting[name] -= 1

    def _queue_place(self, model: str, formations: Sequence[Formation]) -> None:
        """Rejected 429 when the model's queue is full: its formations' slots and `--queue`, taken by the
        requests they admitted and those waiting for a recovery."""
        bound = sum(f.config.parallel + f.config.queue_size for f in formations)
        taken = self.waiting[model] + sum(f.admitted for f in formations)
        if taken >= bound:
            raise Rejected(
                429,
                f"the queue is full: {taken} request(s) wait for {model} to recover "
                f"({bound} places: its slots and --queue)",
            )

    async def _any_change(self, formations: Sequence[Formation], limit: float) -> None:
        """Until a formation of `formations` changes (or one is added or removed), at most `limit` s."""
        waits = [asyncio.ensure_future(f.changed.wait(limit)) for f in formations]
        waits.append(asyncio.ensure_future(self.changed.wait(limit)))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waits:
                waiter.cancel()

    def _unavailable(self, formations: Sequence[Formation]) -> str:
        if len(formations) == 1:
            return formations[0].unavailable()
        states = ", ".join(f"{f.name} {f.state}" for f in formations)
        return f"no formation of {formations[0].model} is serving ({states})"

    # -- state
    @property
    def state(self) -> str:
        """Over the formations loaded at start and the on-demand ones serving (one that loads or fails
        to load does not make serve degraded: /health names it); none of them: ready (loads on demand)."""
        states = [f.state for f in self.counted()]
        return overall(states) if states or self.demand is None else "ready"

    def counted(self) -> list[Formation]:
        """The formations serve's state is judged on (`state`)."""
        on_demand = self.demand.models if self.demand is not None else {}
        return [f for f in self.formations if f.model not in on_demand or f.state in SERVING]

    def summary(self, formation: Formation) -> dict[str, Any]:
        """A formation as /health shows it: model, nodes, state, slots busy, recoveries..."""
        health = formation.health()
        plan = health["plan"]
        return {
            "name": formation.name,
            "model": formation.model,
            "state": health["status"],
            "reason": health["reason"],
            "nodes": plan["endpoints"] if plan else [],
            "slots": formation.config.parallel,
            "slots_busy": health["queue"]["served"],
            "admitted": health["queue"]["admitted"],
            "requests": self.routed[formation.name],
            "engine_pid": health["engine"]["pid"] if health["engine"] else None,
            "lost": health["lost"],
            "recoveries": len(formation.metrics.recoveries),
            "reloads": formation.metrics.reloads,
            "rejoins": len(formation.metrics.rejoins),
            "last_recovery": health["last_recovery"],
        }

    def health(self) -> dict[str, Any]:
        """One formation: its own health (as before formations) and the formations' list; several:
        the overall state, the models and each formation."""
        formations = [self.summary(f) for f in self.formations]
        # the free spares, and by model the requests waiting for a formation of it to recover
        spares: dict[str, Any] = {} if self.spares is None else {"spares": self.spares()}
        spares["waiting"] = {model: self.waiting[model] for model in self.models}
        if len(self.formations) == 1 and self.demand is None:
            return {**self.formations[0].health(), "formations": formations, **spares}
        reasons = [f"{f['name']}: {f['reason']}" for f in formations if f["reason"]]
        on_demand: dict[str, Any] = {}
        if self.demand is not None:
            loading = self.demand.loading()
            reasons = [f"loading {model}" for model in loading] + reasons
            on_demand = {"loading": loading, "on_demand": self.demand.health()}
        return {
            "status": self.state,
            "reason": "; ".join(reasons) or None,
            "pid": os.getpid(),
            "models": self.models,
            "formations": formations,
            **on_demand,
            **spares,
        }

    def endpoint_up(self) -> dict[str, bool]:
        up: dict[str, bool] = {}
        for formation in self.formations:
            up.update(formation.endpoint_up())
        return up

    def combined_metrics(self) -> Metrics:
        """The front's counters with every formation's reloads, recoveries and rejoins."""
        if len(self.formations) == 1 and self.formations[0].metrics is self.metrics:
            return self.metrics
        formations = self.formations
        return dataclasses.replace(
            self.metrics,
            reloads=sum(f.metrics.reloads for f in formations),
            recoveries=sorted(
                (r for f in formations for r in f.metrics.recoveries), key=lambda r: r.detected_at
            ),
            rejoins=sorted((r for f in formations for r in f.metrics.rejoins), key=lambda r: r.at),
        )

    def counters(self, formation: Formation, arrived: float | None = None) -> Counters:
        """Where a request served by `formation` is counted: the front's counters and its own, and
        its times in its formation's histograms (`observe`; `arrived`: its arrival, time.monotonic())."""
        name = next((f.name for f in self.formations if f is formation), None)
        observe = self.observe if name is not None else None
        return Counters(self.metrics, formation.metrics, name or "", observe, arrived)

    async def prometheus(self, *, formations: bool = True) -> str:
        """serve's Prometheus text: the front's counters, the slots with every formation's engine families
        (`formation` and `model` labels), then one series per formation (`formations`; the fleet exporter,
        when on, shows them under the same names, so it alone does then), and the router's own: requests
        routed by reason and each formation's KV cache in use (from its engine's `/slots`)."""
        text = self.combined_metrics().render(self.endpoint_up(), self.state)
        parallel = admitted = 0
        for formation in self.formations:
            states = formation.engine_states()
            parallel += states["parallel"]
            admitted += states["admitted"]
        scrapes = await self.engine_scrapes()
        text += engine_metrics(scrapes, parallel, admitted)
        text += self.formation_metrics() if formations else ""
        text += model_metrics(self.demand.views()) if self.demand is not None else ""
        return text + self.routing_metrics(scrapes)

    async def engine_scrapes(self) -> list[EngineScrape]:
        """Every formation's engine `/metrics` and `/slots`, asked all at once, each bounded by
        `ENGINE_SCRAPE_TIMEOUT` (an engine busy past it is left out of this scrape: a scrape never waits on
        one), and kept `ENGINE_SCRAPE_CACHE` seconds per engine (scrapes in a burst ask each engine once)."""
        now = time.monotonic()

        async def get(url: str, path: str, key: str | None) -> str:
            try:
                body = (await self.upstream.get(url, path, ENGINE_SCRAPE_TIMEOUT, key))[1]
                return body.decode("utf-8", "replace")
            except (UpstreamError, TimeoutError, OSError):
                return ""

        async def one(formation: Formation) -> EngineScrape:
            served = formation.engine_states()["served"]
            engine = formation.engine
            if engine is None:
                return EngineScrape(formation.name, formation.model, "", served)
            cached = self._scraped.get(engine.url)
            if cached is not None and now - cached[0] < ENGINE_SCRAPE_CACHE:
                return EngineScrape(formation.name, formation.model, cached[1], served, cached[2])
            engine_text, slots_text = await asyncio.gather(
                get(engine.url, "/metrics", engine.api_key), get(engine.url, "/slots", engine.api_key)
            )
            self._scraped[engine.url] = (time.monotonic(), engine_text, slots_text)
            return EngineScrape(formation.name, formation.model, engine_text, served, slots_text)

        formations = list(self.formations)
        scrapes = await asyncio.gather(*(one(f) for f in formations))
        live = {f.engine.url for f in formations if f.engine is not None}
        for url in [u for u in self._scraped if u not in live]:  # engines gone
            self._scraped.pop(url, None)
        return list(scrapes)

    def routing_metrics(self, scrapes: Sequence[EngineScrape]) -> str:
        """Requests routed to each formation by reason (`serve.affinity`), and the share of each formation's
        KV cache its slots hold (llama-server's `/slots`: tokens held / context, all slots together and
        each slot; left out where the engine did not answer)."""
        lines = [
            "# HELP rpcfleet_formation_routed_total Requests the router gave the formation, by reason: "
            "affine (the formation of its prompt's prefix), fallback (that one was saturated or not "
            "serving), least_loaded (--routing least-loaded, or a request without a prefix).",
            "# TYPE rpcfleet_formation_routed_total counter",
        ]
        for formation in self.formations:
            labels = f'formation="{label_value(formation.name)}",model="{label_value(formation.model)}"'
            for why in (AFFINE, FALLBACK, LEAST_LOADED):
                n = self.routed_by[(formation.name, why)]
                lines.append(f'rpcfleet_formation_routed_total{{{labels},reason="{why}"}} {n}')
        used = [(scrape, kv_used(scrape.slots)) for scrape in scrapes]
        lines += [
            "# HELP rpcfleet_formation_kv_used_ratio Share of the formation's KV cache (all its slots' "
            "contexts) holding tokens, from llama-server's /slots.",
            "# TYPE rpcfleet_formation_kv_used_ratio gauge",
        ]
        for scrape, kv in used:
            if kv is not None:
                labels = f'formation="{label_value(scrape.formation)}",model="{label_value(scrape.model)}"'
                lines.append(f"rpcfleet_formation_kv_used_ratio{{{labels}}} {kv.ratio:.6g}")
        lines += [
            "# HELP rpcfleet_formation_slot_kv_used_ratio Share of one slot's context holding tokens.",
            "# TYPE rpcfleet_formation_slot_kv_used_ratio gauge",
        ]
        for scrape, kv in used:
            if kv is not None:
                labels = f'formation="{label_value(scrape.formation)}",model="{label_value(scrape.model)}"'
                lines += [
                    f'rpcfleet_formation_slot_kv_used_ratio{{{labels},slot="{slot}"}} {ratio:.6g}'
                    for slot, ratio in kv.slots
                ]
        return "\n".join(lines) + "\n"

    def formation_metrics(self) -> str:
        families: dict[str, tuple[str, str, list[str]]] = {
            "state": ("gauge", "1 for the state the formation is in.", []),
            "nodes": ("gauge", "Nodes (rpc-servers) the formation's loaded plan uses.", []),
            "node": ("gauge", "1 for each endpoint of the formation's loaded plan.", []),
            "slots": ("gauge", "Slots of the formation's engine (--parallel).", []),
            "slots_busy": ("gauge", "Requests holding a slot of the formation's engine.", []),
            "requests_admitted": ("gauge", "Requests admitted by the formation: served and waiting.", []),
            "recoveries_total": ("counter", "Recoveries of the formation after a lost node.", []),
            "reloads_total": ("counter", "Reloads of the formation.", []),
            "rejoins_total": ("counter", "Returns of the formation to more nodes.", []),
        }
        for formation in self.formations:
            summary = self.summary(formation)
            labels = f'formation="{label_value(formation.name)}",model="{label_value(formation.model)}"'
            for state in STATES:
                families["state"][2].append(f'{{{labels},state="{state}"}} {int(summary["state"] == state)}')
            families["nodes"][2].append(f"{{{labels}}} {len(summary['nodes'])}")
            for endpoint in summary["nodes"]:
                families["node"][2].append(f'{{{labels},endpoint="{label_value(endpoint)}"}} 1')
            families["slots"][2].append(f"{{{labels}}} {summary['slots']}")
            families["slots_busy"][2].append(f"{{{labels}}} {summary['slots_busy']}")
            families["requests_admitted"][2].append(f"{{{labels}}} {summary['admitted']}")
            families["recoveries_total"][2].append(f"{{{labels}}} {summary['recoveries']}")
            families["reloads_total"][2].append(f"{{{labels}}} {summary['reloads']}")
            families["rejoins_total"][2].append(f"{{{labels}}} {summary['rejoins']}")
        lines: list[str] = []
        for name, (kind, help_text, samples) in families.items():
            lines += [f"# HELP rpcfleet_formation_{name} {help_text}"]
            lines += [f"# TYPE rpcfleet_formation_{name} {kind}"]
            lines += [f"rpcfleet_formation_{name}{sample}" for sample in samples]
        return "\n".join(lines) + "\n"

    async def slots(self) -> tuple[int, bytes]:
        """llama-server's /slots: one formation's as it is; several: by formation name."""
        if len(self.formations) == 1 and self.demand is None:
            engine = self.formations[0].engine
            if engine is None:
                raise Rejected(503, str(self.health()["status"]), self.config.retry_after)
            return await self.upstream.get(engine.url, "/slots", 5.0, engine.api_key)
        out: dict[str, Any] = {}
        for formation in self.formations:
            engine = formation.engine
            if engine is None:
                out[formation.name] = None
                continue
            try:
                got = await self.upstream.get(engine.url, "/slots", 5.0, engine.api_key)
                out[formation.name] = json.loads(got[1])
            except (UpstreamError, ValueError):
                out[formation.name] = None
        return 200, json.dumps({"formations": out}).encode()

    # -- life
    def start(self, plans: Sequence[Any] | None = None) -> None:
        """Every formation's first load (on the serving loop)."""
        for i, formation in enumerate(self.formations):
            formation.start(plans[i] if plans is not None else None)

    async def stop(self) -> None:
        await asyncio.gather(*(f.stop() for f in self.formations))
        if self._reload is not None:
            self._reload.cancel()

    def reload(self, *, rolling_restart: bool = False) -> asyncio.Task[None]:
        """Reload every formation, one at a time (the next once the previous serves again, or gave up),
        in a task of the serving loop; a second reload waits for the first."""

        async def run() -> None:
            async with self._reloading:
                for formation in self.formations:
                    get_logger().info("serve_reload_formation", formation=formation.name)
                    await formation.reload(rolling_restart=rolling_restart)

        self._reload = asyncio.get_running_loop().create_task(run(), name="serve-reload-all")
        return self._reload


def _lost(formations: Sequence[Formation]) -> tuple[str, ...]:
    """The nodes lost by formations that do not serve (what a 503 names)."""
    lost = (ep for f in formations if f.state not in SERVING for ep in f.lost)
    return tuple(dict.fromkeys(lost))


class Counters:
    """The front's counters and a formation's (one object when a single formation shares the front's),
    and the formation's histograms (`observe`, under the formation's `name`): its time to first token,
    and its request's duration from `arrived` to its answer's end (`record_request`)."""

    def __init__(
        self,
        front: Metrics,
        formation: Metrics,
        name: str = "",
        observe: Callable[[str, str, float], None] | None = None,
        arrived: float | None = None,
    ) -> None:
        self.targets = (front,) if formation is front else (front, formation)
        self.name, self.observe, self.arrived = name, observe, arrived

    def record_request(self, route: str, code: int) -> None:
        for target in self.targets:
            target.record_request(route, code)
        if self.observe is not None and self.arrived is not None:
            self.observe(self.name, "latency", time.monotonic() - self.arrived)

    def record_done(self, prompt: int, completion: int, tokens_per_second: float, ttft: float | None) -> None:
        for target in self.targets:
            target.record_done(prompt, completion, tokens_per_second, ttft)
        if self.observe is not None and ttft is not None:
            self.observe(self.name, "ttft", ttft)
