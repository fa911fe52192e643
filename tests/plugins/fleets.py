"""Fleets made of the probe's own records, by hand (no server): for the report's and the planner's tests."""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.probe.capacity import DeviceCapacity
from orchestrator.probe.fleet import FleetProbe, NodeProbe
from orchestrator.rpc.records import DeviceMemory, Outcome, ProbeResult, ProtocolVersion

GiB = 1024**3


def ok_node(host: str, endpoint: str, usables: Sequence[int], *, reserve: int = GiB) -> NodeProbe:
    devices = tuple(
        DeviceCapacity(
            host=host,
            endpoint=endpoint,
            index=i,
            name=f"{endpoint}#{i}",
            description="AMD EPYC 9654",
            backend="cpu",
            kind="cpu",
            total=u + reserve + 2 * GiB,
            free=u + reserve,
            reserve=reserve,
            limit=None,
            usable=u,
            source_of_free="meminfo",
        )
        for i, u in enumerate(usables)
    )
    rpc = ProbeResult(
        endpoint,
        Outcome.OK,
        ProtocolVersion(7, 0, 0),
        tuple(DeviceMemory(d.index, d.total, d.total) for d in devices),
        "ok",
        0.004,
    )
    return NodeProbe(host, endpoint, rpc, None, devices, "ok")


def down_node(host: str, endpoint: str, outcome: Outcome = Outcome.REFUSED) -> NodeProbe:
    rpc = ProbeResult(endpoint, outcome, None, (), "connection refused", 0.001)
    return NodeProbe(host, endpoint, rpc, None, (), outcome.value)


def fleet_of(*nodes: NodeProbe) -> FleetProbe:
    return FleetProbe.of(nodes, protocol="7.0.0", timeout=3.0, elapsed=0.01)
