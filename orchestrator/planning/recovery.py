"""A formation's recovery after it loses a node: one rule, followed by serve (`workflows.serving.ServeFleet
.plan_round`) and by the report's N-1 (`report.formations`, through `replan_after_loss`). Pure: the plans
are made by the caller (serve probes first; the report plans on the probe it has).

The formation plans on its servers that still answer. When none answers, or the model does not fit on
them, the next spare in the pool's order joins and it plans again, until it fits or the pool is empty.
When the planner refuses (it makes no plan at all: a model it cannot place, an option it rejects), no
spare is taken: more memory would not change a refusal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from orchestrator.core.errors import PlanError, ProbeError
from orchestrator.inventory.model import Host
from orchestrator.planning.formations import PlannedFormation
from orchestrator.planning.layer_assignment import order_devices
from orchestrator.planning.plan import Plan, PlanDevice
from orchestrator.planning.strategy import make_plan

S = TypeVar("S")  # a spare as its caller holds it (serve: a Host; the report: an endpoint)


@dataclass(frozen=True)
class Attempt:
    """One plan on a formation's servers: `plan` None when none answers or the planner refused
    (`refusal`: its message); a plan that does not fit is an attempt too."""

    plan: Plan | None
    refusal: str | None = None

    @property
    def fits(self) -> bool:
        return self.plan is not None and self.plan.fit.fits

    @property
    def reason(self) -> str:
        """Why there is no plan to load, in a line (empty when it fits)."""
        if self.refusal is not None:
            return self.refusal
        if self.plan is None:
            return "no node answers"
        return "" if self.plan.fit.fits else "it does not fit"


def next_spare(attempt: Attempt, spares: Sequence[S]) -> S | None:
    """The spare to take after `attempt` (the rule of the module's doc): the first of `spares` (the
    pool's order) when none answered or the model does not fit; None when it fits, when the planner
    refused, or when no spare is left."""
    if attempt.fits or attempt.refusal is not None or not spares:
        return None
    return spares[0]


@dataclass(frozen=True)
class Recovered:
    """A formation re-planned after losing a node: the plan it would load (None: none fits, it waits for
    the fleet) and the spares it took, in the order taken."""

    plan: Plan | None
    borrowed: tuple[str, ...]
    reason: str = ""


def replan_after_loss(
    formed: PlannedFormation, lost: str, devices: Sequence[PlanDevice], spares: Sequence[Host]
) -> Recovered:
    """What serve's recovery plans when `formed` loses the node `lost`, by `next_spare`'s rule: the model
    on its servers that still answer (`devices`: the probed ones), then with one more spare at a time."""
    members = [h.endpoint for h in formed.hosts if h.endpoint != lost]
    pool = [h.endpoint for h in spares if h.endpoint != lost]
    borrowed: list[str] = []
    model = formed.model
    while True:
        chosen = [d for d in devices if d.endpoint in {*members, *borrowed}]
        ordered = order_devices(chosen, (), [])
        attempt = Attempt(None)
        if ordered:
            try:
                attempt = Attempt(make_plan(ordered, model.profile, model.options, model.draft))
            except (PlanError, ProbeError) as exc:
                attempt = Attempt(None, exc.message)
        spare = next_spare(attempt, pool)
        if spare is None:
            return Recovered(attempt.plan if attempt.fits else None, tuple(borrowed), attempt.reason)
        pool.remove(spare)
        borrowed.append(spare)
