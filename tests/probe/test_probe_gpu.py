"""Memory rules of GPU devices (pure): a discrete GPU's free memory is its own figure; a unified-memory
GPU (an iGPU) shares the host's RAM with the CPU servers of that machine and is never counted beside it."""

from __future__ import annotations

from orchestrator.facts.gpus import GpuRuntime, VulkanDevice
from orchestrator.facts.system import MemInfo
from orchestrator.inventory.model import Host
from orchestrator.probe.capacity import fleet_capacity
from orchestrator.probe.host import HostFacts
from orchestrator.rpc.records import DeviceMemory, Outcome, ProbeResult, ProtocolVersion

GiB = 1 << 30
V7 = ProtocolVersion(7, 0, 0)


def result(endpoint: str, free: int, total: int, alignment: int = 32) -> ProbeResult:
    device = DeviceMemory(0, free, total, alignment, GiB)
    return ProbeResult(endpoint, Outcome.OK, V7, (device,), "protocol 7.0.0", 0.004)


def facts(*devices: VulkanDevice) -> HostFacts:
    runtime = GpuRuntime(vulkan_loader=True, vulkan_devices=devices)
    return HostFacts(memory=MemInfo(total=32 * GiB, available=20 * GiB), machine_id="m1", gpu_runtime=runtime)


def test_a_discrete_gpu_keeps_its_own_figure_and_takes_no_share_of_the_ram() -> None:
    gpu_facts = facts(VulkanDevice("Radeon RX 7900", "PHYSICAL_DEVICE_TYPE_DISCRETE_GPU"))
    cpu = Host(name="c", address="10.0.0.1", rpc_host="10.0.0.1", rpc_port=50052)
    gpu = Host(name="g", address="10.0.0.1", rpc_host="10.0.0.1", rpc_port=50053, rpc_backend="vulkan")
    (cpu_dev,), (gpu_dev,) = fleet_capacity(
        [
            (cpu, result(cpu.endpoint, 30 * GiB, 32 * GiB), gpu_facts),
            (gpu, result(gpu.endpoint, 23 * GiB, 24 * GiB, 64), gpu_facts),
        ]
    )
    assert (cpu_dev.memory_rule, cpu_dev.free, cpu_dev.shared_by) == ("meminfo", 20 * GiB, 1)
    assert (gpu_dev.memory_rule, gpu_dev.free, gpu_dev.kind, gpu_dev.alignment) == (
        "device",
        23 * GiB,
        "gpu",
        64,
    )
    assert gpu_dev.description == "Radeon RX 7900"


def test_an_integrated_gpu_shares_the_hosts_ram_with_its_cpu_server() -> None:
    igpu_facts = facts(VulkanDevice("Intel(R) Arc(tm) Graphics (MTL)", "PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU"))
    cpu = Host(name="c", address="10.0.0.1", rpc_host="10.0.0.1", rpc_port=50052)
    igpu = Host(name="i", address="10.0.0.1", rpc_host="10.0.0.1", rpc_port=50053, rpc_backend="vulkan")
    # The iGPU's server reports a heap of most of the RAM: counted beside the CPU's, twice the RAM.
    (cpu_dev,), (igpu_dev,) = fleet_capacity(
        [
            (cpu, result(cpu.endpoint, 30 * GiB, 32 * GiB), igpu_facts),
            (igpu, result(igpu.endpoint, 24 * GiB, 24 * GiB), igpu_facts),
        ]
    )
    assert (igpu_dev.kind, igpu_dev.memory_rule, igpu_dev.source_of_free) == ("gpu", "uma", "meminfo")
    assert cpu_dev.free == igpu_dev.free == 10 * GiB  # MemAvailable split between the two
    assert cpu_dev.free + igpu_dev.free == 20 * GiB
    assert any("unified memory" in w for w in igpu_dev.warnings)
