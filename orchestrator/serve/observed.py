"""Serve as a formation of the fleet exporter (`orchestrator.observe`): its state, plan and counters.

Today's serve is one formation, named after its model's API id; the exporter probes the serve's hosts
on its own interval, leaving the nodes the loaded plan holds alone.
"""

from __future__ import annotations

from orchestrator.observe.collect import Collector
from orchestrator.observe.snapshot import Formation, FormationDevice
from orchestrator.observe.web import Exporter
from orchestrator.serve.backend import Backend


def formation_of(backend: Backend, name: str) -> Formation:
    """The serve's formation now (reads counters only: never waits on the worker or the fleet)."""
    metrics, plan = backend.metrics, backend.plan
    admitted = int(backend.health()["queue"]["admitted"])
    devices: tuple[FormationDevice, ...] = ()
    if plan is not None:
        devices = tuple(
            FormationDevice(d.endpoint, d.index, d.n_layers, d.layers_label, d.memory.total)
            for d in plan.devices
            if d.endpoint is not None
        )
    return Formation(
        name=name,
        model=name,
        state=backend.state,
        nodes=plan.endpoints if plan is not None else (),
        slots=1,  # the worker serves one request at a time
        slots_busy=min(admitted, 1),
        requests=dict(metrics.requests),
        prompt_tokens=metrics.prompt_tokens,
        completion_tokens=metrics.completion_tokens,
        recoveries=tuple(r.total for r in metrics.recoveries),
        reloads=metrics.reloads,
        rejoins=len(metrics.rejoins),
        reason=backend.reason,
        devices=devices,
    )


def observe(backend: Backend, name: str, *, interval: float, timeout: float, forks: int | None) -> Exporter:
    """An exporter of the serve's hosts with the serve as its formation (started by the caller)."""
    collector = Collector(
        backend.fleet.hosts,
        interval=interval,
        timeout=timeout,
        forks=forks,
        formations=lambda: (formation_of(backend, name),),
        trust_rpc_memory=backend.fleet.trust_rpc_memory,
    )
    exporter = Exporter(collector, collector.formations)
    backend.metrics.on_ttft = exporter.histogram(name, "ttft").observe
    return exporter
