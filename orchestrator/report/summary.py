"""The report's first picture (pure): each model's memory against context, a curve of planner predictions,
beside the fleet's usable capacity. The models × contexts matrix is the cases themselves (`Case.status`).

A curve point is the planner's prediction at that context on the fleet's devices: weights, KV and compute
summed over the devices (what stays on this machine's CPU is not fleet memory). The points are the powers
of two from 1024 up to the largest of the report's contexts and the model's training context, plus those.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from orchestrator.core.errors import PlanError
from orchestrator.planning.plan import CTX_PAD, PlanDevice, PlanOptions
from orchestrator.planning.profile import ModelProfile
from orchestrator.planning.strategy import make_plan

FIRST_POINT = 1024  # the curve's smallest context


@dataclass(frozen=True)
class CurvePoint:
    n_ctx: int
    predicted: int | None  # bytes on the fleet's devices; None: the planner refused this context
    fits: bool


@dataclass(frozen=True)
class Curve:
    model: str  # ReportModel.path
    n_ctx_train: int
    points: tuple[CurvePoint, ...]


def curve_contexts(contexts: Sequence[int], n_ctx_train: int) -> list[int]:
    """The contexts a model's curve is drawn at (0 in `contexts` is the training context)."""
    asked = {c if c else n_ctx_train for c in contexts} - {0}
    top = max([*asked, n_ctx_train, FIRST_POINT])
    points = set(asked) | ({n_ctx_train} if n_ctx_train else set())
    n = FIRST_POINT
    while n <= top:
        points.add(n)
        n *= 2
    return sorted(points)


def model_curve(
    path: str,
    devices: Sequence[PlanDevice],
    profile: ModelProfile,
    options: PlanOptions,
    contexts: Sequence[int],
) -> Curve:
    # The verdict and the bytes do not depend on the largest-context search: cap it (cheap re-plans).
    quick = replace(options, n_ctx_cap=CTX_PAD)
    points = []
    for n_ctx in curve_contexts(contexts, profile.n_ctx_train):
        try:
            plan = make_plan(devices, profile, replace(quick, n_ctx=n_ctx))
        except PlanError:
            points.append(CurvePoint(n_ctx, None, False))
            continue
        predicted = sum(d.memory.total for d in plan.devices)
        points.append(CurvePoint(n_ctx, predicted, plan.fit.fits))
    return Curve(path, profile.n_ctx_train, tuple(points))
