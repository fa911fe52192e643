"""`orchestrator.Llama`: `llama_cpp.Llama` with the RPC adapter's constructor, the drop-in spec's semantics.

    llm = Llama(model_path="./model.gguf", rpc_servers=["127.0.0.1:50052"], rpc_local_devices=[],
                n_gpu_layers=-1, n_ctx=2048)

Importing this module imports llama_cpp (the class derives from it), so `orchestrator/__init__.py`
imports it only when the name `Llama` is used. Construction, in the drop-in spec's order:

1. Every keyword is checked against the stock constructor: one it would swallow is an error.
2. `rpc_servers` (a list or "h1:p,h2:p"; duplicates are one endpoint) are probed in pure Python: an
   unreachable, busy or mismatched server raises its typed error and the process carries on. At most
   16 distinct endpoints per process.
3. Native code: ggml's backends are loaded (where the build has dynamic ones), then each endpoint is
   registered once per process (`llama.native.libllama`), then the model is built on an explicit device list.
4. Devices: all devices of each endpoint in `rpc_servers` order, then the local GPUs
   (`rpc_local_devices`: None = the default ones, [] = none, names select and order them).
5. Without `tensor_split`, rpcfleet plans it: usable memory per device (`dropin_plan`), whole layers,
   llama.cpp's own assignment; a `PlanError` names the shortfall when the model does not fit.
   `split_mode=LLAMA_SPLIT_MODE_NONE` puts the model on `main_gpu` (an index into that order); row
   split is refused. `llm.rpcfleet_plan` and `placement_of(llm)` show the plan and what llama.cpp did.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

# First: it sets GGML_NO_BACKTRACE, which ggml reads when llama_cpp loads it.
from orchestrator.llama.native import libllama as _native_module

# isort: split
import llama_cpp

# isort: split
from orchestrator.caches.manifest import engine_environment
from orchestrator.core.errors import LoaderError, ModelError, PlanError
from orchestrator.inventory.variables import near_miss
from orchestrator.llama.dropin_plan import (
    endpoint_facts,
    measured_devices,
    parse_rpc_memory,
    parse_rpc_servers,
    refuse_unmeasured,
    unmeasured_causes,
)
from orchestrator.llama.errors import UnknownArgumentError
from orchestrator.llama.native.loader import (
    LLAMA_SPLIT_MODE_LAYER,
    LLAMA_SPLIT_MODE_NONE,
    LLAMA_SPLIT_MODE_ROW,
    load_registered,
    register_endpoints,
)
from orchestrator.llama.native.preflight import check_endpoint_limit, probe_for_load
from orchestrator.planning.layer_assignment import order_devices
from orchestrator.planning.plan import Plan, PlanDevice, PlanOptions
from orchestrator.planning.profile import KV_CACHE_TYPES, profile_model
from orchestrator.planning.strategy import make_plan
from orchestrator.workflows.fit import DROPIN_WORDS, misfit_error

# Every keyword the stock constructor names; anything else would vanish into its **kwargs.
STOCK_KEYWORDS = frozenset(inspect.signature(llama_cpp.Llama.__init__).parameters) - {"self", "kwargs"}


DROPIN_KEYWORDS = frozenset(
    {"rpc_servers", "rpc_local_devices", "rpc_memory", "trust_rpc_memory", "rpc_timeout"}
    | {"mmproj_path", "chat_handler_kwargs"}
)


_CACHE_TYPE_NAMES = {int(v): k for k, v in KV_CACHE_TYPES.items()}


def _cache_type(kwargs: dict[str, Any], key: str) -> str:
    value = kwargs.pop(key, None)
    if value is None:
        return "f16"
    if isinstance(value, str) and value in KV_CACHE_TYPES:
        return value
    if isinstance(value, int) and value in _CACHE_TYPE_NAMES:
        return _CACHE_TYPE_NAMES[value]
    raise PlanError(f"{key}={value!r}: not a KV cache type (one of {', '.join(KV_CACHE_TYPES)})")


def _plan_options(kwargs: dict[str, Any], n_gpu_layers: int, tensor_split: Any) -> PlanOptions:
    """The plan's options from the stock keywords (stock defaults), popped from `kwargs`."""
    split = None
    if tensor_split is not None:
        try:
            split = tuple(float(x) for x in tensor_split)
        except (TypeError, ValueError):
            raise PlanError(f"tensor_split must be a list of numbers, got {tensor_split!r}") from None
    return PlanOptions(
        n_ctx=int(kwargs.pop("n_ctx", 512)),
        n_batch=int(kwargs.pop("n_batch", 512)),
        n_ubatch=int(kwargs.pop("n_ubatch", 512)),
        flash_attn=bool(kwargs.pop("flash_attn", False)),
        type_k=_cache_type(kwargs, "type_k"),
        type_v=_cache_type(kwargs, "type_v"),
        n_gpu_layers=n_gpu_layers,
        tensor_split=split,
    )


def _check_keywords(kwargs: Mapping[str, Any]) -> None:
    unknown = sorted(set(kwargs) - STOCK_KEYWORDS)
    if unknown:
        name = unknown[0]
        raise UnknownArgumentError(
            f"Llama() got unknown keyword argument(s) {', '.join(unknown)}: llama-cpp-python "
            f"{llama_cpp.__version__} would ignore them"
            + near_miss(name, [*STOCK_KEYWORDS, *DROPIN_KEYWORDS])
        )


def _select_devices(
    rpc: Sequence[PlanDevice], local_devices: Sequence[str] | None, split_mode: int, main_gpu: int
) -> tuple[PlanDevice, ...]:
    """The drop-in spec's device order, and for split mode NONE only `main_gpu`'s device of it."""
    local = _native_module.local_gpus() if local_devices != [] else []
    ordered = order_devices(rpc, local, None if local_devices is None else list(local_devices))
    if split_mode != LLAMA_SPLIT_MODE_NONE:
        return ordered
    if not 0 <= main_gpu < len(ordered):
        listed = ", ".join(f"{i}: {d.label}" for i, d in enumerate(ordered)) or "none"
        raise PlanError(f"main_gpu {main_gpu} is out of range for LLAMA_SPLIT_MODE_NONE (devices: {listed})")
    return (ordered[main_gpu],)


def make_dropin_plan(
    devices: Sequence[PlanDevice],
    unmeasured: Iterable[str],
    model: Path,
    options: PlanOptions,
    causes: Sequence[str] = (),
) -> Plan:
    """The plan for the selected `devices`: the given tensor_split as is, else rpcfleet's split, which
    must rest on measured memory and fit."""
    try:
        profile = profile_model(model)
    except ModelError as exc:
        raise LoaderError(f"cannot load {model}: {exc.message}") from None
    labels = [d.label for d in devices]
    if options.tensor_split is not None and len(options.tensor_split) != len(devices):
        raise PlanError(
            f"tensor_split has {len(options.tensor_split)} value(s) for {len(devices)} selected device(s): "
            f"{', '.join(labels) or 'none'}",
            hint="one value per device: all devices of each rpc_servers endpoint, then the local GPUs",
        )
    if not devices:
        options = replace(options, n_gpu_layers=0)  # nothing selected: every layer stays on the CPU
    if options.tensor_split is None:
        refuse_unmeasured([label for label in unmeasured if label in labels], causes)
    plan = make_plan(devices, profile, options)
    misfit = misfit_error(plan, DROPIN_WORDS) if options.tensor_split is None else None
    if misfit is not None:  # before llama.cpp would run out of memory half-way through the load
        raise misfit
    return plan


class Llama(llama_cpp.Llama):
    """`llama_cpp.Llama` plus the drop-in API's `rpc_servers`, `rpc_local_devices`, `mmproj_path` and
    `chat_handler_kwargs`, and rpcfleet's `rpc_memory` (usable bytes per device of an endpoint, for CPU
    servers this machine cannot measure), `trust_rpc_memory` and `rpc_timeout` (seconds per probe)."""

    rpcfleet_plan: Plan | None = None

    def __init__(
        self,
        model_path: str,
        *,
        rpc_servers: str | Iterable[str] | None = None,
        rpc_local_devices: Sequence[str] | None = None,
        rpc_memory: Mapping[str, int | str] | None = None,
        trust_rpc_memory: bool = False,
        rpc_timeout: float = 2.0,
        mmproj_path: str | os.PathLike[str] | None = None,
        chat_handler_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        os.environ.setdefault("GGML_NO_BACKTRACE", "1")
        for key, value in engine_environment().items():  # the client reads hashes from manifests
            os.environ.setdefault(key, value)
        _check_keywords(kwargs)
        endpoints = parse_rpc_servers(rpc_servers)
        memory = parse_rpc_memory(rpc_memory)
        if rpc_local_devices is not None and isinstance(rpc_local_devices, str):
            raise TypeError("rpc_local_devices takes a list of names, e.g. ['CUDA0']")
        if not endpoints and rpc_local_devices is None and mmproj_path is None and not chat_handler_kwargs:
            super().__init__(model_path, **kwargs)  # nothing of the drop-in API's: the stock class
            return
        split_mode = int(kwargs.pop("split_mode", LLAMA_SPLIT_MODE_LAYER))
        if split_mode == LLAMA_SPLIT_MODE_ROW:
            raise PlanError(
                "row split mode is not supported with RPC (llama.cpp: 'does not support split buffers')",
                hint="use LLAMA_SPLIT_MODE_LAYER (the default) or LLAMA_SPLIT_MODE_NONE",
            )
        if split_mode not in (LLAMA_SPLIT_MODE_LAYER, LLAMA_SPLIT_MODE_NONE):
            raise PlanError(f"unknown split_mode {split_mode}")
        n_gpu_layers = int(kwargs.pop("n_gpu_layers", 0))
        if endpoints and n_gpu_layers == 0:
            raise LoaderError(
                "n_gpu_layers=0 (the default) keeps every layer on this machine: the rpc_servers would get "
                "nothing",
                hint="pass n_gpu_layers=-1 to offload every layer",
            )
        main_gpu = int(kwargs.pop("main_gpu", 0))
        tensor_split = kwargs.pop("tensor_split", None)
        if split_mode == LLAMA_SPLIT_MODE_NONE and tensor_split is not None:
            raise PlanError(
                "tensor_split has no effect with LLAMA_SPLIT_MODE_NONE (main_gpu takes everything)"
            )
        options = _plan_options(kwargs, n_gpu_layers, tensor_split)
        verbose = bool(kwargs.pop("verbose", True))
        parent_init = super().__init__

        def construct(path: str, **params: Any) -> Llama:
            parent_init(path, **params)
            return self

        with _native_module.LOCK:
            check_endpoint_limit(endpoints)
            results = probe_for_load(endpoints, connect_timeout=rpc_timeout, read_timeout=rpc_timeout)
            native = _native_module.get_native()  # loads ggml's dynamic backends, if any, first
            register_endpoints({ep: len(r.devices) for ep, r in results.items()})
            registered = _native_module.registered_endpoints()
            alignments = {
                (ep, i): native.alignment(dev)
                for ep in endpoints
                for i, dev in enumerate(registered[ep].devices)
            }
            reads = endpoint_facts(endpoints)
            measured = measured_devices(
                results,
                {ep: read.facts for ep, read in reads.items()},
                alignments=alignments,
                rpc_memory=memory,
                trust_rpc_memory=trust_rpc_memory,
            )
            selected = _select_devices(measured.devices, rpc_local_devices, split_mode, main_gpu)
            if split_mode == LLAMA_SPLIT_MODE_NONE:
                options = replace(options, main_gpu=0)  # the one device left
            plan = make_dropin_plan(
                selected, measured.unmeasured, Path(model_path), options, unmeasured_causes(reads)
            )
            load_registered(
                plan,
                Path(model_path),
                construct,
                verbose=verbose,
                llama_kwargs=kwargs,
                mmproj=None if mmproj_path is None else Path(mmproj_path),
                handler_kwargs=chat_handler_kwargs,
                split_mode=split_mode,
            )

    def close(self) -> None:
        if hasattr(self, "_stack"):  # a constructor refused before the model existed
            super().close()
