"""What each device will hold: weights, KV cache and compute buffers, and validation."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.core.errors import PlanError
from orchestrator.core.units import format_size
from orchestrator.planning.architectures import attention_input_bytes, family_compute, unverified_note
from orchestrator.planning.layer_assignment import pad
from orchestrator.planning.plan import (
    CTX_PAD,
    MAX_DEVICES,
    MAX_RPC_DEVICES,
    SCHED_MAX_COPIES,
    HostMemory,
    PlanDevice,
    PlannedMemory,
    PlanOptions,
)
from orchestrator.planning.profile import KV_CACHE_TYPES, ModelProfile, row_bytes
from orchestrator.planning.settings import MAX_SEQ, STRATEGIES


def context_size(n_ctx: int, opts: PlanOptions) -> int:
    """The n_ctx llama.cpp runs with (llama-context.cpp): padded to 256; with several sequences and no
    unified KV, each sequence gets GGML_PAD(n_ctx / n_seq, 256) cells and n_ctx becomes n_seq times that."""
    n_ctx = pad(n_ctx, CTX_PAD)
    if opts.kv_unified or opts.parallel <= 1:
        return n_ctx
    return pad(n_ctx // opts.parallel, CTX_PAD) * opts.parallel


def kv_streams(opts: PlanOptions) -> int:
    """KV streams (llama-kv-cache.cpp n_stream): one per sequence unless unified."""
    return 1 if opts.kv_unified else max(opts.parallel, 1)


def kv_cells(profile: ModelProfile, il: int, n_ctx: int, opts: PlanOptions) -> int:
    """Cells of layer `il`'s cache per stream (the attention's n_kv when the graph is reserved).

    Full layers: n_ctx_seq = n_ctx / n_stream. Sliding-window layers (llama-kv-cache-iswa.cpp), unless
    swa_full: GGML_PAD(min(n_ctx_seq, n_swa * (unified ? n_seq : 1) + n_ubatch), 256)."""
    n_ctx = context_size(n_ctx, opts)
    size = n_ctx // kv_streams(opts)
    if profile.is_swa(il) and not opts.swa_full:
        n_ubatch = min(opts.n_ubatch, opts.n_batch)  # cparams.n_ubatch
        window = profile.n_swa * (opts.parallel if opts.kv_unified else 1) + n_ubatch
        size = pad(min(size, window), CTX_PAD)
    return size


def kv_layer_bytes(profile: ModelProfile, il: int, n_ctx: int, opts: PlanOptions, alignment: int) -> int:
    """K and V cache tensors of layer `il` (each [row, cells, streams], padded to the buffer alignment;
    without flash attention V rows use the widest layer's width: v_trans), plus its recurrent state for
    the --parallel sequences (planning/architectures.py: MLA has no V, recurrent layers no KV)."""
    rules = profile.rules
    # llama-model.cpp create_memory: the recurrent memory has max(1, n_seq_max) rows, unified or not
    state = rules.state_bytes(il, opts.parallel, alignment)
    if profile.n_head_kv[il] == 0 or not rules.has_kv(il):
        return state
    cells = kv_cells(profile, il, n_ctx, opts) * kv_streams(opts)
    n_v = profile.n_embd_v_gqa_max() if not opts.flash_attn else profile.n_embd_v_gqa(il)
    k = row_bytes(opts.type_k, profile.n_embd_k_gqa(il)) * cells
    v = 0 if rules.mla else row_bytes(opts.type_v, n_v) * cells
    return pad(k, alignment) + pad(v, alignment) + state


def attention_layers(profile: ModelProfile, layers: Sequence[int]) -> list[int]:
    """The repeating layers among `layers` with an attention KV cache of their own."""
    rules = profile.rules
    return [il for il in layers if il < profile.n_layer and profile.n_head_kv[il] > 0 and rules.has_kv(il)]


def attention_inputs(profile: ModelProfile, layers: Sequence[int], n_ctx: int, opts: PlanOptions) -> int:
    """Bytes of one copy of the attention inputs `layers` read (architectures.attention_input_bytes)."""
    attn = attention_layers(profile, layers)
    caches = cache_cells(profile, attn, n_ctx, opts)
    return attention_input_bytes(profile, attn, caches, n_tokens(n_ctx, opts), opts)


def cache_cells(profile: ModelProfile, attn: Sequence[int], n_ctx: int, opts: PlanOptions) -> dict[bool, int]:
    """The KV caches the attention layers `attn` use: is_swa -> cells per stream (computed once per
    cache: the planner calls this for every trial split)."""
    out: dict[bool, int] = {}
    for il in attn:
        swa = profile.is_swa(il)
        if swa not in out:
            out[swa] = kv_cells(profile, il, n_ctx, opts)
    return out


def n_tokens(n_ctx: int, opts: PlanOptions) -> int:
    """Tokens of the worst-case graph llama.cpp reserves: min(n_ctx, n_ubatch) (llama-context.cpp
    sched_reserve), n_ubatch capped at n_batch."""
    return min(context_size(n_ctx, opts), opts.n_ubatch, opts.n_batch)


def estimate_compute(
    profile: ModelProfile,
    layers: Sequence[int],
    n_ctx: int,
    opts: PlanOptions,
    *,
    pipeline_parallel: bool,
) -> int:
    """Estimated compute buffer of a device holding `layers` (llama.cpp's worst-case pp graph): the one
    compute model, `architectures.family_compute`, against the caches as this plan sizes them (each
    attention layer's n_kv = its cache's cells per stream, `kv_cells`: the sliding-window layers' are
    small unless swa_full; n_ctx / n_seq per stream without --kv-unified). An architecture the planner
    does not know gets the same model with its generic rules, and its plans say `unverified`."""
    if not layers:
        return 0
    caches = cache_cells(profile, attention_layers(profile, layers), n_ctx, opts)
    copies = SCHED_MAX_COPIES if pipeline_parallel else 1
    return family_compute(profile, layers, opts, n_tokens=n_tokens(n_ctx, opts), caches=caches, copies=copies)


def host_compute(
    profile: ModelProfile, n_ctx: int, opts: PlanOptions, cpu_layers: Sequence[int], pipeline: bool
) -> int:
    """The CPU's compute buffer: the inputs are built there (every cache's mask and v_idxs, the hidden
    state after the embeddings lookup), one set per copy, plus a hidden-state row; or, with layers kept
    on the CPU, their graph."""
    n_tok = n_tokens(n_ctx, opts)
    hidden = profile.n_embd * n_tok * 4
    copies = SCHED_MAX_COPIES if pipeline else 1
    if cpu_layers:
        # No pipeline parallelism with layers on the CPU: its inputs are graph tensors of its own layers'
        # graph (measured: that graph's estimate plus about 2 hidden-state rows)
        return estimate_compute(profile, cpu_layers, n_ctx, opts, pipeline_parallel=False) + 2 * hidden
    inputs = attention_inputs(profile, range(profile.n_layer), n_ctx, opts)
    return copies * (inputs + hidden) + hidden


def cpu_experts_compute(profile: ModelProfile, n_tok: int) -> int:
    """What the CPU's compute buffer gains when it runs the experts of --n-cpu-moe's layers (their
    mul_mat_id ops go where their weights are): the hidden state coming in, one n_expert_used x expert
    width product, and the router's probabilities, chosen experts and their weights. Once, whatever N:
    ggml-alloc reuses it layer after layer. Measured on the synthetic qwen3moe
    (tests/planning/test_moe.py)."""
    rules = profile.rules
    k = rules.n_expert_used
    return (profile.n_embd + k * rules.n_ff_exp + rules.n_expert + 2 * k) * n_tok * 4


def output_buffer(profile: ModelProfile, opts: PlanOptions) -> int:
    """The host's output buffer (llama-context.cpp output_reserve(n_seq_max)): logits for one output per
    sequence, n_vocab floats each; llama.cpp grows it only when a batch asks for more outputs."""
    return profile.n_vocab * max(opts.parallel, 1) * 4


def kv_per_token(profile: ModelProfile, type_k: str = "f16", type_v: str = "f16") -> tuple[int, int]:
    """K + V bytes of one token (cell) over all layers: (full-attention layers, sliding-window layers)."""
    full = swa = 0
    for il in range(profile.n_layer):
        n = profile.kv_bytes_per_token(il, type_k, type_v)
        if profile.is_swa(il):
            swa += n
        else:
            full += n
    return full, swa


def architecture_info(profile: ModelProfile, type_k: str = "f16", type_v: str = "f16") -> dict[str, Any]:
    """The architecture as the planner models it (`model info --json`, the report): plain data. The
    family's rules (planning/architectures.py) and its sliding window and KV per token."""
    full, swa = kv_per_token(profile, type_k, type_v)
    rules = profile.rules
    recurrent = [il for il in range(profile.n_layer) if rules.is_recurrent(il)]
    return {
        "family": rules.family,
        "verified": rules.verified,
        "unverified_note": unverified_note(rules),
        "mla": rules.mla,
        "experts": rules.n_expert,
        "experts_used": rules.n_expert_used,
        "expert_ff": rules.n_ff_exp,
        "recurrent_layers": recurrent,
        "state_bytes_per_sequence": sum(rules.state_bytes_per_seq(il) for il in recurrent),
        "sliding_window": profile.n_swa,
        "swa_layers": list(profile.swa_layer_ids),
        "kv_bytes_per_token_full": full,
        "kv_bytes_per_token_swa": swa,
    }


def architecture_rows(
    profile: ModelProfile, type_k: str = "f16", type_v: str = "f16"
) -> list[tuple[str, str]]:
    """(label, value) rows `model info` prints about the architecture, from `architecture_info`."""
    data = architecture_info(profile, type_k, type_v)
    full, swa = data["kv_bytes_per_token_full"], data["kv_bytes_per_token_swa"]
    kv = f"{type_k}/{type_v}"
    family = data["family"]
    rows = [("family", family if data["verified"] else f"{family} (unverified)")]
    if data["mla"]:
        rows.append(("attention", "MLA: a K cache only (kv_lora_rank + rope wide), no V"))
    if data["experts"]:
        rows.append(
            ("experts", f"{data['experts']}, {data['experts_used']} used per token, {data['expert_ff']} wide")
        )
    if data["recurrent_layers"]:
        n = len(data["recurrent_layers"])
        state = format_size(data["state_bytes_per_sequence"])
        rows.append(("recurrent state", f"{state} per sequence ({n} recurrent layers, f32)"))
    slide = profile.swa_layer_ids
    if not slide:
        rows.append(("KV per token", f"{format_size(full)} ({kv}, all layers)"))
    else:
        full_layers = [il for il in range(profile.n_layer) if not profile.is_swa(il)]
        cells = kv_cells(profile, slide[0], profile.n_ctx_train, PlanOptions(n_ctx=profile.n_ctx_train))
        rows += [
            ("sliding window", f"{profile.n_swa} tokens on {len(slide)} of {profile.n_layer} layers"),
            ("full attention", f"layers {_ranges(full_layers)}" if full_layers else "none"),
            ("KV per token", f"{format_size(full)} full layers + {format_size(swa)} sliding layers ({kv})"),
            ("SWA cache", f"{cells} cells per sequence (n_ubatch 512), or n_ctx with --swa-full"),
        ]
    if data["unverified_note"]:
        rows.append(("note", data["unverified_note"]))
    return rows


def _ranges(ids: Sequence[int]) -> str:
    return ", ".join(str(i) for i in ids)


@dataclass(frozen=True)
class Prediction:
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
) -> Prediction:
    n_all = profile.n_layer
    # llama-context.cpp: no pipeline parallelism when the model has tensor overrides (--n-cpu-moe's)
    pipeline_parallel = len(devices) > 1 and ngl > n_all and opts.split_mode == "layer" and not opts.n_cpu_moe
    on_cpu = range(min(opts.n_cpu_moe, n_all))  # layers whose experts stay on the CPU
    per_dev: list[list[int]] = [[] for _ in devices]
    cpu_layers: list[int] = []
    for il, where in enumerate(assignment):
        (cpu_layers if where is None else per_dev[where]).append(il)
    memories = []
    for dev, layers in zip(devices, per_dev, strict=True):
        weights = sum(profile.layer_bytes_aligned(il, dev.alignment) for il in layers if il < n_all)
        weights -= sum(profile.expert_bytes_aligned(il, dev.alignment) for il in layers if il in on_cpu)
        if n_all in layers:
            weights += profile.output_layer_bytes_aligned(dev.alignment)
        kv = sum(kv_layer_bytes(profile, il, n_ctx_pad, opts, dev.alignment) for il in layers if il < n_all)
        compute = estimate_compute(profile, layers, n_ctx_pad, opts, pipeline_parallel=pipeline_parallel)
        memories.append(PlannedMemory(weights, kv, compute, dev.usable, opts.margin))
    host_weights = profile.token_embd_bytes + profile.other_bytes - profile.rope_freqs_bytes
    host_weights += sum(profile.layer_bytes_aligned(il) for il in cpu_layers if il < n_all)
    host_weights += sum(profile.expert_bytes_aligned(il) for il in on_cpu if il not in cpu_layers)
    if n_all in cpu_layers:
        host_weights += profile.output_layer_bytes_aligned() - (
            profile.token_embd_bytes if profile.output_tied else 0
        )
    host_kv = sum(kv_layer_bytes(profile, il, n_ctx_pad, opts, 32) for il in cpu_layers if il < n_all)
    compute = host_compute(profile, n_ctx_pad, opts, cpu_layers, pipeline_parallel)
    if any(profile.expert_bytes_aligned(il) for il in on_cpu if il not in cpu_layers):
        compute += cpu_experts_compute(profile, n_tokens(n_ctx_pad, opts))
    host = HostMemory(
        weights=host_weights,
        kv=host_kv,
        compute=compute,
        output=output_buffer(profile, opts),
    )
    return Prediction(tuple(memories), host, pipeline_parallel)


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
    if opts.strategy not in STRATEGIES:
        raise PlanError(f"unknown strategy {opts.strategy!r}; expected {' or '.join(map(repr, STRATEGIES))}")
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
    if not 1 <= opts.parallel <= MAX_SEQ:
        raise PlanError(f"parallel must be 1..{MAX_SEQ} (llama.cpp's LLAMA_MAX_SEQ), got {opts.parallel}")
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


# cuBLAS's default workspace for one handle (cuBLAS docs, "cuBLAS workspace"): 32 MiB on Hopper (compute
# capability 9.0) and newer, 4 MiB before; ggml-cuda keeps one handle per device.
CUBLAS_WORKSPACE = {True: 32 << 20, False: 4 << 20}
CUDA_POOL_LOOKAHEAD = 1.05  # ggml_cuda_pool_leg allocates 5% more than asked, to reuse the buffer


def cuda_runtime_bytes(profile: ModelProfile, opts: PlanOptions, compute_major: int = 9) -> int:
    """What a CUDA server allocates for a model beyond its ggml buffers (weights, KV, compute), from the
    model alone: cuBLAS's workspace and ggml-cuda's memory pool (the legacy one: the artifact is built with
    GGML_CUDA_NO_VMM), which holds a GEMM's operands converted to f16, the activations (K x ub) and the
    result (N x ub), for the widest f16/bf16 weight matrix of the layers at -ub rows. The CUDA context is
    not in it: the server holds its context from its start, before any load. Unverified on a GPU until
    bench/gpu.py has run on one (docs/gpu.md)."""
    widest = max(
        (t.shape[0] + t.shape[1] for t in profile.tensors
         if t.name.startswith("blk.") and len(t.shape) == 2 and t.type_name.upper() in ("F16", "BF16")),
        default=0,
    )  # fmt: skip
    pool = math.ceil(CUDA_POOL_LOOKAHEAD * widest * opts.n_ubatch * 2)
    return CUBLAS_WORKSPACE[compute_major >= 9] + pool
