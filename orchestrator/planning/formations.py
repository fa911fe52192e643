"""Formations: which servers hold which copy of which model (pure: no I/O; the probe is given).

A formation is one engine (llama-server) with its own RPC endpoints holding one copy of one model. One
client process takes at most `MAX_RPC_DEVICES` RPC devices (llama.cpp has 16 scheduler backends and the
CPU is one of them), and an RPC server serves one client at a time, so formations never share a server.

`choose` decides them from the probed nodes and a `fits(model, endpoints)` verdict (the planner's, not a
heuristic):
- `--split`: one formation over every node the model may use (today's behaviour);
- `--replicas auto`: the fewest nodes on which the model fits (tried on the largest nodes first), then as
  many disjoint such groups as the nodes hold;
- `--replicas N`: N such groups (an error when the nodes hold fewer).
Several models take their groups in turns (one each, then again), so none takes the whole fleet first.
Nodes left over are spares: a formation that loses a node may re-plan with one.

`form` asks the planner for the verdict and returns each formation with the plan it loads first; `grow`
makes new formations on spares by the same rules. Local GPUs (this machine's) join the first formation
only: two engines on one GPU would share its memory unplanned. `plan`, `report` and `serve` all decide
formations here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from orchestrator.core.errors import PlanError, ProbeError
from orchestrator.inventory.model import Host
from orchestrator.planning.draft import DraftModel
from orchestrator.planning.layer_assignment import order_devices
from orchestrator.planning.plan import Plan, PlanDevice, PlanOptions
from orchestrator.planning.profile import ModelProfile
from orchestrator.planning.strategy import fits as plan_fits
from orchestrator.planning.strategy import make_plan

MAX_RPC_DEVICES = 15  # GGML_SCHED_MAX_BACKENDS (16) less the CPU


class FormationError(Exception):
    """The formations asked for cannot be made (the message says which model and why)."""


@dataclass(frozen=True)
class Node:
    """A node (one rpc-server) as the choice sees it: its endpoint, devices and usable bytes."""

    endpoint: str
    devices: int = 1
    usable: int = 0


@dataclass(frozen=True)
class Want:
    """What one model asks for: `replicas` None is auto; `split` one formation over all its nodes;
    `endpoints` the nodes it may use (None: every node)."""

    model: str
    replicas: int | None = None
    split: bool = False
    endpoints: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Choice:
    """One formation: its model and its endpoints (in the fleet's order)."""

    model: str
    endpoints: tuple[str, ...]
    index: int  # its number among the model's formations

    @property
    def name(self) -> str:
        return f"{self.model}#{self.index}"


Fits = Callable[[str, tuple[str, ...]], bool]


def choose(wants: Sequence[Want], nodes: Sequence[Node], fits: Fits) -> list[Choice]:
    """The formations of every model (see the module's doc); raises FormationError."""
    if not nodes:
        raise FormationError("no node answers")
    order = {n.endpoint: i for i, n in enumerate(nodes)}
    used: set[str] = set()
    made: dict[str, list[tuple[str, ...]]] = {w.model: [] for w in wants}

    def allowed(want: Want) -> list[Node]:
        pool = [n for n in nodes if want.endpoints is None or n.endpoint in want.endpoints]
        return [n for n in pool if n.endpoint not in used]

    def in_order(group: Sequence[Node]) -> tuple[str, ...]:
        return tuple(sorted((n.endpoint for n in group), key=order.__getitem__))

    for want in wants:  # a split takes every node it may use, first
        if not want.split:
            continue
        group = allowed(want)
        if not group:
            raise FormationError(f"{want.model}: no node left to serve it")
        devices = sum(n.devices for n in group)
        if devices > MAX_RPC_DEVICES:
            raise FormationError(
                f"{want.model}: --split over {len(group)} nodes has {devices} RPC devices; one engine "
                f"takes at most {MAX_RPC_DEVICES} (use --replicas)"
            )
        endpoints = in_order(group)
        if not fits(want.model, endpoints):
            raise FormationError(f"{want.model}: the model does not fit on its {len(group)} node(s)")
        made[want.model].append(endpoints)
        used.update(endpoints)

    sizes: dict[str, int] = {}
    for want in wants:
        if want.split:
            continue
        size = smallest_group(want, allowed(want), fits, in_order)
        if size is None:
            raise FormationError(
                f"{want.model}: the model does not fit on the {len(allowed(want))} node(s) it may use"
            )
        sizes[want.model] = size

    active = [w for w in wants if not w.split]
    while active:
        for want in list(active):
            chosen = next_group(want, allowed(want), sizes[want.model], fits, in_order)
            if chosen is None:
                active.remove(want)
                continue
            made[want.model].append(chosen)
            used.update(chosen)
            if want.replicas is not None and len(made[want.model]) >= want.replicas:
                active.remove(want)

    choices: list[Choice] = []
    for want in wants:
        groups = made[want.model]
        if want.replicas is not None and len(groups) < want.replicas:
            raise FormationError(
                f"{want.model}: --replicas {want.replicas} asked, the nodes hold {len(groups)} "
                f"formation(s) of {sizes.get(want.model, 0)} node(s)"
            )
        choices += [Choice(want.model, group, i) for i, group in enumerate(groups)]
    return choices


def largest_first(nodes: Sequence[Node]) -> list[Node]:
    return sorted(nodes, key=lambda n: -n.usable)  # stable: equal nodes keep the fleet's order


def smallest_group(
    want: Want,
    nodes: Sequence[Node],
    fits: Fits,
    in_order: Callable[[Sequence[Node]], tuple[str, ...]],
) -> int | None:
    """The fewest nodes on which the model fits, tried on the largest ones (None: not on all of them)."""
    ranked = largest_first(nodes)
    devices = 0
    for size, node in enumerate(ranked, start=1):
        devices += node.devices
        if devices > MAX_RPC_DEVICES:
            return None
        if fits(want.model, in_order(ranked[:size])):
            return size
    return None


def next_group(
    want: Want,
    free: Sequence[Node],
    size: int,
    fits: Fits,
    in_order: Callable[[Sequence[Node]], tuple[str, ...]],
) -> tuple[str, ...] | None:
    """The next formation of `size` nodes from the free ones: the first ones in the fleet's order when the
    model fits there (so that equal nodes whose free memory moves a little are chosen the same way each
    time), else the largest, grown by the next largest while it does not fit (smaller nodes); None when
    the free nodes hold no more."""
    ranked = largest_first(free)
    if len(ranked) < size:
        return None
    first = free[:size]
    if sum(n.devices for n in first) <= MAX_RPC_DEVICES and fits(want.model, in_order(first)):
        return in_order(first)
    for end in range(size, len(ranked) + 1):
        group = ranked[:end]
        if sum(n.devices for n in group) > MAX_RPC_DEVICES:
            return None
        if fits(want.model, in_order(group)):
            return in_order(group)
    return None


@dataclass(frozen=True)
class ServedModel:
    """One model to serve: its file, API id, plan options (context, --parallel...), the formations asked
    (`replicas` None: auto; `split`), the servers it may use (None: every selected one) and its draft
    model for speculative decoding (planned in each formation's memory)."""

    path: str
    name: str
    profile: ModelProfile
    options: PlanOptions
    replicas: int | None = None
    split: bool = False
    endpoints: tuple[str, ...] | None = None
    on_demand: bool = False  # loaded by its first request (one formation), not at start
    idle_unload: float | None = None  # seconds idle before an on-demand model is unloaded (None: never)
    draft: DraftModel | None = None


@dataclass(frozen=True)
class Formations:
    """What `plan --replicas`, `report --replicas` and `serve` start from: the formations chosen, the
    spare servers, and the --replicas asked ("auto", or a number)."""

    formed: tuple[PlannedFormation, ...]
    spares: tuple[Host, ...]
    replicas: str


@dataclass(frozen=True)
class PlannedFormation:
    """A formation chosen: its model, the choice (name, endpoints) and the plan it loads first."""

    model: ServedModel
    choice: Choice
    plan: Plan
    hosts: tuple[Host, ...]


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
) -> tuple[list[PlannedFormation], list[Host]]:
    """The formations of `models` on the probed `devices` (answering nodes only) and the spare servers
    left over; FormationError when a model gets none (or fewer than its --replicas)."""
    by_name = {m.name: m for m in models}
    plans: dict[tuple[str, tuple[str, ...]], Plan | None] = {}
    # a plan made for devices like these (in order, but for their names): equal nodes plan alike
    alike: dict[tuple[str, tuple[object, ...]], tuple[Plan | None, list[PlanDevice]]] = {}

    def plan_of(model: str, endpoints: tuple[str, ...], local: bool = False) -> Plan | None:
        key = (model, endpoints)
        if key not in plans or local:
            served = by_name[model]
            chosen = [d for d in devices if d.endpoint in endpoints]
            ordered = order_devices(chosen, local_gpus if local else (), local_devices if local else [])
            shape = (model, tuple(_unnamed(d) for d in ordered))
            made = alike.get(shape) if not local else None
            if made is not None and made[0] is None:
                plan = None  # devices like these did not hold it
            else:
                plan = _renamed(made[0], made[1], ordered) if made is not None and made[0] else None
                if plan is None:
                    try:
                        plan = make_plan(ordered, served.profile, served.options, served.draft)
                    except (PlanError, ProbeError):
                        plan = None
                    if not local:
                        alike[shape] = (plan, list(ordered))
            if local:
                return plan
            plans[key] = plan
        return plans[key]

    verdicts: dict[tuple[str, tuple[object, ...]], bool] = {}

    def fits(model: str, endpoints: tuple[str, ...]) -> bool:
        served = by_name[model]
        ordered = order_devices([d for d in devices if d.endpoint in endpoints], (), [])
        shape = (model, tuple(_unnamed(d) for d in ordered))  # equal nodes: one verdict
        if shape not in verdicts:  # the verdict alone: the whole plan only for the groups chosen
            try:
                verdicts[shape] = plan_fits(ordered, served.profile, served.options, served.draft)
            except ProbeError:
                verdicts[shape] = False
        return verdicts[shape]

    wants = [Want(m.name, m.replicas, m.split, m.endpoints) for m in models]
    choices = choose(wants, nodes_of(devices), fits)
    host_of = {h.endpoint: h for h in hosts}
    chosen = {ep for c in choices for ep in c.endpoints}
    formed: list[PlannedFormation] = []
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
        formed.append(PlannedFormation(model, choice, plan, tuple(members)))
    held = {h.endpoint for f in formed for h in f.hosts}
    spares = [h for h in hosts if h.endpoint not in held]
    return formed, spares


def _unnamed(device: PlanDevice) -> tuple[object, ...]:
    """What of a device a plan depends on: all but its endpoint, host and description."""
    return tuple(
        getattr(device, f.name)
        for f in dataclasses.fields(device)
        if f.name not in ("endpoint", "host", "description")
    )


def _renamed(plan: Plan, made_for: Sequence[PlanDevice], devices: Sequence[PlanDevice]) -> Plan | None:
    """`plan` (made for `made_for`) for the devices `devices`, alike but for their names: each planned
    device renamed to its counterpart. None when a note names a device (planned afresh then)."""
    names = {(d.endpoint, d.index): n for d, n in zip(made_for, devices, strict=True)}
    labels = [d.endpoint for d in made_for if d.endpoint is not None]
    if any(label in note for note in plan.notes for label in labels):
        return None
    renamed = []
    for planned in plan.devices:
        new = names.get((planned.endpoint, planned.index))
        if new is None:
            return None
        renamed.append(dataclasses.replace(planned, endpoint=new.endpoint, description=new.description))
    return dataclasses.replace(plan, devices=tuple(renamed))


def grow(
    models: Sequence[ServedModel], hosts: Sequence[Host], devices: Sequence[PlanDevice]
) -> list[PlannedFormation]:
    """New formations on free spares (`hosts`, probed as `devices`: the answering ones only) for the
    models served with `--replicas auto`: by the same rules as at start (the fewest nodes that hold the
    model, disjoint servers, at most 15 RPC devices, the inventory's order), one formation per model in
    turns while the spares hold one. Their `choice.index` counts from 0: the caller numbers them."""
    free = list(hosts)
    made: list[PlannedFormation] = []
    grown = True
    while grown:
        grown = False
        for model in models:
            if model.split or model.replicas is not None:
                continue
            left = {h.endpoint for h in free}
            some = [d for d in devices if d.endpoint in left]
            if not some:
                return made
            try:
                formed, _ = form([dataclasses.replace(model, replicas=1)], free, some)
            except FormationError:  # this model fits on none of them: the next model may
                continue
            made += [dataclasses.replace(f, model=model) for f in formed]  # the model as served
            held = {ep for f in formed for ep in f.choice.endpoints}
            free = [h for h in free if h.endpoint not in held]
            grown = True
    return made
