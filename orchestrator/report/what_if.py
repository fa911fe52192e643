"""What-if fleets for the report (pure): hypothetical nodes added (`--add 2x24GiB:cuda`) and probed hosts
taken away (`--remove HOST`), for the report only.

A hypothetical node enters as the probe's own records (`NodeProbe`, `DeviceCapacity`), so every rule
the planner applies to a probed device of its backend applies to it unchanged: its alignment
(`probe.capacity.device_alignment`: CUDA and ROCm 128), the "unverified on BACKEND" notes
(`planning.architectures.backend_notes`), the N-1 and the formations. Its size is the free memory a
probe would report for each device (reserve 0: usable = size; the plan's margin still applies).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast, get_args

from orchestrator.core.errors import UsageError
from orchestrator.core.units import format_size, parse_size
from orchestrator.inventory.model import Host
from orchestrator.inventory.variables import DEFAULT_RPC_PORT, BackendChoice
from orchestrator.planning.architectures import VERIFIED_ON
from orchestrator.probe.capacity import DeviceCapacity
from orchestrator.probe.fleet import FleetProbe, NodeProbe
from orchestrator.rpc.records import DeviceMemory, Outcome, ProbeResult, ProtocolVersion

# every backend a server can be built for ("auto" is decided from a real node's facts)
BACKENDS: tuple[str, ...] = tuple(b for b in get_args(BackendChoice) if b != "auto")


ADD_FORMAT = "[NAME=][COUNTx]SIZE[:BACKEND], e.g. 2x24GiB:cuda or gpu-a=80GiB:cuda"


_ADD_RE = re.compile(
    r"(?:(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)=)?(?:(?P<count>\d+)[xX])?(?P<size>[^:=]+)(?::(?P<backend>.*))?"
)


MAX_ADDED_DEVICES = 16  # one rpc-server; llama.cpp takes 15 RPC devices in all anyway


@dataclass(frozen=True)
class AddedNode:
    """One hypothetical rpc-server: `count` devices of `size` free bytes each, of `backend`."""

    name: str  # its host name (and endpoint `name:50052`)
    count: int
    size: int
    backend: str
    spec: str  # as the user wrote it, for messages

    @property
    def endpoint(self) -> str:
        return f"{self.name}:{DEFAULT_RPC_PORT}"

    @property
    def kind(self) -> str:
        return "cpu" if self.backend == "cpu" else "gpu"

    def describe(self) -> str:
        return f"{self.count} x {format_size(self.size)} {self.backend}"


@dataclass(frozen=True)
class WhatIf:
    """The report's changes to the probed fleet: nodes added, hosts removed (by name or endpoint)."""

    added: tuple[AddedNode, ...] = ()
    removed: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)

    @property
    def assumed_endpoints(self) -> frozenset[str]:
        return frozenset(a.endpoint for a in self.added)

    def lines(self) -> list[str]:
        """What every format says before the fleet: what is assumed rather than probed."""
        out = [f"what-if: {a.name} ({a.endpoint}) is assumed, not probed: {a.describe()}" for a in self.added]
        out += [f"what-if: {name} is left out of the fleet (--remove)" for name in self.removed]
        return out


def parse_addition(value: str, number: int = 1) -> AddedNode:
    """`--add` VALUE -> AddedNode (`number`: its default name, `what-if-N`); UsageError naming the value."""

    def bad(why: str) -> UsageError:
        return UsageError(f"--add {value}: {why}", hint=f"expected {ADD_FORMAT}")

    match = _ADD_RE.fullmatch(value.strip())
    if match is None:
        raise bad("not a node")
    count = int(match["count"]) if match["count"] else 1
    if not 1 <= count <= MAX_ADDED_DEVICES:
        raise bad(f"the device count must be 1 to {MAX_ADDED_DEVICES}, got {count}")
    try:
        size = parse_size(match["size"].strip())
    except ValueError as exc:
        raise bad(str(exc)) from None
    if size <= 0:
        raise bad("the size must be positive")
    backend = (match["backend"] or "cpu").strip().lower()
    if backend not in BACKENDS:
        raise bad(f"unknown backend {backend or '(empty)'} (one of {', '.join(BACKENDS)})")
    return AddedNode(match["name"] or f"what-if-{number}", count, size, backend, value)


def parse_what_if(adds: Sequence[str], removes: Sequence[str]) -> WhatIf:
    """The --add and --remove values; two added nodes of one name: UsageError."""
    added = tuple(parse_addition(v, i) for i, v in enumerate(adds, 1))
    names = [a.name for a in added]
    for name in names:
        if names.count(name) > 1:
            raise UsageError(f"--add: two nodes are named {name}", hint="name each: NAME=2x24GiB:cuda")
    return WhatIf(added, tuple(dict.fromkeys(r.strip() for r in removes)))


def check_removals(what_if: WhatIf, hosts: Sequence[Host]) -> None:
    """Every --remove names a selected host (by name or endpoint), and no --add takes a host's name."""
    known = {h.name for h in hosts} | {h.endpoint for h in hosts}
    for name in what_if.removed:
        if name not in known:
            listed = ", ".join(h.name for h in hosts) or "none"
            raise UsageError(f"--remove {name}: no such host in the selection", hint=f"hosts: {listed}")
    for added in what_if.added:
        if added.name in known:
            raise UsageError(
                f"--add {added.spec}: {added.name} is already a host of the fleet",
                hint="give it another name",
            )


def _removed(what_if: WhatIf, name: str, endpoint: str) -> bool:
    return name in what_if.removed or endpoint in what_if.removed


def hosts_of(what_if: WhatIf, hosts: Sequence[Host]) -> list[Host]:
    """The inventory's hosts less the removed ones, plus one host per added node (for the formations)."""
    kept = [h for h in hosts if not _removed(what_if, h.name, h.endpoint)]
    added = [
        Host(
            name=a.name, address=a.name, rpc_port=DEFAULT_RPC_PORT, rpc_backend=cast(BackendChoice, a.backend)
        )
        for a in what_if.added
    ]
    return [*kept, *added]


def added_node(added: AddedNode, protocol: str) -> NodeProbe:
    """The probe result an rpc-server of `added`'s devices would give (ok, at the controller's protocol)."""
    devices = tuple(
        DeviceCapacity(
            host=added.name,
            endpoint=added.endpoint,
            index=i,
            name=f"{added.endpoint}#{i}",
            description=f"assumed {format_size(added.size)} {added.backend}",
            backend=added.backend,
            kind="cpu" if added.kind == "cpu" else "gpu",
            total=added.size,
            free=added.size,
            reserve=0,
            limit=None,
            usable=added.size,
            source_of_free="rpc",
        )
        for i in range(added.count)
    )
    rpc = ProbeResult(
        added.endpoint,
        Outcome.OK,
        ProtocolVersion.parse(protocol),
        tuple(DeviceMemory(d.index, d.free, d.total) for d in devices),
        "assumed (--add)",
        0.0,
    )
    return NodeProbe(added.name, added.endpoint, rpc, None, devices, "ok")


def apply_what_if(fleet: FleetProbe, what_if: WhatIf) -> FleetProbe:
    """`fleet` less the removed hosts, plus the added nodes (after the probed ones, in --add order)."""
    kept = [n for n in fleet.nodes if not _removed(what_if, n.host, n.endpoint)]
    added = [added_node(a, fleet.protocol) for a in what_if.added]
    return FleetProbe.of(
        [*kept, *added],
        protocol=fleet.protocol,
        timeout=fleet.timeout,
        elapsed=fleet.elapsed,
        facts=fleet.facts,
    )


def unverified_on(backend: str, architectures: Sequence[str]) -> bool:
    """Whether the memory of any of `architectures` on `backend`'s devices was never compared with real
    allocations (`planning.architectures.VERIFIED_ON`): an assumed device says so until a test has."""
    return any(a not in VERIFIED_ON.get(backend, frozenset()) for a in architectures)
