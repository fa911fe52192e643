"""Formations from a probe of the fleet: the planner's fit verdict for `formations.choose`, and the plan
and hosts of each formation chosen (I/O is the caller's: this module takes the probe as given).

Local GPUs (this machine's) join the first formation only: two engines on one GPU would share its memory
unplanned.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from orchestrator.core.errors import PlanError, ProbeError
from orchestrator.inventory.model import Host
from orchestrator.planning.layer_assignment import order_devices
from orchestrator.planning.plan import Plan, PlanDevice, PlanOptions
from orchestrator.planning.profile import ModelProfile
from orchestrator.planning.strategy import make_plan
from orchestrator.serve.formations import Choice, Node, Want, choose


@dataclass(frozen=True)
class ServedModel:
    """One model to serve: its file, API id, plan options (context, --parallel...), the formations asked
    (`replicas` None: auto; `split`) and the servers it may use (None: every selected one)."""

    path: str
    name: str
    profile: ModelProfile
    options: PlanOptions
    replicas: int | None = None
    split: bool = False
    endpoints: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Formed:
    """A formation chosen: its model, the choice (name, endpoints) and the plan it loads first."""

    model: ServedModel
    choice: Choice
    plan: Plan
    hosts: tuple[Host, ...]


@dataclass
class SparePool:
    """Servers no formation holds: a formation that no longer fits on its own nodes takes one."""

    hosts: list[Host] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def take(self) -> Host | None:
        with self._lock:
            return self.hosts.pop(0) if self.hosts else None


def nodes_of(devices: Sequence[PlanDevice]) -> list[Node]:
    """The probed RPC devices grouped by endpoint (first-seen order), as `choose` sees them."""
    grouped: dict[str, list[PlanDevice]] = {}
    for device in devices:
        if device.endpoint is not None:
            grouped.setdefault(device.endpoint, []).append(device)
    return [Node(ep, len(devs), sum(d.usable for d in devs)) for ep, devs in grouped.items()]


def form(
    models: Sequence[ServedModel],
    hosts: Sequence[Host],
    devices: Sequence[PlanDevice],
    local_gpus: Sequence[PlanDevice] = (),
    local_devices: Sequence[str] | None = None,
) -> tuple[list[Formed], list[Host]]:
    """The formations of `models` on the probed `devices` (answering nodes only) and the spare servers
    left over; FormationError when a model gets none (or fewer than its --replicas)."""
    by_name = {m.name: m for m in models}
    plans: dict[tuple[str, tuple[str, ...]], Plan | None] = {}

    def plan_of(model: str, endpoints: tuple[str, ...], local: bool = False) -> Plan | None:
        key = (model, endpoints)
        if key not in plans or local:
            served = by_name[model]
            chosen = [d for d in devices if d.endpoint in endpoints]
            try:
                plan = make_plan(
                    order_devices(chosen, local_gpus if local else (), local_devices if local else []),
                    served.profile,
                    served.options,
                )
            except (PlanError, ProbeError):
                plan = None
            if local:
                return plan
            plans[key] = plan
        return plans[key]

    def fits(model: str, endpoints: tuple[str, ...]) -> bool:
        plan = plan_of(model, endpoints)
        return plan is not None and plan.fit.fits

    wants = [Want(m.name, m.replicas, m.split, m.endpoints) for m in models]
    choices = choose(wants, nodes_of(devices), fits)
    host_of = {h.endpoint: h for h in hosts}
    chosen = {ep for c in choices for ep in c.endpoints}
    formed: list[Formed] = []
    for i, choice in enumerate(choices):
        plan = plan_of(choice.model, choice.endpoints, local=i == 0 and bool(local_gpus))
        if plan is None or not plan.fit.fits:  # with the local GPUs it did not fit: without them
            plan = plan_of(choice.model, choice.endpoints)
        assert plan is not None  # `choose` only returns groups that fit
        members = [host_of[ep] for ep in choice.endpoints]
        model = by_name[choice.model]
        if model.split:  # every server it may use, the silent ones too: it takes them back when they answer
            held = {ep for f in formed for ep in f.choice.endpoints} | {
                h.endpoint for f in formed for h in f.hosts
            }
            members = [
                h
                for h in hosts
                if h.endpoint in choice.endpoints
                or (
                    h.endpoint not in chosen
                    and h.endpoint not in held
                    and (model.endpoints is None or h.endpoint in model.endpoints)
                )
            ]
        formed.append(Formed(model, choice, plan, tuple(members)))
    held = {h.endpoint for f in formed for h in f.hosts}
    spares = [h for h in hosts if h.endpoint not in held]
    return formed, spares
