"""planning.formations: the choice of formations as data (tests/data/formations/<case>.json: the nodes'
usable sizes, what each model asks for and needs, and the formations expected or the error), and `form`
with the real planner."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.core.errors import PlanError
from orchestrator.inventory.model import Host
from orchestrator.planning.formations import FormationError, Node, ServedModel, Want, choose, form, nodes_of
from orchestrator.planning.plan import PlanOptions
from orchestrator.planning.profile import profile_model
from tests.plugins.llama import GiB, plan_devices

# The planner's refusals that mean "too small" (strategy._choose_split): a verdict, not a failure.
NO_ROOM = {"no device has usable memory beyond the margin"}

CASES = sorted((Path(__file__).parents[1] / "data" / "formations").glob("*.json"))


def test_there_are_cases() -> None:
    assert len(CASES) >= 10


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.stem)
def test_the_choice(case: Path) -> None:
    doc: dict[str, Any] = json.loads(case.read_text())
    nodes = [Node(f"n{i}:1", doc.get("devices", 1), usable) for i, usable in enumerate(doc["nodes"])]
    usable = {n.endpoint: n.usable for n in nodes}
    needs: dict[str, int] = doc["needs"]
    wants = [
        Want(
            w["model"],
            w.get("replicas"),
            w.get("split", False),
            tuple(w["endpoints"]) if "endpoints" in w else None,
        )
        for w in doc["wants"]
    ]

    def fits(model: str, endpoints: tuple[str, ...]) -> bool:  # the planner's verdict, as a sum
        return sum(usable[ep] for ep in endpoints) >= needs[model]

    if "error" in doc:
        with pytest.raises(FormationError, match=doc["error"]):
            choose(wants, nodes, fits)
        return
    got = [[c.name, *c.endpoints] for c in choose(wants, nodes, fits)]
    assert got == doc["expected"], doc["doc"]
    held = [ep for _, *eps in got for ep in eps]
    assert len(held) == len(set(held))  # never one server in two formations


def test_the_planner_decides_with_real_plans(tiny_model: Path) -> None:
    """`form` asks the planner: the tiny model fits one 8 GiB node (3 formations), not one of 1 MiB."""
    profile = profile_model(tiny_model)
    endpoints = ["10.1.0.1:50052", "10.1.0.2:50052", "10.1.0.3:50052"]
    hosts = [Host(name=f"n{i}", address=ep.split(":")[0], rpc_port=50052) for i, ep in enumerate(endpoints)]
    model = ServedModel(str(tiny_model), "tiny", profile, PlanOptions(n_ctx=512, parallel=2))
    formed, spares = form([model], hosts, plan_devices(endpoints))
    assert [f.choice.endpoints for f in formed] == [(ep,) for ep in endpoints] and spares == []
    assert all(f.plan.fit.fits and f.plan.endpoints == f.choice.endpoints for f in formed)
    split, _ = form(
        [ServedModel(str(tiny_model), "tiny", profile, PlanOptions(n_ctx=512), split=True)],
        hosts,
        plan_devices(endpoints),
    )
    assert [f.choice.endpoints for f in split] == [tuple(endpoints)]
    small = plan_devices(endpoints, [8 * GiB, 1024 * 1024, 8 * GiB])
    formed, spares = form([model], hosts, small)
    assert [f.choice.endpoints for f in formed] == [(endpoints[0],), (endpoints[2],)]
    assert [h.name for h in spares] == ["n1"]
    assert [n.usable for n in nodes_of(small)] == [8 * GiB, 1024 * 1024, 8 * GiB]
    # a server silent at start: a split keeps it (to take it back once it answers), auto leaves it spare
    silent = [*hosts, Host(name="n3", address="10.1.0.4", rpc_port=50052)]
    split, spares = form([dataclasses.replace(model, split=True)], silent, plan_devices(endpoints))
    assert [h.name for h in split[0].hosts] == ["n0", "n1", "n2", "n3"] and spares == []
    assert split[0].plan.endpoints == tuple(endpoints)
    formed, spares = form([model], silent, plan_devices(endpoints))
    assert len(formed) == 3 and [h.name for h in spares] == ["n3"]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3moe", "mamba2"])
def test_the_verdict_alone_is_the_whole_plans_verdict_from_too_small_to_roomy(
    arch: str, tmp_path: Path
) -> None:
    # form() asks strategy.fits of many groups and plans only those chosen: both must agree everywhere
    from orchestrator.models.synth_arch import write_arch_model
    from orchestrator.planning.strategy import fits, make_plan

    profile = profile_model(write_arch_model(tmp_path / f"{arch}.gguf", arch))
    options = PlanOptions(n_ctx=4096)
    needed = make_plan(plan_devices(["a:1"], [64 * GiB]), profile, options).devices[0].memory.total
    verdicts = set()
    for n in (1, 2, 3):
        for size in range(needed // 4, needed * 2, max(needed // 16, 1)):
            devices = plan_devices([f"10.0.0.{i}:50052" for i in range(n)], [size + (256 << 20)] * n)
            try:
                whole = make_plan(devices, profile, options).fit.fits
            except PlanError as refused:  # the planner's own "no room" is a verdict; anything else a bug
                assert refused.message in NO_ROOM, (n, size, refused.message)
                whole = False
            assert fits(devices, profile, options) == whole, (n, size)
            verdicts.add(whole)
    assert verdicts == {True, False}  # both sides of the line were crossed


def test_equal_nodes_get_the_plan_each_would_get_on_its_own(tmp_path: Path) -> None:
    # form() plans one group of equal nodes and renames it for the next: the same as planning each afresh
    from orchestrator.models.synth import write_sparse_70b_header
    from orchestrator.planning.layer_assignment import order_devices
    from orchestrator.planning.strategy import fits, make_plan

    profile = profile_model(write_sparse_70b_header(tmp_path / "70b.gguf"))  # large: it needs two nodes
    options = PlanOptions(n_ctx=4096)
    endpoints = [f"10.0.0.{i}:50052" for i in range(8)]

    def smallest(n: int) -> int:  # the smallest node size on which n nodes hold it
        low, high = 1 << 20, 64 * GiB
        while high - low > 1 << 20:
            mid = (low + high) // 2
            low, high = (
                (low, mid) if fits(plan_devices(endpoints[:n], [mid] * n), profile, options) else (mid, high)
            )
        return high

    size = smallest(2)
    assert size < smallest(1)  # on nodes of this size it needs two
    devices = plan_devices(endpoints, [size] * 8)
    hosts = [Host(name=f"n{i}", address=f"10.0.0.{i}", rpc_port=50052) for i in range(8)]
    formed, spares = form([ServedModel(str(profile.path), "big", profile, options)], hosts, devices)
    assert len(formed) == 4 and not spares
    for one in formed:
        alone = make_plan(
            order_devices([d for d in devices if d.endpoint in one.choice.endpoints], (), []),
            profile,
            options,
        )
        assert one.plan == alone and one.plan.endpoints == one.choice.endpoints
