"""What `orchestrator.Llama` decides before loading: the endpoints, each device's usable memory, and
the plan (pure, except `read_local_facts`).

Usable memory without an inventory follows the probe's rules (`probe.capacity`) as far as facts exist:

* A device that reports free == total is taken for a CPU device: CPU servers report their total RAM as
  free (a constant), while a GPU driver always reports less free memory than it has.
* Loopback endpoints run on this machine, so this machine's facts apply: a CPU device gets
  `MemAvailable`, split evenly among the CPU servers of this machine (otherwise each would claim all
  of it). GPU devices keep the free memory they report.
* Remote endpoints that a host of the inventory rpcfleet's commands use serves (`$RPCFLEET_INVENTORY`,
  `./inventory.yml`, the running lab's) get that host's facts, read over its connection, as `rpcfleet
  plan` would: so `rpc_servers=["10.77.0.11:50052"]` after `rpcfleet lab up` plans on MemAvailable.
* Other remote endpoints have no host facts. GPU devices keep the free memory they report (the driver's
  figure). A CPU device's figure is not a measurement, so it is not trusted ("memory that was not
  measured is not trusted"): planning refuses it with a `PlanError`, unless `rpc_memory` gives its
  usable bytes or `trust_rpc_memory=True` accepts the server's figure.
* `rpc_memory={endpoint: size}` sets the usable bytes of each device of that endpoint, for any endpoint.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from orchestrator.connectors.base import ConnectOptions
from orchestrator.connectors.connect import connect
from orchestrator.core.errors import PlanError, RpcfleetError
from orchestrator.core.log import get_logger
from orchestrator.core.units import parse_size
from orchestrator.engine.runtime import run_sync
from orchestrator.facts.base import gather
from orchestrator.inventory.load import default_inventory_path, load_inventory
from orchestrator.inventory.model import Host, is_loopback
from orchestrator.planning.plan import PlanDevice
from orchestrator.probe.capacity import fleet_capacity
from orchestrator.probe.host import HostFacts, probe_facts
from orchestrator.rpc.errors import EndpointUnreachableError
from orchestrator.rpc.records import EndpointError, Outcome, ProbeResult, parse_endpoint

FACTS_TIMEOUT_S = 5.0


def parse_rpc_servers(value: str | Iterable[str] | None) -> list[str]:
    """The drop-in API's `rpc_servers`: a list, or one comma-separated string; canonical `host:port`,
    each once, in the order given. A malformed endpoint is an `EndpointUnreachableError` naming it."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    out: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"rpc_servers: expected 'host:port' strings, got {item!r}")
        if isinstance(value, str) and not item.strip():
            continue  # "a:1,b:2," — a trailing comma
        try:
            endpoint = str(parse_endpoint(item))
        except EndpointError as exc:
            result = ProbeResult(item, Outcome.REFUSED, None, (), str(exc), 0.0)
            raise EndpointUnreachableError(result, f"rpc_servers: {exc}") from None
        if endpoint not in out:
            out.append(endpoint)
    return out


def parse_rpc_memory(value: Mapping[str, int | str] | None) -> dict[str, int]:
    """`rpc_memory`: {endpoint: usable bytes per device (an int or a size such as "16GiB")}."""
    out: dict[str, int] = {}
    for endpoint, size in (value or {}).items():
        try:
            out[str(parse_endpoint(endpoint))] = parse_size(size)
        except (EndpointError, ValueError) as exc:
            raise PlanError(f"rpc_memory[{endpoint!r}]: {exc}") from None
    return out


def _host_for(endpoint: str, result: ProbeResult) -> Host:
    """A host standing for `endpoint` in the probe's rules. `rpc_devices` says which devices are CPUs
    (free == total) so that `compute_capacity` treats them as such."""
    ep = parse_endpoint(endpoint)
    kinds = tuple("CPU" if d.free == d.total else f"GPU{d.index}" for d in result.devices)
    return Host(
        name=endpoint,
        address=ep.host,
        connection="local" if is_loopback(ep.host) else "ssh",
        rpc_host=ep.host,
        rpc_port=ep.port,
        rpc_devices=kinds,
        rpc_backend="vulkan",  # any GPU backend: no driver tool to cross-check without facts
    )


LOCAL_HOST = Host(name="localhost", address="127.0.0.1", connection="local")


def inventory_hosts(endpoints: Iterable[str]) -> dict[str, Host]:
    """{endpoint: the inventory host serving it} for the endpoints a default inventory knows (see the
    module's doc); {} without one. A broken inventory is named in the log, never fatal: the endpoints
    then plan as if there were none."""
    path = default_inventory_path()
    if path is None:
        return {}
    try:
        hosts = load_inventory(path).hosts
    except RpcfleetError as exc:
        get_logger().warning("inventory_unreadable", path=str(path), error=str(exc))
        return {}
    wanted = set(endpoints)
    return {host.endpoint: host for host in hosts if host.endpoint in wanted}


async def _gather(host: Host) -> HostFacts:
    conn = await connect(host, ConnectOptions(connect_timeout=FACTS_TIMEOUT_S))
    try:
        values = await gather(conn, probe_facts(host), timeout=FACTS_TIMEOUT_S, check=False)
    finally:
        await conn.close()
    return HostFacts.from_values(values)


@dataclass(frozen=True)
class FactsRead:
    """A host's facts, or why they could not be read (`error`, for the refusal to name it)."""

    facts: HostFacts | None
    error: str | None = None


def _facts_read(host: Host, result: HostFacts | BaseException) -> FactsRead:
    if isinstance(result, BaseException):
        if not isinstance(result, Exception):
            raise result
        error = result.message if isinstance(result, RpcfleetError) else f"{type(result).__name__}: {result}"
        get_logger().warning("facts_failed", host=host.name, error=error)
        return FactsRead(None, error)
    if result.memory is None:
        error = "MemAvailable (/proc/meminfo) could not be read"
        get_logger().warning("facts_failed", host=host.name, error=error)
        return FactsRead(result, error)
    return FactsRead(result)


def read_facts(hosts: Mapping[str, Host]) -> dict[str, FactsRead]:
    """Each host's facts (MemAvailable, machine identity...), read at once. A host whose facts (or
    MemAvailable) cannot be read has its CPU servers count as unmeasured; the cause is logged as a
    warning and kept in `error`."""

    async def all_facts() -> list[HostFacts | BaseException]:
        return await asyncio.gather(*(_gather(h) for h in hosts.values()), return_exceptions=True)

    results = run_sync(all_facts())
    return {key: _facts_read(host, r) for (key, host), r in zip(hosts.items(), results, strict=True)}


def read_local_facts() -> FactsRead:
    """This machine's facts, for its loopback servers."""
    return read_facts({"local": LOCAL_HOST})["local"]


def endpoint_facts(endpoints: Sequence[str]) -> dict[str, FactsRead]:
    """The facts that measure each endpoint's memory: this machine's for loopback endpoints, the
    inventory host's for the endpoints a default inventory serves; the others are absent."""
    sources: dict[str, Host] = dict(
        inventory_hosts(ep for ep in endpoints if not is_loopback(parse_endpoint(ep).host))
    )
    if any(is_loopback(parse_endpoint(ep).host) for ep in endpoints):
        sources["local"] = LOCAL_HOST
    reads = read_facts(sources) if sources else {}
    return {
        ep: reads["local" if is_loopback(parse_endpoint(ep).host) else ep]
        for ep in endpoints
        if is_loopback(parse_endpoint(ep).host) or ep in reads
    }


def unmeasured_causes(reads: Mapping[str, FactsRead]) -> tuple[str, ...]:
    """Why facts could not be read, once per host, for `refuse_unmeasured`."""
    causes: list[str] = []
    for endpoint, read in reads.items():
        if read.error is None:
            continue
        whose = (
            "this machine's facts"
            if is_loopback(parse_endpoint(endpoint).host)
            else f"{endpoint}'s host facts"
        )
        cause = f"{whose} could not be read: {read.error}"
        if cause not in causes:
            causes.append(cause)
    return tuple(causes)


@dataclass(frozen=True)
class Measured:
    """The planner's devices for the endpoints, and the CPU devices whose memory was not measured."""

    devices: tuple[PlanDevice, ...]
    unmeasured: tuple[str, ...]  # device labels


def measured_devices(
    results: Mapping[str, ProbeResult],
    facts: Mapping[str, HostFacts | None],
    *,
    alignments: Mapping[tuple[str, int], int],
    rpc_memory: Mapping[str, int] | None = None,
    trust_rpc_memory: bool = False,
) -> Measured:
    """Each endpoint's devices (endpoints in the given order) with usable memory by the rules above.
    `facts`: {endpoint: its host's facts} (`endpoint_facts`); `alignments`: each device's buffer
    alignment (from its registration). Pure."""
    explicit = rpc_memory or {}
    probed = [(_host_for(ep, r), r, facts.get(ep)) for ep, r in results.items()]
    devices: list[PlanDevice] = []
    unmeasured: list[str] = []
    capacities_of = fleet_capacity(probed, trust_rpc_memory=trust_rpc_memory)
    for (host, _result, _facts), capacities in zip(probed, capacities_of, strict=True):
        for cap in capacities:
            usable = explicit.get(host.name)
            if usable is None:
                # The probe's rule: a CPU device without facts is not measured (usable 0, untrusted).
                if not cap.measured and not trust_rpc_memory:
                    unmeasured.append(cap.name)
                usable = cap.usable
            devices.append(
                PlanDevice(
                    endpoint=host.name,
                    index=cap.index,
                    name=cap.name,
                    description=host.name,
                    total=cap.total,
                    free=cap.free,
                    usable=usable,
                    alignment=alignments.get((host.name, cap.index), 32),
                    host=host.name,
                )
            )
    return Measured(tuple(devices), tuple(unmeasured))


def refuse_unmeasured(labels: Sequence[str], causes: Sequence[str] = ()) -> None:
    """A PlanError for CPU devices whose memory was not measured; `causes`: why the facts that would
    have measured them could not be read (`unmeasured_causes`)."""
    if labels:
        why = f" ({'; '.join(causes)})" if causes else ""
        raise PlanError(
            f"the free memory of {', '.join(labels)} was not measured: a CPU server reports its total RAM "
            f"as free, and a remote one has no host facts here{why}",
            hint="pass rpc_memory={'host:port': '16GiB'} (usable bytes per device), trust_rpc_memory=True, "
            "or tensor_split; or plan with an inventory (rpcfleet plan), which reads MemAvailable",
        )
