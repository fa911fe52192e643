"""The `load_check` step: a real load of the plan in a worker process, compared to the prediction."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported lazily at run time: planning pulls in numpy
    from orchestrator.inventory.model import Host
    from orchestrator.llama.observed_placement import Placement
    from orchestrator.planning.plan import MemoryBytes, Plan

LOAD_CHECK_TIMEOUT = 300.0


@dataclass(frozen=True)
class DeviceCheck:
    """One device of a load check: the layers the plan put there and those llama.cpp placed there, and
    the memory predicted and allocated (bytes)."""

    label: str
    endpoint: str | None
    index: int
    planned_layers: tuple[int, ...]
    actual_layers: tuple[int, ...]
    predicted: MemoryBytes
    actual: MemoryBytes

    @property
    def as_planned(self) -> bool:
        return self.planned_layers == self.actual_layers


@dataclass(frozen=True)
class LoadCheckResult:
    """What `load_check` found: whether every device got the layers the plan gave it, how long the load
    took, and each device."""

    layers_as_planned: bool
    load_seconds: float
    devices: tuple[DeviceCheck, ...]

    @classmethod
    def of(cls, placement: Placement) -> LoadCheckResult:
        return cls(
            layers_as_planned=placement.layers_as_planned,
            load_seconds=placement.load_seconds,
            devices=tuple(
                DeviceCheck(
                    d.label, d.endpoint, d.index, d.planned_layers, d.actual_layers, d.predicted, d.actual
                )
                for d in placement.devices
            ),
        )


async def load_check(
    plan: Plan,
    model: str | Path,
    *,
    limit_s: float = LOAD_CHECK_TIMEOUT,
    hosts: Sequence[Host] = (),
) -> LoadCheckResult:
    """Load `model` through `plan` in a worker process (`orchestrator.llama.worker.parent`), unload it, and
    return where its layers went.

    A worker, because a loaded model holds its servers for the life of the process that loaded it (one
    client per server) and the native client aborts its process when a server misbehaves. The worker
    never outlives this call: on a timeout (a `LoaderError` subclass), a cancellation (Ctrl-C, an outer
    timeout) or any other error it is killed and reaped, so the servers are free again.

    `hosts`: the inventory hosts of the plan's endpoints; those with `rpc_transport: ssh` are loaded
    through their SSH forwards (this process's `default_tunnels`); on those with `rpc_cache`, a cache
    file the load would read that is truncated is refused first (`LoaderError` naming the host).
    """
    from orchestrator.engine.executor import Session
    from orchestrator.llama.worker.parent import Worker
    from orchestrator.workflows.load import fleet_targets, prepare_load

    wanted = [h for h in hosts if h.endpoint in plan.endpoints]
    if any(h.rpc_cache for h in wanted):  # refuse a truncated cache file before llama.cpp reads it
        async with Session() as session:
            await prepare_load(session, wanted, plan, model, warm="never")
    targets = await asyncio.to_thread(fleet_targets, wanted) if wanted else {}

    worker = Worker.spawn()
    try:
        placement = await asyncio.to_thread(
            worker.load, plan, model, verbose=False, timeout=limit_s, targets=targets
        )
    except BaseException:
        worker.kill()  # a cancellation leaves the waiting thread behind: the kill ends its wait
        raise
    await asyncio.to_thread(worker.close)
    return LoadCheckResult.of(placement)
