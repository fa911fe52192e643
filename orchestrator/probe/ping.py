"""`rpcfleet ping`: connect to a host and report who and what it is, and how far away."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from orchestrator.artifacts.cuda import DRIVER_FIX, driver_too_old
from orchestrator.artifacts.spec import known_cuda_release
from orchestrator.core.errors import HostError
from orchestrator.engine.executor import HostContext, StepOutcome
from orchestrator.facts.base import gather
from orchestrator.facts.gpus import GpuRuntime, GpuRuntimeFact
from orchestrator.facts.system import OsFact, OsInfo, UserFact


@dataclass(frozen=True)
class PingResult:
    os: str
    arch: str
    user: str
    distribution: str | None  # PRETTY_NAME of /etc/os-release
    connect_seconds: float
    latency_seconds: float  # one command round trip on the open connection
    backend: str = "cpu"  # the host's rpc_backend, `auto` decided from the node's GPU runtimes
    gpus: str = ""  # what GPU runtimes the node has: "NVIDIA driver ...", "Vulkan: <device>", or ""


def describe_gpus(runtime: GpuRuntime | None) -> str:
    """The node's GPU runtimes in a few words (empty: none)."""
    if runtime is None or runtime.error:
        return "?"
    parts = []
    if runtime.has_nvidia:
        version = re.search(r"Kernel Module\s+(\S+)", runtime.nvidia_driver or "")
        parts.append(f"NVIDIA driver {version.group(1) if version else ''}".strip())
    if runtime.vulkan_loader and runtime.vulkan_devices:
        parts.append("Vulkan: " + ", ".join(d.name for d in runtime.vulkan_devices))
    return "; ".join(parts)


async def ping_step(context: HostContext) -> StepOutcome[PingResult]:
    started = time.monotonic()
    connection = await context.connection()
    connected = time.monotonic()
    values = await gather(connection, [OsFact(), UserFact(), GpuRuntimeFact()], timeout=10)
    finished = time.monotonic()
    os_info: OsInfo = values[OsFact.name]
    user: str | None = values[UserFact.name]
    if os_info.system is None or os_info.machine is None or user is None:
        raise HostError(
            "the host did not say its kernel, machine and user (uname, id)", host=context.host.name
        )
    runtime: GpuRuntime = values[GpuRuntimeFact.name]
    try:
        backend = runtime.backend_for(context.host.rpc_backend)[0]
    except ValueError:
        backend = "?"
    if backend == "cuda":  # what deploy refuses, said before it
        old = driver_too_old(known_cuda_release(context.host.rpc_artifact), runtime.nvidia_driver)
        if old is not None:
            message = f"{old}: a cuda server cannot start here"
            raise HostError(message, host=context.host.name, hint=DRIVER_FIX)
    ping = PingResult(
        os_info.system,
        os_info.machine,
        user,
        os_info.pretty_name,
        connected - started,
        finished - connected,
        backend,
        describe_gpus(runtime),
    )
    return StepOutcome(
        ping, message=f"{ping.os}/{ping.arch} as {user} in {ping.latency_seconds * 1000:.1f} ms"
    )
