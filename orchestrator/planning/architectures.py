"""Per-architecture memory rules, as llama.cpp 0.3.36 allocates them (pure; read from GGUF metadata).

What differs between families and changes the bytes a device holds:
- MLA (DeepSeek-V2/V3, Kimi K2): the KV cache holds K only, `kv_lora_rank + rope` wide; no V
  (llama-kv-cache.cpp: `has_v = !is_mla`, with `is_mla()` = both `*_length_mla` keys set).
- Recurrent and hybrid (Mamba, RWKV, Granite 4 H, Jamba...): per recurrent layer and sequence an r and an
  s state of f32 rows (llama-memory-recurrent.cpp: `n_embd_r()` and `n_embd_s()` by
  `max(1, n_seq_max)` rows, each tensor in an "RS buffer"); attention KV only on the other layers.
- Shared KV (gemma3n, gemma4): the layers from `n_layer_kv_from_start` on reuse earlier layers' cache
  (llama-hparams.cpp `has_kv`).
- MoE: the expert FFN's compute (experts used, expert width).

Architectures outside `VERIFIED` are planned with the generic rules and reported `unverified`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # profile.py imports this module
    from orchestrator.planning.plan import PlanOptions
    from orchestrator.planning.profile import ModelProfile

# Families whose plans were compared with real allocations (tests/planning/test_families.py,
# tests/planning/test_gemma.py).
VERIFIED = frozenset(
    {"llama", "qwen3", "qwen3moe", "gemma3", "gpt-oss", "deepseek2", "granitehybrid", "mamba2"}
)

# Families whose plans were compared with real allocations on devices of a GPU backend
# (tests/planning/test_vulkan.py, on Mesa's llvmpipe). The recurrent families do not run there:
# ggml-vulkan has no ssm_scan pipeline for that device (GGML_ASSERT(pipeline != nullptr)).
VERIFIED_ON: Mapping[str, frozenset[str]] = {
    "cpu": VERIFIED,
    "vulkan": frozenset({"llama", "qwen3", "qwen3moe", "gemma3", "gpt-oss", "deepseek2"}),
}

# llama-arch.cpp llm_arch_is_recurrent: every layer recurrent, no attention.
RECURRENT = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})

# llm_arch_is_hybrid: recurrent and attention layers.
HYBRID = frozenset(
    {
        "jamba",
        "falcon-h1",
        "plamo2",
        "granitehybrid",
        "lfm2",
        "lfm2moe",
        "nemotron_h",
        "nemotron_h_moe",
        "qwen3next",
        "kimi-linear",
        "bailingmoe3",
        "kimi-k3",
        "glm5-next",
        "qwen35",
        "qwen35moe",
        "qwen4exp",
        "deepseek4",
        "minimax-01",
    }
)

STATE_TYPE_BYTES = 4  # recurrent r and s states are GGML_TYPE_F32 (llama-model.cpp create_memory)


@dataclass(frozen=True)
class ArchRules:
    """What the planner needs to know beyond a llama: experts, MLA, recurrent state, shared KV."""

    architecture: str = "llama"
    verified: bool = True
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0  # one expert's FFN width
    n_expert_shared: int = 0
    mla: bool = False  # K-only cache
    recurrent: tuple[bool, ...] = ()  # per layer (empty: none)
    attention: tuple[bool, ...] = ()  # per layer: holds an attention KV cache (empty: all)
    n_embd_r: int = 0  # recurrent conv/shift state per sequence, elements
    n_embd_s: int = 0  # recurrent SSM/WKV state per sequence, elements
    ssm_in: int = 0  # width of a recurrent layer's input projection (ssm_in), elements
    ssm_inner: int = 0  # d_inner of a Mamba-style recurrent layer

    @property
    def special(self) -> bool:
        """Whether the family's compute differs from a dense transformer's (experts, MLA, recurrence)."""
        return bool(self.n_expert or self.mla or any(self.recurrent))

    @property
    def family(self) -> str:
        """A short description: `dense`, `MoE`, `MLA + MoE`, `recurrent`, `hybrid` ..."""
        parts = []
        if any(self.recurrent):
            parts.append("recurrent" if all(self.recurrent) else "hybrid (recurrent + attention)")
        if self.mla:
            parts.append("MLA")
        if self.n_expert:
            parts.append("MoE")
        return " + ".join(parts) or "dense"

    @property
    def hybrid(self) -> bool:
        """Recurrent and attention layers (Granite 4 H, Jamba...), each followed by an FFN."""
        return any(self.recurrent) and not all(self.recurrent)

    def is_recurrent(self, il: int) -> bool:
        return bool(self.recurrent) and self.recurrent[il]

    def has_kv(self, il: int) -> bool:
        """Whether layer `il` has an attention KV cache of its own."""
        return not self.attention or self.attention[il]

    def state_bytes_per_seq(self, il: int) -> int:
        """Recurrent r + s state of layer `il` for one sequence (0 on attention layers)."""
        if not self.is_recurrent(il):
            return 0
        return (self.n_embd_r + self.n_embd_s) * STATE_TYPE_BYTES

    def state_bytes(self, il: int, n_seq: int, alignment: int) -> int:
        """The r and s tensors of layer `il` in its RS buffer: `max(1, n_seq)` rows each
        (llama-memory-recurrent.cpp; n_rs_seq is 0 by default), each tensor padded to the alignment."""
        if not self.is_recurrent(il):
            return 0
        rows = max(1, n_seq)
        r = self.n_embd_r * STATE_TYPE_BYTES * rows
        s = self.n_embd_s * STATE_TYPE_BYTES * rows
        return _pad(r, alignment) + _pad(s, alignment)


GENERIC = ArchRules()


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment if alignment > 1 else n


def _int(meta: Mapping[str, Any], key: str, default: int = 0) -> int:
    value = meta.get(key, default)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _max_int(meta: Mapping[str, Any], key: str) -> int:
    value = meta.get(key, 0)
    if isinstance(value, list):
        return max((int(v) for v in value), default=0)
    return _int(meta, key)


def _state_sizes(meta: Mapping[str, Any], arch: str, n_embd: int, n_head: int) -> tuple[int, int]:
    """llama-hparams.cpp n_embd_r() and n_embd_s(): RWKV, LFM2 short convolutions, Mamba (1 and 2)."""
    a = arch + "."
    wkv = _int(meta, a + "wkv.head_size")
    if wkv:
        return _int(meta, a + "token_shift_count", 2) * n_embd, n_embd * wkv
    l_cache = _int(meta, a + "shortconv.l_cache")
    d_conv = _int(meta, a + "ssm.conv_kernel")
    d_inner = _int(meta, a + "ssm.inner_size")
    d_state = _int(meta, a + "ssm.state_size")
    n_group = _int(meta, a + "ssm.group_count")
    r = n_embd * (l_cache - 1) if l_cache else max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state)
    return r, d_state * d_inner


def arch_rules(
    meta: Mapping[str, Any], arch: str, n_layer: int, n_embd: int, n_head: int, n_head_kv: tuple[int, ...]
) -> ArchRules:
    """The rules of `arch` from a GGUF's metadata (n_head and n_head_kv as the profile read them)."""
    a = arch + "."
    recurrent: tuple[bool, ...] = ()
    attention: tuple[bool, ...] = ()
    if arch in RECURRENT:
        recurrent = (True,) * n_layer
        attention = (False,) * n_layer
    elif arch == "falcon-h1":  # every layer has both (llama-model.cpp create_memory's filters)
        recurrent = (True,) * n_layer
    elif arch in HYBRID:
        # granite-hybrid.cpp, jamba.cpp, nemotron-h.cpp: a layer is recurrent iff its n_head_kv is 0.
        recurrent = tuple(kv == 0 for kv in n_head_kv)
        attention = tuple(not r for r in recurrent)
    if arch == "gemma3n":  # models/gemma3n.cpp: n_layer_kv_from_start = 20
        attention = tuple(il < 20 for il in range(n_layer))
    elif arch == "gemma4" or _int(meta, a + "attention.shared_kv_layers"):
        start = n_layer - _int(meta, a + "attention.shared_kv_layers")
        attention = tuple(il < start for il in range(n_layer))
    n_embd_r, n_embd_s = _state_sizes(meta, arch, n_embd, n_head) if recurrent else (0, 0)
    n_expert = _int(meta, a + "expert_count")
    return ArchRules(
        ssm_in=_ssm_in(meta, arch, n_head_kv) if recurrent else 0,
        ssm_inner=_int(meta, a + "ssm.inner_size") if recurrent else 0,
        architecture=arch,
        verified=arch in VERIFIED,
        n_expert=n_expert,
        n_expert_used=_max_int(meta, a + "expert_used_count") if n_expert else 0,
        n_ff_exp=_max_int(meta, a + "expert_feed_forward_length") if n_expert else 0,
        n_expert_shared=_int(meta, a + "expert_shared_count") if n_expert else 0,
        # llama-hparams.cpp is_mla(): both per-head MLA sizes given.
        mla=bool(_int(meta, a + "attention.key_length_mla") and _int(meta, a + "attention.value_length_mla")),
        recurrent=recurrent,
        attention=attention,
        n_embd_r=n_embd_r,
        n_embd_s=n_embd_s,
    )


def _ssm_in(meta: Mapping[str, Any], arch: str, n_head_kv: tuple[int, ...]) -> int:
    a = arch + "."
    d_inner = _int(meta, a + "ssm.inner_size")
    return (
        2 * d_inner
        + 2 * _int(meta, a + "ssm.group_count") * _int(meta, a + "ssm.state_size")
        + _int(meta, a + "ssm.time_step_rank")
    )


def unverified_note(rules: ArchRules) -> str | None:
    """The note a plan, report or `model info` carries for an architecture the planner does not know."""
    if rules.verified:
        return None
    return (
        f"unverified: architecture {rules.architecture!r} is planned with the generic rules "
        "(its KV, state and compute were never compared with llama.cpp's allocations)"
    )


def backend_notes(rules: ArchRules, backends: Sequence[str]) -> list[str]:
    """Notes for the GPU backends among a plan's devices on which this family was never measured."""
    notes = []
    for backend in dict.fromkeys(b for b in backends if b != "cpu"):
        if rules.verified and rules.architecture not in VERIFIED_ON.get(backend, frozenset()):
            notes.append(
                f"unverified on {backend}: the memory of {rules.architecture!r} on {backend} devices was "
                "never compared with real allocations (weights are exact on every backend)"
            )
    return notes


def _ffn_widths(profile: ModelProfile, il: int) -> tuple[int, int, int]:
    """(dense n_ff, one expert's n_ff, shared experts' n_ff) of layer `il`, from its tensors."""
    dense = expert = shared = 0
    prefix = f"blk.{il}."
    for t in profile.layer_tensors(il):
        if len(t.shape) < 2:
            continue
        base = t.name[len(prefix) :]
        if base == "ffn_up.weight":
            dense = t.shape[1]
        elif base in ("ffn_up_exps.weight", "ffn_gate_exps.weight"):
            expert = t.shape[1]
        elif base == "ffn_gate_up_exps.weight":
            expert = t.shape[1] // 2
        elif base == "ffn_up_shexp.weight":
            shared = t.shape[1]
    return dense, expert, shared


def attention_input_bytes(
    profile: ModelProfile, attn: Sequence[int], caches: Mapping[bool, int], n_tok: int, opts: PlanOptions
) -> int:
    """One copy of the attention inputs the layers `attn` read (llm_graph_input_attn_kv[_iswa]): per KV
    cache they use (`caches`: is_swa -> cells per stream; the full layers', the sliding-window layers'),
    the KQ mask [n_kv, n_tokens] (f32; f16 with flash attention; with several streams n_tokens is split
    between them), k_idxs [n_tokens] (i64) and v_idxs: [n_embd_v_gqa, n_tokens] (i64) without flash
    attention, whose transposed V cache is written element by element (llama-kv-cache.cpp
    build_input_v_idxs), [n_tokens] with it; and the positions and output ids (i32). 0 without
    attention layers."""
    if not attn:
        return 0
    mask_bytes = 2 if opts.flash_attn else 4
    v_width = 1 if opts.flash_attn else max(profile.n_embd_v_gqa(il) for il in attn)
    idxs = 8 * n_tok * (1 + v_width)
    positions = 8 * n_tok  # inp_pos and inp_out_ids, beside the caches' own
    return positions + sum(n_kv * n_tok * mask_bytes + idxs for n_kv in caches.values())


def family_compute(
    profile: ModelProfile,
    layers: Sequence[int],
    opts: PlanOptions,
    *,
    n_tokens: int,
    caches: Mapping[bool, int],
    copies: int,
) -> int:
    """Compute buffer of a device holding `layers` (index n_layer: the output layer): the worst-case
    graph llama.cpp reserves (n_tokens = min(n_ctx, n_ubatch)), for every family (dense, sliding-window,
    experts, MLA, recurrent). `caches`: the KV caches the device's attention layers use, is_swa -> cells
    per stream (memory.kv_cells: the small SWA cache unless swa_full, n_ctx / n_seq per stream).

    inputs × `copies` (GGML_SCHED_MAX_COPIES with pipeline parallelism) plus the largest live set, as
    ggml-alloc reuses memory between them:
    - inputs: the hidden state coming in, and `attention_input_bytes` (per cache on the device: two on
      Gemma's and gpt-oss's devices with both kinds of layer; none on a device with no attention
      layer, e.g. only recurrent layers or only the output layer);
    - attention without flash attention: the KQ matrix (n_head × n_kv × n_tokens f32, n_kv of the
      largest cache on the device) and about 5 hidden-state rows; with flash attention about 6 rows;
    - dense FFN: 6 rows + gate and up, or 4 n_ff-wide rows + half a row with copies (3 + 2 rows
      without), whichever is larger (a wide FFN, e.g. Gemma's);
    - expert FFN (llama-graph.cpp build_moe_ffn): 2 rows + the router's logits and probabilities + for
      the experts used by every token either gate, up and their product (3 × n_expert_used × expert
      width) or the product and the experts' outputs (n_expert_used × (expert width + n_embd)),
      whichever is larger, + the shared experts' gate and up;
    - recurrent (Mamba-2) layers: the input projection, convolution and scan rows, 2.5 × ssm_in with one
      recurrent layer on the device, 3 × with more. Where two recurrent layers meet at a device
      boundary, ggml's scheduler runs part of the earlier layer on the later device (GGML_SCHED_DEBUG
      shows the splits): 2 × d_inner rows more come in there, d_inner rows go back, each `copies` times.
      A hybrid's recurrent layer that ends on a device with copies adds hidden rows for its FFN;
    - the output layer: the logits (n_vocab × n_tokens f32) and one row. With one copy (no pipeline
      parallelism) the inputs are graph tensors, freed after the last layer's attention, so the buffer
      is the larger of the layers' and the logits' (measured on Gemma 3 270M, one device and layers on
      the CPU); with copies they have buffers of their own.
    Calibrated against llama.cpp 0.3.36's allocations over loopback RPC: every family
    (tests/planning/test_families.py) and Gemma 3 270M at 4k-32k, swa_full on and off, 1-4 sequences, unified
    or not, layers on the CPU (tests/planning/test_gemma.py).
    """
    if not layers:
        return 0
    n_tok = n_tokens
    f32 = 4
    rules = profile.rules
    row = max(profile.n_embd, max(profile.n_head) * profile.head_dim_v) * n_tok * f32
    hidden = profile.n_embd * n_tok * f32
    repeating = [il for il in layers if il < profile.n_layer]
    attn = [il for il in repeating if profile.n_head_kv[il] > 0 and rules.has_kv(il)]
    inputs = (attention_input_bytes(profile, attn, caches, n_tok, opts) + hidden) * copies
    peak = 0
    recurrent = [il for il in repeating if rules.is_recurrent(il)]
    if recurrent:
        first, last = min(repeating), max(repeating)
        spill = 0
        if rules.is_recurrent(first) and first > 0 and rules.is_recurrent(first - 1):
            # the earlier layer's input projection (z, xBC, dt) comes in whole, and a state-wide row:
            # measured on Mamba-2 shapes from 1 group of 16 states to 8 groups of 128 (2 x d_inner, the
            # rule before, was 30 % under with 8 groups)
            d_state = rules.n_embd_s // rules.ssm_inner if rules.ssm_inner else 0
            spill += (rules.ssm_in + d_state) * n_tok * f32
        spills_out = rules.is_recurrent(last) and last + 1 < profile.n_layer and rules.is_recurrent(last + 1)
        if spills_out:
            spill += rules.ssm_inner * n_tok * f32
        inputs += spill * copies
        # The scan's states beside its rows: the states read for each sequence and the scan's copy of
        # them, 1.5 states per sequence and one more (measured on the shapes above at 1 and 4 sequences;
        # without it a wide state, 128 x d_inner, was 10 % under at 4 sequences)
        inputs += rules.n_embd_s * f32 * (3 * max(1, opts.parallel) + 2) // 2
        peak = (5 if len(recurrent) == 1 else 6) * rules.ssm_in * n_tok * f32 // 2
        if rules.hybrid and copies > 1 and len(recurrent) > spills_out:
            # A hybrid's recurrent layer ends here (not on the next device) and its FFN follows: with
            # pipeline copies two hidden rows more beside one recurrent layer, one beside several
            # (measured on granitehybrid shapes, n_embd 128 and 256, n_ubatch 128 and 512, every split
            # of its four layers over 1-3 devices; without them up to 6 % under)
            peak += (2 if len(recurrent) == 1 else 1) * hidden
    if attn:
        if opts.flash_attn:
            peak = max(peak, 6 * row)
        else:
            n_kv = max(caches.values(), default=0)
            peak = max(peak, max(profile.n_head[il] for il in attn) * n_kv * n_tok * f32 + 5 * row)
    for il in repeating:
        dense, expert, shared = _ffn_widths(profile, il)
        if dense:
            ff = dense * n_tok * f32
            # 6 rows + gate and up (the tiny families), or, measured on Gemma 3 (n_ff 3.2 x n_embd), 4
            # rows n_ff wide + half a row with input copies, 3 n_ff rows + 2 rows without
            wide = 4 * ff + hidden // 2 if copies > 1 else 3 * ff + 2 * hidden
            peak = max(peak, 6 * hidden + 2 * ff, wide)
        if expert:
            k = rules.n_expert_used
            # gate, up and their product per expert used, or the product and the experts' outputs
            routed = max(3 * k * expert, k * expert + k * profile.n_embd) * n_tok * f32
            if il < opts.n_cpu_moe:  # --n-cpu-moe: the experts run on the CPU (memory.cpu_experts_compute)
                routed = 0
            router = 2 * rules.n_expert * n_tok * f32  # logits and probabilities
            peak = max(peak, 2 * hidden + router + routed + 2 * shared * n_tok * f32)
    if profile.n_layer not in layers:
        return inputs + peak
    # llama.cpp reserves min(n_tokens, n_outputs_max) logits rows (llama-context.cpp n_outputs_pp)
    rows = min(n_tok, opts.n_outputs_max) if opts.n_outputs_max > 0 else n_tok
    logits = profile.n_vocab * rows * f32 + hidden
    if copies > 1:  # the input copies have buffers of their own
        return inputs + max(peak, logits)
    return max(inputs + peak, logits)
