"""Usable capacity per device from RPC answers and host facts (pure)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

from orchestrator.core.units import format_size
from orchestrator.facts.gpus import VULKAN_INTEGRATED_TYPE, VulkanDevice
from orchestrator.inventory.model import Host
from orchestrator.inventory.variables import BackendChoice
from orchestrator.probe.host import HostFacts
from orchestrator.rpc.records import (
    ProbeResult,
)

MiB = 1024 * 1024


# GPU cross-check: the server's and the driver tool's numbers may differ by this fraction of the device's
# total, or by GPU_TOLERANCE_MIN bytes, whichever is larger (free memory moves; CUDA's total excludes
# what the driver reserves) before the probe warns.
GPU_TOLERANCE = 0.05


GPU_TOLERANCE_MIN = 256 * MiB


# buffer alignment of a backend's devices (CPU 32, CUDA/HIP 128), for a device whose server did not
# report its own (GET_ALIGNMENT); the planner pads tensors with it
ALIGNMENT = {"cuda": 128, "rocm": 128}


def device_alignment(device: DeviceCapacity) -> int:
    """The alignment the device's buffers use: its server's figure, else its backend's usual one."""
    return device.alignment or ALIGNMENT.get(device.backend, 32)


SourceOfFree = Literal["rpc", "meminfo"]


DeviceKind = Literal["cpu", "gpu"]


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
    # False for a CPU device whose free memory could not be read on the host (no facts, no MemAvailable):
    # its server reports total RAM, which is not free memory.
    measured: bool = True
    # Why `usable` is 0 although the server reported memory: it was not measured and not trusted.
    untrusted: str | None = None
    # How many CPU servers of one machine `free` is divided among (1: not divided). `total` stays the
    # whole RAM the server reports, so free / total compares a share with the whole: `total_share` is
    # the like-for-like figure.
    shared_by: int = 1
    # Which rule gave `free`: `device` (a GPU's own figure, Vulkan's heap budget or CUDA's
    # cudaMemGetInfo, as its server reports it), `meminfo` (a CPU device: the host's MemAvailable,
    # shared among its CPU servers), `cgroup` (a CPU device whose host's processes are in a memory
    # cgroup leaving less than that: what the cgroup leaves, shared among its CPU servers), `uma` (a
    # GPU sharing the host's RAM: an iGPU, Apple; counted in that share, never beside it), or `server`
    # (the server's own figure, unchecked).
    memory_rule: str = "device"
    # The device's buffer alignment and largest single buffer, as its server reports them (None: an
    # older probe result); the planner pads every tensor to the alignment.
    alignment: int | None = None
    max_size: int | None = None

    @property
    def total_share(self) -> int:
        """`total` divided as `free` is: this device's share of its machine's RAM."""
        return self.total // self.shared_by

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
            "memory_rule": self.memory_rule,
            "alignment": self.alignment,
            "max_size": self.max_size,
            "warnings": list(self.warnings),
            "measured": self.measured,
            "untrusted": self.untrusted,
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
    if host.rpc_backend == "cpu":
        return "cpu", None
    vendor = {"cuda": "nvidia", "rocm": "amd"}.get(host.rpc_backend, "gpu")
    return vendor, index


def with_backend_decided(host: Host, facts: HostFacts | None) -> Host:
    """`host` with `rpc_backend: auto` replaced by what the deploy picks from the same facts (left as it
    is when they were not read)."""
    runtime = facts.gpu_runtime if facts is not None else None
    if host.rpc_backend != "auto" or runtime is None or runtime.error is not None:
        return host
    decided = runtime.backend_for("auto")[0]
    return replace(host, rpc_backend=cast(BackendChoice, decided))


def _vulkan_device(host: Host, index: int, facts: HostFacts | None) -> VulkanDevice | None:
    """The Vulkan device behind the server's device `index` (vulkaninfo's order; GPUs only unless
    GGML_VK_VISIBLE_DEVICES picks them), or None when not a Vulkan server or not known."""
    runtime = facts.gpu_runtime if facts is not None else None
    if runtime is None or runtime.vulkan_devices is None or host.rpc_backend not in ("vulkan", "auto"):
        return None
    target, number = _device_target(host, index)
    position = number if number is not None else index
    visible = dict(host.rpc_env).get("GGML_VK_VISIBLE_DEVICES")
    if visible is not None:
        picked = [int(v) for v in visible.split(",") if v.strip().isdigit()]
        candidates = tuple(runtime.vulkan_devices[i] for i in picked if i < len(runtime.vulkan_devices))
    else:
        candidates = runtime.vulkan_gpus
    return candidates[position] if target != "cpu" and 0 <= position < len(candidates) else None


def _vulkan_name(host: Host, index: int, facts: HostFacts | None) -> str | None:
    device = _vulkan_device(host, index, facts)
    return device.name if device is not None else None


def _is_uma(host: Host, index: int, facts: HostFacts | None) -> bool:
    """Whether the device shares the host's RAM: Apple's Metal, or an integrated Vulkan GPU."""
    if host.rpc_backend == "metal":
        return True
    device = _vulkan_device(host, index, facts)
    return device is not None and device.type == VULKAN_INTEGRATED_TYPE


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
    host: Host,
    rpc_result: ProbeResult,
    facts: HostFacts | None,
    *,
    cpu_share: int = 1,
    cgroup_share: int = 1,
    trust_rpc_memory: bool = False,
) -> tuple[DeviceCapacity, ...]:
    """Capacity of every device the server reported (none unless the probe is ok). Pure.

    `cpu_share`: how many CPU devices of the fleet run on this host's machine (`cpu_shares`); each
    gets that fraction of MemAvailable, since each of them would otherwise claim all of it. Reserve
    and limit still apply per host, to the share. A CPU device whose host's processes run in a memory
    cgroup with a limit (`MemInfo.cgroup_free`) gets no more than its `cgroup_share` of what that cgroup
    leaves (`cgroup_shares`): a container or a lab node of `--memory` is a machine that small.

    Memory that was not measured is not trusted: a CPU device whose MemAvailable could not be read (no
    facts: SSH down, facts failed or not asked for) has `usable` 0 and says why in `untrusted`, since
    its server's figure is the total RAM. `trust_rpc_memory` uses that figure anyway (with a warning).
    """
    if cpu_share < 1 or cgroup_share < 1:
        raise ValueError(f"shares must be at least 1, got {cpu_share} and {cgroup_share}")
    if not rpc_result.ok:
        return ()
    host = with_backend_decided(host, facts)
    endpoint = rpc_result.endpoint
    devices: list[DeviceCapacity] = []
    for dev in rpc_result.devices:
        warnings: list[str] = []
        target, gpu_index = _device_target(host, dev.index)
        kind: DeviceKind = "cpu" if target == "cpu" else "gpu"
        if kind == "gpu" and _looks_like_cpu(dev.free, dev.total, facts):
            warnings.append(
                f"backend {host.rpc_backend}: the device reports free == total == the host's RAM, "
                "so it is the CPU (did the server find no GPU?)"
            )
            kind = "cpu"
        free = dev.free
        source: SourceOfFree = "rpc"
        rule = "device" if kind == "gpu" else "server"
        description = ""
        unmeasured: str | None = None
        uma = kind == "gpu" and _is_uma(host, dev.index, facts)
        if uma and facts is not None and facts.memory is not None and facts.memory.available is not None:
            # An iGPU's "VRAM" is the host's RAM: it takes its share of MemAvailable like a CPU device
            # (cpu_shares counts it), so the two are never both planned on the whole of it.
            free = min(facts.memory.available // cpu_share, dev.free)
            source, rule = "meminfo", "uma"
            description = _vulkan_name(host, dev.index, facts) or ""
            if cpu_share > 1:
                warnings.append(
                    f"unified memory: MemAvailable ({format_size(facts.memory.available)}) is shared among "
                    f"the {cpu_share} CPU and UMA devices of this machine: {format_size(free)} each"
                )
        elif kind == "cpu":
            description = (facts.cpu_model if facts else None) or "CPU"
            if facts is None:
                unmeasured = "no host facts"
            elif facts.memory is None or facts.memory.available is None:
                unmeasured = "MemAvailable unreadable"
            else:
                free = min(facts.memory.available // cpu_share, dev.total)
                source, rule = "meminfo", "meminfo"
                if cpu_share > 1:
                    warnings.append(
                        f"MemAvailable ({format_size(facts.memory.available)}) is shared among the "
                        f"{cpu_share} CPU servers of this machine: {format_size(free)} each"
                    )
                left = facts.memory.cgroup_free
                if left is not None and left // cgroup_share < free:
                    # the kernel reclaims, then kills, the cgroup's processes past its limit
                    free, rule = left // cgroup_share, "cgroup"
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
        if not description and kind == "gpu":
            description = _vulkan_name(host, dev.index, facts) or ""
        if not description:
            description = f"{host.rpc_backend} device {dev.index}"
        usable = usable_bytes(free, host.memory_reserve, host.memory_limit)
        untrusted = None
        if unmeasured is not None and trust_rpc_memory:
            warnings.append(
                f"CPU memory not measured ({unmeasured}): the server's figure (total RAM) is used as free "
                "(--trust-rpc-memory)"
            )
        elif unmeasured is not None:
            untrusted = f"CPU memory not measured ({unmeasured})"
            warnings.append(
                f"{untrusted}: the server's figure ({format_size(free)}, total RAM) is not used, usable 0 "
                "(--trust-rpc-memory uses it)"
            )
            usable = 0
        devices.append(
            DeviceCapacity(
                host=host.name,
                endpoint=endpoint,
                index=dev.index,
                name=f"{endpoint}#{dev.index}",
                description=description,
                backend=host.rpc_backend,
                kind=kind,
                total=dev.total,
                free=free,
                reserve=host.memory_reserve,
                limit=host.memory_limit,
                usable=usable,
                source_of_free=source,
                warnings=tuple(warnings),
                measured=unmeasured is None,
                untrusted=untrusted,
                shared_by=cpu_share if source == "meminfo" else 1,
                memory_rule=rule,
                alignment=dev.alignment,
                max_size=dev.max_size,
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


def _cgroup_of(facts: HostFacts | None) -> tuple[str, str] | None:
    """(machine id, memory cgroup) of a host whose processes a cgroup's limit binds (None: none)."""
    if facts is None or facts.machine_id is None or facts.memory is None or facts.memory.cgroup is None:
        return None
    return facts.machine_id, facts.memory.cgroup


def cgroup_shares(
    probed: Sequence[tuple[Host, ProbeResult, HostFacts | None]],
) -> dict[tuple[str, str], int]:
    """{(machine id, memory cgroup): CPU devices whose servers run in it} over distinct ok endpoints.
    Pure. Servers started from one cgroup (a lab node, a container) each see all it leaves."""
    counts: dict[tuple[str, str], int] = {}
    seen: set[str] = set()
    for host, result, facts in probed:
        group = _cgroup_of(facts)
        if result.endpoint in seen or group is None:
            continue
        seen.add(result.endpoint)
        n = _cpu_device_count(host, result, facts)
        if n:
            counts[group] = counts.get(group, 0) + n
    return counts


def fleet_capacity(
    probed: Sequence[tuple[Host, ProbeResult, HostFacts | None]], *, trust_rpc_memory: bool = False
) -> list[tuple[DeviceCapacity, ...]]:
    """`compute_capacity` of every (host, RPC result, facts), the CPU devices of one machine sharing
    its MemAvailable (`cpu_shares`), and those of one memory cgroup what it leaves (`cgroup_shares`).
    Pure."""
    shares = cpu_shares(probed)
    groups = cgroup_shares(probed)
    out = []
    for host, result, facts in probed:
        machine = facts.machine_id if facts is not None else None
        share = shares.get(machine, 1) if machine is not None else 1
        group = _cgroup_of(facts)
        in_group = groups.get(group, 1) if group is not None else 1
        out.append(
            compute_capacity(
                host, result, facts, cpu_share=share, cgroup_share=in_group, trust_rpc_memory=trust_rpc_memory
            )
        )
    return out
