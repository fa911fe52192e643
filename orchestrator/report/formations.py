"""The formations section of the report and of `plan --replicas`: one line per formation (its nodes,
context, headroom, the largest context it holds), then the spares; JSON: each with its plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.core.units import format_size
from orchestrator.planning.draft import draft_note
from orchestrator.planning.formations import Formations
from orchestrator.planning.plan import Plan, PlanDevice, largest_ctx_text
from orchestrator.planning.recovery import replan_after_loss


@dataclass(frozen=True)
class FormationLoss:
    """One node lost with the formations serve chose: the formation that held it (None: a spare) and what
    its recovery would plan: on its nodes left, plus spares while it does not fit (serve's rule)."""

    endpoint: str
    formation: str | None
    fits: bool
    borrowed: tuple[str, ...] = ()
    reason: str = ""
    endpoints: tuple[str, ...] = ()  # the re-planned formation's nodes


def formation_losses(formations: Formations, devices: Sequence[PlanDevice]) -> tuple[FormationLoss, ...]:
    """N-1 for the set: each answering node lost in turn, the formation holding it re-planned as serve's
    recovery does (`planning.recovery.replan_after_loss`); formations never share a node, so the others
    serve on, and the spares are all free."""
    held = {h.endpoint: one for one in formations.formed for h in one.hosts}
    answering = list(dict.fromkeys(d.endpoint for d in devices if d.endpoint is not None))
    out = []
    for endpoint in answering:
        one = held.get(endpoint)
        if one is None:
            out.append(FormationLoss(endpoint, None, True))
            continue
        left = [d for d in devices if d.endpoint != endpoint]
        got = replan_after_loss(one, endpoint, left, formations.spares)
        planned = tuple(dict.fromkeys(d.endpoint or "local" for d in got.plan.devices)) if got.plan else ()
        out.append(
            FormationLoss(endpoint, one.choice.name, got.plan is not None, got.borrowed, got.reason, planned)
        )
    return tuple(out)


def formation_loss_lines(losses: Sequence[FormationLoss]) -> list[str]:
    broken = [loss for loss in losses if not loss.fits]
    head = (
        "N-1: every formation still serves after losing any one node"
        if not broken
        else f"N-1: losing {', '.join(b.endpoint for b in broken)} leaves a formation without a plan"
    )
    lines = [head]
    for loss in losses:
        if loss.formation is None:
            lines.append(f"  lose {loss.endpoint}: a spare; every formation serves on")
        elif loss.fits:
            spare = f" with spare {', '.join(loss.borrowed)}" if loss.borrowed else ""
            lines.append(
                f"  lose {loss.endpoint}: {loss.formation} re-plans on {', '.join(loss.endpoints)}{spare}"
            )
        else:
            lines.append(f"  lose {loss.endpoint}: {loss.formation} cannot re-plan ({loss.reason})")
    return lines


def node_headroom(plan: Plan) -> dict[str, int]:
    """Per node of a plan, the least headroom of its devices (what is left there once it is loaded)."""
    out: dict[str, int] = {}
    for d in plan.devices:
        key = d.endpoint or "local"
        out[key] = min(out.get(key, d.memory.headroom), d.memory.headroom)
    return out


def formations_lines(formations: Formations) -> list[str]:
    lines = [f"formations (--replicas {formations.replicas}): {len(formations.formed)}"]
    for one in formations.formed:
        plan = one.plan
        headroom = min((d.memory.headroom for d in plan.devices), default=0)
        lines.append(
            f"  {one.choice.name}: {len(one.choice.endpoints)} node(s) {', '.join(one.choice.endpoints)} · "
            f"n_ctx {plan.n_ctx} x {plan.options.parallel} sequence(s) · headroom {format_size(headroom)} · "
            f"{largest_ctx_text(plan.fit)}"
        )
        per_node = ", ".join(f"{ep} {format_size(h)}" for ep, h in node_headroom(plan).items())
        lines.append(f"    headroom per node: {per_node}")
        if plan.draft is not None:
            lines.append(f"    {draft_note(plan.draft, plan.devices[0].label if plan.devices else None)}")
    lines.append(f"spares: {', '.join(h.endpoint for h in formations.spares) or 'none'}")
    return lines


def formations_json(formations: Formations, losses: Sequence[FormationLoss] = ()) -> dict[str, Any]:
    return {
        "formations": [
            {
                "name": one.choice.name,
                "model": one.model.name,
                "endpoints": list(one.choice.endpoints),
                "headroom": node_headroom(one.plan),
                "plan": one.plan.to_json(),
            }
            for one in formations.formed
        ],
        "spares": [h.endpoint for h in formations.spares],
        "formations_n_minus_one": {
            "survives": all(loss.fits for loss in losses),
            "losses": [
                {
                    "endpoint": loss.endpoint,
                    "formation": loss.formation,
                    "fits": loss.fits,
                    "endpoints": list(loss.endpoints),
                    "borrowed": list(loss.borrowed),
                    "reason": loss.reason or None,
                }
                for loss in losses
            ],
        },
    }
