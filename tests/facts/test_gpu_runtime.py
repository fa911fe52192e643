"""What a node's GPU runtimes decide (pure): `rpc_backend: auto`, and what a server of a backend cannot
run, with the fix; the install step's refusal, before anything is switched."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.core.errors import InputError, NodeMismatchError
from orchestrator.facts.gpus import GpuRuntime, VulkanDevice
from orchestrator.inventory.load import load_inventory_text
from orchestrator.operations.install.ensure import server_backend
from orchestrator.operations.install.plan import InstallState

LLVMPIPE = VulkanDevice("llvmpipe (LLVM 15.0.6, 256 bits)", "PHYSICAL_DEVICE_TYPE_CPU")
RTX = VulkanDevice("NVIDIA GeForce RTX 4090", "PHYSICAL_DEVICE_TYPE_DISCRETE_GPU")
IGPU = VulkanDevice("Intel(R) UHD Graphics 770", "PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU")
NVIDIA = GpuRuntime(nvidia_device_nodes=2, nvidia_driver="NVRM version: 580.65", vulkan_loader=True,
                    vulkan_devices=(RTX,), render_nodes=1)  # fmt: skip
LAB = GpuRuntime(vulkan_loader=True, vulkan_devices=(LLVMPIPE,))
NOTHING = GpuRuntime()


@pytest.mark.parametrize(
    ("runtime", "backend"),
    [
        (NVIDIA, "cuda"),
        (GpuRuntime(vulkan_loader=True, vulkan_devices=(IGPU, LLVMPIPE)), "vulkan"),
        (GpuRuntime(vulkan_loader=True, render_nodes=1), "vulkan"),  # no vulkaninfo: a render node
        (GpuRuntime(nvidia_device_nodes=1), "cpu"),  # device nodes but no driver loaded
        (LAB, "cpu"),  # llvmpipe is a CPU: ggml skips it
        (NOTHING, "cpu"),
    ],
)
def test_auto_picks_from_the_runtimes(runtime: GpuRuntime, backend: str) -> None:
    assert runtime.backend_for("auto")[0] == backend
    assert runtime.backend_for("vulkan") == ("vulkan", "rpc_backend")  # a named backend is kept


def test_what_cannot_run_says_why_and_the_fix() -> None:
    assert NOTHING.cannot_run("cuda", {}) == (
        "the cuda server cannot run: no /dev/nvidia* device (/proc/driver/nvidia/version)",
        "install the NVIDIA driver, or set rpc_backend to vulkan or cpu for this host",
    )
    why, fix = NOTHING.cannot_run("vulkan", {}) or ("", "")
    assert "no Vulkan loader (libvulkan.so.1)" in why and "apt-get install libvulkan1" in fix
    why, fix = LAB.cannot_run("vulkan", {}) or ("", "")
    assert "no Vulkan GPU (vulkaninfo lists llvmpipe" in why and "GGML_VK_VISIBLE_DEVICES" in fix
    assert LAB.cannot_run("vulkan", {"GGML_VK_VISIBLE_DEVICES": "0"}) is None
    assert NVIDIA.cannot_run("cuda", {}) is None and NOTHING.cannot_run("cpu", {}) is None
    assert NVIDIA.device_names("cuda", {}) == ("CUDA0", "CUDA1", "CPU")
    assert NVIDIA.device_names("cuda", {"CUDA_VISIBLE_DEVICES": "1"}) == ("CUDA0", "CPU")
    assert LAB.device_names("vulkan", {"GGML_VK_VISIBLE_DEVICES": "0"}) == ("Vulkan0", "CPU")


def state(runtime: GpuRuntime | None) -> InstallState:
    return InstallState("g", "/x", "linux", "x86_64", None, (), (), None, None, gpu_runtime=runtime)


def host(variables: str):  # type: ignore[no-untyped-def]
    return load_inventory_text(f"hosts:\n  g: {{{variables}}}\n", Path("inv.yml")).host("g")


def test_the_install_step_refuses_at_the_inventorys_line() -> None:
    with pytest.raises(NodeMismatchError) as info:
        server_backend(host("rpc_backend: cuda"), state(LAB))
    error = info.value
    assert isinstance(error, InputError) and error.host == "g"
    assert str(error).startswith("g: inv.yml:2:3: the cuda server cannot run")
    assert "(rpc_backend: cuda, from host)" in str(error) and "install the NVIDIA driver" in (
        error.hint or ""
    )
    with pytest.raises(NodeMismatchError, match="rpc_devices Vulkan1: no such device on this node"):
        server_backend(
            host("rpc_backend: vulkan, rpc_devices: [Vulkan1], rpc_env: {GGML_VK_VISIBLE_DEVICES: '0'}"),
            state(LAB),
        )
    assert server_backend(host("rpc_backend: auto"), state(NVIDIA)) == "cuda"
    assert server_backend(host("rpc_backend: auto"), state(LAB)) == "cpu"
    assert server_backend(host("rpc_backend: vulkan"), state(None)) == "vulkan"  # not read: the server says
    with pytest.raises(NodeMismatchError, match="the node's GPU facts were not read"):
        server_backend(host("rpc_backend: auto"), state(None))
