"""Serve's formations as formations of the fleet exporter (`orchestrator.observe`): their state, plan
and counters, each under its own `formation` label.

A single formation is named after its model's API id (as before formations); several are `MODEL#N`. The
exporter reads the serve's hosts over SSH on its own interval; over RPC only in its first round, before
the loads: after it, serve's own probes (recoveries, rejoins) are the only ones its nodes see.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from orchestrator.inventory.model import Host
from orchestrator.observe.collect import Collector
from orchestrator.observe.prometheus import RequestTimes
from orchestrator.observe.snapshot import Event, FormationDevice, FormationView
from orchestrator.observe.web import Exporter
from orchestrator.serve.formation import Formation
from orchestrator.serve.router import Router


def formation_of(formation: Formation, *, probes_itself: bool = True) -> FormationView:
    """One formation now (reads counters only: never waits on the engine or the fleet).
    `probes_itself`: the exporter leaves every endpoint of the formation to serve's own probes."""
    metrics, plan = formation.metrics, formation.plan
    queue = formation.health()["queue"]
    devices: tuple[FormationDevice, ...] = ()
    if plan is not None:
        devices = tuple(
            FormationDevice(d.endpoint, d.index, d.n_layers, d.layers_label, d.memory.total)
            for d in plan.devices
            if d.endpoint is not None
        )
    return FormationView(
        name=formation.name,
        model=formation.model,
        state=formation.state,
        nodes=plan.endpoints if plan is not None else (),
        slots=formation.config.parallel,  # llama-server's slots
        slots_busy=int(queue["served"]),
        requests=dict(metrics.requests),
        prompt_tokens=metrics.prompt_tokens,
        completion_tokens=metrics.completion_tokens,
        recoveries=tuple(r.total for r in metrics.recoveries),
        reloads=metrics.reloads,
        rejoins=len(metrics.rejoins),
        reason=formation.reason,
        devices=devices,
        probes_itself=formation.fleet.endpoints if probes_itself else (),
    )


def formations_of(router: Router, *, probes_itself: bool = True) -> tuple[FormationView, ...]:
    """Every formation of the router (a single one: the front's request and token counters)."""
    if len(router.formations) == 1 and router.demand is None:
        only = router.formations[0]
        one = formation_of(only, probes_itself=probes_itself)
        front = router.metrics
        if front is only.metrics:
            return (one,)
        return (
            dataclasses.replace(
                one,
                requests=dict(front.requests),
                prompt_tokens=front.prompt_tokens,
                completion_tokens=front.completion_tokens,
            ),
        )
    return tuple(formation_of(f, probes_itself=probes_itself) for f in router.formations)


def observe(
    router: Router,
    hosts: Sequence[Host],
    *,
    interval: float,
    timeout: float,
    forks: int | None,
    trust_rpc_memory: bool = False,
    times: RequestTimes | None = None,
) -> Exporter:
    """An exporter of the serve's hosts with the serve's formations (started by the caller), and their
    request histograms (`times`: those the router observes into, `Router(observe=times.observe)`)."""
    seen = 0  # the events the page has (`News.count`)

    def news() -> list[Event]:
        """serve's events since the last round (on-demand loads, unloads, swaps; resumed requests)."""
        nonlocal seen
        recent, seen = router.news.since(seen)
        return [Event(e.at, e.kind, e.formation, f"{e.model}: {e.message}") for e in recent]

    collector = Collector(
        hosts,
        interval=interval,
        timeout=timeout,
        forks=forks,
        # The first round (before the load) reads every node's devices over RPC; later rounds read the
        # nodes over SSH only: serve's own probes (re-plans, rejoins) must never meet one of the exporter's.
        formations=lambda: formations_of(router, probes_itself=collector.first_round.is_set()),
        trust_rpc_memory=trust_rpc_memory,
        events=news,
    )
    return Exporter(collector, collector.formations, times)
