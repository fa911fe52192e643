"""Small random-weight GGUFs of other model families, for tests and benchmarks of per-architecture plans.

Each family's tensors, shapes and keys follow what llama.cpp 0.3.36 (the vendored source of
llama-cpp-python) requires in `models/<arch>.cpp` (`load_arch_hparams`, `load_arch_tensors`): the files
load and decode (the output is noise, the shapes and allocations are real). They stay tiny (a few MB)
so a load takes well under a second.

Shapes are given in ggml order (ne[0] first); gguf-py takes numpy arrays, whose shape is the reverse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from orchestrator.core.errors import ModelError
from orchestrator.models.synth import add_spm_tokenizer

ARCHES = ("llama", "qwen3", "qwen3moe", "gemma3", "gpt-oss", "deepseek2", "granitehybrid", "mamba2")


@dataclass
class _Spec:
    arch: str
    keys: dict[str, Any] = field(default_factory=dict)  # without the "<arch>." prefix
    tensors: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)

    def t(self, name: str, *ne: int) -> None:
        self.tensors.append((name, ne))


# Dimensions of every synthetic family: head size 64 (what the CPU flash-attention kernels are built
# for), a vocabulary just above the SPM minimum.
_EMBD = 128
_HEAD = 64
_N_HEAD = 2
_FF = 256
_VOCAB = 320


def _common(spec: _Spec, n_layer: int, *, attention: bool = True, n_head_kv: int | list[int] = 1) -> None:
    spec.keys.update(
        {
            "context_length": 4096,
            "embedding_length": _EMBD,
            "block_count": n_layer,
            "feed_forward_length": _FF,
            "attention.layer_norm_rms_epsilon": 1e-5,
            "vocab_size": _VOCAB,
        }
    )
    if attention:
        spec.keys.update(
            {
                "attention.head_count": _N_HEAD,
                "attention.head_count_kv": n_head_kv,
                "attention.key_length": _HEAD,
                "attention.value_length": _HEAD,
                "rope.dimension_count": _HEAD,
                "rope.freq_base": 10000.0,
            }
        )
    spec.t("token_embd.weight", _EMBD, _VOCAB)
    spec.t("output_norm.weight", _EMBD)
    spec.t("output.weight", _EMBD, _VOCAB)


def _attention(spec: _Spec, il: int, n_head_kv: int, *, qk_norm: bool = False) -> None:
    p = f"blk.{il}."
    spec.t(p + "attn_q.weight", _EMBD, _N_HEAD * _HEAD)
    spec.t(p + "attn_k.weight", _EMBD, n_head_kv * _HEAD)
    spec.t(p + "attn_v.weight", _EMBD, n_head_kv * _HEAD)
    spec.t(p + "attn_output.weight", _N_HEAD * _HEAD, _EMBD)
    if qk_norm:
        spec.t(p + "attn_q_norm.weight", _HEAD)
        spec.t(p + "attn_k_norm.weight", _HEAD)


def _dense_ffn(spec: _Spec, il: int, n_ff: int = _FF) -> None:
    p = f"blk.{il}."
    spec.t(p + "ffn_gate.weight", _EMBD, n_ff)
    spec.t(p + "ffn_up.weight", _EMBD, n_ff)
    spec.t(p + "ffn_down.weight", n_ff, _EMBD)


def _experts(spec: _Spec, il: int, n_ff_exp: int, n_expert: int, *, bias: bool = False) -> None:
    p = f"blk.{il}."
    spec.t(p + "ffn_gate_inp.weight", _EMBD, n_expert)
    spec.t(p + "ffn_gate_exps.weight", _EMBD, n_ff_exp, n_expert)
    spec.t(p + "ffn_up_exps.weight", _EMBD, n_ff_exp, n_expert)
    spec.t(p + "ffn_down_exps.weight", n_ff_exp, _EMBD, n_expert)
    if bias:
        spec.t(p + "ffn_gate_inp.bias", n_expert)
        spec.t(p + "ffn_gate_exps.bias", n_ff_exp, n_expert)
        spec.t(p + "ffn_up_exps.bias", n_ff_exp, n_expert)
        spec.t(p + "ffn_down_exps.bias", _EMBD, n_expert)


def _llama() -> _Spec:
    spec = _Spec("llama")
    _common(spec, 4, n_head_kv=1)
    for il in range(4):
        spec.t(f"blk.{il}.attn_norm.weight", _EMBD)
        _attention(spec, il, 1)
        spec.t(f"blk.{il}.ffn_norm.weight", _EMBD)
        _dense_ffn(spec, il)
    return spec


def _qwen3() -> _Spec:
    # models/qwen3.cpp: q/k norms of one head each.
    spec = _Spec("qwen3")
    _common(spec, 4, n_head_kv=1)
    for il in range(4):
        spec.t(f"blk.{il}.attn_norm.weight", _EMBD)
        _attention(spec, il, 1, qk_norm=True)
        spec.t(f"blk.{il}.ffn_norm.weight", _EMBD)
        _dense_ffn(spec, il)
    return spec


def _qwen3moe() -> _Spec:
    # models/qwen3moe.cpp: every layer's FFN is 3-D expert tensors {n_embd, n_ff_exp, n_expert}.
    spec = _Spec("qwen3moe")
    _common(spec, 4, n_head_kv=1)
    spec.keys.update({"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 64})
    for il in range(4):
        spec.t(f"blk.{il}.attn_norm.weight", _EMBD)
        _attention(spec, il, 1, qk_norm=True)
        spec.t(f"blk.{il}.ffn_norm.weight", _EMBD)
        _experts(spec, il, 64, 8)
    return spec


def _gemma3() -> _Spec:
    # models/gemma3.cpp: sliding window on 5 of every 6 layers (the default pattern), post norms.
    spec = _Spec("gemma3")
    _common(spec, 6, n_head_kv=1)
    spec.keys.update({"attention.sliding_window": 128})
    for il in range(6):
        p = f"blk.{il}."
        spec.t(p + "attn_norm.weight", _EMBD)
        _attention(spec, il, 1, qk_norm=True)
        spec.t(p + "post_attention_norm.weight", _EMBD)
        spec.t(p + "ffn_norm.weight", _EMBD)
        _dense_ffn(spec, il)
        spec.t(p + "post_ffw_norm.weight", _EMBD)
    return spec


def _gpt_oss() -> _Spec:
    # models/openai-moe.cpp: attention sinks, biased experts, sliding window on every other layer;
    # output.weight is required (no tied output).
    spec = _Spec("gpt-oss")
    _common(spec, 4, n_head_kv=1)
    spec.keys.update(
        {
            "expert_count": 4,
            "expert_used_count": 2,
            "expert_feed_forward_length": 64,
            "attention.sliding_window": 128,
        }
    )
    for il in range(4):
        p = f"blk.{il}."
        spec.t(p + "attn_norm.weight", _EMBD)
        spec.t(p + "post_attention_norm.weight", _EMBD)
        _attention(spec, il, 1)
        spec.t(p + "attn_output.bias", _EMBD)
        spec.t(p + "attn_sinks.weight", _N_HEAD)
        _experts(spec, il, 64, 4, bias=True)
    return spec


# DeepSeek-V2 MLA sizes: the K cache row is kv_lora_rank + rope wide (one "head"), no V cache.
_KV_LORA = 64
_Q_LORA = 64
_ROPE = 32
_NOPE = 32
_V_MLA = 32


def _deepseek2() -> _Spec:
    # models/deepseek2.cpp: MLA (q_lora/kv_lora, split attn_k_b/attn_v_b) and, after the leading dense
    # block, experts with a shared expert. key_length/value_length are the compressed sizes, the _mla
    # keys the per-head sizes after decompression (the convention of current GGUFs).
    spec = _Spec("deepseek2")
    n_layer, n_expert, n_ff_exp = 3, 4, 64
    _common(spec, n_layer, attention=False)
    spec.keys.update(
        {
            "attention.head_count": _N_HEAD,
            "attention.head_count_kv": 1,
            "attention.key_length": _KV_LORA + _ROPE,
            "attention.value_length": _KV_LORA,
            "attention.key_length_mla": _NOPE + _ROPE,
            "attention.value_length_mla": _V_MLA,
            "attention.q_lora_rank": _Q_LORA,
            "attention.kv_lora_rank": _KV_LORA,
            "rope.dimension_count": _ROPE,
            "rope.freq_base": 10000.0,
            "leading_dense_block_count": 1,
            "expert_count": n_expert,
            "expert_used_count": 2,
            "expert_shared_count": 1,
            "expert_feed_forward_length": n_ff_exp,
            "expert_weights_scale": 1.0,
        }
    )
    k_mla = _NOPE + _ROPE
    for il in range(n_layer):
        p = f"blk.{il}."
        spec.t(p + "attn_norm.weight", _EMBD)
        spec.t(p + "attn_q_a_norm.weight", _Q_LORA)
        spec.t(p + "attn_kv_a_norm.weight", _KV_LORA)
        spec.t(p + "attn_q_a.weight", _EMBD, _Q_LORA)
        spec.t(p + "attn_q_b.weight", _Q_LORA, _N_HEAD * k_mla)
        spec.t(p + "attn_kv_a_mqa.weight", _EMBD, _KV_LORA + _ROPE)
        spec.t(p + "attn_k_b.weight", _NOPE, _KV_LORA, _N_HEAD)
        spec.t(p + "attn_v_b.weight", _KV_LORA, _V_MLA, _N_HEAD)
        spec.t(p + "attn_output.weight", _N_HEAD * _V_MLA, _EMBD)
        spec.t(p + "ffn_norm.weight", _EMBD)
        if il < 1:
            _dense_ffn(spec, il)
        else:
            _experts(spec, il, n_ff_exp, n_expert)
            spec.t(p + "ffn_gate_shexp.weight", _EMBD, n_ff_exp)
            spec.t(p + "ffn_up_shexp.weight", _EMBD, n_ff_exp)
            spec.t(p + "ffn_down_shexp.weight", n_ff_exp, _EMBD)
    return spec


# Mamba-2 sizes: d_inner = 2 n_embd (granitehybrid requires it), 4 SSM heads of 64, one group.
_D_CONV = 4
_D_INNER = 2 * _EMBD
_D_STATE = 16
_SSM_HEADS = 4
_GROUPS = 1


def _ssm_keys(spec: _Spec) -> None:
    spec.keys.update(
        {
            "ssm.conv_kernel": _D_CONV,
            "ssm.inner_size": _D_INNER,
            "ssm.state_size": _D_STATE,
            "ssm.time_step_rank": _SSM_HEADS,
            "ssm.group_count": _GROUPS,
        }
    )


def _ssm_layer(spec: _Spec, il: int) -> None:
    # models/mamba2.cpp / granite-hybrid.cpp: in_proj {n_embd, 2 d_inner + 2 ng ds + nh}.
    p = f"blk.{il}."
    conv_dim = _D_INNER + 2 * _GROUPS * _D_STATE
    spec.t(p + "ssm_in.weight", _EMBD, _D_INNER + conv_dim + _SSM_HEADS)
    spec.t(p + "ssm_conv1d.weight", _D_CONV, conv_dim)
    spec.t(p + "ssm_conv1d.bias", conv_dim)
    spec.t(p + "ssm_dt.bias", _SSM_HEADS)
    spec.t(p + "ssm_a", 1, _SSM_HEADS)
    spec.t(p + "ssm_d", 1, _SSM_HEADS)
    spec.t(p + "ssm_norm.weight", _D_INNER // _GROUPS, _GROUPS)
    spec.t(p + "ssm_out.weight", _D_INNER, _EMBD)


def _mamba2() -> _Spec:
    # A pure recurrent model: no attention keys at all (llama.cpp: "non-transformer models do not have
    # attention heads").
    spec = _Spec("mamba2")
    _common(spec, 4, attention=False)
    del spec.keys["feed_forward_length"]
    _ssm_keys(spec)
    for il in range(4):
        spec.t(f"blk.{il}.attn_norm.weight", _EMBD)
        _ssm_layer(spec, il)
    return spec


_GRANITE_KV = [0, 0, 1, 0]  # a layer is recurrent iff its head_count_kv is 0 (granite-hybrid.cpp)


def _granitehybrid() -> _Spec:
    spec = _Spec("granitehybrid")
    _common(spec, len(_GRANITE_KV), n_head_kv=list(_GRANITE_KV))
    _ssm_keys(spec)
    for il, kv in enumerate(_GRANITE_KV):
        p = f"blk.{il}."
        spec.t(p + "attn_norm.weight", _EMBD)
        if kv == 0:
            _ssm_layer(spec, il)
        else:
            _attention(spec, il, kv)
        spec.t(p + "ffn_norm.weight", _EMBD)
        _dense_ffn(spec, il)
    return spec


_BUILDERS: dict[str, Callable[[], _Spec]] = {
    "llama": _llama,
    "qwen3": _qwen3,
    "qwen3moe": _qwen3moe,
    "gemma3": _gemma3,
    "gpt-oss": _gpt_oss,
    "deepseek2": _deepseek2,
    "granitehybrid": _granitehybrid,
    "mamba2": _mamba2,
}


def _f32(name: str, ne: tuple[int, ...]) -> bool:
    # Norms, biases, SSM parameters and the convolution run as f32 in llama.cpp's graphs.
    base = name.split(".", 2)[-1]
    return (
        len(ne) == 1
        or name.endswith(".bias")
        or base.startswith(("ssm_a", "ssm_d", "ssm_conv1d", "ssm_norm"))
    )


def _data(name: str, ne: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    shape = tuple(reversed(ne))
    base = name.split(".", 2)[-1]
    if base.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    if base == "ssm_a":
        return -np.ones(shape, dtype=np.float32)  # A = -exp(A_log): negative, a decaying state
    if base == "ssm_d" or name.endswith(".bias") or base == "attn_sinks.weight":
        return np.zeros(shape, dtype=np.float32)
    data = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
    return data if _f32(name, ne) else data.astype(np.float16)


def write_arch_model(path: str | Path, arch: str, *, seed: int = 0, architecture: str | None = None) -> Path:
    """Write a tiny random-weight model of family `arch` (one of ARCHES); returns the path.

    `architecture` overrides the `general.architecture` written (keys keep their family's meaning under
    the new prefix): a model of an architecture the planner does not know, for its `unverified` marking.
    The same arguments give the same bytes.
    """
    if arch not in _BUILDERS:
        raise ModelError(f"unknown family {arch!r}; expected one of {', '.join(ARCHES)}")
    spec = _BUILDERS[arch]()
    name = architecture or spec.arch
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, name)
    writer.add_name(f"tiny-{name}")
    writer.add_file_type(1)
    for key, value in spec.keys.items():
        full = f"{name}.{key}"
        if isinstance(value, list):
            writer.add_array(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_uint32(full, value)
    add_spm_tokenizer(writer, _VOCAB)
    for tname, ne in spec.tensors:
        writer.add_tensor(tname, _data(tname, ne, rng))
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path
