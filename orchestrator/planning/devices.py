"""Probe results → the planner's devices."""

from __future__ import annotations

from typing import Literal

from orchestrator.core.errors import ProbeError
from orchestrator.planning.plan import PlanDevice
from orchestrator.probe.capacity import _ALIGNMENT
from orchestrator.probe.fleet import FleetProbe


def to_plan_devices(
    fleet: FleetProbe, *, failed: Literal["raise", "skip", "flag"] = "raise"
) -> list[PlanDevice]:
    """The planner's devices: all devices of each endpoint, endpoints in inventory order, each once.

    A node that is not ok: `raise` (ProbeError naming them), `skip` (left out), or `flag`: one placeholder
    device with `ok=False` and the node's state, which `planner.validate` refuses with the host named.
    """
    bad = fleet.failed
    if bad and failed == "raise":
        listed = ", ".join(f"{n.host} ({n.endpoint}: {n.state})" for n in bad)
        raise ProbeError(
            f"{len(bad)} node(s) not ok: {listed}",
            hint="fix them, or leave them out with --limit",
        )
    out: list[PlanDevice] = []
    seen: set[str] = set()
    for node in fleet.nodes:
        if node.endpoint in seen:
            continue
        seen.add(node.endpoint)
        if node.ok:
            out += [
                PlanDevice(
                    endpoint=d.endpoint,
                    index=d.index,
                    name=d.name,
                    description=d.description,
                    total=d.total,
                    free=d.free,
                    usable=d.usable,
                    alignment=_ALIGNMENT.get(d.backend, 32),
                    ok=True,
                    state="ok",
                    host=d.host,
                )
                for d in node.devices
            ]
        elif failed == "flag":
            out.append(
                PlanDevice(
                    endpoint=node.endpoint,
                    index=0,
                    name=f"{node.endpoint}#0",
                    description=node.rpc.message,
                    ok=False,
                    state=node.state,
                    host=node.host,
                )
            )
    return out
