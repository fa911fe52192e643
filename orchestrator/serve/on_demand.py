"""serve's on-demand models (`load: on-demand` in a --models file): loaded by the first request that names
them, unloaded when idle past their `idle_unload`, their nodes back in the spare pool.

A request for an on-demand model that no formation serves waits (at most `--queue-timeout`) while one is
made: the model is planned on the free nodes (freshly probed); when it does not fit there, on the free
nodes and those of idle on-demand formations of other models, least recently used first (`serve.swap`,
pure, on the devices each node had when last probed: a node held by an engine answers no probe), which
are then unloaded; when only busy ones (or ones within their residency or swap cooldown) would make room,
the load waits for them, or is refused at once with the time left when that outlasts the request's wait;
when even every node open to on-demand models cannot hold it, the answer is a 503 at once, naming which
formation holds which nodes. A plan decides the fit, so a load never runs out of memory on a node.

A model whose load failed is in backoff (`serve.swap.backoff`): its requests get a 503 with the failure
and a Retry-After, and nothing is evicted for it, until the backoff ends. Requests waiting for a load are
bounded by the model's slots and `--queue` (429 beyond), and wait on a `Pulse`, woken when the load ends.

Each load, unload, swap, resume (a load of a model unloaded before) and failed load is an event
(the router's `News`: the console's line, the live page's events) and a counter (`/metrics`, `model_metrics`).
One load or unload decision at a time (`_deciding`); each model's load is one task that every request
for it waits on. Everything runs on the serving loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

from orchestrator.core.errors import RpcfleetError
from orchestrator.core.log import get_logger
from orchestrator.engine.shared import Pulse
from orchestrator.inventory.model import Host
from orchestrator.planning.formations import PlannedFormation, ServedModel
from orchestrator.planning.plan import PlanDevice
from orchestrator.serve.formation import Formation
from orchestrator.serve.metrics import ModelView
from orchestrator.serve.pool import SparePool
from orchestrator.serve.router import Router
from orchestrator.serve.states import SERVING, FormationState, Rejected
from orchestrator.serve.swap import (
    BACKOFF_FIRST,
    BACKOFF_MAX,
    Occupant,
    Swap,
    backoff,
    fits_on,
    swap,
    swappable_at,
)

Probe = Callable[[Sequence[Host]], Awaitable[tuple[dict[str, str], list[PlanDevice]]]]
# a formation chosen, its name, what it calls when its load fails -> the formation to add (its first load
# not recovered: a failed load is the model's backoff, not a recovery)
Make = Callable[[PlannedFormation, str, Callable[[Formation], None]], Formation]
RETRY_STEP = 1.0  # seconds between two placements of a load waiting for nodes in use


class OnDemand:
    """The on-demand models of a serve: their loads (one task per model), their idle unloads, their state.
    Its events go to the router's `News`; `backoff_first`, `backoff_max`: the failed loads' backoff."""

    def __init__(
        self,
        router: Router,
        pool: SparePool,
        models: Sequence[ServedModel],
        hosts: Sequence[Host],
        probe: Probe,
        make: Make,
        known: dict[str, list[PlanDevice]],
        *,
        backoff_first: float = BACKOFF_FIRST,
        backoff_max: float = BACKOFF_MAX,
    ) -> None:
        self.router = router
        self.pool = pool
        self.models = {m.name: m for m in models}
        self.hosts = list(hosts)
        self.probe = probe
        self.make = make
        self.known = known  # each node's devices when last probed free
        self.backoff_first, self.backoff_max = backoff_first, backoff_max
        self.last_used: dict[str, float] = dict.fromkeys(self.models, time.monotonic())
        self.waiting: Counter[str] = Counter()  # requests waiting in `ensure`, by model
        self.loads: dict[str, asyncio.Task[None]] = {}
        # loads that placed nothing: when, why, the Retry-After
        self.refused: dict[asyncio.Task[None], tuple[float, str, int]] = {}
        self.deadlines: dict[str, float] = {}  # by model: when its last waiting request gives up
        self.stopping: set[asyncio.Task[None]] = set()  # engines being stopped by an unload
        self.failures: dict[str, str] = {}  # the last failure to load, by model (for /health)
        self.failed_loads: Counter[str] = Counter()  # failed loads in a row, by model (the backoff's)
        self.retry_at: dict[str, float] = {}  # by model in backoff: when its next load may start
        self.loaded_at: dict[str, float] = {}  # by model: when its formation began serving
        self.load_seconds: dict[str, float] = {}  # by model: its last load, placement to serving
        self.started_loads: Counter[str] = Counter()  # loads started (resumes included), by model
        self.load_failures: Counter[str] = Counter()  # failed loads, by model
        self.unloads: Counter[str] = Counter()  # idle unloads, swaps and failed ones, by model
        self.unloads_by: Counter[tuple[str, str]] = Counter()  # (model, idle | swap | failed)
        self.changed = Pulse()  # wakes the requests waiting in `ensure`: a load ended, a model failed
        self._deciding = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None

    # -- state
    def state(self, model: str) -> str:
        """loaded (a formation serves), loading, backoff (its last load failed, the next waits),
        unloaded; or, for a formation that neither serves nor loads, its own state (recovering, draining,
        failed: unloaded by the next request or swap)."""
        formations = [f for f in self.router.formations if f.model == model]
        states = {f.state for f in formations}
        if states & SERVING:
            return "loaded"
        task = self.loads.get(model)
        if "loading" in states or (not formations and task is not None and not task.done()):
            return "loading"
        for state in ("recovering", "draining", "failed"):
            if state in states:
                return state
        return "backoff" if self._backoff_left(model) > 0 else "unloaded"

    def loading(self) -> list[str]:
        return [m for m in self.models if self.state(m) == "loading"]

    def health(self) -> dict[str, dict[str, object]]:
        now = time.monotonic()
        return {
            name: {
                "state": self.state(name),
                "idle_unload": model.idle_unload,
                "idle_seconds": round(now - self.last_used[name], 1),
                "loads": self.started_loads[name],
                "unloads": self.unloads[name],
                "last_failure": self.failures.get(name),
                "failed_loads": self.failed_loads[name],
                "retry_after": math.ceil(self._backoff_left(name)) or None,
                "waiting": self.waiting[name],
            }
            for name, model in self.models.items()
        }

    def views(self) -> list[ModelView]:
        """Each on-demand model's counters and state (`/metrics`)."""
        return [
            ModelView(
                name,
                self.state(name),
                self.started_loads[name],
                self.load_failures[name],
                {why: n for (model, why), n in self.unloads_by.items() if model == name},
                self.waiting[name],
                self.load_seconds.get(name),
                self._backoff_left(name),
            )
            for name in self.models
        ]

    def _tell(self, kind: str, model: str, formation: str, message: str) -> None:
        get_logger().info(f"serve_on_demand_{kind}", model=model, formation=formation, message=message)
        self.router.news.tell(kind, model, formation, message)

    # -- requests
    async def ensure(self, name: str, wait: float) -> None:
        """Return once a formation of the on-demand model `name` serves (loading it if none does); raise
        Rejected: 503 with the reason when it cannot be loaded, is in backoff, or is still loading after
        `wait` seconds; 429 when its slots and queue are already taken by requests waiting for it."""
        if self._serving(name):
            self.last_used[name] = time.monotonic()
            return
        self._refuse_in_backoff(name)
        model, config = self.models[name], self.router.config
        bound = model.options.parallel + config.queue_size
        if self.waiting[name] >= bound:
            raise Rejected(
                429,
                f"{self.waiting[name]} request(s) already wait for {name} to load: its "
                f"{model.options.parallel} slot(s) and --queue {config.queue_size} are taken",
            )
        started = time.monotonic()
        deadline = started + wait
        self.deadlines[name] = max(self.deadlines.get(name, 0.0), deadline)  # its load waits for us all
        self.waiting[name] += 1
        try:
            while True:
                now = time.monotonic()
                self.last_used[name] = now
                if self._serving(name):
                    return
                self._refuse_in_backoff(name)  # its load failed while we waited
                formations = [f for f in self.router.formations if f.model == name]
                task = self.loads.get(name)
                if task is not None and task.done() and not formations:  # it placed nothing
                    refusal = self.refused.get(task)
                    if refusal is not None and refusal[0] >= started:  # refused while we waited
                        raise Rejected(503, refusal[1], refusal[2])
                    del self.loads[name]  # done before this request came, or its formation went
                    self.refused.pop(task, None)
                    task = None
                if task is None and not formations:
                    task = self.loads[name] = asyncio.get_running_loop().create_task(
                        self._bring_up(model), name=f"serve-on-demand-{name}"
                    )
                    task.add_done_callback(lambda _: self.changed.notify())
                if now >= deadline:
                    raise Rejected(
                        503,
                        f"{name} is loading on demand: not serving after {wait:g} s (--queue-timeout)",
                        config.retry_after,
                    )
                # the load's end wakes us (its task); a formation of ours that recovers, its own
                pulse = self.changed if task is not None and not task.done() else formations[0].changed
                await pulse.wait(deadline - now)
        finally:
            self.waiting[name] -= 1

    def _serving(self, name: str) -> bool:
        return any(f.model == name and f.state in SERVING for f in self.router.formations)

    def _backoff_left(self, name: str) -> float:
        return max(0.0, self.retry_at.get(name, 0.0) - time.monotonic())

    def _refuse_in_backoff(self, name: str) -> None:
        left = self._backoff_left(name)
        if left > 0:
            raise Rejected(
                503,
                f"{name} is not loaded: its last load failed ({self.failures.get(name)}); "
                f"{self.failed_loads[name]} failed load(s) in a row, next try in {math.ceil(left)} s",
                math.ceil(left),
            )

    async def _bring_up(self, model: ServedModel) -> None:
        """Place `model` (unloading idle ones if that makes room, waiting for busy ones while a request
        for it still waits: `deadlines`), start its formation and wait until it serves or fails; a
        placement that cannot be made leaves its reason in `refused`, for the requests waiting then."""
        task = asyncio.current_task()
        assert task is not None
        retry_after = self.router.config.retry_after
        while True:
            try:
                async with self._deciding:
                    blocked = await self._place(model)
            except RpcfleetError as exc:
                blocked = Swap(never=f"{model.name} could not be placed: {exc.message}")
            except Exception as exc:  # a bug must answer the waiting requests, not end the task unseen
                get_logger().error("serve_on_demand_failed", model=model.name, error=repr(exc))
                blocked = Swap(never=f"{model.name} could not be placed: {exc!r}")
            if isinstance(blocked, Formation):
                await self._until_served(blocked)
                return
            left = self.deadlines.get(model.name, 0.0) - time.monotonic()
            # protected formations that outlast every waiting request: refused now, with the time left
            if blocked.never is not None or left <= 0 or blocked.ready_in > left:
                why = blocked.never or blocked.wait or model.name
                later = math.ceil(blocked.ready_in) if blocked.ready_in > 0 else retry_after
                self.refused[task] = (time.monotonic(), why, later)
                get_logger().warning("serve_on_demand_refused", model=model.name, why=why)
                return
            await asyncio.sleep(min(RETRY_STEP, blocked.ready_in) if blocked.ready_in > 0 else RETRY_STEP)

    async def _until_served(self, formation: Formation) -> None:
        """Wait for `formation`'s first load: serving (the model's backoff over), or failed (`_failed`)."""
        started = time.monotonic()
        while formation in self.router.formations and formation.state not in (
            *SERVING,
            FormationState.FAILED,
        ):
            await formation.changed.wait()
        if formation.state in SERVING:
            now = time.monotonic()
            self.loaded_at[formation.model] = self.last_used[formation.model] = now
            self.load_seconds[formation.model] = round(now - started, 3)
            self.failed_loads[formation.model] = 0
            self.retry_at.pop(formation.model, None)
            self._tell("loaded", formation.model, formation.name, f"serving after {now - started:.1f} s")

    async def _place(self, model: ServedModel) -> Formation | Swap:
        """One attempt: its formation once made on free nodes (after unloading idle ones if that makes
        room), else what stands in the way."""
        made = await self._place_on_free(model)
        if made is not None:
            return made
        now = time.monotonic()
        decision = swap(model, self.pool.snapshot(), self.occupants(now), self.hosts, self.known, now)
        if decision.wait is not None or decision.never is not None:
            return decision
        chosen = [f for f in self.router.formations if f.name in decision.unload]
        await self.unload(chosen, why=f"swapped out for {model.name}", reason="swap")  # idle: no drain
        if decision.unload:
            made = await self._place_on_free(model)
            if made is not None:
                return made
        # a freed server still letting go of its client, or memory that moved since the last probe
        return Swap(wait=f"{model.name}: the free nodes do not hold it yet")

    async def _place_on_free(self, model: ServedModel) -> Formation | None:
        """Probe the free nodes (their devices kept in `known`) and start `model`'s formation on the fewest
        that hold it: the formation, or None."""
        free = self.pool.snapshot()
        if not free:
            return None
        states, devices = await self.probe(free)
        for endpoint in {d.endpoint for d in devices if d.endpoint is not None}:
            self.known[endpoint] = [d for d in devices if d.endpoint == endpoint]
        formed = fits_on(model, [h for h in free if states.get(h.endpoint) == "ok"], devices)
        if formed is None or self.pool.take_these(formed.choice.endpoints) is None:
            return None
        name = f"{model.name}#{self.router.next_index(model.name)}"
        formation = self.make(dataclasses.replace(formed, model=model), name, self._failed)
        nodes = ", ".join(formed.choice.endpoints)
        self.started_loads[model.name] += 1
        if self.unloads[model.name]:
            self._tell("resume", model.name, name, f"loading again on {nodes}")
        else:
            self._tell("load", model.name, name, f"loading on {nodes}")
        self.router.add(formation, formed.plan)
        return formation

    def _failed(self, formation: Formation) -> None:
        """Its load failed, or its recovery gave up: unloaded now, its nodes back in the pool, and the
        model in backoff (its requests get the failure until the next try)."""
        model = formation.model
        self.failures[model] = f"{formation.name} {formation.reason or 'failed'}"
        self.failed_loads[model] += 1
        self.load_failures[model] += 1
        wait = backoff(self.failed_loads[model], self.backoff_first, self.backoff_max)
        self.retry_at[model] = time.monotonic() + wait
        self._tell("load_failed", model, formation.name, f"{self.failures[model]}; next try in {wait:g} s")
        self.router.remove(formation)  # now: a swap must not take it for an idle formation meanwhile
        self.changed.notify()
        asyncio.get_running_loop().create_task(
            self._stop([formation], why="it failed", reason="failed"), name=f"serve-unload-{formation.name}"
        )

    def occupants(self, now: float | None = None) -> list[Occupant]:
        on_demand = set(self.models)
        config = self.router.config
        now = time.monotonic() if now is None else now
        held: list[Occupant] = []
        for formation in self.router.formations:
            model = formation.model
            endpoints = tuple(h.endpoint for h in [*formation.fleet.hosts, *formation.fleet.borrowed])
            idle = (
                model in on_demand
                and formation.admitted == 0
                and self.waiting[model] == 0
                and formation.state not in (FormationState.LOADING, FormationState.RECOVERING)
            )
            last_used = self.last_used.get(model, 0.0)
            kept = 0.0
            if model in on_demand and formation.state in SERVING:  # a failed one may go at once
                kept = swappable_at(
                    self.loaded_at.get(model),
                    self.load_seconds.get(model),
                    last_used,
                    config.min_resident,
                    config.swap_cooldown,
                )
            held.append(
                Occupant(
                    formation.name,
                    model,
                    endpoints,
                    model in on_demand,
                    idle,
                    last_used,
                    formation.admitted,
                    kept,
                )
            )
        return held

    async def unload(self, formations: Sequence[Formation], why: str = "idle", reason: str = "idle") -> None:
        """Take `formations` out of the router, all before the first wait (no request reaches one of them
        from then on), then stop their engines and put their nodes back in the pool (`reason`: idle, swap
        or failed, as counted). A stop runs to its end even when this is cancelled (serve ending): `stop`
        waits for it."""
        gone = [f for f in formations if f in self.router.formations]
        for formation in gone:
            self.router.remove(formation)
        await self._stop(gone, why, reason)

    async def _stop(self, gone: Sequence[Formation], why: str, reason: str) -> None:
        """Stop the engines of `gone` (out of the router) and put their nodes back in the pool."""
        for formation in gone:
            stopping = asyncio.get_running_loop().create_task(formation.stop())
            self.stopping.add(stopping)
            stopping.add_done_callback(self.stopping.discard)
            await asyncio.shield(stopping)
            fleet = formation.fleet
            self.pool.put([*fleet.hosts, *fleet.borrowed])
            self.unloads[formation.model] += 1
            self.unloads_by[(formation.model, reason)] += 1
            self.loaded_at.pop(formation.model, None)
            kind = "swap" if reason == "swap" else "unload"
            self._tell(kind, formation.model, formation.name, f"unloaded: {why}")
        self.changed.notify()

    # -- idle unloads
    def start(self) -> None:
        if any(m.idle_unload is not None for m in self.models.values()):
            self._watch = asyncio.get_running_loop().create_task(self._idle_watch(), name="serve-idle")

    async def stop(self) -> None:
        tasks = [t for t in [self._watch, *self.loads.values()] if t is not None]
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*self.stopping, return_exceptions=True)  # engines being unloaded: closed

    async def _idle_watch(self) -> None:
        limits = [m.idle_unload for m in self.models.values() if m.idle_unload is not None]
        step = min(1.0, min(limits) / 4)
        while True:
            await asyncio.sleep(step)
            try:
                await self.unload_idle()
            except Exception as exc:  # one failed round must not end the watch
                get_logger().warning("serve_idle_unload_failed", error=repr(exc))

    async def unload_idle(self) -> list[str]:
        """Unload the on-demand formations idle past their model's `idle_unload`: their names."""
        now = time.monotonic()
        done: list[str] = []
        async with self._deciding:
            for occupant in self.occupants(now):
                model = self.models.get(occupant.model)
                if model is None or model.idle_unload is None:
                    continue
                if not occupant.idle:
                    self.last_used[occupant.model] = now
                elif now - self.last_used[occupant.model] >= model.idle_unload:
                    done.append(occupant.name)
            chosen = [f for f in self.router.formations if f.name in done]
            await self.unload(chosen, why=f"idle past {_seconds(chosen, self.models)}", reason="idle")
        return done


def _seconds(formations: Sequence[Formation], models: dict[str, ServedModel]) -> str:
    limits = {models[f.model].idle_unload for f in formations if f.model in models}
    return ", ".join(f"{s:g} s" for s in sorted(x for x in limits if x is not None)) or "its idle_unload"
