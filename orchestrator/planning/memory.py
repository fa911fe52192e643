"""What each device will hold: weights, KV cache and compute buffers, and validation."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.core.errors import PlanError
from orchestrator.planning.architectures import family_compute
from orchestrator.planning.placement import pad
from orchestrator.planning.plan import (
    MAX_DEVICES,
    MAX_RPC_DEVICES,
    SCHED_MAX_COPIES,
    HostMemory,
    PlanDevice,
    PlannedMemory,
    PlanOptions,
)
from orchestrator.planning.profile import KV_CACHE_TYPES, ModelProfile, row_bytes


def kv_layer_bytes(
    profile: ModelProfile, il: int, n_ctx_pad: int, opts: PlanOptions, alignment: int, n_seq: int = 1
) -> int:
    """K and V cache tensors of layer `il` (each padded to the buffer alignment), plus its recurrent
    state for `n_seq` sequences (planning/architectures.py: MLA has no V, recurrent layers no KV)."""
    rules = profile.rules
    state = rules.state_bytes(il, n_seq, alignment)
    if profile.n_head_kv[il] == 0 or not rules.has_kv(il):
        return state
    n_v = profile.n_embd_v_gqa_max() if not opts.flash_attn else profile.n_embd_v_gqa(il)
    k = row_bytes(opts.type_k, profile.n_embd_k_gqa(il)) * n_ctx_pad
    v = 0 if rules.mla else row_bytes(opts.type_v, n_v) * n_ctx_pad
    return pad(k, alignment) + pad(v, alignment) + state


def estimate_compute(
    profile: ModelProfile,
    layers: Sequence[int],
    n_ctx_pad: int,
    opts: PlanOptions,
    *,
    pipeline_parallel: bool,
) -> int:
    """Estimated compute buffer of a device holding `layers` (llama.cpp's worst-case pp graph).

    Verified families use `architectures.family_compute`; what follows is the generic estimate an
    architecture the planner does not know gets (its plans say `unverified`).

    The graph is reserved for n_tokens = min(n_ctx, n_ubatch) tokens against a full KV cache (n_kv =
    n_ctx_pad). ggml-alloc reuses memory, so the buffer is about the inputs plus the largest live set:
    - inputs copied onto the device: the KQ mask (n_kv × n_tokens, f32; f16 with flash attention) and
      the incoming hidden state (n_embd × n_tokens f32); with pipeline parallelism measured as 5 times
      that (GGML_SCHED_MAX_COPIES = 4 copies on top of the graph's own);
    - attention without flash attention: the KQ matrix n_head × n_kv × n_tokens f32 (soft_max in place)
      plus residual, Q, K, V and output rows; with flash attention only the rows;
    - feed-forward: 6 hidden-state rows + gate and up (n_ff wide);
    - the output layer: logits n_vocab × n_tokens f32 plus the normed hidden state.
    Calibrated against llama.cpp 0.3.36 over loopback RPC (n_embd 256-512, n_ctx 1024-4096, ubatch 512,
    f16/q8_0, with and without flash attention, one and two devices): within -3 %/+25 % of the logged
    `compute buffer size` (e.g. 79 vs 78.0 MiB, 19 vs 19.0 MiB with flash attention, 115 vs 112.0 MiB
    per device on two devices). The margin absorbs the rest.
    """
    if not layers:
        return 0
    if profile.rules.verified:  # the families compared with llama.cpp: planning/architectures.py
        copies = SCHED_MAX_COPIES if pipeline_parallel else 1
        return family_compute(profile, layers, n_ctx_pad, opts, copies=copies)
    n_tok = min(n_ctx_pad, opts.n_ubatch)
    f32 = 4
    mask = n_ctx_pad * n_tok * (2 if opts.flash_attn else 4)
    hidden = profile.n_embd * n_tok * f32
    inputs = (mask + hidden) * (SCHED_MAX_COPIES + 1 if pipeline_parallel else 1)
    repeating = [il for il in layers if il < profile.n_layer]
    peak = 0
    if repeating:
        n_head = max(profile.n_head[il] for il in repeating)
        n_kv_max = max(profile.n_embd_k_gqa(il) + profile.n_embd_v_gqa(il) for il in repeating)
        q = n_head * profile.head_dim_k * n_tok * f32
        rows = 2 * hidden + q + n_kv_max * n_tok * f32 + n_head * profile.head_dim_v * n_tok * f32
        kq = 0 if opts.flash_attn else n_head * n_ctx_pad * n_tok * f32
        n_ff = _n_ff(profile)
        ffn = 6 * hidden + 2 * n_ff * n_tok * f32
        peak = max(rows + kq, ffn)
    if profile.n_layer in layers:
        peak = max(peak, profile.n_vocab * n_tok * f32 + 2 * hidden)
    return inputs + peak


def _n_ff(profile: ModelProfile) -> int:
    widest = 0
    for t in profile.tensors:
        if t.name.endswith(".ffn_up.weight") and len(t.shape) >= 2:
            widest = max(widest, t.shape[1])
    return widest or 4 * profile.n_embd


def _host_compute(
    profile: ModelProfile, n_ctx_pad: int, opts: PlanOptions, cpu_layers: Sequence[int], pipeline: bool
) -> int:
    # Inputs live on the CPU first (token ids, positions, the mask) and the embeddings lookup runs there;
    # measured: (mask + hidden) per copy plus about 3 hidden-state rows.
    n_tok = min(n_ctx_pad, opts.n_ubatch)
    mask = n_ctx_pad * n_tok * (2 if opts.flash_attn else 4)
    hidden = profile.n_embd * n_tok * 4
    base = (mask + hidden) * (SCHED_MAX_COPIES + 1 if pipeline else 1) + 3 * hidden
    if cpu_layers:
        base += estimate_compute(profile, cpu_layers, n_ctx_pad, opts, pipeline_parallel=False)
    return base


@dataclass(frozen=True)
class _Prediction:
    memories: tuple[PlannedMemory, ...]
    host: HostMemory
    pipeline_parallel: bool


def predict(
    profile: ModelProfile,
    devices: Sequence[PlanDevice],
    assignment: Sequence[int | None],
    n_ctx_pad: int,
    opts: PlanOptions,
    ngl: int,
) -> _Prediction:
    n_all = profile.n_layer
    pipeline_parallel = len(devices) > 1 and ngl > n_all and opts.split_mode == "layer"
    per_dev: list[list[int]] = [[] for _ in devices]
    cpu_layers: list[int] = []
    for il, where in enumerate(assignment):
        (cpu_layers if where is None else per_dev[where]).append(il)
    memories = []
    for dev, layers in zip(devices, per_dev, strict=True):
        weights = sum(profile.layer_bytes_aligned(il, dev.alignment) for il in layers if il < n_all)
        if n_all in layers:
            weights += profile.output_layer_bytes_aligned(dev.alignment)
        kv = sum(kv_layer_bytes(profile, il, n_ctx_pad, opts, dev.alignment) for il in layers if il < n_all)
        compute = estimate_compute(profile, layers, n_ctx_pad, opts, pipeline_parallel=pipeline_parallel)
        memories.append(PlannedMemory(weights, kv, compute, dev.usable, opts.margin))
    host_weights = profile.token_embd_bytes + profile.other_bytes - profile.rope_freqs_bytes
    host_weights += sum(profile.layer_bytes_aligned(il) for il in cpu_layers if il < n_all)
    if n_all in cpu_layers:
        host_weights += profile.output_layer_bytes_aligned() - (
            profile.token_embd_bytes if profile.output_tied else 0
        )
    host_kv = sum(kv_layer_bytes(profile, il, n_ctx_pad, opts, 32) for il in cpu_layers if il < n_all)
    host = HostMemory(
        weights=host_weights,
        kv=host_kv,
        compute=_host_compute(profile, n_ctx_pad, opts, cpu_layers, pipeline_parallel),
        output=profile.n_vocab * opts.n_batch * 4,
    )
    return _Prediction(tuple(memories), host, pipeline_parallel)


def validate(devices: Sequence[PlanDevice], profile: ModelProfile, opts: PlanOptions) -> None:
    """Refuse inputs llama.cpp would refuse (or abort on) with a clear PlanError."""
    if opts.split_mode == "row":
        raise PlanError(
            "split mode 'row' is not supported with RPC devices "
            "(llama.cpp: 'does not support split buffers')",
            hint="use split_mode 'layer'",
        )
    if opts.split_mode != "layer":
        raise PlanError(f"unknown split mode {opts.split_mode!r}; rpcfleet plans use 'layer'")
    if opts.strategy not in ("proportional", "fewest"):
        raise PlanError(f"unknown strategy {opts.strategy!r}; expected 'proportional' or 'fewest'")
    for kind, value in (("type_k", opts.type_k), ("type_v", opts.type_v)):
        if value not in KV_CACHE_TYPES:
            raise PlanError(f"unknown KV cache {kind} {value!r}; expected one of {', '.join(KV_CACHE_TYPES)}")
    if opts.type_v not in ("f32", "f16", "bf16") and not opts.flash_attn:
        raise PlanError(
            f"a quantized V cache ({opts.type_v}) requires flash attention (llama.cpp refuses it otherwise)"
        )
    if opts.n_ctx < 0 or opts.n_ubatch <= 0 or opts.n_batch <= 0:
        raise PlanError("n_ctx must be >= 0 and n_ubatch, n_batch > 0")
    if opts.margin < 0:
        raise PlanError("margin cannot be negative")
    if not devices and opts.n_gpu_layers != 0:
        raise PlanError(
            "no devices to offload to", hint="add RPC hosts or local GPUs, or set n_gpu_layers to 0"
        )
    if len(devices) > MAX_DEVICES:
        raise PlanError(f"{len(devices)} devices: llama.cpp takes at most {MAX_DEVICES} tensor_split entries")
    n_rpc = sum(1 for d in devices if d.is_rpc)
    if n_rpc > MAX_RPC_DEVICES:
        raise PlanError(
            f"{n_rpc} RPC devices: the scheduler takes at most {MAX_RPC_DEVICES} "
            "(16 backends including the CPU)"
        )
    seen: set[tuple[str | None, int | str]] = set()
    for d in devices:
        key: tuple[str | None, int | str] = (d.endpoint, d.index) if d.is_rpc else (None, d.name)
        if key in seen:
            raise PlanError(f"device {d.label} appears twice (duplicate endpoint)")
        seen.add(key)
        if not d.ok or d.state != "ok":
            raise PlanError(
                f"device {d.label} is not usable: {d.state}",
                host=d.host,
                hint="probe the fleet and fix or exclude this host",
            )
        if d.usable < 0 or d.alignment <= 0:
            raise PlanError(f"device {d.label}: usable bytes and alignment must be positive")
    # Endpoints must be contiguous: all devices of one server, then the next (registration order).
    endpoints = [d.endpoint for d in devices if d.is_rpc]
    for i in range(1, len(endpoints)):
        if endpoints[i] != endpoints[i - 1] and endpoints[i] in endpoints[:i]:
            raise PlanError(f"endpoint {endpoints[i]} appears twice in the device list (duplicate endpoint)")
    if devices and not 0 <= opts.main_gpu < len(devices):
        raise PlanError(f"main_gpu {opts.main_gpu} is out of range (0..{len(devices) - 1})")
    if opts.tensor_split is not None:
        if len(opts.tensor_split) != len(devices):
            raise PlanError(
                f"tensor_split has {len(opts.tensor_split)} values for {len(devices)} devices "
                "(one value per device is required)"
            )
        if any(x < 0 or not math.isfinite(x) for x in opts.tensor_split):
            raise PlanError("tensor_split values must be finite and non-negative")
        if devices and opts.n_gpu_layers != 0 and not any(x > 0 for x in opts.tensor_split):
            raise PlanError("tensor_split is all zeros; give at least one device a share")
