"""serve's spare servers: their pool, and the watch of them (models served with `--replicas auto`).

A server that did not answer when serve started is a spare (as is one left over); so is a spare that a
formation took after a loss and gave back once its own node returned. Every `interval` seconds the watch
probes the spares (bounded by the probe's timeout); when the answering ones are not those of the last
round, `planning.formations.grow` decides (pure, by the rules of the start) whether they make new
formations: those are taken from the pool, made by `make` and added to the router (which sends them
requests once they serve). Spares that make none stay in the pool, free for the next loss.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence

from orchestrator.core.errors import RpcfleetError
from orchestrator.core.log import get_logger
from orchestrator.inventory.model import Host
from orchestrator.planning.formations import PlannedFormation, ServedModel, grow
from orchestrator.planning.plan import PlanDevice
from orchestrator.serve.formation import Formation
from orchestrator.serve.pool import SparePool
from orchestrator.serve.router import Router

Probe = Callable[[Sequence[Host]], Awaitable[tuple[dict[str, str], list[PlanDevice]]]]
Make = Callable[[PlannedFormation, str], Formation]  # a formation chosen, its name -> the formation to add


class SpareWatch:
    def __init__(
        self,
        router: Router,
        pool: SparePool,
        models: Sequence[ServedModel],
        probe: Probe,
        make: Make,
        interval: float,
    ) -> None:
        self.router = router
        self.pool = pool
        self.models = [m for m in models if not m.split and m.replicas is None]  # `--replicas auto` only
        self.probe = probe
        self.make = make
        self.interval = interval
        self.states: dict[str, str] = {}  # the spares' last probe states (for /health's nodes)
        self._answered: frozenset[str] = frozenset()  # the answering spares the last decision saw
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """The watch, as a task of the serving loop."""
        if not self.models or self.interval <= 0:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="serve-spares")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.round()
            except Exception as exc:  # one failed round must not end the watch
                get_logger().warning("serve_spares_failed", error=repr(exc))

    async def round(self) -> list[Formation]:
        """One probe of the spares, and the formations it made (added and started)."""
        spares = self.pool.snapshot()
        if not spares:
            self._answered = frozenset()
            return []
        try:
            states, devices = await self.probe(spares)
        except RpcfleetError as exc:
            get_logger().warning("serve_spares_failed", error=exc.message)
            return []
        self.states = states
        answering = frozenset(ep for ep, state in states.items() if state == "ok")
        if answering == self._answered or not answering:  # nothing new since the last decision
            self._answered = answering
            return []
        self._answered = answering
        formed = grow(self.models, [h for h in spares if h.endpoint in answering], devices)
        added: list[Formation] = []
        for one in formed:
            taken = self.pool.take_these(one.choice.endpoints)
            if taken is None:  # a formation took one of them meanwhile: decide again next round
                self._answered = frozenset()
                continue
            name = f"{one.model.name}#{self.router.next_index(one.model.name)}"
            formation = self.make(one, name)
            get_logger().info("serve_formation_formed", formation=name, nodes=list(one.choice.endpoints))
            self.router.add(formation, one.plan)
            added.append(formation)
        return added
