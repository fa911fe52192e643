"""Tier 2: the fleet probe against a lab of network namespaces with real sshd and real rpc-servers."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from orchestrator.artifacts.manifest import Artifact
from orchestrator.engine.executor import Session
from orchestrator.lab.state import Lab
from orchestrator.operations.install.ensure import ArtifactChooser
from orchestrator.operations.server.steps import make_deploy_step
from orchestrator.probe.fleet import probe_fleet
from tests.plugins.lab import lab_hosts_of

pytestmark = pytest.mark.lab


async def test_probe_three_nodes_then_a_cut_link_times_out_alone(
    make_lab: Callable[..., Lab], cpu_artifact: Artifact
) -> None:
    lab = make_lab(3)
    hosts = lab_hosts_of(lab)
    async with Session() as session:
        deployed = await session.run(hosts, make_deploy_step(ArtifactChooser(cpu_artifact.id)), name="deploy")
        assert deployed.ok, [str(r.error) for r in deployed.failed]

    fleet = await probe_fleet(hosts, timeout=2.0)
    assert [n.state for n in fleet.nodes] == ["ok", "ok", "ok"], [n.rpc.message for n in fleet.nodes]
    for node, host in zip(fleet.nodes, hosts, strict=True):
        assert node.endpoint == host.endpoint and not host.endpoint.startswith("127.")
        assert node.facts is not None and node.facts_error is None, node.facts_error
        assert node.facts.rpc_clients == ()
        (device,) = node.devices
        assert device.kind == "cpu" and device.source_of_free == "meminfo"
        assert 0 < device.usable <= device.free < device.total
    assert fleet.totals.ok_endpoints == 3 and fleet.ok

    cut = lab.nodes[1]
    lab.cut_link(cut)
    timeout = 3.0
    started = time.monotonic()
    fleet = await probe_fleet(hosts, timeout=timeout)
    elapsed = time.monotonic() - started
    assert [n.state for n in fleet.nodes] == ["ok", "timeout", "ok"], [n.rpc.message for n in fleet.nodes]
    broken = fleet.nodes[1]
    assert broken.host == cut.name and broken.devices == () and broken.facts is None
    assert broken.facts_error is not None  # SSH could not reach it either
    assert elapsed < timeout + 2.5  # a dead node costs its timeout, not two of them (headroom for load)
    assert fleet.totals.ok_endpoints == 2 and not fleet.ok and fleet.memory() is None
