"""Probe results → the planner's devices."""

from __future__ import annotations

from typing import Literal

from orchestrator.core.errors import ProbeError
from orchestrator.planning.plan import PlanDevice
from orchestrator.probe.capacity import device_alignment
from orchestrator.probe.fleet import FleetProbe


def to_plan_devices(
    fleet: FleetProbe, *, failed: Literal["raise", "skip", "flag"] = "raise"
) -> list[PlanDevice]:
    """The planner's devices: all devices of each endpoint, endpoints in inventory order, each once.

    A node that is not ok, or whose memory was not measured (`NodeProbe.untrusted`: a CPU server whose
    host facts could not be read reports its total RAM as free): `raise` (ProbeError naming them and
    why), `skip` (left out), or `flag`: one placeholder device with `ok=False` and the node's state
    (`unmeasured` for the latter), which `planning.memory.validate` refuses with the host named.
    """
    bad = [n for n in fleet.nodes if not n.ok or n.untrusted]
    if bad and failed == "raise":
        listed = ", ".join(f"{n.host} ({n.endpoint}: {n.state if not n.ok else n.untrusted})" for n in bad)
        unmeasured = any(n.ok for n in bad)
        raise ProbeError(
            f"{len(bad)} node(s) not ok: {listed}",
            hint="fix them, or leave them out with --limit"
            + (
                "; a node whose host facts cannot be read (SSH) may be planned on the server's own figure "
                "(total RAM) with --trust-rpc-memory"
                if unmeasured
                else ""
            ),
        )
    out: list[PlanDevice] = []
    seen: set[str] = set()
    for node in fleet.nodes:
        if node.endpoint in seen:
            continue
        seen.add(node.endpoint)
        if node.ok and not node.untrusted:
            out += [
                PlanDevice(
                    endpoint=d.endpoint,
                    index=d.index,
                    name=d.name,
                    description=d.description,
                    total=d.total,
                    free=d.free,
                    usable=d.usable,
                    alignment=device_alignment(d),
                    max_size=d.max_size,
                    backend=d.backend,
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
                    description=node.untrusted or node.rpc.message,
                    ok=False,
                    state=node.state if not node.ok else "unmeasured",
                    host=node.host,
                )
            )
    return out
