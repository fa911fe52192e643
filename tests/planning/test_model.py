"""GGUF → ModelProfile: sizes from tensor infos, cross-checked with gguf-py's reader."""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import pytest

from orchestrator.core.errors import ModelError
from orchestrator.models.synth import write_tiny_llama
from orchestrator.planning.profile import KV_CACHE_TYPES, iter_metadata, profile_model, row_bytes


def _reader_sizes(paths: tuple[Path, ...]) -> dict[str, int]:
    return {t.name: int(t.n_bytes) for p in paths for t in gguf.GGUFReader(p).tensors}


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"weight_type": "q8_0"},
        {"n_head": 8, "n_head_kv": 2},
        {"tied_output": True},
        {"n_layer": 3, "n_embd": 128, "n_head": 2, "n_head_kv": 1, "n_ff": 384, "weight_type": "f32"},
    ],
)
def test_profile_equals_sums_of_tensor_sizes(tiny_model_factory, kwargs: dict[str, object]) -> None:  # type: ignore[no-untyped-def]
    path = tiny_model_factory(**kwargs)
    m = profile_model(path)
    sizes = _reader_sizes(m.paths)
    n_layer = int(kwargs.get("n_layer", 4))  # type: ignore[call-overload]
    n_embd = int(kwargs.get("n_embd", 256))  # type: ignore[call-overload]
    n_head = int(kwargs.get("n_head", 4))  # type: ignore[call-overload]
    n_head_kv = int(kwargs.get("n_head_kv", n_head))  # type: ignore[call-overload]
    assert m.architecture == "llama"
    assert (m.n_layer, m.n_embd, m.n_ctx_train, m.n_vocab) == (n_layer, n_embd, 4096, 300)
    assert m.n_head == (n_head,) * n_layer and m.n_head_kv == (n_head_kv,) * n_layer
    assert m.head_dim_k == m.head_dim_v == n_embd // n_head
    for il in range(n_layer):
        assert m.layer_bytes[il] == sum(v for k, v in sizes.items() if k.startswith(f"blk.{il}."))
        assert m.layer_bytes_aligned(il) == m.layer_bytes[il]
        assert m.n_embd_k_gqa(il) == m.n_embd_v_gqa(il) == n_head_kv * (n_embd // n_head)
    assert m.token_embd_bytes == sizes["token_embd.weight"]
    assert m.output_norm_bytes == sizes["output_norm.weight"] == n_embd * 4
    assert m.output_tied is bool(kwargs.get("tied_output", False))
    assert m.output_bytes == sizes.get("output.weight", 0)
    assert m.output_layer_bytes == (m.token_embd_bytes if m.output_tied else m.output_bytes) + n_embd * 4
    assert m.total_bytes == sum(sizes.values())
    assert m.other_bytes == 0 and m.rope_freqs_bytes == 0
    assert m.total_bytes == sum(m.layer_bytes) + m.token_embd_bytes + m.output_bytes + m.output_norm_bytes
    assert m.file_size == path.stat().st_size
    assert m.path == path and len(m.tensors) == len(sizes)


def test_kv_bytes_per_token_for_each_cache_type(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    m = profile_model(tiny_model_factory(n_head=8, n_head_kv=2))  # n_embd_k_gqa = 2 * 32 = 64
    assert m.kv_bytes_per_token(0) == 64 * 2 * 2
    assert m.kv_bytes_per_token(0, "f32", "f32") == 64 * 4 * 2
    assert m.kv_bytes_per_token(0, "q8_0", "q8_0") == 2 * (64 // 32 * 34)
    assert m.kv_bytes_per_token(0, "q4_0", "f16") == 64 // 32 * 18 + 64 * 2
    for name, qtype in KV_CACHE_TYPES.items():
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        assert row_bytes(name, 256) == 256 // block * size
    with pytest.raises(ModelError, match="unknown KV cache type"):
        m.kv_bytes_per_token(0, "q3_k")
    with pytest.raises(ModelError, match="multiple of 32"):
        row_bytes("q8_0", 48)


def test_split_model_reads_every_shard(tmp_path: Path, tiny_model: Path) -> None:
    first = write_tiny_llama(tmp_path / "m.gguf", split_max_tensors=10)
    whole = profile_model(tiny_model)
    for shard in sorted(tmp_path.glob("m-*.gguf")):
        m = profile_model(shard)  # any shard finds the others
        assert m.paths[0] == first and len(m.paths) == 4
        assert m.layer_bytes == whole.layer_bytes
        assert m.total_bytes == whole.total_bytes
        assert m.output_bytes == whole.output_bytes and m.n_vocab == whole.n_vocab
        assert m.file_size == sum(p.stat().st_size for p in m.paths)
    (tmp_path / "m-00003-of-00004.gguf").unlink()
    with pytest.raises(ModelError, match=r"missing shard.*m-00003-of-00004"):
        profile_model(first)


def test_sparse_70b_profile_is_fast(sparse_70b: Path) -> None:
    t0 = time.perf_counter()
    m = profile_model(sparse_70b)
    elapsed = time.perf_counter() - t0
    print(f"profile of the sparse 70B header: {elapsed * 1000:.1f} ms")
    assert elapsed < 5.0  # about 60 ms here; timings proper live in the benchmarks
    assert (m.n_layer, m.n_embd, m.n_vocab) == (80, 8192, 128256)
    assert m.n_head == (64,) * 80 and m.n_head_kv == (8,) * 80 and m.head_dim_k == 128
    assert m.n_embd_k_gqa(0) == 1024
    assert m.kv_bytes_per_token(0) == 1024 * 2 * 2
    assert len(m.tensors) == 723
    q4k = 144 / 256
    q6k = 210 / 256
    expected_layer = 8192 * 4 * 2 + int(
        (8192 * 8192 * 2 + 1024 * 8192 + 2 * 28672 * 8192) * q4k + (1024 * 8192 + 28672 * 8192) * q6k
    )
    assert m.layer_bytes == (expected_layer,) * 80
    assert m.total_bytes == sum(m.layer_bytes) + 2 * int(128256 * 8192 * q6k) + 8192 * 4
    assert m.file_size == sparse_70b.stat().st_size


def test_per_layer_head_counts_and_explicit_head_dims(tmp_path: Path) -> None:
    # A hand-written GGUF: head_count_kv as an array, key/value lengths given, rope_freqs present.
    w = gguf.GGUFWriter(tmp_path / "arr.gguf", "llama")
    w.add_context_length(1024)
    w.add_embedding_length(64)
    w.add_block_count(3)
    w.add_head_count(4)
    w.add_head_count_kv([4, 2, 0])
    w.add_key_length(32)
    w.add_value_length(16)
    import numpy as np

    w.add_tensor("token_embd.weight", np.zeros((10, 64), dtype=np.float16))
    w.add_tensor("rope_freqs.weight", np.zeros(8, dtype=np.float32))
    for il in range(3):
        w.add_tensor(f"blk.{il}.attn_norm.weight", np.zeros(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    m = profile_model(tmp_path / "arr.gguf")
    assert m.n_head_kv == (4, 2, 0) and m.head_dim_k == 32 and m.head_dim_v == 16
    assert [m.n_embd_k_gqa(i) for i in range(3)] == [128, 64, 0]
    assert [m.n_embd_v_gqa(i) for i in range(3)] == [64, 32, 0]
    assert m.kv_bytes_per_token(1) == 64 * 2 + 32 * 2
    assert m.kv_bytes_per_token(1, v_trans=True) == 64 * 2 + 64 * 2  # V rows sized to the widest layer
    assert m.kv_bytes_per_token(2) == 0
    assert m.output_tied and m.output_bytes == 0 and m.output_norm_bytes == 0
    assert m.rope_freqs_bytes == 32 and m.other_bytes == 32
    assert m.layer_bytes_aligned(0) == 256 + 32
    assert m.layer_bytes_aligned(0, 128) == 256 + 128
    assert m.n_vocab == 10  # no vocab_size and no tokenizer: token_embd's rows
    assert dict(iter_metadata(tmp_path / "arr.gguf"))["llama.attention.head_count_kv"] == [4, 2, 0]


def test_errors_name_the_file(tmp_path: Path, tiny_model: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelError, match=r"nope\.gguf: no such model file"):
        profile_model(missing)
    text = tmp_path / "text.gguf"
    text.write_text("this is not a model, just some text\n")
    with pytest.raises(ModelError, match=r"text\.gguf: not a GGUF file"):
        profile_model(text)
    tiny = tmp_path / "tiny.gguf"
    tiny.write_bytes(b"GG")
    with pytest.raises(ModelError, match=r"tiny\.gguf: not a GGUF file"):
        profile_model(tiny)
    data = tiny_model.read_bytes()
    header_cut = tmp_path / "header-cut.gguf"
    header_cut.write_bytes(data[:3000])
    with pytest.raises(ModelError, match=r"header-cut\.gguf: truncated GGUF header"):
        profile_model(header_cut)
    data_cut = tmp_path / "data-cut.gguf"
    data_cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelError, match=r"data-cut\.gguf: truncated: tensor output\.weight"):
        profile_model(data_cut)
    bad_version = tmp_path / "v9.gguf"
    bad_version.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + data[8:])
    with pytest.raises(ModelError, match="unsupported GGUF version 9"):
        profile_model(bad_version)


def test_missing_keys(tmp_path: Path) -> None:
    import numpy as np

    def write(name: str, **keys: int) -> Path:
        w = gguf.GGUFWriter(tmp_path / name, "llama")
        for key, value in keys.items():
            w.add_uint32(f"llama.{key.replace('__', '.')}", value)
        w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float16))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return tmp_path / name

    full = {"block_count": 1, "embedding_length": 32, "context_length": 64, "attention__head_count": 2}
    assert profile_model(write("ok.gguf", **full)).n_layer == 1
    for key in full:
        keys = {k: v for k, v in full.items() if k != key}
        path = write(f"no-{key}.gguf", **keys)
        with pytest.raises(
            ModelError, match=rf"no-{key}\.gguf: missing GGUF key llama\.{key.replace('__', '.')}"
        ):
            profile_model(path)
