"""serve's on-demand models (`load: on-demand` in a --models file): loaded by the first request that names
them, unloaded when idle past their `idle_unload`, their nodes back in the spare pool.

A request for an on-demand model that no formation serves waits (at most `--queue-timeout`) while one is
made: the model is planned on the free nodes (freshly probed); when it does not fit there, on the free
nodes and those of idle on-demand formations of other models, least recently used first (`swap`, pure,
on the devices each node had when last probed: a node held by an engine answers no probe), which are
then unloaded; when only busy ones would make room, the load waits for them; when even every node
open to on-demand models cannot hold it, the answer is a 503 at once, naming which formation holds which
nodes. A plan decides the fit, so a load never runs out of memory on a node.

One load or unload decision at a time (`_deciding`); each model's load is one task that every request
for it waits on. Everything runs on the serving loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from orchestrator.core.errors import RpcfleetError
from orchestrator.core.log import get_logger
from orchestrator.inventory.model import Host
from orchestrator.planning.formations import FormationError, Formed, ServedModel, form
from orchestrator.planning.plan import PlanDevice
from orchestrator.serve.pool import SparePool
from orchestrator.serve.router import Formation, Router
from orchestrator.serve.states import SERVING, Rejected

Probe = Callable[[Sequence[Host]], Awaitable[tuple[dict[str, str], list[PlanDevice]]]]
Make = Callable[[Formed, str], Formation]
WAIT_STEP = 0.2  # seconds between two looks at a load under way (one loop: a look is cheap)


@dataclass(frozen=True)
class Holder:
    """A formation holding nodes, as the swap sees it: idle (no request admitted or waiting, serving),
    on-demand or always loaded, and when its model was last asked for."""

    name: str
    model: str
    endpoints: tuple[str, ...]
    on_demand: bool
    idle: bool
    last_used: float
    admitted: int = 0


@dataclass(frozen=True)
class Swap:
    """What a load needs: `unload` these idle formations first (none: the free nodes hold it), or `wait`
    for busy ones (the reason), or `never`: the nodes open to the model cannot hold it (the reason)."""

    unload: tuple[str, ...] = ()
    wait: str | None = None
    never: str | None = None


def fits_on(model: ServedModel, hosts: Sequence[Host], devices: Sequence[PlanDevice]) -> Formed | None:
    """The formation of `model` on the fewest of `hosts` that hold it (None: they do not)."""
    some = [d for d in devices if d.endpoint in {h.endpoint for h in hosts}]
    if not some:
        return None
    try:
        formed, _ = form([dataclasses.replace(model, replicas=1, split=False)], hosts, some)
    except FormationError:
        return None
    return formed[0] if formed else None


def swap(
    model: ServedModel,
    free: Sequence[Host],
    holders: Sequence[Holder],
    hosts: Sequence[Host],
    known: dict[str, list[PlanDevice]],
) -> Swap:
    """Which idle on-demand formations to unload so that `model` fits (least recently used first, the
    fewest that make room), judged on each node's devices when last probed (`known`)."""
    by_endpoint = {h.endpoint: h for h in hosts}

    def fits(endpoints: Sequence[str]) -> bool:
        chosen = [by_endpoint[ep] for ep in endpoints if ep in by_endpoint]
        devices = [d for ep in endpoints for d in known.get(ep, [])]
        return fits_on(model, chosen, devices) is not None

    free_eps = [h.endpoint for h in free]
    if fits(free_eps):
        return Swap()
    others = [h for h in holders if h.model != model.name]
    idle = sorted((h for h in others if h.on_demand and h.idle), key=lambda h: h.last_used)
    for count in range(1, len(idle) + 1):
        if fits([*free_eps, *(ep for h in idle[:count] for ep in h.endpoints)]):
            return Swap(unload=tuple(h.name for h in idle[:count]))
    busy = [h for h in others if h.on_demand and not h.idle]
    if fits([*free_eps, *(ep for h in [*idle, *busy] for ep in h.endpoints)]):
        held = ", ".join(f"{h.name} ({h.admitted} request(s)) holds {', '.join(h.endpoints)}" for h in busy)
        return Swap(wait=f"{model.name} waits for nodes in use: {held}")
    always = [h for h in others if not h.on_demand]
    held = "; ".join(f"{h.name} holds {', '.join(h.endpoints)}" for h in always) or "none is held"
    open_to = ", ".join(free_eps + [ep for h in [*idle, *busy] for ep in h.endpoints]) or "none"
    return Swap(
        never=f"{model.name} does not fit on the nodes open to on-demand models ({open_to}); "
        f"always loaded: {held}"
    )


class OnDemand:
    """The on-demand models of a serve: their loads (one task per model), their idle unloads, their state."""

    def __init__(
        self,
        router: Router,
        pool: SparePool,
        models: Sequence[ServedModel],
        hosts: Sequence[Host],
        probe: Probe,
        make: Make,
        known: dict[str, list[PlanDevice]],
    ) -> None:
        self.router = router
        self.pool = pool
        self.models = {m.name: m for m in models}
        self.hosts = list(hosts)
        self.probe = probe
        self.make = make
        self.known = known  # each node's devices when last probed free
        self.last_used: dict[str, float] = dict.fromkeys(self.models, time.monotonic())
        self.waiting: Counter[str] = Counter()  # requests waiting in `ensure`, by model
        self.loads: dict[str, asyncio.Task[None]] = {}
        self.refused: dict[asyncio.Task[None], tuple[float, str]] = {}  # loads that placed nothing: when, why
        self.deadlines: dict[str, float] = {}  # by model: when its last waiting request gives up
        self.stopping: set[asyncio.Task[None]] = set()  # engines being stopped by an unload
        self.failures: dict[str, str] = {}  # the last failure to load, by model (for /health)
        self.unloads: Counter[str] = Counter()  # idle unloads and swaps, by model
        self._deciding = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None

    # -- state
    def state(self, model: str) -> str:
        """loaded (a formation serves), loading, unloaded; or, for a formation that neither serves nor
        loads, its own state (recovering, draining, failed: unloaded by the next request or swap)."""
        formations = [f for f in self.router.formations if f.model == model]
        states = {f.backend.state for f in formations}
        if states & SERVING:
            return "loaded"
        task = self.loads.get(model)
        if "loading" in states or (not formations and task is not None and not task.done()):
            return "loading"
        for state in ("recovering", "draining", "failed"):
            if state in states:
                return state
        return "unloaded"

    def loading(self) -> list[str]:
        return [m for m in self.models if self.state(m) == "loading"]

    def health(self) -> dict[str, dict[str, object]]:
        now = time.monotonic()
        return {
            name: {
                "state": self.state(name),
                "idle_unload": model.idle_unload,
                "idle_seconds": round(now - self.last_used[name], 1),
                "unloads": self.unloads[name],
                "last_failure": self.failures.get(name),
            }
            for name, model in self.models.items()
        }

    # -- requests
    async def ensure(self, name: str, wait: float) -> None:
        """Return once a formation of the on-demand model `name` serves (loading it if none does); raise
        Rejected 503 with the reason when it cannot be loaded, or is still loading after `wait` seconds."""
        started = time.monotonic()
        deadline = started + wait
        self.deadlines[name] = max(self.deadlines.get(name, 0.0), deadline)  # its load waits for us all
        retry_after = self.router.config.retry_after
        self.waiting[name] += 1
        try:
            while True:
                self.last_used[name] = time.monotonic()
                formations = [f for f in self.router.formations if f.model == name]
                if any(f.backend.state in SERVING for f in formations):
                    return
                failed = [f for f in formations if f.backend.state == "failed"]
                if failed:
                    self.failures[name] = f"{failed[0].name} failed to load: {failed[0].backend.reason}"
                    await self.unload(failed, why="its load failed")
                    raise Rejected(503, self.failures[name], retry_after)
                task = self.loads.get(name)
                if task is not None and task.done() and not formations:  # it placed nothing
                    refusal = self.refused.get(task)
                    if refusal is not None and refusal[0] >= started:  # refused while we waited
                        raise Rejected(503, refusal[1], retry_after)
                    del self.loads[name]  # done before this request came, or its formation went
                    self.refused.pop(task, None)
                    task = None
                if task is None and not formations:
                    self.loads[name] = asyncio.get_running_loop().create_task(
                        self._bring_up(self.models[name]), name=f"serve-on-demand-{name}"
                    )
                if time.monotonic() >= deadline:
                    raise Rejected(
                        503,
                        f"{name} is loading on demand: not serving after {wait:g} s (--queue-timeout)",
                        retry_after,
                    )
                await asyncio.sleep(WAIT_STEP)
        finally:
            self.waiting[name] -= 1

    async def _bring_up(self, model: ServedModel) -> None:
        """Place `model` (unloading idle ones if that makes room, waiting for busy ones while a request
        for it still waits: `deadlines`) and start its formation; a placement that cannot be made leaves
        its reason in `refused`, for the requests waiting then."""
        task = asyncio.current_task()
        assert task is not None
        while True:
            try:
                async with self._deciding:
                    blocked = await self._place(model)
            except RpcfleetError as exc:
                blocked = Swap(never=f"{model.name} could not be placed: {exc.message}")
            except Exception as exc:  # a bug must answer the waiting requests, not end the task unseen
                get_logger().error("serve_on_demand_failed", model=model.name, error=repr(exc))
                blocked = Swap(never=f"{model.name} could not be placed: {exc!r}")
            if blocked is None:
                return
            if blocked.never is not None or time.monotonic() >= self.deadlines.get(model.name, 0.0):
                why = blocked.never or blocked.wait or model.name
                self.refused[task] = (time.monotonic(), why)
                self.failures[model.name] = why
                get_logger().warning("serve_on_demand_refused", model=model.name, why=why)
                return
            await asyncio.sleep(WAIT_STEP * 5)

    async def _place(self, model: ServedModel) -> Swap | None:
        """One attempt: None once its formation is made on free nodes (after unloading idle ones if that
        makes room), else what stands in the way."""
        if await self._place_on_free(model):
            return None
        decision = swap(model, self.pool.snapshot(), self.holders(), self.hosts, self.known)
        if decision.wait is not None or decision.never is not None:
            return decision
        chosen = [f for f in self.router.formations if f.name in decision.unload]
        await self.unload(chosen, why=f"swapped out for {model.name}")  # idle: nothing to drain
        if decision.unload and await self._place_on_free(model):
            return None
        # a freed server still letting go of its client, or memory that moved since the last probe
        return Swap(wait=f"{model.name}: the free nodes do not hold it yet")

    async def _place_on_free(self, model: ServedModel) -> bool:
        """Probe the free nodes (their devices kept in `known`) and start `model`'s formation on the fewest
        that hold it; whether it did."""
        free = self.pool.snapshot()
        if not free:
            return False
        states, devices = await self.probe(free)
        for endpoint in {d.endpoint for d in devices if d.endpoint is not None}:
            self.known[endpoint] = [d for d in devices if d.endpoint == endpoint]
        formed = fits_on(model, [h for h in free if states.get(h.endpoint) == "ok"], devices)
        if formed is None or self.pool.take_these(formed.choice.endpoints) is None:
            return False
        name = f"{model.name}#{self.router.next_index(model.name)}"
        get_logger().info("serve_on_demand_load", formation=name, nodes=list(formed.choice.endpoints))
        formation = self.make(dataclasses.replace(formed, model=model), name)
        formation.backend.on_failed = lambda: self._failed(formation)
        self.router.add(formation, formed.plan)
        return True

    def _failed(self, formation: Formation) -> None:
        """Its recovery gave up: unloaded now, its nodes back in the pool (the next request tries again)."""
        self.failures[formation.model] = f"{formation.name} failed: {formation.backend.reason}"
        asyncio.get_running_loop().create_task(
            self.unload([formation], why="it failed"), name=f"serve-unload-{formation.name}"
        )

    def holders(self) -> list[Holder]:
        on_demand = set(self.models)
        held: list[Holder] = []
        for formation in self.router.formations:
            backend = formation.backend
            endpoints = tuple(h.endpoint for h in [*backend.fleet.hosts, *backend.fleet.borrowed])
            idle = (
                formation.model in on_demand
                and backend.admitted == 0
                and self.waiting[formation.model] == 0
                and backend.state not in ("loading", "recovering")
            )
            held.append(
                Holder(
                    formation.name,
                    formation.model,
                    endpoints,
                    formation.model in on_demand,
                    idle,
                    self.last_used.get(formation.model, 0.0),
                    backend.admitted,
                )
            )
        return held

    async def unload(self, formations: Sequence[Formation], why: str = "idle") -> None:
        """Take `formations` out of the router, all before the first wait (no request reaches one of them
        from then on), then stop their engines and put their nodes back in the pool. A stop runs to its
        end even when this is cancelled (serve ending): `stop` waits for it."""
        gone = [f for f in formations if f in self.router.formations]
        for formation in gone:
            self.router.remove(formation)
        for formation in gone:
            stopping = asyncio.get_running_loop().create_task(formation.backend.stop())
            self.stopping.add(stopping)
            stopping.add_done_callback(self.stopping.discard)
            await asyncio.shield(stopping)
            fleet = formation.backend.fleet
            self.pool.put([*fleet.hosts, *fleet.borrowed])
            self.unloads[formation.model] += 1
            get_logger().info("serve_on_demand_unload", formation=formation.name, why=why)

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
            for holder in self.holders():
                model = self.models.get(holder.model)
                if model is None or model.idle_unload is None:
                    continue
                if not holder.idle:
                    self.last_used[holder.model] = now
                elif now - self.last_used[holder.model] >= model.idle_unload:
                    done.append(holder.name)
            await self.unload([f for f in self.router.formations if f.name in done], why="idle")
        return done
