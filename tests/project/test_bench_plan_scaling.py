"""bench/plan_scaling.py measures what its block says (issue 45: "the plan at 64 devices that are not all
equal (today one plan is made and renamed)"): on equal nodes the formations share one plan, renamed; on
its unequal nodes every formation is planned, and a model that needs two nodes of the equal size (the
70B-class header; the families' tiny models fit on one node of any size the script tries) still does."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from orchestrator.inventory.model import Host
from orchestrator.models.synth import write_sparse_70b_header
from orchestrator.planning import strategy
from orchestrator.planning.formations import ServedModel, form
from orchestrator.planning.plan import PlanOptions
from orchestrator.planning.profile import profile_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def plan_scaling() -> Iterator[ModuleType]:
    """The script imported as its folder does (it imports `_common` beside it)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        yield importlib.import_module("plan_scaling")
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_unequal_nodes_are_each_planned_where_equal_ones_share_a_plan(
    plan_scaling: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    profile = profile_model(write_sparse_70b_header(tmp_path / "sparse70b.gguf"))
    options = PlanOptions(n_ctx=plan_scaling.N_CTX)
    size = plan_scaling.two_node_size(profile, options)
    made: list[int] = []
    real = strategy.make_plan

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr("orchestrator.planning.formations.make_plan", counted)  # the one form calls
    served = ServedModel(str(profile.path), "70b", profile, options)
    planned = {}
    for unequal in (False, True):
        fleet = plan_scaling.devices(16, size, unequal=unequal)
        usable = [d.usable for d in fleet]
        if unequal:  # all different, none smaller, all within the 10 % step that made two nodes needed
            assert len(set(usable)) == 16 and min(usable) == size and max(usable) < size * 1.1, usable
        else:
            assert set(usable) == {size}
        hosts = [Host(name=f"n{i}", address=str(d.endpoint).split(":")[0]) for i, d in enumerate(fleet)]
        made.clear()
        formed, spare = form([served], hosts, fleet)
        assert len(formed) == 8 and not spare, (unequal, len(formed), spare)
        assert all(len(f.choice.endpoints) == 2 for f in formed)
        planned[unequal] = len(made)
    assert planned == {False: 1, True: 8}, planned  # equal: one plan renamed; unequal: each its own
