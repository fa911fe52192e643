"""Serve as a formation of the fleet exporter (`orchestrator.observe`): its state, plan and counters.

Today's serve is one formation, named after its model's API id. The exporter reads the serve's hosts
over SSH on its own interval; over RPC only in its first round, before the load: after it, serve's own
probes (recoveries, rejoins) are the only ones its nodes see.
"""

from __future__ import annotations

from orchestrator.observe.collect import Collector
from orchestrator.observe.snapshot import Formation, FormationDevice
from orchestrator.observe.web import Exporter
from orchestrator.serve.backend import Backend


def formation_of(backend: Backend, name: str, *, probes_itself: bool = True) -> Formation:
    """The serve's formation now (reads counters only: never waits on the worker or the fleet).
    `probes_itself`: the exporter leaves every endpoint of the serve to serve's own probes."""
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
        probes_itself=backend.fleet.endpoints if probes_itself else (),
    )


def observe(backend: Backend, name: str, *, interval: float, timeout: float, forks: int | None) -> Exporter:
    """An exporter of the serve's hosts with the serve as its formation (started by the caller)."""
    collector = Collector(
        backend.fleet.hosts,
        interval=interval,
        timeout=timeout,
        forks=forks,
        # The first round (before the load) reads every node's devices over RPC; later rounds read the
        # nodes over SSH only: serve's own probes (re-plans, rejoins) must never meet one of the exporter's.
        formations=lambda: (formation_of(backend, name, probes_itself=collector.first_round.is_set()),),
        trust_rpc_memory=backend.fleet.trust_rpc_memory,
    )
    exporter = Exporter(collector, collector.formations)
    backend.metrics.on_ttft = exporter.histogram(name, "ttft").observe
    return exporter
