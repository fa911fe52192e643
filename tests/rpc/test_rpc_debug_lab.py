"""Tier 2: to-the-byte allocations through servers deployed with `rpc_debug: true`.

Deploy the real artifact to a 3-node lab of this module with `rpc_debug` (the server runs with
GGML_RPC_DEBUG=1 and logs every allocation), probe the fleet, plan a generated GQA model, load it through
the plan in a child process (playbook.load_check), then fetch each node's server log over SSH: the
planner's predicted weights and KV bytes per node equal what each server allocated, to the byte.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from orchestrator.artifacts.manifest import Artifact
from orchestrator.connectors.connect import connect
from orchestrator.engine.executor import Session
from orchestrator.inventory.model import Host
from orchestrator.lab.state import Lab
from orchestrator.llama.logs import model_allocations, parse_server_log
from orchestrator.llama.observed_placement import exact_memory
from orchestrator.operations.install.ensure import ArtifactChooser
from orchestrator.operations.server.state import LOG_FILE
from orchestrator.operations.server.steps import DeployResult, make_deploy_step
from orchestrator.planning.devices import to_plan_devices
from orchestrator.planning.plan import PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan
from orchestrator.playbooks.load_check import load_check
from orchestrator.probe.fleet import probe_fleet
from tests.plugins.lab import lab_hosts_of, own_lab

pytestmark = [pytest.mark.lab, pytest.mark.llama]


@pytest.fixture(scope="module")
def debug_lab() -> Iterator[Lab]:
    with own_lab(3, "dbg") as made:
        yield made


async def _fetch_log(host: Host, dest: Path) -> str:
    async with await connect(host) as conn:
        await conn.get(f"{host.install_dir}/{LOG_FILE}", dest)
    return await asyncio.to_thread(dest.read_text, errors="replace")


async def test_predicted_weights_and_kv_equal_the_allocations_of_deployed_debug_servers(
    debug_lab: Lab,
    cpu_artifact: Artifact,
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
) -> None:
    hosts = [dataclasses.replace(h, rpc_debug=True, install_dir="~/dbg") for h in lab_hosts_of(debug_lab)]
    async with Session(forks=8) as session:
        run = await session.run(hosts, make_deploy_step(ArtifactChooser()), name="deploy")
        assert run.ok, [str(r.error) for r in run.failed]
        assert all(
            isinstance(r.value, DeployResult) and r.value.install.version == cpu_artifact.id
            for r in run.results
        )
        fleet = await probe_fleet(hosts, session=session)
    devices = to_plan_devices(fleet)
    assert [d.endpoint for d in devices] == [h.endpoint for h in hosts]

    path = tiny_model_factory(n_layer=6, n_embd=256, n_head=8, n_head_kv=2)  # GQA, f16
    plan = make_plan(devices, profile_model(path), PlanOptions(n_ctx=1024))
    assert len(plan.devices) == 3 and all(n > 0 for n in plan.layer_counts)
    placement = await load_check(plan, path)
    assert placement.layers_as_planned

    by_endpoint = {h.endpoint: h for h in hosts}
    checked = 0
    for device in placement.devices:
        assert device.endpoint is not None
        host = by_endpoint[device.endpoint]
        log = await _fetch_log(host, tmp_path / f"{host.name}.log")
        assert "[alloc_buffer]" in log  # GGML_RPC_DEBUG=1 reached the deployed server
        sizes = model_allocations(parse_server_log(log))[device.index]
        predicted = device.predicted
        exact = exact_memory(device.actual, sizes)
        assert exact.weights == predicted.weights, (host.name, exact, predicted)
        assert exact.kv == predicted.kv, (host.name, exact, predicted)
        assert exact.weights > 0 and exact.kv > 0
        checked += 1
    assert checked == 3
