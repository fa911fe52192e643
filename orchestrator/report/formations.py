"""The formations section of the report and of `plan --replicas`: one line per formation (its nodes,
context, headroom, the largest context it holds), then the spares; JSON: each with its plan."""

from __future__ import annotations

from typing import Any

from orchestrator.core.units import format_size
from orchestrator.planning.draft import draft_note
from orchestrator.planning.formations import Formations
from orchestrator.planning.plan import largest_ctx_text


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
        if plan.draft is not None:
            lines.append(f"    {draft_note(plan.draft, plan.devices[0].label if plan.devices else None)}")
    lines.append(f"spares: {', '.join(h.endpoint for h in formations.spares) or 'none'}")
    return lines


def formations_json(formations: Formations) -> dict[str, Any]:
    return {
        "formations": [
            {
                "name": one.choice.name,
                "model": one.model.name,
                "endpoints": list(one.choice.endpoints),
                "plan": one.plan.to_json(),
            }
            for one in formations.formed
        ],
        "spares": [h.endpoint for h in formations.spares],
    }
