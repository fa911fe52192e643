"""The fleet probe: RPC from the controller plus host facts over SSH -> capacity per device.

Every selected host is probed, up to `forks` at once, two ways, both bounded by one timeout per host:

* RPC, from this controller straight to the endpoint (`orchestrator.rpc`): HELLO, device count and each
  device's free/total memory. Each distinct endpoint is probed once (two probes of one server at once
  would make one of them `busy`).
* Facts, over the host's connection through the executor (`orchestrator.facts`): MemAvailable, the CPU
  model, nvidia-smi / rocm-smi, the clients connected to the rpc port (`ss`, less the probe's own
  connection) and the machine's identity (boot id, else machine-id), in one round trip.

`compute_capacity` (pure) turns both into one `DeviceCapacity` per device:

* usable = max(0, min(free - memory_reserve, memory_limit)); reserve and limit are per device.
* CPU devices report free == total == physical RAM (a constant), so their free is `MemAvailable`
  (`source_of_free="meminfo"`). Without facts (SSH down, facts failed or `facts=False`) that memory is
  not measured: the device's `usable` is 0 and `untrusted` says why (`to_plan_devices` refuses the
  node), unless `trust_rpc_memory`, which keeps the RPC number with a warning. Several CPU
  devices on one machine (same machine identity: lab nodes share one kernel, a machine may run several
  servers) split its MemAvailable evenly, with a warning on each: otherwise each would claim all of it.
* GPU devices keep the RPC numbers (the driver's, as the server sees them), cross-checked against
  nvidia-smi / rocm-smi when present; a disagreement beyond `GPU_TOLERANCE` is a warning on the device.
* The protocol has no command that names a device (protocol 7.0.0: HELLO, DEVICE_COUNT and
  GET_DEVICE_MEMORY only), so a device is named `<endpoint>#<index>` and described from the facts: the
  GPU's name from the driver tool, the CPU model from /proc/cpuinfo.

Node state: the RPC outcome (ok, refused, timeout, busy, closed, version_mismatch, protocol_error), except
that a timeout while `ss` shows a client connected is `busy` (a server whose accept queue is full does
not even complete the connect).

JSON (`FleetProbe.to_json()`, schema version 1; sizes in bytes, times in seconds; keys are only ever
added)::

    {"schema_version": 1, "ok": bool, "protocol": "7.0.0", "timeout": 3.0, "elapsed": 0.01,
     "totals": {"endpoints": int, "ok_endpoints": int, "devices": int,
                "total": int, "free": int, "usable": int},          # ok endpoints, each counted once
                                                                    # (total: a machine's RAM once)
     "nodes": [{"host": str, "endpoint": str, "state": str, "ok": bool,
                "outcome": str, "protocol": str | null, "message": str, "elapsed": float,
                "clients": [str] | null,                            # from ss; null without facts
                "duplicate_of": str | null,                         # host probed for the same endpoint
                "warnings": [str], "facts_error": str | null,
                "untrusted": str | null,                            # why its memory is not used
                "facts": {"mem_total": int | null, "mem_available": int | null,
                          "cpu_model": str | null, "cpu_count": int | null,
                          "gpus": [{"vendor", "index", "name", "total", "free"}],
                          "gpu_errors": [str], "rpc_clients": [str] | null,
                          "machine_id": str | null} | null,
                "devices": [{"index": int, "name": str, "description": str, "backend": str,
                             "kind": "cpu" | "gpu", "total": int, "free": int, "reserve": int,
                             "limit": int | null, "usable": int, "source_of_free": "rpc" | "meminfo",
                             "warnings": [str], "measured": bool, "untrusted": str | null}]}]}
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from orchestrator.artifacts.local_protocol import cached_local_protocol_version
from orchestrator.connectors.base import ConnectOptions
from orchestrator.connectors.tunnel import target_of
from orchestrator.core.errors import RpcfleetError
from orchestrator.core.log import get_logger
from orchestrator.engine.executor import DEFAULT_FORKS, HostContext, Session, StepOutcome
from orchestrator.engine.shared import gather_bounded
from orchestrator.inventory.model import Host
from orchestrator.probe.capacity import DeviceCapacity, fleet_capacity, without_own_connection
from orchestrator.probe.host import HostFacts, read_facts
from orchestrator.probe.settings import DEFAULT_TIMEOUT
from orchestrator.rpc.client import probe_endpoint
from orchestrator.rpc.records import (
    AggregateMemory,
    Outcome,
    ProbeResult,
    ProtocolVersion,
)

SCHEMA_VERSION = 1


NodeStateName = Literal["ok", "refused", "timeout", "busy", "closed", "version_mismatch", "protocol_error"]


FailOn = Literal["any", "none", "all"]


FAIL_ON: tuple[str, ...] = ("any", "none", "all")


def node_state(rpc_result: ProbeResult, facts: HostFacts | None) -> NodeStateName:
    """The RPC outcome, except that a timeout while `ss` shows a connected client is `busy`."""
    if rpc_result.outcome is Outcome.TIMEOUT and facts is not None and facts.rpc_clients:
        return "busy"
    return _STATE_OF_OUTCOME[rpc_result.outcome]


_STATE_OF_OUTCOME: Mapping[Outcome, NodeStateName] = {
    Outcome.OK: "ok",
    Outcome.REFUSED: "refused",
    Outcome.TIMEOUT: "timeout",
    Outcome.BUSY: "busy",
    Outcome.CLOSED: "closed",
    Outcome.VERSION_MISMATCH: "version_mismatch",
    Outcome.PROTOCOL_ERROR: "protocol_error",
}


@dataclass(frozen=True)
class NodeProbe:
    """One host: its RPC probe, its facts (None: not gathered or unreadable), its devices, its state."""

    host: str
    endpoint: str
    rpc: ProbeResult
    facts: HostFacts | None
    devices: tuple[DeviceCapacity, ...]
    state: NodeStateName
    facts_error: str | None = None  # why facts are missing although they were asked for
    duplicate_of: str | None = None  # the earlier host with the same endpoint (counted once in totals)
    warnings: tuple[str, ...] = ()
    transport: str = "tcp"  # rpc_transport: how the controller reached the server

    @property
    def ok(self) -> bool:
        return self.state == "ok"

    @property
    def untrusted(self) -> str | None:
        """Why this node's memory is not used (not measured, not trusted), or None."""
        why = next((d.untrusted for d in self.devices if d.untrusted), None)
        if why is not None and self.facts_error:
            why += f": {self.facts_error}"
        return why

    @property
    def clients(self) -> tuple[str, ...] | None:
        return self.facts.rpc_clients if self.facts is not None else None

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "endpoint": self.endpoint,
            "transport": self.transport,
            "state": self.state,
            "ok": self.ok,
            "outcome": self.rpc.outcome.value,
            "protocol": str(self.rpc.version) if self.rpc.version is not None else None,
            "message": self.rpc.message,
            "elapsed": round(self.rpc.elapsed, 4),
            "clients": list(self.clients) if self.clients is not None else None,
            "duplicate_of": self.duplicate_of,
            "warnings": list(self.warnings),
            "facts_error": self.facts_error,
            "untrusted": self.untrusted,
            "facts": self.facts.to_json() if self.facts is not None else None,
            "devices": [d.to_json() for d in self.devices],
        }


@dataclass(frozen=True)
class FleetTotals:
    """Sums over the ok endpoints, each endpoint counted once; the RAM of a machine that runs several
    CPU servers counted once in `total` (their free and usable are shares of it: they add up)."""

    endpoints: int  # distinct endpoints probed
    ok_endpoints: int
    devices: int
    total: int
    free: int
    usable: int

    def to_json(self) -> dict[str, Any]:
        return {
            "endpoints": self.endpoints,
            "ok_endpoints": self.ok_endpoints,
            "devices": self.devices,
            "total": self.total,
            "free": self.free,
            "usable": self.usable,
        }


def fleet_totals(nodes: Sequence[NodeProbe]) -> FleetTotals:
    """Totals with endpoints de-duplicated (one registration per host:port, as llama.cpp keeps them)."""
    first: dict[str, NodeProbe] = {}
    for node in nodes:
        first.setdefault(node.endpoint, node)
    ok = [n for n in first.values() if n.ok]
    devices = [d for n in ok for d in n.devices]
    total, machines = 0, set[str]()
    for node in ok:
        machine = node.facts.machine_id if node.facts is not None else None
        for d in node.devices:
            if d.kind == "cpu" and machine is not None:
                if machine in machines:  # the same RAM, seen by another server of this machine
                    continue
                machines.add(machine)
            total += d.total
    return FleetTotals(
        endpoints=len(first),
        ok_endpoints=len(ok),
        devices=len(devices),
        total=total,
        free=sum(d.free for d in devices),
        usable=sum(d.usable for d in devices),
    )


@dataclass(frozen=True)
class FleetProbe:
    """Every probed host in inventory order, plus the totals."""

    nodes: tuple[NodeProbe, ...]
    totals: FleetTotals
    protocol: str  # the protocol this controller speaks (servers must match it)
    timeout: float
    elapsed: float = 0.0
    facts: bool = True  # whether facts were asked for

    @classmethod
    def of(
        cls,
        nodes: Sequence[NodeProbe],
        *,
        protocol: str,
        timeout: float,
        elapsed: float = 0.0,
        facts: bool = True,
    ) -> FleetProbe:
        return cls(tuple(nodes), fleet_totals(nodes), protocol, timeout, elapsed, facts)

    @property
    def ok(self) -> bool:
        """Every node answered ok (an empty fleet is ok)."""
        return all(n.ok for n in self.nodes)

    @property
    def failed(self) -> tuple[NodeProbe, ...]:
        return tuple(n for n in self.nodes if not n.ok)

    @property
    def devices(self) -> tuple[DeviceCapacity, ...]:
        """Devices of the ok nodes, each endpoint once, in inventory order."""
        seen: set[str] = set()
        out: list[DeviceCapacity] = []
        for node in self.nodes:
            if node.ok and node.endpoint not in seen:
                seen.add(node.endpoint)
                out += node.devices
        return tuple(out)

    def memory(self) -> AggregateMemory | None:
        """Free/total summed over distinct endpoints, or None when any endpoint is not ok (never raises).

        Free here is the probe's (MemAvailable for CPU devices), unlike `rpc.query_memory`'s raw numbers.
        """
        if not self.ok:
            return None
        return AggregateMemory(
            free=self.totals.free,
            total=self.totals.total,
            server_count=self.totals.ok_endpoints,
            device_count=self.totals.devices,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "ok": self.ok,
            "protocol": self.protocol,
            "timeout": self.timeout,
            "elapsed": round(self.elapsed, 4),
            "totals": self.totals.to_json(),
            "nodes": [n.to_json() for n in self.nodes],
        }


def fleet_failed(fleet: FleetProbe, fail_on: FailOn | str = "any") -> bool:
    """Whether the probe counts as failed: `any` node not ok, `all` nodes not ok, or `none` (never)."""
    bad = len(fleet.failed)
    if fail_on == "any":
        return bad > 0
    if fail_on == "all":
        return bool(fleet.nodes) and bad == len(fleet.nodes)
    if fail_on == "none":
        return False
    raise ValueError(f"fail_on must be one of {', '.join(FAIL_ON)}, got {fail_on!r}")


def _unreachable_endpoint(host: Host) -> str | None:
    """Why the controller cannot probe `host`'s endpoint, or None when it can.

    A server bound to a remote node's loopback is reachable only from that node; probing the same
    address here would reach a different server (or none).
    """
    if host.binds_own_loopback:
        return (
            f"the server binds the node's loopback ({host.endpoint}): "
            "unreachable from this controller (set rpc_host to an address clients can reach)"
        )
    return None


async def _probe_rpc(host: Host, timeout: float, expected: ProtocolVersion | None) -> ProbeResult:  # noqa: ASYNC109
    why = _unreachable_endpoint(host)
    if why is not None:
        return ProbeResult(host.endpoint, Outcome.REFUSED, None, (), why, 0.0)
    try:
        target = await target_of(host)
    except RpcfleetError as exc:  # the SSH forward could not be opened: the server is unreachable
        return ProbeResult(host.endpoint, Outcome.REFUSED, None, (), f"SSH forward: {exc.message}", 0.0)
    return await probe_endpoint(
        target, expected=expected, connect_timeout=timeout, read_timeout=timeout, deadline=timeout
    )


async def probe_fleet(
    hosts: Iterable[Host],
    *,
    timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109 (per host, not for the whole call)
    facts: bool = True,
    session: Session | None = None,
    forks: int | None = None,
    expected: ProtocolVersion | None = None,
    trust_rpc_memory: bool = False,
) -> FleetProbe:
    """Probe up to `forks` hosts at once: RPC from here and (when `facts`) host facts through the executor.

    Each host's RPC probe and facts are bounded by `timeout`; the whole call takes about the slowest
    host's time when `forks` covers the fleet, never more than about `timeout` per round of `forks`
    hosts. Never raises for a host's failure: it is in its `NodeProbe`. `session`: reuse its
    connections (otherwise one is opened and closed here, with `timeout` as the connect timeout).
    `forks` (default: the session's, else `DEFAULT_FORKS`) bounds the RPC probes and the facts alike.
    `trust_rpc_memory`: see `compute_capacity`.
    """
    hosts = list(hosts)
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    forks = forks if forks is not None else session.forks if session is not None else DEFAULT_FORKS
    if forks < 1:
        raise ValueError(f"forks must be at least 1, got {forks}")
    started = time.monotonic()
    client = expected or cached_local_protocol_version()

    # One probe per distinct endpoint: two probes of one server at once would make one of them busy.
    first_host: dict[str, Host] = {}
    for host in hosts:
        first_host.setdefault(host.endpoint, host)

    async def rpc_all() -> dict[str, ProbeResult]:
        endpoints = list(first_host)
        calls = [functools.partial(_probe_rpc, first_host[e], timeout, client) for e in endpoints]
        return dict(zip(endpoints, await gather_bounded(calls, forks), strict=True))

    async def facts_step(ctx: HostContext) -> StepOutcome[HostFacts]:
        value = await read_facts(ctx, timeout=timeout)
        return StepOutcome(value, message="facts read")

    async def facts_all() -> dict[str, tuple[HostFacts | None, str | None]]:
        if not facts or not hosts:
            return {}
        if session is not None:
            run = await session.run(hosts, facts_step, name="probe_facts")
        else:
            async with Session(forks=forks, options=ConnectOptions(connect_timeout=timeout)) as own:
                run = await own.run(hosts, facts_step, name="probe_facts")
        return {
            r.host.name: (r.value, None if r.succeeded else (r.error.message if r.error else r.message))
            for r in run.results
        }

    rpc_results, fact_results = await asyncio.gather(rpc_all(), facts_all())
    capacities = fleet_capacity(
        [(h, rpc_results[h.endpoint], fact_results.get(h.name, (None, None))[0]) for h in hosts],
        trust_rpc_memory=trust_rpc_memory,
    )
    nodes: list[NodeProbe] = []
    for host, devices in zip(hosts, capacities, strict=True):
        result = rpc_results[host.endpoint]
        host_facts, facts_error = fact_results.get(host.name, (None, None))
        first = first_host[host.endpoint]
        duplicate_of = first.name if first.name != host.name else None
        warnings: list[str] = []
        if duplicate_of is not None:
            warnings.append(f"same endpoint as {duplicate_of}: probed and counted once")
        if facts_error is not None:
            warnings.append(f"facts not read: {facts_error}")
        if host_facts is not None:
            warnings += host_facts.gpu_errors()
            if host_facts.rpc_clients is not None:
                clients = without_own_connection(host_facts.rpc_clients, result.local_address)
                host_facts = dataclasses.replace(host_facts, rpc_clients=clients)
        nodes.append(
            NodeProbe(
                host=host.name,
                endpoint=result.endpoint,
                rpc=result,
                facts=host_facts,
                devices=devices,
                state=node_state(result, host_facts),
                facts_error=facts_error,
                duplicate_of=duplicate_of,
                warnings=tuple(warnings),
                transport=host.rpc_transport,
            )
        )
    fleet = FleetProbe.of(
        nodes, protocol=str(client), timeout=timeout, elapsed=time.monotonic() - started, facts=facts
    )
    # The logger is made at call time: one bound at import would miss the CLI's logging configuration.
    get_logger().info(
        "probe_done",
        hosts=len(nodes),
        failed=len(fleet.failed),
        elapsed=round(fleet.elapsed, 3),
    )
    return fleet


async def query_fleet_memory(
    hosts: Iterable[Host],
    *,
    timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109
    facts: bool = True,
) -> AggregateMemory | None:
    """Free/total memory over the fleet's distinct endpoints, or None when any host is not ok.

    Never raises (llamaj.cpp's `RpcMemoryQuery.queryAll`); an empty fleet gives zeros and 0 servers.
    """
    try:
        fleet = await probe_fleet(hosts, timeout=timeout, facts=facts)
    except (RpcfleetError, ValueError, OSError) as exc:
        get_logger().debug("fleet_memory_query_failed", error=str(exc))
        return None
    return fleet.memory()
