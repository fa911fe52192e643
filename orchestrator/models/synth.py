"""Tiny llama-architecture GGUF models with random weights, for tests, benchmarks and the demo.

`write_tiny_llama` writes a model llama.cpp loads and runs (the output is noise, the shapes are real).
`write_sparse_70b_header` writes a 70B-class file whose tensor data is a hole: header and tensor infos
are real, the data region is never written (the file is sparse), so profiling can be timed on a
realistic tensor table without 40 GB of disk.

Conventions of the format (gguf-py): a numpy array of shape (rows, cols) becomes a ggml tensor with
ne = [cols, rows]; quantised data is passed as bytes with `raw_dtype` set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from orchestrator.core.errors import ModelError

WeightType = Literal["f16", "f32", "q8_0"]


_WEIGHT_TYPES: dict[str, QType] = {"f16": QType.F16, "f32": QType.F32, "q8_0": QType.Q8_0}


# general.file_type values (llama_ftype): ALL_F32 0, MOSTLY_F16 1, MOSTLY_Q8_0 7, MOSTLY_Q4_K_M 15.
_FILE_TYPES: dict[str, int] = {"f32": 0, "f16": 1, "q8_0": 7}


_N_SPECIAL = 3  # <unk>, <s>, </s>


_N_BYTE_TOKENS = 256


_LETTERS = "etaoinshrdlucmfwypvbgkjqxz"


def _vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """An SPM vocabulary: specials, the 256 byte tokens (byte fallback) and simple pieces."""
    minimum = _N_SPECIAL + _N_BYTE_TOKENS + 1
    if n_vocab < minimum:
        raise ModelError(
            f"n_vocab must be at least {minimum} (specials + 256 byte tokens + '▁'), got {n_vocab}"
        )
    tokens = ["<unk>", "<s>", "</s>"]
    types = [int(gguf.TokenType.UNKNOWN), int(gguf.TokenType.CONTROL), int(gguf.TokenType.CONTROL)]
    tokens += [f"<0x{b:02X}>" for b in range(_N_BYTE_TOKENS)]
    types += [int(gguf.TokenType.BYTE)] * _N_BYTE_TOKENS
    pieces: list[str] = ["▁"]
    pieces += [f"▁{c}" for c in _LETTERS] + list(_LETTERS)
    pieces += [f"▁{a}{b}" for a in _LETTERS for b in _LETTERS]
    pieces += [f"{a}{b}" for a in _LETTERS for b in _LETTERS]
    n_pieces = n_vocab - len(tokens)
    if n_pieces > len(pieces):
        pieces += [f"▁{a}{b}{c}" for a in _LETTERS for b in _LETTERS for c in _LETTERS]
    if n_pieces > len(pieces):
        pieces += [f"▁w{i}" for i in range(n_pieces - len(pieces))]
    tokens += pieces[:n_pieces]
    types += [int(gguf.TokenType.NORMAL)] * n_pieces
    scores = [0.0] * (len(tokens) - n_pieces) + [-float(i) for i in range(n_pieces)]
    return tokens, scores, types


def _add_llama_hparams(
    writer: gguf.GGUFWriter,
    *,
    name: str,
    n_layer: int,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    n_ff: int,
    n_vocab: int,
    n_ctx_train: int,
    file_type: int,
) -> None:
    writer.add_name(name)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(file_type)


def add_spm_tokenizer(writer: gguf.GGUFWriter, n_vocab: int) -> None:
    tokens, scores, types = _vocab(n_vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _check_dims(n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int) -> None:
    if min(n_layer, n_embd, n_head, n_head_kv, n_ff) <= 0:
        raise ModelError("all model dimensions must be positive")
    if n_embd % n_head:
        raise ModelError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
    if n_head % n_head_kv:
        raise ModelError(f"n_head ({n_head}) must be a multiple of n_head_kv ({n_head_kv})")


def write_tiny_llama(
    path: str | Path,
    *,
    n_layer: int = 4,
    n_embd: int = 256,
    n_head: int = 4,
    n_head_kv: int = 4,
    n_ff: int = 512,
    n_vocab: int = 300,
    n_ctx_train: int = 4096,
    weight_type: WeightType = "f16",
    tied_output: bool = False,
    seed: int = 0,
    split_max_tensors: int = 0,
    chat_template: str | None = None,
) -> Path:
    """Write a small llama model with random weights; returns the path (the first shard when split).

    Matrices use `weight_type` (f16, f32 or q8_0, quantised with gguf.quants), norms are f32. With
    `tied_output` there is no `output.weight` (llama.cpp then reuses token_embd). With
    `split_max_tensors` > 0 the model is written as shards `<stem>-0000i-of-0000n.gguf` of at most that
    many tensors each. `chat_template` (Jinja) becomes `tokenizer.chat_template`. The same arguments
    give the same bytes.
    """
    _check_dims(n_layer, n_embd, n_head, n_head_kv, n_ff)
    if weight_type not in _WEIGHT_TYPES:
        raise ModelError(f"unknown weight type {weight_type!r}; expected one of {sorted(_WEIGHT_TYPES)}")
    qtype = _WEIGHT_TYPES[weight_type]
    if qtype == QType.Q8_0 and (n_embd % 32 or n_ff % 32):
        raise ModelError("q8_0 needs n_embd and n_ff to be multiples of 32")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head

    writer = gguf.GGUFWriter(path, "llama", split_max_tensors=split_max_tensors)
    _add_llama_hparams(
        writer,
        name=f"tiny-llama-{n_layer}L-{n_embd}d-{weight_type}",
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=n_ff,
        n_vocab=n_vocab,
        n_ctx_train=n_ctx_train,
        file_type=_FILE_TYPES[weight_type],
    )
    add_spm_tokenizer(writer, n_vocab)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    def matrix(name: str, rows: int, cols: int) -> None:
        # Small weights keep activations finite through the random network.
        data = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
        if qtype == QType.F32:
            writer.add_tensor(name, data)
        elif qtype == QType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    def norm(name: str) -> None:
        writer.add_tensor(name, np.ones(n_embd, dtype=np.float32))

    matrix("token_embd.weight", n_vocab, n_embd)
    for il in range(n_layer):
        norm(f"blk.{il}.attn_norm.weight")
        matrix(f"blk.{il}.attn_q.weight", n_head * head_dim, n_embd)
        matrix(f"blk.{il}.attn_k.weight", n_head_kv * head_dim, n_embd)
        matrix(f"blk.{il}.attn_v.weight", n_head_kv * head_dim, n_embd)
        matrix(f"blk.{il}.attn_output.weight", n_embd, n_head * head_dim)
        norm(f"blk.{il}.ffn_norm.weight")
        matrix(f"blk.{il}.ffn_gate.weight", n_ff, n_embd)
        matrix(f"blk.{il}.ffn_up.weight", n_ff, n_embd)
        matrix(f"blk.{il}.ffn_down.weight", n_embd, n_ff)
    norm("output_norm.weight")
    if not tied_output:
        matrix("output.weight", n_vocab, n_embd)

    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return writer.format_shard_names(path)[0]


# Real Llama-2/3-70B shapes.
_70B: dict[str, int] = {
    "n_layer": 80,
    "n_embd": 8192,
    "n_head": 64,
    "n_head_kv": 8,
    "n_ff": 28672,
    "n_vocab": 128256,
    "n_ctx_train": 8192,
}


def _type_nbytes(qtype: QType, shape: tuple[int, ...]) -> int:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape))
    if shape[-1] % block_size:
        raise ModelError(f"row length {shape[-1]} is not a multiple of the {qtype.name} block size")
    return n // block_size * type_size


def write_sparse_70b_header(
    path: str | Path, *, weight_type: Literal["q4_K", "f16"] = "q4_K", with_vocab: bool = True
) -> Path:
    """Write a 70B-class llama GGUF (80 layers, 723 tensors) whose data region is a hole.

    Header, metadata (including a 128k-token vocabulary when `with_vocab`) and tensor infos with correct
    offsets are written; the file is then extended to its full size without writing data, so it takes
    only the header's blocks on disk. Token embeddings and output are q6_K for q4_K (as in Q4_K_M),
    norms f32.
    """
    qtype = QType.Q4_K if weight_type == "q4_K" else QType.F16
    big = QType.Q6_K if weight_type == "q4_K" else QType.F16
    h = _70B
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, "llama")
    _add_llama_hparams(
        writer,
        name=f"sparse-llama-70b-{weight_type}",
        n_layer=h["n_layer"],
        n_embd=h["n_embd"],
        n_head=h["n_head"],
        n_head_kv=h["n_head_kv"],
        n_ff=h["n_ff"],
        n_vocab=h["n_vocab"],
        n_ctx_train=h["n_ctx_train"],
        file_type=15 if weight_type == "q4_K" else 1,
    )
    if with_vocab:
        add_spm_tokenizer(writer, h["n_vocab"])

    infos: list[tuple[str, tuple[int, ...], QType]] = []
    n_embd, n_ff, head_dim = h["n_embd"], h["n_ff"], h["n_embd"] // h["n_head"]
    n_embd_kv = h["n_head_kv"] * head_dim
    infos.append(("token_embd.weight", (h["n_vocab"], n_embd), big))
    for il in range(h["n_layer"]):
        infos += [
            (f"blk.{il}.attn_norm.weight", (n_embd,), QType.F32),
            (f"blk.{il}.attn_q.weight", (n_embd, n_embd), qtype),
            (f"blk.{il}.attn_k.weight", (n_embd_kv, n_embd), qtype),
            (f"blk.{il}.attn_v.weight", (n_embd_kv, n_embd), big),
            (f"blk.{il}.attn_output.weight", (n_embd, n_embd), qtype),
            (f"blk.{il}.ffn_norm.weight", (n_embd,), QType.F32),
            (f"blk.{il}.ffn_gate.weight", (n_ff, n_embd), qtype),
            (f"blk.{il}.ffn_up.weight", (n_ff, n_embd), qtype),
            (f"blk.{il}.ffn_down.weight", (n_embd, n_ff), big),
        ]
    infos += [("output_norm.weight", (n_embd,), QType.F32), ("output.weight", (h["n_vocab"], n_embd), big)]

    total = 0
    for name, shape, t in infos:
        nbytes = _type_nbytes(t, shape)
        writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=t)
        total += gguf.GGUFWriter.ggml_pad(nbytes, writer.data_alignment)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        fout: Any = writer.fout[0]
        data_start = gguf.GGUFWriter.ggml_pad(fout.tell(), writer.data_alignment)
        fout.truncate(data_start + total)
    finally:
        writer.close()
    return path
