"""Host facts the probe reads beside RPC: memory, CPU model, GPUs, boot id."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from orchestrator.core.errors import UnreachableError
from orchestrator.engine.executor import HostContext
from orchestrator.facts.base import Fact, gather
from orchestrator.facts.gpus import Gpu, GpuReport, GpuRuntime, GpuRuntimeFact, NvidiaGpuFact, RocmGpuFact
from orchestrator.facts.server import RpcClientsFact
from orchestrator.facts.system import CpuCountFact, MachineIdFact, MemInfo, MemoryFact
from orchestrator.inventory.model import Host
from orchestrator.probe.settings import DEFAULT_TIMEOUT


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
    gpu_runtime: GpuRuntime | None = None  # `GpuRuntimeFact`: NVIDIA driver, Vulkan loader and devices

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
            gpu_runtime=values.get(GpuRuntimeFact.name),
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
        GpuRuntimeFact(),
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
