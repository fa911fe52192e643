"""The process's RPC registry in the Java binding's terms (`BackendRegistry`, `RpcMemoryQuery`).

    supports_rpc() -> bool
    add_rpc_server(endpoint) -> tuple[RpcDevice, ...]     # preflight first: a bad server raises
    add_rpc_servers(*endpoints) -> tuple[RpcDevice, ...]  # duplicates ignored
    rpc_device_handles() -> tuple[int, ...]
    print_summary(file=None)                              # backends, devices, RPC devices + memory
    query_rpc_memory(endpoint) -> list[RpcDeviceMemory]   # registration-free; raises on failure
    query_all(endpoints) -> RpcMemoryInfo | None          # registration-free; never raises

Memory figures are what the servers report, and **CPU servers report their total RAM as free**. The
honest figure for a fleet (MemAvailable for CPU servers, shared among the servers of one machine) is
`FleetProbe.memory()` of `probe_fleet`, which returns the same `RpcMemoryInfo` record.

Registrations are the ones `Llama` and `load_llama` use: made once per endpoint, kept until the process
exits, and never added to ggml's global device list (so they join a model only through its explicit
device list).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, TextIO

from orchestrator.core.errors import RpcfleetError
from orchestrator.core.log import get_logger
from orchestrator.core.units import format_size
from orchestrator.engine.runtime import run_sync
from orchestrator.llama.dropin_plan import parse_rpc_servers
from orchestrator.llama.native.libllama import (
    LOCK,
    get_native,
    live_endpoints,
    llama_cpp_module,
    registered_endpoints,
)
from orchestrator.llama.native.preflight import check_endpoint_limit, probe_for_load
from orchestrator.rpc.client import endpoint_list, probe_endpoint, query_memory
from orchestrator.rpc.errors import error_for
from orchestrator.rpc.records import RpcDeviceMemory, RpcMemoryInfo, parse_endpoint


@dataclass(frozen=True)
class RpcDevice:
    """A device of a registered RPC server: `handle` is its ggml_backend_dev_t (for an explicit device
    list), `name` its name in this process (`RPC<k>`, a process-wide counter)."""

    endpoint: str
    index: int
    name: str
    description: str
    handle: int


def supports_rpc() -> bool:
    """Whether llama-cpp-python is installed and built with RPC (never raises)."""
    try:
        return bool(get_native().reg_by_name(b"RPC"))
    except RpcfleetError:
        return False


def _devices_of(endpoint: str) -> tuple[RpcDevice, ...]:
    reg = registered_endpoints()[endpoint]
    return tuple(
        RpcDevice(endpoint, i, name, desc, handle)
        for i, (name, desc, handle) in enumerate(zip(reg.names, reg.descriptions, reg.devices, strict=True))
    )


def add_rpc_servers(*endpoints: str, timeout: float = 5.0) -> tuple[RpcDevice, ...]:
    """Register each distinct endpoint (once per process) and return the devices of all of them, in
    order. Every endpoint is probed first: an unreachable, busy or mismatched one raises its typed
    error and none is registered (the native client would abort the process instead)."""
    from orchestrator.llama.native.loader import register_endpoints

    unique = parse_rpc_servers(list(endpoints))
    with LOCK:
        results = probe_for_load(unique, connect_timeout=timeout, read_timeout=timeout, deadline=timeout)
        check_endpoint_limit(unique)  # after the servers' own problems (see load_llama)
        llama_cpp_module()  # RPC compiled in, else RpcUnavailableError
        register_endpoints({ep: len(r.devices) for ep, r in results.items()})
        return tuple(dev for ep in unique for dev in _devices_of(ep))


def add_rpc_server(endpoint: str, *, timeout: float = 5.0) -> tuple[RpcDevice, ...]:
    """Register one endpoint (see `add_rpc_servers`) and return its devices."""
    return add_rpc_servers(endpoint, timeout=timeout)


def rpc_device_handles() -> tuple[int, ...]:
    """The handles of every registered RPC device, in registration order."""
    return tuple(handle for reg in registered_endpoints().values() for handle in reg.devices)


def query_rpc_memory(endpoint: str, *, timeout: float = 5.0) -> list[RpcDeviceMemory]:
    """Each device's free/total memory as `endpoint` reports it (pure Python, registration-free).
    Raises the typed error of a probe that fails (`EndpointProbeError`)."""
    canonical = str(parse_endpoint(endpoint))
    result = run_sync(
        probe_endpoint(canonical, connect_timeout=timeout, read_timeout=timeout, deadline=timeout)
    )
    if not result.ok:
        raise error_for(result)
    return list(result.devices)


def query_all(endpoints: Any, *, timeout: float = 5.0) -> RpcMemoryInfo | None:
    """Free/total memory summed over the distinct endpoints, or None on any failure, whatever it is
    given (None, [None], a bare string is read as "h1:p,h2:p"). Never raises; registration-free."""
    try:
        items = endpoint_list(endpoints)
        if items is None:
            return None
        info: RpcMemoryInfo | None = run_sync(
            query_memory(items, connect_timeout=timeout, read_timeout=timeout, deadline=timeout)
        )
        return info
    except Exception as exc:
        get_logger().debug("rpc_query_all_failed", error=repr(exc))
        return None


def summary() -> str:
    """The text `print_summary` writes: ggml's backends and devices in this process, then the
    registered RPC devices with their endpoint and the memory their server reports."""
    native = get_native()
    lines = ["ggml backends:"]
    for i in range(native.reg_count()):
        reg = native.reg_get(i)
        lines.append(f"  {native.reg_name(reg).decode()}: {native.reg_dev_count(reg)} device(s)")
    lines.append("devices:")
    for i in range(native.dev_count()):
        dev = native.dev_get(i)
        free, total = native.memory(dev)
        lines.append(
            f"  {native.dev_name(dev).decode()}: {native.dev_description(dev).decode()} "
            f"({format_size(free)} free of {format_size(total)})"
        )
    held = live_endpoints()
    lines.append("RPC devices:" if registered_endpoints() else "RPC devices: none registered")
    for endpoint, reg in registered_endpoints().items():
        memory = None
        if endpoint not in held:  # a probe of a held server would only see our own connection
            result = run_sync(probe_endpoint(endpoint, connect_timeout=2.0, read_timeout=2.0))
            memory = result.devices if result.ok else None
            state = "" if result.ok else f" ({result.outcome}: {result.message})"
        else:
            state = " (in use by a model of this process)"
        for i, name in enumerate(reg.names):
            figure = ""
            if memory is not None and i < len(memory):
                figure = f" {format_size(memory[i].free)} free of {format_size(memory[i].total)}"
            lines.append(f"  {name}: {endpoint} device {i}{figure}{state}")
    return "\n".join(lines) + "\n"


def print_summary(file: TextIO | None = None) -> None:
    """Write `summary()` to `file` (default: standard output), like the Java binding's printSummary."""
    (file or sys.stdout).write(summary())
