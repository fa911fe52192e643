"""What `orchestrator.Llama` decides before loading: the endpoints, each device's usable memory, and
the plan (pure, except `read_local_facts`).

Usable memory without an inventory follows the probe's rules (`probe.capacity`) as far as facts exist:

* A device that reports free == total is taken for a CPU device: CPU servers report their total RAM as
  free (a constant), while a GPU driver always reports less free memory than it has.
* Loopback endpoints run on this machine, so this machine's facts apply: a CPU device gets
  `MemAvailable`, split evenly among the CPU servers of this machine (otherwise each would claim all
  of it). GPU devices keep the free memory they report.
* Remote endpoints have no host facts. GPU devices keep the free memory they report (the driver's
  figure). A CPU device's figure is not a measurement, so it is not trusted ("memory that was not
  measured is not trusted"): planning refuses it with a `PlanError`, unless `rpc_memory` gives its
  usable bytes or `trust_rpc_memory=True` accepts the server's figure.
* `rpc_memory={endpoint: size}` sets the usable bytes of each device of that endpoint, for any endpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from orchestrator.connectors.local import LocalConnection
from orchestrator.core.errors import PlanError, RpcfleetError
from orchestrator.core.log import get_logger
from orchestrator.core.units import format_size, parse_size
from orchestrator.facts.base import gather
from orchestrator.inventory.model import Host, is_loopback
from orchestrator.planning.plan import Plan, PlanDevice
from orchestrator.probe.capacity import fleet_capacity
from orchestrator.probe.host import HostFacts, probe_facts
from orchestrator.rpc.errors import EndpointUnreachableError
from orchestrator.rpc.protocol import EndpointError, Outcome, ProbeResult, parse_endpoint

FACTS_TIMEOUT_S = 5.0


def parse_rpc_servers(value: str | Iterable[str] | None) -> list[str]:
    """The seed's `rpc_servers`: a list, or one comma-separated string; canonical `host:port`, each once,
    in the order given. A malformed endpoint is an `EndpointUnreachableError` naming it."""
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
        backend="vulkan",  # any GPU backend: no driver tool to cross-check without facts
    )


async def _gather_local() -> HostFacts:
    host = Host(name="localhost", address="127.0.0.1", connection="local")
    conn = LocalConnection(host)
    try:
        values = await gather(conn, probe_facts(host), timeout=FACTS_TIMEOUT_S, check=False)
    finally:
        await conn.close()
    return HostFacts.from_values(values)


@dataclass(frozen=True)
class LocalFacts:
    """This machine's facts, or why they could not be read (`error`)."""

    facts: HostFacts | None
    error: str | None = None


def read_local_facts() -> LocalFacts:
    """This machine's facts (MemAvailable, machine identity...) for its loopback servers. When they (or
    MemAvailable) cannot be read, loopback CPU servers count as unmeasured: the cause is logged as a
    warning and kept in `error`, for the refusal to name it."""
    from orchestrator.llama.preflight import _run_sync

    try:
        facts: HostFacts = _run_sync(_gather_local())
    except Exception as exc:
        error = exc.message if isinstance(exc, RpcfleetError) else f"{type(exc).__name__}: {exc}"
        get_logger().warning("local_facts_failed", error=error)
        return LocalFacts(None, error)
    if facts.memory is None:
        error = "MemAvailable (/proc/meminfo) could not be read"
        get_logger().warning("local_facts_failed", error=error)
        return LocalFacts(facts, error)
    return LocalFacts(facts)


@dataclass(frozen=True)
class Measured:
    """The planner's devices for the endpoints, and the CPU devices whose memory was not measured."""

    devices: tuple[PlanDevice, ...]
    unmeasured: tuple[str, ...]  # device labels


def measured_devices(
    results: Mapping[str, ProbeResult],
    local_facts: HostFacts | None,
    *,
    alignments: Mapping[tuple[str, int], int],
    rpc_memory: Mapping[str, int] | None = None,
    trust_rpc_memory: bool = False,
) -> Measured:
    """Each endpoint's devices (endpoints in the given order) with usable memory by the rules above.
    `alignments`: each device's buffer alignment (from its registration). Pure."""
    explicit = rpc_memory or {}
    probed = [
        (_host_for(ep, r), r, local_facts if is_loopback(parse_endpoint(ep).host) else None)
        for ep, r in results.items()
    ]
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


def refuse_unmeasured(labels: Sequence[str], local_error: str | None = None) -> None:
    """A PlanError for CPU devices whose memory was not measured; `local_error`: why this machine's
    facts (for its loopback servers) could not be read."""
    if labels:
        why = f" (this machine's facts could not be read: {local_error})" if local_error else ""
        raise PlanError(
            f"the free memory of {', '.join(labels)} was not measured: a CPU server reports its total RAM "
            f"as free, and a remote one has no host facts here{why}",
            hint="pass rpc_memory={'host:port': '16GiB'} (usable bytes per device), trust_rpc_memory=True, "
            "or tensor_split; or plan with an inventory (rpcfleet plan), which reads MemAvailable",
        )


def refuse_misfit(plan: Plan) -> None:
    """A planned split that does not fit: a `PlanError` naming the device and the shortfall, before
    llama.cpp would run out of memory half-way through the load."""
    fit = plan.fit
    if fit.fits or fit.binding_device is None:
        return
    dev = plan.devices[fit.binding_device]
    m = dev.memory
    raise PlanError(
        f"the model does not fit: {dev.label} needs {format_size(m.total)} (weights "
        f"{format_size(m.weights)}, KV {format_size(m.kv)}, compute {format_size(m.compute)}) plus a "
        f"margin of {format_size(m.margin)} but may use {format_size(m.usable)}: short by "
        f"{format_size(fit.shortfall)}",
        host=dev.endpoint,
        hint="use a smaller n_ctx, more servers, or a tensor_split of your own",
    )
