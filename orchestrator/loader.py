"""`Plan` → `llama_cpp.Llama` on stock llama-cpp-python 0.3.36 (the only module importing llama_cpp).

0.3.36 has no `rpc_servers` argument (it is swallowed by `**kwargs`), and its native RPC client aborts the
whole process on an unreachable or mismatched server. So, in this order (facts: docs/llama-rpc.md §4-§6):

1. Preflight every endpoint of the plan with the pure-Python client (`orchestrator.rpc`) and refuse,
   with a typed `LoaderError`, anything unreachable, busy, of another protocol, or whose devices do not
   match the plan. No native call happens before this (`GGML_NO_BACKTRACE=1` is set even earlier).
2. Register the endpoints through libllama's own ggml (`llama_cpp.llama_cpp._lib`; `llama_cpp._ggml` is a
   second copy whose registry llama never sees). Registrations live for the process (models hold
   pointers to their devices), so a module-level, lock-guarded registry reuses them per endpoint.
3. Construct `Llama` with an explicit NULL-terminated device list (the plan's devices, in plan order),
   so devices registered for another model never join this one. `Llama` builds its params from
   `llama_model_default_params()` with no override, so that function is wrapped during construction.
   `tensor_split` and `n_gpu_layers` come from the plan, split mode LAYER.
4. Capture llama.cpp's load log (`llama_log_set`) and attach a `Placement`: predicted versus actual bytes
   per device (`placement_of(llm)`).

Parsers for the client's load log and for a server's `GGML_RPC_DEBUG=1` log are pure functions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import functools
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Read by ggml at library load (its terminate handler) and at abort time: without it an abort tries to
# attach gdb to the process. Set before llama_cpp is ever imported (it is imported lazily below).
os.environ.setdefault("GGML_NO_BACKTRACE", "1")

from orchestrator import rpc
from orchestrator.errors import LoaderError
from orchestrator.log import get_logger
from orchestrator.model import KV_CACHE_TYPES
from orchestrator.planner import Plan, PlanDevice

MiB = 1024 * 1024
# ggml-rpc itself has no limit on servers, but every registration lives until the process exits (a
# socket and a device per server): the adapter's documented policy is 16 distinct endpoints per process.
MAX_ENDPOINTS = 16
LLAMA_SPLIT_MODE_LAYER = 1
# The llama-cpp-python release this loader is written against, and the RPC protocol it speaks.
SUPPORTED_LLAMA_CPP = "0.3.36"
LLAMA_CPP_PROTOCOL = {"0.3.36": "7.0.0"}
# Keyword arguments the plan decides: passing them beside a plan would make the prediction wrong.
PLAN_CONTROLLED = frozenset(
    {
        "n_gpu_layers",
        "tensor_split",
        "split_mode",
        "main_gpu",
        "n_ctx",
        "n_batch",
        "n_ubatch",
        "flash_attn",
        "type_k",
        "type_v",
        "rpc_servers",  # silently ignored by 0.3.36: refusing it beats a model quietly on the CPU
    }
)


# --- errors -----------------------------------------------------------------------------------------------


class PreflightError(LoaderError):
    """An endpoint failed the preflight probe; `probe` holds what the probe learned."""

    probe: rpc.ProbeResult | None = None


class EndpointUnreachableError(PreflightError):
    """An endpoint refused the connection, timed out or closed it (nothing listens, or a node is down)."""


class EndpointBusyError(PreflightError):
    """An endpoint serves another client (the server takes one client at a time)."""


class ProtocolMismatchError(PreflightError):
    """An endpoint speaks another RPC protocol version (or is not a ggml-rpc-server at all)."""


class DeviceMismatchError(LoaderError):
    """The plan's devices do not match what the servers report or what is registered."""


class EndpointLimitError(LoaderError):
    """Loading would register more distinct endpoints than one process allows."""


class RpcUnavailableError(LoaderError):
    """llama-cpp-python is missing, is another version, or was built without RPC."""


class LocalDeviceError(LoaderError):
    """A local GPU named in the plan does not exist in this process."""


class LoadFailedError(LoaderError):
    """llama.cpp refused the model after preflight (its own error, e.g. a file it cannot read)."""


def _error_for_probe(result: rpc.ProbeResult) -> PreflightError:
    cls: type[PreflightError]
    hint: str
    if result.outcome is rpc.Outcome.BUSY:
        cls, hint = EndpointBusyError, "another client holds this server; stop it or pick another node"
    elif result.outcome in (rpc.Outcome.VERSION_MISMATCH, rpc.Outcome.PROTOCOL_ERROR):
        cls = ProtocolMismatchError
        hint = "install a server built from the same llama.cpp as llama-cpp-python (rpcfleet install)"
    else:
        cls, hint = EndpointUnreachableError, "start the server (rpcfleet start) or remove it from the plan"
    err = cls(f"refused before loading: {result.outcome}: {result.message}", host=result.endpoint, hint=hint)
    err.probe = result
    return err


# --- the client's load log (pure) -------------------------------------------------------------------------

# llama-model.cpp: "%s: %12s model buffer size = %8.2f MiB"; llama-kv-cache.cpp: "%s: %10s KV buffer
# size = ..."; llama-context.cpp: "%s: %10s compute buffer size = ..." and "%s: %10s  output buffer size".
_BUFFER_RE = re.compile(
    r"^(?P<func>\w+):\s+(?P<buffer>\S+)\s+(?P<kind>model|KV|compute|output) buffer size =\s*"
    r"(?P<mib>[0-9]+(?:\.[0-9]+)?) MiB\s*$"
)
# ggml-rpc.cpp: buffer types are named "RPC<device index on the server>[<endpoint>]".
_RPC_BUFFER_RE = re.compile(r"^RPC(?P<index>\d+)\[(?P<endpoint>.+)\]$")
# llama.cpp: "%s: using device %s (%s) (%s) - %zu MiB free"
_USING_RE = re.compile(
    r"^\w+: using device (?P<name>\S+) \((?P<description>.*)\) \((?P<id>.*)\) - \d+ MiB free"
)
# llama-model.cpp: "load_tensors: layer %3d assigned to device %s, is_swa = %d"
_LAYER_RE = re.compile(r"^\w+: layer\s+(?P<il>\d+) assigned to device (?P<device>[^,\s]+)")

_KINDS = {"model": "weights", "KV": "kv", "compute": "compute", "output": "output"}


@dataclass(frozen=True)
class BufferLine:
    """One `... buffer size = X MiB` line: `kind` is weights, kv, compute or output."""

    kind: str
    buffer: str  # the buffer type's name: "RPC0[127.0.0.1:50052]", "CPU_Mapped", "CUDA0", ...
    mib: float
    endpoint: str | None = None  # for RPC buffers: the server and its device index
    index: int | None = None

    @property
    def approx_bytes(self) -> int:
        """The size to the log's precision (0.01 MiB: within 5243 bytes of the real size)."""
        return round(self.mib * MiB)


@dataclass(frozen=True)
class LoadLog:
    """What llama.cpp said while loading: buffers, the devices it used (name, description) in order, and
    the device each layer went to (index n_layer is the output layer)."""

    buffers: tuple[BufferLine, ...]
    devices: tuple[tuple[str, str], ...]
    layers: Mapping[int, str]


def parse_buffer_line(line: str) -> BufferLine | None:
    m = _BUFFER_RE.match(line.strip())
    if m is None:
        return None
    buffer = m.group("buffer")
    rpc_m = _RPC_BUFFER_RE.match(buffer)
    return BufferLine(
        kind=_KINDS[m.group("kind")],
        buffer=buffer,
        mib=float(m.group("mib")),
        endpoint=rpc_m.group("endpoint") if rpc_m else None,
        index=int(rpc_m.group("index")) if rpc_m else None,
    )


def parse_load_log(lines: Iterable[str]) -> LoadLog:
    buffers: list[BufferLine] = []
    devices: list[tuple[str, str]] = []
    layers: dict[int, str] = {}
    for raw in lines:
        line = raw.strip()
        if (buf := parse_buffer_line(line)) is not None:
            buffers.append(buf)
        elif (m := _USING_RE.match(line)) is not None:
            devices.append((m.group("name"), m.group("description")))
        elif (m := _LAYER_RE.match(line)) is not None:
            layers[int(m.group("il"))] = m.group("device")
    return LoadLog(tuple(buffers), tuple(devices), layers)


def join_log_records(records: Iterable[tuple[int, str]]) -> list[str]:
    """ggml log records (level, text) → whole lines: level 5 (CONT) continues the previous record, and
    a record may hold several lines or part of one."""
    text = "".join(t for _, t in records)
    return text.splitlines()


# --- the server's GGML_RPC_DEBUG=1 log (pure) -------------------------------------------------------------

# ggml-rpc.cpp rpc_server::alloc_buffer / free_buffer, and rpc-server.cpp's connection messages.
_ALLOC_RE = re.compile(
    r"^\[alloc_buffer\] device: (?P<device>\d+), size: (?P<size>\d+) -> "
    r"(?:remote_ptr: (?P<ptr>[0-9a-fA-F]+), remote_size: (?P<rsize>\d+)|failed)"
)
_FREE_RE = re.compile(r"^\[free_buffer\] remote_ptr: (?P<ptr>[0-9a-fA-F]+)")


@dataclass(frozen=True)
class ServerAllocation:
    """One ALLOC_BUFFER a server served: `connection` counts accepted clients from 0 in this log."""

    connection: int
    device: int
    size: int
    remote_ptr: int | None  # None: the allocation failed
    remote_size: int
    freed: bool


def parse_server_log(text: str) -> tuple[ServerAllocation, ...]:
    """Every buffer allocation in a server log (started with `GGML_RPC_DEBUG=1`), in order; a buffer is
    `freed` once FREE_BUFFER names it or its client's connection closes (the server frees them all)."""
    allocs: list[dict[str, Any]] = []
    live: dict[int, int] = {}  # remote_ptr -> index into allocs
    connection = -1
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("Accepted client connection"):
            connection += 1
        elif line.startswith("Client connection closed"):
            for i in live.values():
                allocs[i]["freed"] = True
            live.clear()
        elif (m := _ALLOC_RE.match(line)) is not None:
            ptr = int(m.group("ptr"), 16) if m.group("ptr") else None
            allocs.append(
                {
                    "connection": max(connection, 0),
                    "device": int(m.group("device")),
                    "size": int(m.group("size")),
                    "remote_ptr": ptr,
                    "remote_size": int(m.group("rsize") or 0),
                    "freed": ptr is None,
                }
            )
            if ptr is not None:
                live[ptr] = len(allocs) - 1
        elif (m := _FREE_RE.match(line)) is not None:
            index = live.pop(int(m.group("ptr"), 16), None)
            if index is not None:
                allocs[index]["freed"] = True
    return tuple(ServerAllocation(**a) for a in allocs)


def model_allocations(allocs: Sequence[ServerAllocation]) -> dict[int, list[int]]:
    """Sizes allocated per device by the last connection that allocated anything (a model's connection:
    probes and registration allocate nothing), in order: weights, KV, then compute buffers."""
    ok = [a for a in allocs if a.remote_ptr is not None]
    if not ok:
        return {}
    last = ok[-1].connection
    out: dict[int, list[int]] = {}
    for a in ok:
        if a.connection == last:
            out.setdefault(a.device, []).append(a.size)
    return out


# --- placement --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryBytes:
    weights: int
    kv: int
    compute: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute


def _mib_of(n: int) -> str:
    return f"{n / MiB:.2f}"


def exact_memory(logged: MemoryBytes, sizes: Sequence[int]) -> MemoryBytes:
    """Pair a device's logged buffers (0.01 MiB precision) with the sizes its server allocated, in order
    (weights, KV, compute), to get exact bytes. Raises ValueError when they do not correspond."""
    out: dict[str, int] = {}
    pos = 0
    for kind in ("weights", "kv", "compute"):
        target = getattr(logged, kind)
        if target == 0:
            out[kind] = 0
            continue
        while pos < len(sizes) and _mib_of(sizes[pos]) != _mib_of(target):
            pos += 1
        if pos == len(sizes):
            raise ValueError(f"no allocation of {_mib_of(target)} MiB for {kind} in {list(sizes)}")
        out[kind] = sizes[pos]
        pos += 1
    return MemoryBytes(**out)


@dataclass(frozen=True)
class DevicePlacement:
    """One device of a loaded model: what the plan predicted beside what llama.cpp allocated.

    `actual` comes from the load log, so it is exact only to 0.01 MiB (`exact_memory` refines it with
    a server's allocation log)."""

    label: str  # host:port#index, or the local device's name
    name: str  # the device name in this process: RPC<k> (a process-wide counter) or CUDA0...
    endpoint: str | None
    index: int
    planned_layers: tuple[int, ...]
    actual_layers: tuple[int, ...]
    predicted: MemoryBytes
    actual: MemoryBytes


@dataclass(frozen=True)
class HostPlacement:
    predicted_weights: int
    predicted_kv: int
    predicted_compute: int
    predicted_output: int
    actual_weights: int
    actual_kv: int
    actual_compute: int
    actual_output: int


@dataclass(frozen=True)
class Placement:
    devices: tuple[DevicePlacement, ...]
    host: HostPlacement
    used_devices: tuple[tuple[str, str], ...]  # (name, description) llama.cpp reported using, in order
    load_seconds: float
    log: tuple[str, ...] = field(repr=False)

    @property
    def layers_as_planned(self) -> bool:
        return all(d.planned_layers == d.actual_layers for d in self.devices)


def build_placement(
    plan: Plan,
    names: Sequence[str],
    lines: Sequence[str],
    load_seconds: float = 0.0,
) -> Placement:
    """Predicted (from the plan) beside actual (from the load log) per device. `names` are the devices'
    names in this process, in plan order. Pure."""
    parsed = parse_load_log(lines)
    devices: list[DevicePlacement] = []
    for dev, name in zip(plan.devices, names, strict=True):
        sizes = {"weights": 0, "kv": 0, "compute": 0}
        for buf in parsed.buffers:
            mine = (
                buf.endpoint == dev.endpoint and buf.index == dev.index
                if dev.endpoint is not None
                else buf.buffer == dev.name
            )
            if mine and buf.kind in sizes:
                sizes[buf.kind] += buf.approx_bytes
        actual_layers = tuple(sorted(il for il, d in parsed.layers.items() if d == name))
        m = dev.memory
        devices.append(
            DevicePlacement(
                label=dev.label,
                name=name,
                endpoint=dev.endpoint,
                index=dev.index,
                planned_layers=dev.layers,
                actual_layers=actual_layers,
                predicted=MemoryBytes(m.weights, m.kv, m.compute),
                actual=MemoryBytes(**sizes),
            )
        )
    device_buffers = {(d.endpoint, d.index) for d in plan.devices if d.endpoint is not None}
    local_names = {d.name for d in plan.devices if d.endpoint is None}
    host = {"weights": 0, "kv": 0, "compute": 0, "output": 0}
    for buf in parsed.buffers:
        on_device = (buf.endpoint, buf.index) in device_buffers if buf.endpoint else buf.buffer in local_names
        if not on_device:
            host[buf.kind] += buf.approx_bytes
    h = plan.host
    return Placement(
        devices=tuple(devices),
        host=HostPlacement(
            h.weights, h.kv, h.compute, h.output, host["weights"], host["kv"], host["compute"], host["output"]
        ),
        used_devices=parsed.devices,
        load_seconds=load_seconds,
        log=tuple(lines),
    )


# --- the registry of native RPC registrations -------------------------------------------------------------


@dataclass(frozen=True)
class RegisteredEndpoint:
    endpoint: str
    server_reg: int  # ggml_backend_reg_t
    devices: tuple[int, ...]  # ggml_backend_dev_t, by the server's device index
    names: tuple[str, ...]  # RPC<k>
    descriptions: tuple[str, ...]


# One lock for the registry, the live-model counts and model construction (the params wrapper and the log
# callback are process-wide).
_LOCK = threading.RLock()
_REGISTRY: dict[str, RegisteredEndpoint] = {}
# Endpoints held by a live model of this process: its connection stays open for the model's life, so a
# probe from here would only see our own connection as "busy".
_LIVE: dict[str, int] = {}


def registered_endpoints() -> dict[str, RegisteredEndpoint]:
    """The endpoints registered natively in this process (they stay until it exits)."""
    with _LOCK:
        return dict(_REGISTRY)


def live_endpoints() -> dict[str, int]:
    """Endpoints in use by models of this process that are not closed yet, with their model count."""
    with _LOCK:
        return {k: v for k, v in _LIVE.items() if v > 0}


class _Native:
    """ggml entry points resolved from libllama's handle, with argtypes/restype set."""

    def __init__(self, llama_cpp_mod: Any) -> None:
        lib = llama_cpp_mod._lib
        vp, cp, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t

        def fn(name: str, argtypes: list[Any], restype: Any) -> Any:
            f = getattr(lib, name)
            f.argtypes, f.restype = argtypes, restype
            return f

        self.reg_by_name = fn("ggml_backend_reg_by_name", [cp], vp)
        self.reg_get_proc_address = fn("ggml_backend_reg_get_proc_address", [vp, cp], vp)
        self.reg_dev_count = fn("ggml_backend_reg_dev_count", [vp], sz)
        self.reg_dev_get = fn("ggml_backend_reg_dev_get", [vp, sz], vp)
        self.dev_name = fn("ggml_backend_dev_name", [vp], cp)
        self.dev_description = fn("ggml_backend_dev_description", [vp], cp)
        self.dev_by_name = fn("ggml_backend_dev_by_name", [cp], vp)
        self.dev_type = fn("ggml_backend_dev_type", [vp], ctypes.c_int)
        self.dev_count = fn("ggml_backend_dev_count", [], sz)
        self.dev_get = fn("ggml_backend_dev_get", [sz], vp)
        self.dev_memory = fn("ggml_backend_dev_memory", [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)], None)
        self.dev_buffer_type = fn("ggml_backend_dev_buffer_type", [vp], vp)
        self.buft_alignment = fn("ggml_backend_buft_get_alignment", [vp], sz)

    def add_server(self) -> Callable[[bytes], int | None]:
        reg = self.reg_by_name(b"RPC")
        if not reg:
            raise RpcUnavailableError(
                "llama-cpp-python was built without RPC (no 'RPC' backend)",
                hint='reinstall it with CMAKE_ARGS="-DGGML_RPC=ON"',
            )
        addr = self.reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
        if not addr:
            raise RpcUnavailableError("the RPC backend has no ggml_backend_rpc_add_server")
        return ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(addr)


_NATIVE: _Native | None = None


@dataclass(frozen=True)
class GenerationTimings:
    """llama.cpp's own counters for the last completion (not the stream's chunks, which
    llama-cpp-python holds back while a token ends inside a UTF-8 character)."""

    prompt_tokens: int
    prompt_seconds: float
    generated_tokens: int  # tokens evaluated after the prompt
    generate_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds > 0 else 0.0


def generation_timings(llm: Any) -> GenerationTimings:
    """Prompt and generation counters of `llm`'s last completion (llama_perf_context)."""
    perf = _llama_cpp().llama_perf_context(llm._ctx.ctx)
    return GenerationTimings(
        prompt_tokens=int(perf.n_p_eval),
        prompt_seconds=perf.t_p_eval_ms / 1000,
        generated_tokens=int(perf.n_eval),
        generate_seconds=perf.t_eval_ms / 1000,
    )


_GPU_TYPES = (1, 2)  # enum ggml_backend_dev_type: CPU 0, GPU 1, IGPU 2, ACCEL 3


def local_gpus() -> list[PlanDevice]:
    """This machine's GPUs as llama.cpp sees them (CUDA0, Vulkan0...), with their free memory, for
    the device list after the RPC devices. Empty without llama-cpp-python or without GPUs."""
    try:
        native = _native()
    except RpcUnavailableError:
        return []
    found: list[PlanDevice] = []
    gpus = [native.dev_get(i) for i in range(native.dev_count())]
    gpus = [d for d in gpus if d and native.dev_type(d) in _GPU_TYPES]
    # llama.cpp uses integrated GPUs only when there is no discrete one.
    if any(native.dev_type(d) == 1 for d in gpus):
        gpus = [d for d in gpus if native.dev_type(d) == 1]
    for dev in gpus:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        native.dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        name = (native.dev_name(dev) or b"").decode()
        found.append(
            PlanDevice(
                endpoint=None,
                index=len(found),
                name=name,
                description=(native.dev_description(dev) or b"").decode(),
                total=total.value,
                free=free.value,
                usable=free.value,
                alignment=int(native.buft_alignment(native.dev_buffer_type(dev))),
            )
        )
    return found


def _llama_cpp() -> Any:
    """The llama_cpp.llama_cpp module (imported here only), checked for version and RPC support."""
    try:
        import llama_cpp
        import llama_cpp.llama_cpp as lc
    except ImportError as exc:
        raise RpcUnavailableError(
            f"llama-cpp-python is not installed ({exc})",
            hint=f'CMAKE_ARGS="-DGGML_RPC=ON" pip install llama-cpp-python=={SUPPORTED_LLAMA_CPP}',
        ) from exc
    if getattr(llama_cpp, "__version__", None) != SUPPORTED_LLAMA_CPP:
        get_logger().warning("llama_cpp_version_untested", version=getattr(llama_cpp, "__version__", None))
    if not lc.llama_supports_rpc():
        raise RpcUnavailableError(
            "llama-cpp-python was built without RPC", hint='reinstall it with CMAKE_ARGS="-DGGML_RPC=ON"'
        )
    return lc


def _native() -> _Native:
    global _NATIVE
    if _NATIVE is None:
        _NATIVE = _Native(_llama_cpp())
    return _NATIVE


def _register(endpoint: str, expected_devices: int) -> RegisteredEndpoint:
    """Register `endpoint` natively (once per process). Call only after a successful preflight."""
    with _LOCK:
        known = _REGISTRY.get(endpoint)
        if known is not None:
            return known
        native = _native()
        add = native.add_server()
        # Native: aborts the process if the server vanished since the preflight (a small window).
        server_reg = add(endpoint.encode())
        if not server_reg:
            raise DeviceMismatchError("the server reports no devices", host=endpoint)
        count = native.reg_dev_count(server_reg)
        devices = tuple(int(native.reg_dev_get(server_reg, i)) for i in range(count))
        entry = RegisteredEndpoint(
            endpoint=endpoint,
            server_reg=int(server_reg),
            devices=devices,
            names=tuple(native.dev_name(d).decode() for d in devices),
            descriptions=tuple(native.dev_description(d).decode() for d in devices),
        )
        _REGISTRY[endpoint] = entry
        get_logger().debug("rpc_registered", endpoint=endpoint, devices=entry.names)
        if count != expected_devices:
            raise DeviceMismatchError(
                f"registered {count} device(s) but the preflight saw {expected_devices}", host=endpoint
            )
        return entry


# --- preflight --------------------------------------------------------------------------------------------


def _run_sync(coro: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    # Called from async code: run the probe on a private loop in a worker thread.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


@functools.cache
def expected_protocol() -> rpc.ProtocolVersion:
    """The RPC protocol of the installed llama-cpp-python (known per release), else the local default."""
    # llama_cpp.__version__, not importlib.metadata: the latter scans every distribution on
    # sys.path (22 ms, half of load_llama's own overhead). Importing llama_cpp loads its
    # libraries but calls nothing that can abort.
    import llama_cpp

    known = LLAMA_CPP_PROTOCOL.get(str(getattr(llama_cpp, "__version__", "")))
    return rpc.ProtocolVersion.parse(known) if known else rpc.local_protocol_version()


def check_plan_devices(plan: Plan, device_counts: Mapping[str, int]) -> None:
    """Refuse a plan whose devices do not match the servers (pure): every RPC device's index must exist
    on its server, no device twice, and one tensor_split value per device."""
    if len(plan.tensor_split) != len(plan.devices):
        raise DeviceMismatchError(
            f"the plan has {len(plan.devices)} device(s) but {len(plan.tensor_split)} tensor_split value(s)",
            hint="re-create the plan (rpcfleet plan)",
        )
    seen: set[tuple[str | None, int | str]] = set()
    for dev in plan.devices:
        key: tuple[str | None, int | str] = (
            (dev.endpoint, dev.index) if dev.endpoint is not None else (None, dev.name)
        )
        if key in seen:
            raise DeviceMismatchError(f"device {dev.label} appears twice in the plan")
        seen.add(key)
        if dev.endpoint is None:
            continue
        count = device_counts.get(dev.endpoint)
        if count is None:
            raise DeviceMismatchError(f"no probe result for {dev.endpoint}", host=dev.endpoint)
        if not 0 <= dev.index < count:
            raise DeviceMismatchError(
                f"the plan uses device {dev.index} but the server has {count} device(s)",
                host=dev.endpoint,
                hint="the fleet changed since planning: probe and plan again",
            )


def preflight(
    plan: Plan,
    *,
    expected: rpc.ProtocolVersion | None = None,
    connect_timeout: float = 2.0,
    read_timeout: float = 2.0,
    deadline: float = 5.0,
) -> dict[str, int]:
    """Probe every endpoint of the plan (pure Python, no native code) and check its devices.

    Returns the device count per endpoint. Endpoints held by a live model of this process are not probed
    (their connection is ours); their registered device count is used. Raises a `LoaderError` subclass
    for the first endpoint that is unreachable, busy or mismatched (all problems are in the message).
    """
    endpoints = list(plan.endpoints)
    for ep in endpoints:
        try:
            rpc.parse_endpoint(ep)
        except rpc.EndpointError as exc:
            raise EndpointUnreachableError(f"invalid endpoint {ep!r} in the plan: {exc}", host=ep) from exc
    with _LOCK:
        held = {ep: len(_REGISTRY[ep].devices) for ep in endpoints if _LIVE.get(ep) and ep in _REGISTRY}
    to_probe = [ep for ep in endpoints if ep not in held]
    results: list[rpc.ProbeResult] = []
    if to_probe:
        results = _run_sync(
            rpc.probe_endpoints(
                to_probe,
                expected=expected or expected_protocol(),
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                deadline=deadline,
            )
        )
    bad = [r for r in results if not r.ok]
    if bad:
        err = _error_for_probe(bad[0])
        if len(bad) > 1:
            others = "; ".join(f"{r.endpoint}: {r.outcome}" for r in bad[1:])
            err.message += f" (also refused: {others})"
        raise err
    counts = dict(held)
    # probe_endpoints canonicalises endpoints; map results back to the plan's spelling.
    by_canonical = {str(rpc.parse_endpoint(ep)): ep for ep in to_probe}
    for r in results:
        counts[by_canonical.get(r.endpoint, r.endpoint)] = len(r.devices)
    with _LOCK:
        for ep, n in counts.items():
            reg = _REGISTRY.get(ep)
            if reg is not None and len(reg.devices) != n:
                raise DeviceMismatchError(
                    f"the server now reports {n} device(s) but {len(reg.devices)} are registered in this "
                    "process",
                    host=ep,
                    hint="restart Python to register the server again",
                )
    check_plan_devices(plan, counts)
    return counts


# --- construction -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _capture_log(lc: Any, sink: list[tuple[int, str]], verbose: bool) -> Iterator[None]:
    """Route llama.cpp's (and ggml's) log into `sink` while the block runs; echo it when verbose. The
    previous callback is restored afterwards."""

    def record(level: int, text: bytes, user_data: Any) -> None:
        decoded = text.decode("utf-8", "replace")
        sink.append((level, decoded))
        if verbose:
            sys.stderr.write(decoded)

    callback = lc.llama_log_callback(record)

    previous = None
    with contextlib.suppress(Exception):  # llama_log_get exists in 0.3.36; keep working without it
        prev_cb = lc.llama_log_callback()
        prev_ud = ctypes.c_void_p()
        lc.llama_log_get(ctypes.byref(prev_cb), ctypes.byref(prev_ud))
        previous = (prev_cb, prev_ud)
    lc.llama_log_set(callback, ctypes.c_void_p(0))
    try:
        yield
    finally:
        if previous is not None and previous[0]:
            lc.llama_log_set(previous[0], previous[1])
        else:
            import llama_cpp._logger as default_logger

            lc.llama_log_set(default_logger.llama_log_callback, ctypes.c_void_p(0))


@contextlib.contextmanager
def _explicit_devices(lc: Any, devices: Any) -> Iterator[None]:
    """`Llama.__init__` takes its model params from `llama_model_default_params()` and offers no way to
    set `devices`: wrap that function for the construction only (under `_LOCK`)."""
    original = lc.llama_model_default_params

    def with_devices() -> Any:
        params = original()
        params.devices = ctypes.addressof(devices)
        return params

    lc.llama_model_default_params = with_devices
    try:
        yield
    finally:
        lc.llama_model_default_params = original


def _resolve_devices(plan: Plan, native: _Native) -> tuple[list[int], list[str]]:
    handles: list[int] = []
    names: list[str] = []
    for dev in plan.devices:
        if dev.endpoint is not None:
            reg = _REGISTRY[dev.endpoint]
            handles.append(reg.devices[dev.index])
            names.append(reg.names[dev.index])
        else:
            handle = native.dev_by_name(dev.name.encode())
            if not handle:
                raise LocalDeviceError(f"local device {dev.name!r} not found in this process")
            handles.append(int(handle))
            names.append(dev.name)
    return handles, names


def device_names(plan: Plan) -> list[str]:
    """The names the plan's devices have in this process (RPC<k> once registered), in plan order."""
    with _LOCK:
        return [
            _REGISTRY[d.endpoint].names[d.index] if d.endpoint is not None else d.name for d in plan.devices
        ]


def _check_kwargs(kwargs: Mapping[str, Any]) -> None:
    clash = sorted(set(kwargs) & PLAN_CONTROLLED)
    if clash:
        raise LoaderError(
            f"{', '.join(clash)} come(s) from the plan and cannot be passed to load_llama",
            hint="set them in the plan options (rpcfleet plan --ctx/...) and plan again",
        )


def _check_model(plan: Plan, model_path: Path) -> None:
    from orchestrator.model import profile_model

    if not model_path.exists():
        raise LoaderError(f"model file {model_path} does not exist")
    try:
        profile = profile_model(model_path)
    except Exception as exc:
        raise LoaderError(f"cannot read model {model_path}: {exc}") from exc
    if profile.n_layer != plan.n_layer:
        raise LoaderError(
            f"the plan was made for a model with {plan.n_layer} layers but {model_path} has "
            f"{profile.n_layer}",
            hint="plan again for this model",
        )


def _multimodal(
    kwargs: dict[str, Any], mmproj: str | Path | None, has_local_gpu: bool, verbose: bool
) -> list[str]:
    """Pass mmproj / chat handler through; with no local GPU selected, keep the projector on the CPU
    (MTMD otherwise picks the first GPU in the process-wide registry, which may be an RPC device)."""
    notes: list[str] = []
    handler = kwargs.get("chat_handler")
    if mmproj is not None and handler is None:
        from llama_cpp.llama_chat_format import MTMDChatHandler

        kwargs["chat_handler"] = MTMDChatHandler(
            clip_model_path=str(mmproj), verbose=verbose, use_gpu=has_local_gpu
        )
    elif handler is not None and not has_local_gpu:
        if hasattr(handler, "use_gpu"):
            handler.use_gpu = False
        else:
            notes.append(f"{type(handler).__name__} has no use_gpu setting: its projector may use a GPU")
    return notes


def load_llama(
    plan: Plan,
    model_path: str | Path | None = None,
    *,
    mmproj: str | Path | None = None,
    verbose: bool = False,
    connect_timeout: float = 2.0,
    read_timeout: float = 2.0,
    **llama_kwargs: Any,
) -> Any:
    """Load `model_path` (default: the plan's) on the plan's devices; returns a `llama_cpp.Llama` with
    the `Placement` attached (`placement_of(llm)`).

    Every endpoint is preflighted before any native call: an unreachable, busy or mismatched server
    raises a `LoaderError` subclass and the process carries on. `llama_kwargs` go to `Llama` (e.g.
    `seed`, `n_threads`, `chat_format`, `chat_handler`), except what the plan decides (`PLAN_CONTROLLED`).
    `mmproj`: a multimodal projector, run on the CPU unless the plan selects a local GPU.
    The llama.cpp log is always captured and shown only when `verbose`.
    """
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    _check_kwargs(llama_kwargs)
    path = Path(model_path) if model_path is not None else Path(plan.model_path)
    _check_model(plan, path)
    if plan.split_mode != "layer":
        raise LoaderError(f"split mode {plan.split_mode!r} is not supported with RPC; plans use 'layer'")
    with _LOCK:
        endpoints = plan.endpoints
        new = [ep for ep in endpoints if ep not in _REGISTRY]
        if len(_REGISTRY) + len(new) > MAX_ENDPOINTS:
            raise EndpointLimitError(
                f"loading would register {len(_REGISTRY) + len(new)} distinct endpoints; one process "
                f"allows {MAX_ENDPOINTS} (registrations last until the process exits)",
                hint="restart Python, or load in a child process",
            )
        counts = preflight(plan, connect_timeout=connect_timeout, read_timeout=read_timeout)
        # Only now native code runs (import, RPC check, registration).
        lc = _llama_cpp()
        native = _native()
        for ep in endpoints:
            _register(ep, counts[ep])
        handles, names = _resolve_devices(plan, native)
        devices = (ctypes.c_void_p * (len(handles) + 1))(*handles, None)
        has_local_gpu = any(d.endpoint is None for d in plan.devices)
        notes = _multimodal(llama_kwargs, mmproj, has_local_gpu, verbose)
        opts = plan.options
        records: list[tuple[int, str]] = []
        from llama_cpp import Llama

        started = time.monotonic()
        try:
            with _capture_log(lc, records, verbose), _explicit_devices(lc, devices):
                llm: Any = Llama(
                    str(path),
                    n_gpu_layers=plan.n_gpu_layers,
                    split_mode=LLAMA_SPLIT_MODE_LAYER,
                    main_gpu=plan.main_gpu,
                    tensor_split=list(plan.tensor_split) if plan.devices else None,
                    n_ctx=plan.n_ctx,
                    n_batch=opts.n_batch,
                    n_ubatch=opts.n_ubatch,
                    flash_attn=opts.flash_attn,
                    type_k=int(KV_CACHE_TYPES[opts.type_k]),
                    type_v=int(KV_CACHE_TYPES[opts.type_v]),
                    verbose=verbose,
                    **llama_kwargs,
                )
        except ValueError as exc:
            lines = join_log_records(records)
            raise LoadFailedError(
                f"llama.cpp could not load {path}: {exc}", stderr="\n".join(lines[-20:])
            ) from exc
        elapsed = time.monotonic() - started
        for ep in endpoints:
            _LIVE[ep] = _LIVE.get(ep, 0) + 1

    def release() -> None:
        with _LOCK:
            for ep in endpoints:
                _LIVE[ep] = max(0, _LIVE.get(ep, 0) - 1)

    llm._stack.callback(release)  # runs on close() and on garbage collection (Llama.__del__ closes)
    placement = build_placement(plan, names, join_log_records(records), elapsed)
    # The device array must outlive the model: llama keeps the pointer.
    llm._rpcfleet_devices = devices
    llm.rpcfleet_placement = placement
    llm.rpcfleet_plan = plan
    llm.rpcfleet_notes = tuple(notes)
    get_logger().info(
        "llama_loaded",
        model=str(path),
        devices=[d.label for d in plan.devices],
        seconds=round(elapsed, 3),
    )
    return llm


def placement_of(llm: Any) -> Placement:
    """The `Placement` of a model loaded by `load_llama`."""
    placement = getattr(llm, "rpcfleet_placement", None)
    if not isinstance(placement, Placement):
        raise LoaderError("this model was not loaded by rpcfleet's load_llama")
    return placement


__all__ = [
    "MAX_ENDPOINTS",
    "BufferLine",
    "DeviceMismatchError",
    "DevicePlacement",
    "EndpointBusyError",
    "EndpointLimitError",
    "EndpointUnreachableError",
    "HostPlacement",
    "LoadFailedError",
    "LoadLog",
    "LocalDeviceError",
    "MemoryBytes",
    "Placement",
    "ProtocolMismatchError",
    "RegisteredEndpoint",
    "RpcUnavailableError",
    "ServerAllocation",
    "build_placement",
    "check_plan_devices",
    "device_names",
    "exact_memory",
    "join_log_records",
    "load_llama",
    "model_allocations",
    "parse_buffer_line",
    "parse_load_log",
    "parse_server_log",
    "placement_of",
    "preflight",
    "registered_endpoints",
]
