"""GPU facts: nvidia-smi and rocm-smi, each a command plus a pure parser."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

if TYPE_CHECKING:
    pass
from orchestrator.facts.base import NOT_FOUND, TOOL_TIMEOUT_S, Fact, MiB, tail, with_tool


@dataclass(frozen=True)
class Gpu:
    vendor: Literal["nvidia", "amd"]
    index: int
    name: str
    total: int | None  # bytes
    free: int | None  # bytes


@dataclass(frozen=True)
class GpuReport:
    """What one GPU tool said. `present=False`: the tool is not installed (a normal answer)."""

    tool: str
    present: bool
    gpus: tuple[Gpu, ...] = ()
    error: str | None = None  # the tool ran but failed (driver not loaded, timed out...)


def _mib(text: str) -> int | None:
    text = text.strip()
    return int(text) * MiB if text.isdigit() else None  # "[N/A]", "[Not Supported]"


def parse_nvidia_smi_csv(text: str) -> tuple[Gpu, ...]:
    """`index, name, memory.total, memory.free` rows (csv, noheader, nounits; MiB)."""
    gpus: list[Gpu] = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4 or not fields[0].isdigit():
            continue
        name = ", ".join(fields[1:-2])  # a name could hold a comma; the numbers are the last two
        gpus.append(Gpu("nvidia", int(fields[0]), name, _mib(fields[-2]), _mib(fields[-1])))
    return tuple(gpus)


@dataclass(frozen=True)
class NvidiaGpuFact(Fact[GpuReport]):
    name: ClassVar[str] = "nvidia_gpus"
    QUERY: ClassVar[str] = "--query-gpu=index,name,memory.total,memory.free --format=csv,noheader,nounits"

    def command(self) -> str:
        return with_tool("nvidia-smi", self.QUERY)

    def parse(self, stdout: str, stderr: str, exit_status: int) -> GpuReport:
        if exit_status == NOT_FOUND:
            return GpuReport("nvidia-smi", present=False)
        gpus = parse_nvidia_smi_csv(stdout) if exit_status == 0 else ()
        error = None
        if exit_status == 124:
            error = f"nvidia-smi timed out after {TOOL_TIMEOUT_S} s"
        elif exit_status != 0 or (not gpus and stdout.strip()):
            # nvidia-smi prints its failures on stdout ("NVIDIA-SMI has failed ...", "No devices were found").
            error = tail(stdout + "\n" + stderr) or f"exit status {exit_status}"
        return GpuReport("nvidia-smi", present=True, gpus=gpus, error=error)


_AMD_NAME_KEYS = ("Card Series", "Card series", "Device Name", "Card Model", "Card model", "Card SKU")


def parse_rocm_smi_json(text: str) -> tuple[Gpu, ...]:
    """`rocm-smi --showmeminfo vram --json`: {"card0": {"VRAM Total Memory (B)": "...", "VRAM Total
    Used Memory (B)": "..."}, ...}; warnings before the JSON and non-card keys are skipped."""
    start = text.find("{")
    if start < 0:
        raise ValueError("no JSON object in rocm-smi output")
    data, _ = json.JSONDecoder().raw_decode(text[start:])
    if not isinstance(data, dict):
        raise ValueError("rocm-smi JSON is not an object")
    gpus: list[Gpu] = []
    for key, card in data.items():
        match = re.fullmatch(r"card(\d+)", str(key))
        if match is None or not isinstance(card, dict):
            continue
        total = _int_or_none(card.get("VRAM Total Memory (B)"))
        used = _int_or_none(card.get("VRAM Total Used Memory (B)"))
        free = total - used if total is not None and used is not None else None
        name = next((str(card[k]) for k in _AMD_NAME_KEYS if card.get(k) not in (None, "", "N/A")), str(key))
        gpus.append(Gpu("amd", int(match.group(1)), name, total, free))
    return tuple(sorted(gpus, key=lambda g: g.index))


def _int_or_none(value: object) -> int | None:
    text = str(value).strip() if value is not None else ""
    return int(text) if text.isdigit() else None


@dataclass(frozen=True)
class RocmGpuFact(Fact[GpuReport]):
    name: ClassVar[str] = "rocm_gpus"

    def command(self) -> str:
        return with_tool("rocm-smi", "--showmeminfo vram --json")

    def parse(self, stdout: str, stderr: str, exit_status: int) -> GpuReport:
        if exit_status == NOT_FOUND:
            return GpuReport("rocm-smi", present=False)
        if exit_status == 124:
            return GpuReport("rocm-smi", present=True, error=f"rocm-smi timed out after {TOOL_TIMEOUT_S} s")
        try:
            gpus = parse_rocm_smi_json(stdout)
        except ValueError:
            gpus = ()
            if exit_status != 0 or stdout.strip():
                return GpuReport(
                    "rocm-smi",
                    present=True,
                    error=tail(stdout + "\n" + stderr) or f"exit status {exit_status}",
                )
        error = None if exit_status == 0 else (tail(stderr) or f"exit status {exit_status}")
        return GpuReport("rocm-smi", present=True, gpus=gpus, error=error)


# ---- what a node can run: the GPU runtimes present (`rpc_backend: auto` and the deploy's refusal) ----

VULKAN_CPU_TYPE = "PHYSICAL_DEVICE_TYPE_CPU"


VULKAN_INTEGRATED_TYPE = "PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU"


@dataclass(frozen=True)
class VulkanDevice:
    name: str
    type: str  # vulkaninfo's deviceType: PHYSICAL_DEVICE_TYPE_DISCRETE_GPU, ..._INTEGRATED_GPU, ..._CPU

    @property
    def is_cpu(self) -> bool:
        """Mesa's llvmpipe and the like: ggml-vulkan skips them unless GGML_VK_VISIBLE_DEVICES lists them."""
        return self.type == VULKAN_CPU_TYPE


@dataclass(frozen=True)
class GpuRuntime:
    """The GPU runtimes a node has: NVIDIA's driver (device nodes, its version), the Vulkan loader and
    the devices vulkaninfo lists (None: vulkaninfo absent or failed), and the DRM render nodes."""

    nvidia_device_nodes: int = 0
    nvidia_driver: str | None = None  # /proc/driver/nvidia/version's first line
    vulkan_loader: bool = False  # libvulkan.so.1 in the linker cache
    vulkan_devices: tuple[VulkanDevice, ...] | None = None
    render_nodes: int = 0
    error: str | None = None  # the fact's output could not be read

    @property
    def has_nvidia(self) -> bool:
        return self.nvidia_device_nodes > 0 and self.nvidia_driver is not None

    @property
    def vulkan_gpus(self) -> tuple[VulkanDevice, ...]:
        return tuple(d for d in self.vulkan_devices or () if not d.is_cpu)

    def backend_for(self, choice: str) -> tuple[str, str]:
        """(backend, why) for an inventory's `rpc_backend`: itself unless `auto`; `auto` is cuda where
        an NVIDIA driver and device are, vulkan where the loader and a Vulkan GPU (or a render node
        when vulkaninfo is absent) are, else cpu."""
        if choice != "auto":
            return choice, "rpc_backend"
        if self.error is not None:
            raise ValueError(
                f"rpc_backend auto cannot decide: the node's GPU facts are unreadable ({self.error})"
            )
        if self.has_nvidia:
            return "cuda", f"auto: NVIDIA driver ({self.nvidia_device_nodes} device node(s))"
        if self.vulkan_loader and self.vulkan_gpus:
            return "vulkan", f"auto: Vulkan GPU {self.vulkan_gpus[0].name}"
        if self.vulkan_loader and self.vulkan_devices is None and self.render_nodes:
            return "vulkan", f"auto: Vulkan loader and {self.render_nodes} render node(s)"
        return "cpu", "auto: no NVIDIA driver, no Vulkan GPU"

    def cannot_run(self, backend: str, env: Mapping[str, str]) -> tuple[str, str] | None:
        """(why, fix) when a server of `backend` cannot run here, else None. `env`: the server's own
        environment (GGML_VK_VISIBLE_DEVICES makes ggml use a CPU-type Vulkan device such as llvmpipe)."""
        if self.error is not None:
            return None  # not known: the server's own start says
        if backend == "cuda" and not self.has_nvidia:
            missing = "no /dev/nvidia* device" if not self.nvidia_device_nodes else "no NVIDIA driver loaded"
            return (
                f"the cuda server cannot run: {missing} (/proc/driver/nvidia/version)",
                "install the NVIDIA driver, or set rpc_backend to vulkan or cpu for this host",
            )
        if backend == "vulkan":
            if not self.vulkan_loader:
                return (
                    "the vulkan server cannot run: no Vulkan loader (libvulkan.so.1)",
                    "install the loader and a driver (Debian: apt-get install libvulkan1 "
                    "mesa-vulkan-drivers), or set rpc_backend to cpu for this host",
                )
            usable = self.vulkan_gpus or (self.vulkan_devices if env.get("GGML_VK_VISIBLE_DEVICES") else ())
            if self.vulkan_devices is not None and not usable:
                listed = ", ".join(d.name for d in self.vulkan_devices) or "none"
                return (
                    f"the vulkan server cannot run: no Vulkan GPU (vulkaninfo lists {listed})",
                    "install a Vulkan driver for the GPU; a CPU-type device (llvmpipe) is used only with "
                    "rpc_env: {GGML_VK_VISIBLE_DEVICES: '0'}",
                )
            if self.vulkan_devices is None and not self.render_nodes:
                return (
                    "the vulkan server cannot run: no Vulkan device (no vulkaninfo, no /dev/dri/renderD*)",
                    "install a Vulkan driver (and vulkan-tools to list it)",
                )
        return None

    def device_names(self, backend: str, env: Mapping[str, str]) -> tuple[str, ...] | None:
        """The devices a server of `backend` would offer here, as llama.cpp names them (None: not
        known, e.g. vulkaninfo absent). The *_VISIBLE_DEVICES variables renumber them from 0."""
        if backend == "vulkan":
            visible = env.get("GGML_VK_VISIBLE_DEVICES")
            if visible is not None:
                count = len([v for v in visible.split(",") if v.strip()])
            elif self.vulkan_devices is not None:
                count = len(self.vulkan_gpus)
            else:
                return None
            return (*(f"Vulkan{i}" for i in range(count)), "CPU")
        if backend == "cuda":
            visible = env.get("CUDA_VISIBLE_DEVICES")
            gpus = self.nvidia_device_nodes
            if visible is not None:
                gpus = len([v for v in visible.split(",") if v.strip()])
            return (*(f"CUDA{i}" for i in range(gpus)), "CPU")
        if backend == "cpu":
            return ("CPU",)
        return None


_RUNTIME_MARK = "@@rpcfleet-gpu@@"


def parse_vulkan_summary(text: str) -> tuple[VulkanDevice, ...]:
    """The devices of `vulkaninfo --summary`: each `GPUn:` block's deviceName and deviceType."""
    devices: list[VulkanDevice] = []
    name = kind = None
    for line in text.splitlines():
        stripped = line.strip()
        if re.fullmatch(r"GPU\d+:", stripped):
            if name is not None:
                devices.append(VulkanDevice(name, kind or ""))
            name, kind = "", None
            continue
        key, sep, value = stripped.partition("=")
        if not sep or name is None:
            continue
        if key.strip() == "deviceName":
            name = value.strip()
        elif key.strip() == "deviceType":
            kind = value.strip()
    if name is not None:
        devices.append(VulkanDevice(name, kind or ""))
    return tuple(devices)


@dataclass(frozen=True)
class GpuRuntimeFact(Fact[GpuRuntime]):
    name: ClassVar[str] = "gpu_runtime"

    def command(self) -> str:
        mark = _RUNTIME_MARK
        return (
            "ls /dev/nvidia[0-9]* 2>/dev/null | wc -l; "
            f"echo {mark}; head -n 1 /proc/driver/nvidia/version 2>/dev/null; "
            f"echo {mark}; {{ ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; }}"
            " | grep -c 'libvulkan\\.so\\.1 '; "
            f"echo {mark}; ls /dev/dri/renderD* 2>/dev/null | wc -l; "
            f'echo {mark}; {with_tool("vulkaninfo", "--summary 2>/dev/null")}; echo "vulkaninfo-exit=$?"'
        )

    def parse(self, stdout: str, stderr: str, exit_status: int) -> GpuRuntime:
        parts = stdout.split(_RUNTIME_MARK)
        if len(parts) != 5:
            return GpuRuntime(error=f"unexpected output: {tail(stdout + stderr) or '(none)'}")
        nodes, driver, loader, render, vulkan = (p.strip() for p in parts)
        status = re.search(r"vulkaninfo-exit=(\d+)\s*$", vulkan)
        devices = parse_vulkan_summary(vulkan) if status is not None and status.group(1) == "0" else None
        return GpuRuntime(
            nvidia_device_nodes=int(nodes) if nodes.isdigit() else 0,
            nvidia_driver=driver.splitlines()[0].strip() if driver else None,
            vulkan_loader=loader.isdigit() and int(loader) > 0,
            vulkan_devices=devices,
            render_nodes=int(render) if render.isdigit() else 0,
        )
