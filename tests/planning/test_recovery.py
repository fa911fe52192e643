"""planning.recovery: the one rule a formation that lost a node follows (serve's recovery and the
report's N-1): plan on the servers left; on "no node answers" or "does not fit" the next spare in the
pool's order; none when it fits, when the planner refused, or when the pool is empty."""

from __future__ import annotations

from pathlib import Path

from orchestrator.planning.plan import Plan, PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.recovery import Attempt, next_spare
from orchestrator.planning.strategy import make_plan
from tests.plugins.llama import GiB, plan_devices

MiB = 1 << 20
POOL = ("s1", "s2", "s3")


def _plan(tiny_model: Path, usable: int) -> Plan:
    return make_plan(
        plan_devices(["10.0.0.1:50052"], [usable]),
        profile_model(tiny_model),
        PlanOptions(n_ctx=512, margin=0),
    )


def test_a_plan_that_fits_takes_no_spare(tiny_model: Path) -> None:
    fitting = Attempt(_plan(tiny_model, 8 * GiB))
    assert fitting.fits and fitting.reason == ""
    assert next_spare(fitting, POOL) is None


def test_no_node_answering_or_a_misfit_takes_the_pools_first(tiny_model: Path) -> None:
    short = Attempt(_plan(tiny_model, 2 * MiB))
    assert short.plan is not None and not short.fits and short.reason == "it does not fit"
    assert next_spare(short, POOL) == "s1"
    assert next_spare(short, POOL[1:]) == "s2"  # the pool's order, whatever is left of it
    silent = Attempt(None)
    assert silent.reason == "no node answers" and next_spare(silent, POOL) == "s1"


def test_a_refusal_takes_no_spare_even_with_some_free() -> None:
    refused = Attempt(None, "unknown architecture 'x'")
    assert not refused.fits and refused.reason == "unknown architecture 'x'"
    assert next_spare(refused, POOL) is None


def test_an_empty_pool_gives_none() -> None:
    assert next_spare(Attempt(None), ()) is None
