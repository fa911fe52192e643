"""`Plan` → `llama_cpp.Llama` on stock llama-cpp-python 0.3.36 (llama_cpp itself through `llama.native`).

0.3.36 has no `rpc_servers` argument (it is swallowed by `**kwargs`), and its native RPC client aborts the
whole process on an unreachable or mismatched server. So, in this order (facts: §4-§6 of
docs/llama-rpc.md):

1. Preflight every endpoint of the plan with the pure-Python client (`llama.native.preflight`) and refuse,
   with a typed error, anything unreachable, busy, of another protocol, or whose devices do not
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

import contextlib
import ctypes
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from orchestrator.caches.manifest import engine_environment
from orchestrator.core.errors import LoaderError
from orchestrator.core.log import get_logger
from orchestrator.core.target import Target, dial_addresses, targets_for
from orchestrator.llama.errors import LoadFailedError, LocalDeviceError
from orchestrator.llama.logs import join_log_records
from orchestrator.llama.native.libllama import (
    LIVE,
    LOCK,
    REGISTRY,
    Native,
    capture_log,
    get_native,
    llama_cpp_module,
    register,
)
from orchestrator.llama.native.multimodal import mtmd_handler
from orchestrator.llama.native.preflight import check_endpoint_limit, preflight
from orchestrator.llama.observed_placement import build_placement
from orchestrator.planning.plan import Plan
from orchestrator.planning.profile import KV_CACHE_TYPES

LLAMA_SPLIT_MODE_NONE = 0


LLAMA_SPLIT_MODE_LAYER = 1


LLAMA_SPLIT_MODE_ROW = 2


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
        "swa_full",
        "rpc_servers",  # silently ignored by 0.3.36: refusing it beats a model quietly on the CPU
    }
)


@contextlib.contextmanager
def _model_params(
    lc: Any, devices: Any, on_progress: Callable[[float], None] | None, overrides: Any = None
) -> Iterator[Any]:
    """`Llama.__init__` takes its model params from `llama_model_default_params()` and offers no way to
    set `devices` or a progress callback: wrap that function for the construction only (under `_LOCK`).

    `on_progress(fraction)` is llama.cpp's own progress (bytes of tensors loaded, before each tensor);
    it may not raise into native code, so an exception from it is logged and the load goes on. Yields the
    ctypes callback: the model's params keep its address, so it must live as long as the model."""
    original = lc.llama_model_default_params
    callback = None
    if on_progress is not None:

        def report(fraction: float, _user_data: Any) -> bool:
            try:
                on_progress(fraction)
            except Exception as exc:  # never unwind through llama.cpp's loader
                get_logger().warning("load_progress_failed", error=str(exc))
            return True

        callback = lc.llama_progress_callback(report)

    def with_devices() -> Any:
        params = original()
        params.devices = ctypes.addressof(devices)
        if overrides is not None:  # the binding declares this field but never sets it (0.3.36)
            params.tensor_buft_overrides = ctypes.addressof(overrides)
        if callback is not None:
            params.progress_callback = callback
        return params

    lc.llama_model_default_params = with_devices
    try:
        yield callback
    finally:
        lc.llama_model_default_params = original


DEV_TYPE_CPU = 0  # enum ggml_backend_dev_type


class _BuftOverride(ctypes.Structure):
    """llama.h struct llama_model_tensor_buft_override."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _cpu_moe_overrides(n_cpu_moe: int, native: Native) -> Any:
    """--n-cpu-moe's overrides (common.h llm_add_n_cpu_ffn_overrides): the expert tensors of layers
    0..N-1 in the CPU's buffer type; a NULL-terminated array (None when N is 0)."""
    if n_cpu_moe <= 0:
        return None
    cpu = next(
        (
            dev
            for dev in map(native.dev_get, range(native.dev_count()))
            if native.dev_type(dev) == DEV_TYPE_CPU
        ),
        None,
    )
    if cpu is None:
        raise LoadFailedError("--n-cpu-moe: llama.cpp has no CPU device in this process")
    buft = native.dev_buffer_type(cpu)
    overrides = (_BuftOverride * (n_cpu_moe + 1))()
    for il in range(n_cpu_moe):
        overrides[il].pattern = rf"blk\.{il}\.ffn_(up|down|gate|gate_up)_(ch|)exps".encode()
        overrides[il].buft = buft
    return overrides


@contextlib.contextmanager
def _context_params(lc: Any, n_seq_max: int, kv_unified: bool) -> Iterator[None]:
    """`Llama.__init__` has no n_seq_max or kv_unified argument (0.3.36): it starts its context params
    from `llama_context_default_params()`, so that function is wrapped for the construction only."""
    original = lc.llama_context_default_params

    def with_sequences() -> Any:
        params = original()
        params.n_seq_max = n_seq_max
        params.kv_unified = kv_unified
        return params

    lc.llama_context_default_params = with_sequences
    try:
        yield
    finally:
        lc.llama_context_default_params = original


def _resolve_devices(plan: Plan, native: Native) -> tuple[list[int], list[str]]:
    handles: list[int] = []
    names: list[str] = []
    for dev in plan.devices:
        if dev.endpoint is not None:
            reg = REGISTRY[dev.endpoint]
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
    with LOCK:
        return [
            REGISTRY[d.endpoint].names[d.index] if d.endpoint is not None else d.name for d in plan.devices
        ]


def _check_kwargs(kwargs: Mapping[str, Any]) -> None:
    clash = sorted(set(kwargs) & PLAN_CONTROLLED)
    if clash:
        raise LoaderError(
            f"{', '.join(clash)} come(s) from the plan and cannot be passed to load_llama",
            hint="set them in the plan options (rpcfleet plan --ctx/...) and plan again",
        )


def _check_model(plan: Plan, model_path: Path) -> None:
    from orchestrator.planning.profile import profile_model

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
    kwargs: dict[str, Any],
    mmproj: str | Path | None,
    has_local_gpu: bool,
    verbose: bool,
    handler_kwargs: Mapping[str, Any] | None = None,
) -> list[str]:
    """Pass mmproj / chat handler through; with no local GPU selected, keep the projector on the CPU
    (MTMD otherwise picks the first GPU in the process-wide registry, which may be a local GPU the model
    does not use), unless `handler_kwargs` says `use_gpu` itself."""
    notes: list[str] = []
    handler = kwargs.get("chat_handler")
    if handler_kwargs and mmproj is None:
        raise LoaderError("chat_handler_kwargs configure the mmproj handler: pass mmproj_path too")
    if mmproj is not None and handler is not None:
        raise LoaderError("pass either a chat_handler or an mmproj, not both")
    if mmproj is not None:
        kwargs["chat_handler"] = mtmd_handler(mmproj, verbose, has_local_gpu, handler_kwargs or {})
    elif handler is not None and not has_local_gpu:
        if hasattr(handler, "use_gpu"):
            handler.use_gpu = False
        else:
            notes.append(f"{type(handler).__name__} has no use_gpu setting: its projector may use a GPU")
    return notes


def register_endpoints(counts: Mapping[str, int], targets: Mapping[str, Target] | None = None) -> None:
    """Register each preflighted endpoint natively (once per process) with its device count, at the
    address its target dials (`targets`; default: the endpoint)."""
    for target in targets_for(counts, targets):
        register(target.dial, counts[target.endpoint], target=target)


def load_registered(
    plan: Plan,
    path: Path,
    construct: Callable[..., Any],
    *,
    verbose: bool,
    llama_kwargs: dict[str, Any],
    mmproj: str | Path | None = None,
    handler_kwargs: Mapping[str, Any] | None = None,
    split_mode: int = LLAMA_SPLIT_MODE_LAYER,
    on_progress: Callable[[float], None] | None = None,
    named: Plan | None = None,
) -> Any:
    """Construct the model (`construct(model_path, **params)` returns it) on the plan's devices, whose
    endpoints are registered already: explicit device list, the plan's split, the load log captured,
    the `Placement` attached; `on_progress(fraction)` during the load (llama.cpp's own). `named`: the
    same plan under the endpoints the placement names, when `plan` has the addresses dialed (forwards).
    Call under `_LOCK`."""
    lc = llama_cpp_module()
    native = get_native()
    handles, names = _resolve_devices(plan, native)
    devices = (ctypes.c_void_p * (len(handles) + 1))(*handles, None)
    has_local_gpu = any(d.endpoint is None for d in plan.devices)
    notes = _multimodal(llama_kwargs, mmproj, has_local_gpu, verbose, handler_kwargs)
    opts = plan.options
    overrides = _cpu_moe_overrides(opts.n_cpu_moe, native)
    records: list[tuple[int, str]] = []
    started = time.monotonic()
    try:
        with (
            capture_log(lc, records, verbose),
            _context_params(lc, opts.parallel, opts.kv_unified),
            _model_params(lc, devices, on_progress, overrides) as callback,
        ):
            llm: Any = construct(
                str(path),
                n_gpu_layers=plan.n_gpu_layers,
                split_mode=split_mode,
                main_gpu=plan.main_gpu,
                tensor_split=list(plan.tensor_split) if plan.devices else None,
                n_ctx=plan.n_ctx,
                n_batch=opts.n_batch,
                n_ubatch=opts.n_ubatch,
                flash_attn=opts.flash_attn,
                swa_full=opts.swa_full,  # llama.cpp's C default is true; llama-server's is false
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
    endpoints = plan.endpoints
    for ep in endpoints:
        LIVE[ep] = LIVE.get(ep, 0) + 1

    def release() -> None:
        with LOCK:
            for ep in endpoints:
                LIVE[ep] = max(0, LIVE.get(ep, 0) - 1)

    llm._stack.callback(release)  # runs on close() and on garbage collection (Llama.__del__ closes)
    # The device array and the progress callback must outlive the model: llama keeps the pointers.
    llm._rpcfleet_devices = devices
    llm._rpcfleet_progress = callback
    llm._rpcfleet_overrides = overrides  # the model reads them again when it makes its context
    llm.rpcfleet_placement = build_placement(named or plan, names, join_log_records(records), elapsed)
    llm.rpcfleet_plan = named or plan
    llm.rpcfleet_notes = tuple(notes)
    get_logger().info(
        "llama_loaded", model=str(path), devices=[d.label for d in plan.devices], seconds=round(elapsed, 3)
    )
    return llm


def load_llama(
    plan: Plan,
    model_path: str | Path | None = None,
    *,
    mmproj: str | Path | None = None,
    verbose: bool = False,
    connect_timeout: float = 2.0,
    read_timeout: float = 2.0,
    targets: Mapping[str, Target] | None = None,
    on_progress: Callable[[float], None] | None = None,
    **llama_kwargs: Any,
) -> Any:
    """Load `model_path` (default: the plan's) on the plan's devices; returns a `llama_cpp.Llama` with
    the `Placement` attached (`placement_of(llm)`).

    Every endpoint is preflighted before any native call: an unreachable, busy or mismatched server
    raises its typed error (`EndpointProbeError`) and the process carries on. `llama_kwargs` go to
    `Llama` (e.g. `seed`, `n_threads`, `chat_format`, `chat_handler`), except what the plan decides
    (`PLAN_CONTROLLED`). `mmproj`: a multimodal projector, run on the CPU unless the plan selects a local
    GPU. The llama.cpp log is always captured and shown only when `verbose`.

    `targets` gives a plan endpoint the address to connect to: `Tunnels(...).targets(hosts)` for hosts
    with `rpc_transport: ssh` (keep the `Tunnels` open as long as the model); the placement, errors and
    `llm.rpcfleet_plan` name the plan's endpoints (`str(target)` adds the forward).
    `on_progress(fraction)` is called during the load with llama.cpp's own progress (0..1, bytes of
    tensors loaded).
    """
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    # the RPC client rpcfleet builds takes weight hashes from the manifests instead of hashing
    for key, value in engine_environment().items():
        os.environ.setdefault(key, value)
    _check_kwargs(llama_kwargs)
    path = Path(model_path) if model_path is not None else Path(plan.model_path)
    _check_model(plan, path)
    if plan.split_mode != "layer":
        raise LoaderError(f"split mode {plan.split_mode!r} is not supported with RPC; plans use 'layer'")
    # Native code dials the forwards: it registers, and the model names, the addresses dialed.
    dial = dial_addresses(targets_for(plan.endpoints, targets))
    dialed = plan.with_endpoints(dial)
    with LOCK:
        # The servers' own problems first (unreachable, busy, another protocol): one of them is never
        # registered, so it is what to report, not the process's limit.
        counts = preflight(plan, targets=targets, connect_timeout=connect_timeout, read_timeout=read_timeout)
        check_endpoint_limit(dialed.endpoints)
        # Only now native code runs (RPC check, registration).
        from llama_cpp import Llama

        register_endpoints(counts, targets)
        llm = load_registered(
            dialed,
            path,
            Llama,
            verbose=verbose,
            llama_kwargs=llama_kwargs,
            mmproj=mmproj,
            on_progress=on_progress,
            named=plan,
        )
    return llm
