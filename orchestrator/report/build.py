"""Capacity-planning report (pure): a probed fleet + model profiles + contexts → `Report` → text, Markdown,
JSON or a self-contained HTML page.

For every model × context the planner (`planning.strategy.make_plan`) is run on the fleet's usable
devices and the report keeps its verdict: predicted bytes per device (weights, KV, compute), the binding
device, the shortfall, the largest context that fits. When a model does not fit, the report finds the
smallest change that makes it fit, by re-planning:

* per device: the least usable memory that, added to that device alone, makes the planner's verdict
  "fits" (the re-plan may move layers onto the grown device). Found by a doubling search for an amount
  that fits, then a binary search between the last amount that does not and the first that does, at
  `ReportOptions.resolution` (1 MiB): the amount found fits and one resolution step less does not.
* a new node: the least usable memory of one device added at the end of the device list (a new
  rpc-server), searched the same way.

The smallest per-device amount is "the smallest change"; the new node is the alternative. Amounts are
*usable* bytes: on a node, free memory must grow by that much (reserve and limit stay as they are).

Nothing here does I/O: the CLI (`orchestrator/cli/report.py`) probes, profiles and writes the file.
The JSON document is described in `docs/report-schema.md` (`SCHEMA_VERSION`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from orchestrator.core.errors import PlanError
from orchestrator.core.search import first_true
from orchestrator.core.units import format_size
from orchestrator.planning.devices import to_plan_devices
from orchestrator.planning.formations import Formations
from orchestrator.planning.plan import (
    CTX_PAD,
    MAX_DEVICES,
    MAX_RPC_DEVICES,
    Plan,
    PlanDevice,
    PlannedDevice,
    PlanOptions,
)
from orchestrator.planning.profile import ModelProfile
from orchestrator.planning.strategy import make_plan
from orchestrator.probe.fleet import FleetProbe
from orchestrator.report.formations import FormationLoss, formation_losses
from orchestrator.report.summary import Curve, model_curve
from orchestrator.report.what_if import WhatIf, apply_what_if

# 2: a case's `status` ("beyond_training" is no plain fit), `beyond_training`, `nodes`; the `summary`
SCHEMA_VERSION = 2


MiB = 1024 * 1024


DEFAULT_SEARCH_LIMIT = 1 << 50  # 1 PiB: no single device or node is searched beyond this


NEW_NODE_ENDPOINT = "new-node:50052"  # the placeholder endpoint of the "add a node" re-plan


@dataclass(frozen=True)
class ReportOptions:
    """How plans are made (`plan`; its n_ctx is replaced by each context) and how changes are searched."""

    plan: PlanOptions = field(default_factory=PlanOptions)
    recommend: bool = True
    resolution: int = MiB  # granularity of the smallest-change search, bytes
    search_limit: int = DEFAULT_SEARCH_LIMIT
    generated_at: str | None = None  # a timestamp the caller supplies (the report itself has no clock)
    inventory: str | None = None  # where the fleet came from, for the reader


@dataclass(frozen=True)
class ReportModel:
    path: str  # as the user named it
    profile: ModelProfile


@dataclass(frozen=True)
class DeviceChange:
    """Usable bytes to add to one device (alone) so the plan fits; `add` None: no amount up to the limit."""

    device: str  # the device's label, `host:port#index`
    host: str | None
    add: int | None


@dataclass(frozen=True)
class Recommendation:
    devices: tuple[DeviceChange, ...]  # one per device the fleet could plan with, in device order
    smallest: DeviceChange | None  # the least `add` among `devices` (first on ties); None: none helps
    new_node: int | None  # usable bytes of one added node that make the plan fit; None: none does
    new_node_note: str | None = None  # why there is no new-node option, when there is none


@dataclass(frozen=True)
class NodeLoss:
    """The case re-planned on the fleet without one node (N-1): whether it still fits, and by how much."""

    endpoint: str
    host: str | None
    fits: bool
    headroom: int  # the binding device's (negative: short by that much); 0 when no plan could be made
    error: str | None = None


@dataclass(frozen=True)
class Case:
    """One model at one context: the plan (None when the planner refused) and what would make it fit."""

    model: str  # ReportModel.path
    n_ctx: int  # as requested (0 = the model's n_ctx_train)
    plan: Plan | None
    error: str | None
    recommendation: Recommendation | None
    n_ctx_train: int = 0  # the model's (0: unknown)
    losses: tuple[NodeLoss, ...] = ()  # N-1, for a case that fits: one per node the plan may use

    @property
    def worst_loss(self) -> NodeLoss | None:
        """The node whose loss hurts most: one that breaks the fit with the largest shortfall, else the
        one that leaves the least headroom (None: no N-1 was made)."""
        return min(self.losses, key=lambda loss: (loss.fits, loss.error is None, loss.headroom), default=None)

    @property
    def fits(self) -> bool:
        return self.plan is not None and self.plan.fit.fits

    @property
    def beyond_training(self) -> bool:
        """Asked past the context the model was trained on: it may load, its answers there are untested."""
        return bool(self.n_ctx_train) and self.n_ctx > self.n_ctx_train

    @property
    def status(self) -> str:
        """fits, beyond_training (fits, past the training context: never a plain fit), short (does not
        fit) or cannot_plan (the planner refused)."""
        if self.plan is None:
            return "cannot_plan"
        if not self.plan.fit.fits:
            return "short"
        return "beyond_training" if self.beyond_training else "fits"

    @property
    def nodes(self) -> tuple[str, ...]:
        """The endpoints that hold some of its layers, in plan order."""
        if self.plan is None:
            return ()
        return tuple(dict.fromkeys(d.endpoint or "local" for d in self.plan.devices if d.n_layers))

    @property
    def binding(self) -> PlannedDevice | None:
        if self.plan is None or self.plan.fit.binding_device is None:
            return None
        return self.plan.devices[self.plan.fit.binding_device]


@dataclass(frozen=True)
class Report:
    schema_version: int
    fleet: FleetProbe
    devices: tuple[PlanDevice, ...]  # what the plans could use: ok nodes' devices, each endpoint once
    models: tuple[ReportModel, ...]
    contexts: tuple[int, ...]
    cases: tuple[Case, ...]  # models × contexts, model-major
    options: ReportOptions
    notes: tuple[str, ...] = ()
    formations: Formations | None = None  # `report --replicas`: the formations serve would choose
    curves: tuple[Curve, ...] = ()  # per model: predicted memory against context
    formation_losses: tuple[FormationLoss, ...] = ()  # N-1 of the formations, one per answering node
    what_if: WhatIf = field(default_factory=WhatIf)  # nodes assumed (--add) and hosts left out (--remove)

    def assumed(self, endpoint: str | None) -> bool:
        """Whether `endpoint` is a hypothetical node (`--add`), not a probed one."""
        return endpoint in self.what_if.assumed_endpoints

    @property
    def capacity(self) -> int:
        """The usable bytes of the devices the plans could use (the curves' capacity line)."""
        return sum(d.usable for d in self.devices)

    def largest_ctx(self, model: str) -> tuple[int, bool]:
        """The largest context that fits of `model`'s cases, and whether the search was capped there."""
        fits = [c.plan.fit for c in self.cases if c.model == model and c.plan is not None]
        best = max(fits, key=lambda f: f.largest_n_ctx, default=None)
        if best is None:
            return 0, False
        return best.largest_n_ctx, bool(best.ctx_cap) and best.largest_n_ctx >= best.ctx_cap

    def host_of(self, endpoint: str | None) -> str | None:
        for dev in self.devices:
            if dev.endpoint == endpoint:
                return dev.host
        return None


def smallest_addition(
    fits: Callable[[int], bool], *, start: int, resolution: int = MiB, limit: int = DEFAULT_SEARCH_LIMIT
) -> int | None:
    """The least multiple of `resolution` for which `fits(amount)` holds, given that `fits(0)` does not.

    Doubling from `start` (rounded up) finds an amount that fits; a binary search then narrows the gap to
    one step: the result fits and the result minus `resolution` does not. None when nothing up to `limit`
    fits. (If `fits` is not monotone the result is still a boundary of that kind, found from below.)
    """
    if resolution <= 0:
        raise ValueError("resolution must be positive")
    max_units = limit // resolution  # amounts above `limit` are never tried
    if max_units == 0:
        return None
    hi = min(max(1, -(-start // resolution)), max_units)
    lo = 0  # known not to fit
    while not fits(hi * resolution):
        if hi >= max_units:
            return None
        lo = hi
        hi = min(hi * 2, max_units)
    return first_true(lambda units: fits(units * resolution), lo, hi) * resolution


def _plan_fits(devices: Sequence[PlanDevice], profile: ModelProfile, opts: PlanOptions) -> bool:
    try:
        return make_plan(devices, profile, opts).fit.fits
    except PlanError:
        return False


def _grow(device: PlanDevice, extra: int) -> PlanDevice:
    return replace(device, usable=device.usable + extra, free=device.free + extra, total=device.total + extra)


def _recommend(
    devices: tuple[PlanDevice, ...],
    profile: ModelProfile,
    opts: PlanOptions,
    plan: Plan | None,
    ro: ReportOptions,
) -> Recommendation:
    # The verdict does not depend on the largest-context search: cap it so each re-plan stays cheap.
    quick = replace(opts, n_ctx_cap=CTX_PAD)
    shortfall = plan.fit.shortfall if plan is not None else 0
    changes: list[DeviceChange] = []
    for i, dev in enumerate(devices):

        def fits_with(extra: int, i: int = i) -> bool:
            grown = (*devices[:i], _grow(devices[i], extra), *devices[i + 1 :])
            return _plan_fits(grown, profile, quick)

        add = smallest_addition(fits_with, start=shortfall, resolution=ro.resolution, limit=ro.search_limit)
        changes.append(DeviceChange(device=dev.label, host=dev.host, add=add))
    helpful = [c for c in changes if c.add is not None]
    smallest = min(helpful, key=lambda c: c.add or 0) if helpful else None

    note: str | None = None
    new_node: int | None = None
    n_rpc = sum(1 for d in devices if d.is_rpc)
    if len(devices) >= MAX_DEVICES or n_rpc >= MAX_RPC_DEVICES:
        note = f"the fleet already has {len(devices)} devices; llama.cpp takes at most {MAX_RPC_DEVICES}"
    else:
        template = PlanDevice(
            endpoint=NEW_NODE_ENDPOINT, index=0, name=f"{NEW_NODE_ENDPOINT}#0", description="a new node"
        )

        def node_fits(extra: int) -> bool:
            return _plan_fits((*devices, _grow(template, extra)), profile, quick)

        # A new device only helps past the margin: start the search there.
        new_node = smallest_addition(
            node_fits, start=shortfall + opts.margin, resolution=ro.resolution, limit=ro.search_limit
        )
        if new_node is None:
            note = f"no node of up to {format_size(ro.search_limit)} makes it fit"
    return Recommendation(tuple(changes), smallest, new_node, note)


def node_losses(
    devices: tuple[PlanDevice, ...], profile: ModelProfile, opts: PlanOptions
) -> tuple[NodeLoss, ...]:
    """N-1: the plan re-made without each node's devices in turn (same options; the largest-context
    search capped, as it does not change the verdict)."""
    quick = replace(opts, n_ctx_cap=CTX_PAD)
    endpoints = list(dict.fromkeys(d.endpoint for d in devices if d.endpoint is not None))
    losses = []
    for endpoint in endpoints:
        left = [d for d in devices if d.endpoint != endpoint]
        host = next((d.host for d in devices if d.endpoint == endpoint), None)
        try:
            plan = make_plan(left, profile, quick)
        except PlanError as exc:
            losses.append(NodeLoss(endpoint, host, False, 0, exc.message))
            continue
        binding = plan.devices[plan.fit.binding_device] if plan.fit.binding_device is not None else None
        headroom = binding.memory.headroom if binding is not None else 0
        losses.append(NodeLoss(endpoint, host, plan.fit.fits, headroom))
    return tuple(losses)


def build_report(
    fleet: FleetProbe,
    models: Sequence[tuple[str, ModelProfile]],
    contexts: Sequence[int],
    options: ReportOptions | None = None,
    formations: Formations | None = None,
    what_if: WhatIf | None = None,
    own_options: Mapping[str, PlanOptions] | None = None,
) -> Report:
    """Plan every model at every context on the fleet's ok devices; find the smallest change where a plan
    does not fit; carry `formations` (decided by workflows.plan.plan_formations) for the renderers. With
    `what_if`, the fleet is first changed by it (`report.what_if.apply_what_if`: nodes added, hosts
    removed) and the report marks what is assumed. `own_options` (model path -> options): a models
    file's entries, planned with their own options (serve's: context, parallel) rather than the report's;
    each one's own context joins the contexts, and a note says which it is. Pure: no I/O, no clock."""
    ro = options or ReportOptions()
    own = dict(own_options or {})
    contexts = list(dict.fromkeys([*contexts, *(own[path].n_ctx for path, _ in models if path in own)]))
    what_if = what_if or WhatIf()
    fleet = apply_what_if(fleet, what_if) if what_if else fleet
    if not contexts:
        raise PlanError("no context sizes to report on")
    if any(c < 0 for c in contexts):
        raise PlanError(
            f"context sizes must be >= 0 (0 = the model's training context), got {list(contexts)}"
        )
    devices = tuple(to_plan_devices(fleet, failed="skip"))
    notes: list[str] = []
    for node in fleet.nodes:
        if not node.ok:
            notes.append(f"{node.host} ({node.endpoint}) is {node.state}: its devices are not in the plans")
        elif node.untrusted:
            notes.append(
                f"{node.host} ({node.endpoint}): {node.untrusted}: its devices are not in the plans "
                "(--trust-rpc-memory plans on the server's figure, total RAM)"
            )
    for path, _ in models:
        if path in own:  # which column is the entry's own: the others are what it would need there
            o = own[path]
            notes.append(
                f"{path}: planned with its models-file options (parallel {o.parallel}); serve runs it at "
                f"ctx {o.n_ctx}, the other contexts are for comparison"
            )
    cases: list[Case] = []
    for path, profile in models:
        for n_ctx in contexts:
            opts = replace(own.get(path, ro.plan), n_ctx=n_ctx)
            plan: Plan | None = None
            error: str | None = None
            try:
                plan = make_plan(devices, profile, opts)
            except PlanError as exc:
                error = exc.message
            rec = None
            if ro.recommend and (plan is None or not plan.fit.fits):
                rec = _recommend(devices, profile, opts, plan, ro)
            losses = node_losses(devices, profile, opts) if plan is not None and plan.fit.fits else ()
            cases.append(Case(path, n_ctx, plan, error, rec, profile.n_ctx_train, losses))
    curves = tuple(
        model_curve(path, devices, profile, own.get(path, ro.plan), contexts) for path, profile in models
    )
    return Report(
        schema_version=SCHEMA_VERSION,
        fleet=fleet,
        devices=devices,
        models=tuple(ReportModel(p, m) for p, m in models),
        contexts=tuple(contexts),
        cases=tuple(cases),
        options=ro,
        notes=tuple(notes),
        formations=formations,
        curves=curves,
        formation_losses=formation_losses(formations, devices) if formations is not None else (),
        what_if=what_if,
    )


def size_up(n: int | None) -> str:
    """Like `format_size`, but never shows less than `n` (a recommended amount must not be rounded down)."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{n} B"
            return f"{math.ceil(value * 100 - 1e-9) / 100:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
