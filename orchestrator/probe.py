"""The fleet probe: RPC from the controller plus host facts over SSH -> capacity per device.

Every selected host is probed at once, two ways, both bounded by one timeout per host:

* RPC, from this controller straight to the endpoint (`orchestrator.rpc`): HELLO, device count and each
  device's free/total memory. Each distinct endpoint is probed once (two probes of one server at once
  would make one of them `busy`).
* Facts, over the host's connection through the executor (`orchestrator.facts`): MemAvailable, the CPU
  model, nvidia-smi / rocm-smi, the clients connected to the rpc port (`ss`, less the probe's own
  connection) and the machine's identity (boot id, else machine-id), in one round trip.

`compute_capacity` (pure) turns both into one `DeviceCapacity` per device:

* usable = max(0, min(free - memory_reserve, memory_limit)); reserve and limit are per device.
* CPU devices report free == total == physical RAM (a constant), so their free is `MemAvailable`
  (`source_of_free="meminfo"`); without facts the RPC number is kept, with a warning. Several CPU
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
     "nodes": [{"host": str, "endpoint": str, "state": str, "ok": bool,
                "outcome": str, "protocol": str | null, "message": str, "elapsed": float,
                "clients": [str] | null,                            # from ss; null without facts
                "duplicate_of": str | null,                         # host probed for the same endpoint
                "warnings": [str], "facts_error": str | null,
                "facts": {"mem_total": int | null, "mem_available": int | null,
                          "cpu_model": str | null, "cpu_count": int | null,
                          "gpus": [{"vendor", "index", "name", "total", "free"}],
                          "gpu_errors": [str], "rpc_clients": [str] | null,
                          "machine_id": str | null} | null,
                "devices": [{"index": int, "name": str, "description": str, "backend": str,
                             "kind": "cpu" | "gpu", "total": int, "free": int, "reserve": int,
                             "limit": int | null, "usable": int, "source_of_free": "rpc" | "meminfo",
                             "warnings": [str]}]}]}
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from orchestrator.connection import ConnectOptions
from orchestrator.errors import ProbeError, RpcfleetError, UnreachableError
from orchestrator.executor import HostContext, Session, StepOutcome
from orchestrator.facts import (
    CpuCountFact,
    Fact,
    Gpu,
    GpuReport,
    MachineIdFact,
    MemInfo,
    MemoryFact,
    NvidiaGpuFact,
    RocmGpuFact,
    RpcClientsFact,
    gather,
)
from orchestrator.inventory import Host
from orchestrator.log import get_logger
from orchestrator.planner import PlanDevice
from orchestrator.rpc import (
    AggregateMemory,
    Outcome,
    ProbeResult,
    ProtocolVersion,
    cached_local_protocol_version,
    probe_endpoint,
)
from orchestrator.units import format_size

__all__ = [
    "DEFAULT_TIMEOUT",
    "GPU_TOLERANCE",
    "SCHEMA_VERSION",
    "CpuModelFact",
    "DeviceCapacity",
    "FailOn",
    "FleetProbe",
    "FleetTotals",
    "HostFacts",
    "NodeProbe",
    "compute_capacity",
    "cpu_shares",
    "fleet_capacity",
    "fleet_failed",
    "fleet_totals",
    "node_state",
    "probe_facts",
    "probe_fleet",
    "query_fleet_memory",
    "read_facts",
    "to_plan_devices",
    "usable_bytes",
    "without_own_connection",
]


SCHEMA_VERSION = 1
DEFAULT_TIMEOUT = 3.0  # seconds, per host, for the RPC probe and for the facts alike
MiB = 1024 * 1024
# GPU cross-check: the server's and the driver tool's numbers may differ by this fraction of the device's
# total, or by GPU_TOLERANCE_MIN bytes, whichever is larger (free memory moves; CUDA's total excludes
# what the driver reserves) before the probe warns.
GPU_TOLERANCE = 0.05
GPU_TOLERANCE_MIN = 256 * MiB
# buffer alignment of the server's devices (CPU 32, CUDA/HIP 128); the planner pads tensors with it
_ALIGNMENT = {"cuda": 128, "rocm": 128}

NodeStateName = Literal["ok", "refused", "timeout", "busy", "closed", "version_mismatch", "protocol_error"]
SourceOfFree = Literal["rpc", "meminfo"]
DeviceKind = Literal["cpu", "gpu"]
FailOn = Literal["any", "none", "all"]
FAIL_ON: tuple[str, ...] = ("any", "none", "all")


# --- facts ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuModelFact(Fact[str | None]):
    """The CPU's model name (/proc/cpuinfo, lscpu on ARM, sysctl on macOS); None when none is found."""

    name: ClassVar[str] = "cpu_model"

    def command(self) -> str:
        return (
            "m=$(grep -m1 -i -E '^(model name|cpu model|hardware)[[:space:]]*:' /proc/cpuinfo 2>/dev/null"
            " | cut -d: -f2-); "
            "[ -n \"$m\" ] || m=$(lscpu 2>/dev/null | grep -m1 '^Model name:' | cut -d: -f2-); "
            '[ -n "$m" ] || m=$(sysctl -n machdep.cpu.brand_string 2>/dev/null); '
            "printf '%s\\n' \"$m\""
        )

    def parse(self, stdout: str, stderr: str, exit_status: int) -> str | None:
        text = " ".join(stdout.split())
        return text or None


@dataclass(frozen=True)
class HostFacts:
    """What the probe reads from a host besides RPC. None in a field: the fact could not be read."""

    memory: MemInfo | None = None
    cpu_model: str | None = None
    cpu_count: int | None = None
    nvidia: GpuReport | None = None
    rocm: GpuReport | None = None
    rpc_clients: tuple[str, ...] | None = None  # peers connected to the rpc port; None: no `ss`
    machine_id: str | None = None  # `MachineIdFact`: hosts with the same one share one machine's RAM

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> HostFacts:
        """From `parse_gathered` output ({fact name: value}); missing facts stay None."""
        return cls(
            memory=values.get(MemoryFact.name),
            cpu_model=values.get(CpuModelFact.name),
            cpu_count=values.get(CpuCountFact.name),
            nvidia=values.get(NvidiaGpuFact.name),
            rocm=values.get(RocmGpuFact.name),
            rpc_clients=values.get(RpcClientsFact.name),
            machine_id=values.get(MachineIdFact.name),
        )

    def gpus(self, vendor: Literal["nvidia", "amd"]) -> dict[int, Gpu]:
        report = self.nvidia if vendor == "nvidia" else self.rocm
        return {gpu.index: gpu for gpu in report.gpus} if report is not None else {}

    def gpu_errors(self) -> list[str]:
        return [f"{r.tool}: {r.error}" for r in (self.nvidia, self.rocm) if r is not None and r.error]

    def to_json(self) -> dict[str, Any]:
        gpus = [g for r in (self.nvidia, self.rocm) if r is not None for g in r.gpus]
        return {
            "mem_total": self.memory.total if self.memory else None,
            "mem_available": self.memory.available if self.memory else None,
            "cpu_model": self.cpu_model,
            "cpu_count": self.cpu_count,
            "gpus": [
                {"vendor": g.vendor, "index": g.index, "name": g.name, "total": g.total, "free": g.free}
                for g in gpus
            ],
            "gpu_errors": self.gpu_errors(),
            "rpc_clients": list(self.rpc_clients) if self.rpc_clients is not None else None,
            "machine_id": self.machine_id,
        }


def probe_facts(host: Host) -> list[Fact[Any]]:
    """The facts the probe gathers from `host`, in one round trip."""
    return [
        MemoryFact(),
        CpuModelFact(),
        CpuCountFact(),
        NvidiaGpuFact(),
        RocmGpuFact(),
        RpcClientsFact(host.rpc_port),
        MachineIdFact(),
    ]


async def read_facts(ctx: HostContext, *, timeout: float = DEFAULT_TIMEOUT) -> HostFacts:  # noqa: ASYNC109
    """Gather `probe_facts` over the host's connection; connect and command bounded by `timeout` together.

    Raises UnreachableError when the host cannot be reached within it (the executor records it).
    """
    try:
        async with asyncio.timeout(timeout):
            conn = await ctx.connection()
            values = await gather(conn, probe_facts(ctx.host), timeout=timeout, check=False)
    except TimeoutError:
        raise UnreachableError(f"facts not read within {timeout:g} s", host=ctx.host.name) from None
    return HostFacts.from_values(values)


# --- capacity (pure) --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceCapacity:
    """One device of one rpc-server, with what a plan may put on it (`usable`, bytes)."""

    host: str
    endpoint: str
    index: int
    name: str  # `<endpoint>#<index>`: stable (the native client's `RPC<k>` depends on registration order)
    description: str
    backend: str
    kind: DeviceKind
    total: int
    free: int
    reserve: int
    limit: int | None
    usable: int
    source_of_free: SourceOfFree
    warnings: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "description": self.description,
            "backend": self.backend,
            "kind": self.kind,
            "total": self.total,
            "free": self.free,
            "reserve": self.reserve,
            "limit": self.limit,
            "usable": self.usable,
            "source_of_free": self.source_of_free,
            "warnings": list(self.warnings),
        }


def usable_bytes(free: int, reserve: int, limit: int | None) -> int:
    """min(free - reserve, limit), never negative."""
    usable = free - reserve
    if limit is not None:
        usable = min(usable, limit)
    return max(0, usable)


_DEVICE_NAME_RE = re.compile(r"([A-Za-z]+)(\d*)")


def _device_target(host: Host, index: int) -> tuple[str, int | None]:
    """(kind hint, driver index) of device `index` from the inventory: 'cpu', 'nvidia', 'amd' or 'gpu'.

    With `rpc_devices` the server exposes exactly those, in that order (`CUDA1` is nvidia GPU 1). Without
    it a GPU build exposes every GPU in order and a CPU build the CPU.
    """
    if host.rpc_devices:
        if index >= len(host.rpc_devices):
            return "gpu", None
        match = _DEVICE_NAME_RE.fullmatch(host.rpc_devices[index].strip())
        if match is None:
            return "gpu", None
        prefix, number = match.group(1).upper(), match.group(2)
        gpu_index = int(number) if number else None
        if prefix == "CPU":
            return "cpu", None
        if prefix == "CUDA":
            return "nvidia", gpu_index
        if prefix in ("ROCM", "HIP"):
            return "amd", gpu_index
        return "gpu", gpu_index
    if host.backend == "cpu":
        return "cpu", None
    vendor = {"cuda": "nvidia", "rocm": "amd"}.get(host.backend, "gpu")
    return vendor, index


def _disagrees(a: int, b: int, total: int) -> bool:
    return abs(a - b) > max(GPU_TOLERANCE_MIN, int(GPU_TOLERANCE * total))


def _looks_like_cpu(free: int, total: int, facts: HostFacts | None) -> bool:
    """A 'GPU' reporting free == total == the host's RAM is the CPU (a GPU build that found no GPU)."""
    return (
        facts is not None
        and facts.memory is not None
        and free == total
        and abs(total - facts.memory.total) <= MiB
    )


def compute_capacity(
    host: Host, rpc_result: ProbeResult, facts: HostFacts | None, *, cpu_share: int = 1
) -> tuple[DeviceCapacity, ...]:
    """Capacity of every device the server reported (none unless the probe is ok). Pure.

    `cpu_share`: how many CPU devices of the fleet run on this host's machine (`cpu_shares`); each
    gets that fraction of MemAvailable, since each of them would otherwise claim all of it. Reserve
    and limit still apply per host, to the share.
    """
    if cpu_share < 1:
        raise ValueError(f"cpu_share must be at least 1, got {cpu_share}")
    if not rpc_result.ok:
        return ()
    endpoint = rpc_result.endpoint
    devices: list[DeviceCapacity] = []
    for dev in rpc_result.devices:
        warnings: list[str] = []
        target, gpu_index = _device_target(host, dev.index)
        kind: DeviceKind = "cpu" if target == "cpu" else "gpu"
        if kind == "gpu" and _looks_like_cpu(dev.free, dev.total, facts):
            warnings.append(
                f"backend {host.backend}: the device reports free == total == the host's RAM, "
                "so it is the CPU (did the server find no GPU?)"
            )
            kind = "cpu"
        free = dev.free
        source: SourceOfFree = "rpc"
        description = ""
        if kind == "cpu":
            description = (facts.cpu_model if facts else None) or "CPU"
            if facts is None:
                warnings.append("CPU memory: no host facts, so free is the server's figure (total RAM)")
            elif facts.memory is None or facts.memory.available is None:
                warnings.append(
                    "CPU memory: MemAvailable unreadable, so free is the server's figure (total RAM)"
                )
            else:
                free = min(facts.memory.available // cpu_share, dev.total)
                source = "meminfo"
                if cpu_share > 1:
                    warnings.append(
                        f"MemAvailable ({format_size(facts.memory.available)}) is shared among the "
                        f"{cpu_share} CPU servers of this machine: {format_size(free)} each"
                    )
        elif target in ("nvidia", "amd") and facts is not None:
            tool = "nvidia-smi" if target == "nvidia" else "rocm-smi"
            report = facts.nvidia if target == "nvidia" else facts.rocm
            gpu = (
                facts.gpus("nvidia" if target == "nvidia" else "amd").get(gpu_index)
                if gpu_index is not None
                else None
            )
            if gpu is not None:
                description = gpu.name
                if gpu.total is not None and _disagrees(gpu.total, dev.total, dev.total):
                    warnings.append(
                        f"{tool} says total {format_size(gpu.total)}, the server {format_size(dev.total)}"
                    )
                if gpu.free is not None and _disagrees(gpu.free, dev.free, dev.total):
                    warnings.append(
                        f"{tool} says free {format_size(gpu.free)}, the server {format_size(dev.free)}"
                    )
            elif report is not None and report.present and not report.error:
                warnings.append(f"{tool} lists no GPU {gpu_index}")
        if not description:
            description = f"{host.backend} device {dev.index}"
        devices.append(
            DeviceCapacity(
                host=host.name,
                endpoint=endpoint,
                index=dev.index,
                name=f"{endpoint}#{dev.index}",
                description=description,
                backend=host.backend,
                kind=kind,
                total=dev.total,
                free=free,
                reserve=host.memory_reserve,
                limit=host.memory_limit,
                usable=usable_bytes(free, host.memory_reserve, host.memory_limit),
                source_of_free=source,
                warnings=tuple(warnings),
            )
        )
    return tuple(devices)


def _peer(address: str) -> tuple[str, str]:
    """(host, port) of an `ss` peer or a probe's local address; IPv4-mapped IPv6 is the IPv4 address."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]").lower().removeprefix("::ffff:")
    return host, port


def without_own_connection(clients: Sequence[str], own: str | None) -> tuple[str, ...]:
    """`clients` less the probe's own connection (`ProbeResult.local_address`): facts are read while
    the RPC probe is connected, and a stalled server must not look busy because of our own socket."""
    if own is None:
        return tuple(clients)
    mine = _peer(own)
    return tuple(c for c in clients if _peer(c) != mine)


def _cpu_device_count(host: Host, rpc_result: ProbeResult, facts: HostFacts | None) -> int:
    """How many of the server's devices take their free memory from MemAvailable."""
    return sum(d.source_of_free == "meminfo" for d in compute_capacity(host, rpc_result, facts))


def cpu_shares(
    probed: Sequence[tuple[Host, ProbeResult, HostFacts | None]],
) -> dict[str, int]:
    """{machine id: CPU devices running on it} over distinct ok endpoints (first host of each). Pure.

    Several servers on one machine (lab nodes share one kernel; a machine may run a server per NUMA
    node or per port) each see the whole MemAvailable; counting them lets each take its share.
    """
    counts: dict[str, int] = {}
    seen: set[str] = set()
    for host, result, facts in probed:
        if result.endpoint in seen or facts is None or facts.machine_id is None:
            continue
        seen.add(result.endpoint)
        n = _cpu_device_count(host, result, facts)
        if n:
            counts[facts.machine_id] = counts.get(facts.machine_id, 0) + n
    return counts


def fleet_capacity(
    probed: Sequence[tuple[Host, ProbeResult, HostFacts | None]],
) -> list[tuple[DeviceCapacity, ...]]:
    """`compute_capacity` of every (host, RPC result, facts), the CPU devices of one machine sharing
    its MemAvailable (`cpu_shares`). Pure."""
    shares = cpu_shares(probed)
    out = []
    for host, result, facts in probed:
        machine = facts.machine_id if facts is not None else None
        share = shares.get(machine, 1) if machine is not None else 1
        out.append(compute_capacity(host, result, facts, cpu_share=share))
    return out


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


# --- results ----------------------------------------------------------------------------------------------


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

    @property
    def ok(self) -> bool:
        return self.state == "ok"

    @property
    def clients(self) -> tuple[str, ...] | None:
        return self.facts.rpc_clients if self.facts is not None else None

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "endpoint": self.endpoint,
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
            "facts": self.facts.to_json() if self.facts is not None else None,
            "devices": [d.to_json() for d in self.devices],
        }


@dataclass(frozen=True)
class FleetTotals:
    """Sums over the ok endpoints, each endpoint counted once."""

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
    return FleetTotals(
        endpoints=len(first),
        ok_endpoints=len(ok),
        devices=len(devices),
        total=sum(d.total for d in devices),
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


# --- probing (I/O) ----------------------------------------------------------------------------------------


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
    return await probe_endpoint(
        host.endpoint, expected=expected, connect_timeout=timeout, read_timeout=timeout, deadline=timeout
    )


async def probe_fleet(
    hosts: Iterable[Host],
    *,
    timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109 (per host, not for the whole call)
    facts: bool = True,
    session: Session | None = None,
    forks: int = 64,
    expected: ProtocolVersion | None = None,
) -> FleetProbe:
    """Probe every host at once: RPC from here and (when `facts`) host facts through the executor.

    Each host's RPC probe and facts are bounded by `timeout`; the whole call takes about the slowest
    host's time, never more than about `timeout`. Never raises for a host's failure: it is in its
    `NodeProbe`. `session`: reuse its connections (otherwise one is opened and closed here, with
    `timeout` as the connect timeout).
    """
    hosts = list(hosts)
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    started = time.monotonic()
    client = expected or cached_local_protocol_version()

    # One probe per distinct endpoint: two probes of one server at once would make one of them busy.
    first_host: dict[str, Host] = {}
    for host in hosts:
        first_host.setdefault(host.endpoint, host)

    async def rpc_all() -> dict[str, ProbeResult]:
        endpoints = list(first_host)
        results = await asyncio.gather(*(_probe_rpc(first_host[e], timeout, client) for e in endpoints))
        return dict(zip(endpoints, results, strict=True))

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
        [(h, rpc_results[h.endpoint], fact_results.get(h.name, (None, None))[0]) for h in hosts]
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
