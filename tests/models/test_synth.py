"""The tiny-GGUF generator, cross-checked with gguf-py's own reader (an independent parser)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import numpy as np
import pytest

from orchestrator.core.errors import ModelError
from orchestrator.models.synth import write_sparse_70b_header, write_tiny_llama


def _field(reader: gguf.GGUFReader, key: str) -> object:
    field = reader.get_field(key)
    assert field is not None, key
    return field.contents()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_llama_metadata_and_shapes(tiny_model: Path) -> None:
    r = gguf.GGUFReader(tiny_model)
    assert _field(r, "general.architecture") == "llama"
    assert _field(r, "llama.block_count") == 4
    assert _field(r, "llama.embedding_length") == 256
    assert _field(r, "llama.attention.head_count") == 4
    assert _field(r, "llama.attention.head_count_kv") == 4
    assert _field(r, "llama.feed_forward_length") == 512
    assert _field(r, "llama.context_length") == 4096
    assert _field(r, "tokenizer.ggml.model") == "llama"
    tokens = _field(r, "tokenizer.ggml.tokens")
    assert isinstance(tokens, list)
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3] == "<0x00>" and tokens[3 + 255] == "<0xFF>"
    assert len(tokens) == 300 and len(set(tokens)) == 300
    types = _field(r, "tokenizer.ggml.token_type")
    assert isinstance(types, list)
    assert types[3:259] == [int(gguf.TokenType.BYTE)] * 256
    by_name = {t.name: t for t in r.tensors}
    assert len(by_name) == 2 + 4 * 9 + 1
    # numpy (rows, cols) -> ggml ne [cols, rows]
    assert list(by_name["token_embd.weight"].shape) == [256, 300]
    assert list(by_name["blk.0.ffn_down.weight"].shape) == [512, 256]
    assert list(by_name["blk.0.ffn_up.weight"].shape) == [256, 512]
    assert by_name["blk.3.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert by_name["blk.3.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert by_name["output.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    weights = np.asarray(by_name["blk.0.attn_q.weight"].data, dtype=np.float32)
    assert np.all(np.isfinite(weights)) and 0.01 < float(weights.std()) < 0.05


def test_gqa_q8_0_and_tied_output(tiny_model_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tiny_model_factory(n_head=8, n_head_kv=2, weight_type="q8_0", tied_output=True)
    r = gguf.GGUFReader(path)
    by_name = {t.name: t for t in r.tensors}
    assert "output.weight" not in by_name
    assert "output_norm.weight" in by_name
    assert _field(r, "llama.attention.head_count_kv") == 2
    k = by_name["blk.1.attn_k.weight"]
    assert k.tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert list(k.shape) == [256, 2 * 32]  # n_head_kv * head_dim rows
    assert int(k.n_bytes) == 64 * (256 // 32) * 34
    assert by_name["blk.1.ffn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32


def test_deterministic_for_a_seed(tmp_path: Path) -> None:
    a = write_tiny_llama(tmp_path / "a.gguf", n_layer=2, seed=7)
    b = write_tiny_llama(tmp_path / "b.gguf", n_layer=2, seed=7)
    c = write_tiny_llama(tmp_path / "c.gguf", n_layer=2, seed=8)
    assert _sha(a) == _sha(b)
    assert _sha(a) != _sha(c)


def test_split_shards(tmp_path: Path) -> None:
    first = write_tiny_llama(tmp_path / "split.gguf", split_max_tensors=15)
    assert first.name == "split-00001-of-00003.gguf"
    shards = sorted(tmp_path.glob("split-*-of-00003.gguf"))
    assert [p.name for p in shards] == [f"split-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    counts = [len(gguf.GGUFReader(p).tensors) for p in shards]
    assert counts == [15, 15, 9]
    assert _field(gguf.GGUFReader(shards[1]), "split.no") == 1
    assert _field(gguf.GGUFReader(shards[0]), "split.count") == 3


def test_sparse_70b_is_sparse_and_well_formed(tmp_path: Path) -> None:
    path = write_sparse_70b_header(tmp_path / "70b.gguf", with_vocab=False)
    st = path.stat()
    assert st.st_size > 35 * 2**30
    assert st.st_blocks * 512 < 64 * 2**20  # only the header is on disk
    r = gguf.GGUFReader(path)
    assert len(r.tensors) == 1 + 80 * 9 + 2
    by_name = {t.name: t for t in r.tensors}
    q = by_name["blk.79.attn_q.weight"]
    assert q.tensor_type == gguf.GGMLQuantizationType.Q4_K
    assert list(q.shape) == [8192, 8192] and int(q.n_bytes) == 8192 * 8192 // 256 * 144
    assert list(by_name["blk.0.attn_k.weight"].shape) == [8192, 1024]  # 8 KV heads x 128
    last = max(r.tensors, key=lambda t: int(t.data_offset))
    assert int(last.data_offset) + int(last.n_bytes) <= st.st_size


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_vocab": 100}, "n_vocab"),
        ({"n_embd": 250, "n_head": 4}, "multiple of n_head"),
        ({"n_head": 4, "n_head_kv": 3}, "multiple of n_head_kv"),
        ({"n_embd": 48, "n_head": 4, "weight_type": "q8_0"}, "q8_0"),
        ({"weight_type": "q4_k"}, "unknown weight type"),
        ({"n_layer": 0}, "positive"),
    ],
)
def test_rejects_bad_dimensions(tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ModelError, match=message):
        write_tiny_llama(tmp_path / "bad.gguf", **kwargs)  # type: ignore[arg-type]
