"""GGUF → model profile: what a planner needs to know about a model, from metadata and tensor infos only.

The tensor data is never read. gguf-py's `GGUFReader` parses every metadata array element in Python
(seconds for a 128k-token vocabulary), so this module has its own small header parser: it memory-maps
each file and touches only the header pages, skipping string arrays without decoding them.

Split models (`name-00001-of-00003.gguf`) are read across all shards: metadata from the first shard,
tensor infos from every shard.
"""

from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from orchestrator.core.errors import ModelError
from orchestrator.planning.architectures import GENERIC, RECURRENT, ArchRules, arch_rules
from orchestrator.planning.settings import KV_CACHE_TYPE_NAMES

GGUF_MAGIC = b"GGUF"


DEFAULT_ALIGNMENT = 32


# The ggml type of each KV cache type llama.cpp accepts (planning.settings.KV_CACHE_TYPE_NAMES).
KV_CACHE_TYPES: dict[str, GGMLQuantizationType] = {
    name: GGMLQuantizationType[name.upper()] for name in KV_CACHE_TYPE_NAMES
}


@dataclass(frozen=True)
class SwaRule:
    """How an architecture's layers slide (its `load_arch_hparams` in llama.cpp's src/models/<arch>.cpp):
    `load_swa_pattern(ml, pattern, dense_first)` reads `<arch>.attention.sliding_window_pattern` (a per-layer
    bool array, or an integer period) and falls back to `pattern`; `set_swa_pattern` (llama-hparams.cpp)
    then makes layer il full when il % pattern == pattern - 1 (dense_first: when il % pattern == 0).
    `default_window`: n_swa when the GGUF has no `attention.sliding_window` key (0: no SWA without it)."""

    pattern: int
    dense_first: bool = False
    default_window: int = 0


# llama.cpp 0.3.36's architectures with a standard sliding window whose pattern comes from
# load_swa_pattern (src/models/*.cpp). gemma3 slides only when attention.sliding_window > 0.
SWA_RULES: dict[str, SwaRule] = {
    "gemma2": SwaRule(2, default_window=4096),
    "gemma3": SwaRule(6),
    "gemma3n": SwaRule(5),
    "gemma-embedding": SwaRule(6),
    "cohere2": SwaRule(4),
    "gpt-oss": SwaRule(2),
    "exaone4": SwaRule(4),
    "olmo2": SwaRule(4),
    "smallthinker": SwaRule(4, dense_first=True),
}


def swa_layers_of(meta: dict[str, Any], arch: str, n_layer: int, path: Path) -> tuple[int, tuple[bool, ...]]:
    """(n_swa, which layers slide) as llama.cpp derives them for `arch`; (0, ()) when none slide."""
    rule = SWA_RULES.get(arch)
    if rule is None:
        return 0, ()
    n_swa = _int(meta, f"{arch}.attention.sliding_window", path, default=rule.default_window or -1)
    if n_swa <= 0:
        return 0, ()
    key = f"{arch}.attention.sliding_window_pattern"
    value = meta.get(key, rule.pattern)
    if isinstance(value, list):  # llama.cpp's get_arr: the per-layer flags as given
        if len(value) != n_layer:
            raise ModelError(f"{path}: {key} has {len(value)} entries for {n_layer} layers")
        return n_swa, tuple(bool(v) for v in value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelError(f"{path}: {key} must be a non-negative integer or an array, got {value!r}")
    if rule.dense_first:
        flags = tuple(value == 0 or il % value != 0 for il in range(n_layer))
    else:
        flags = tuple(value == 0 or il % value < value - 1 for il in range(n_layer))
    return n_swa, flags if any(flags) else ()


_SHARD = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


_LAYER = re.compile(r"^blk\.(\d+)\.")


# GGUF value types (gguf.GGUFValueType) → struct format of a scalar.
_SCALARS: dict[int, str] = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}


_STRING = 8


_ARRAY = 9


def row_bytes(type_name: str, n: int) -> int:
    """Bytes of a row of `n` elements of KV cache type `type_name` (ggml_row_size)."""
    try:
        qtype = KV_CACHE_TYPES[type_name]
    except KeyError:
        raise ModelError(
            f"unknown KV cache type {type_name!r}; expected one of {', '.join(KV_CACHE_TYPES)}"
        ) from None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if n % block_size:
        raise ModelError(f"KV cache type {type_name} needs rows that are a multiple of {block_size}, got {n}")
    return n // block_size * type_size


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the GGUF describes it: ggml shape order (ne[0] first), type name, size in bytes."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    n_bytes: int
    shard: int = 0
    data_offset: int = 0  # where its data starts in its shard's file (absolute)


@dataclass(frozen=True)
class ModelProfile:
    """Sizes and hyperparameters of a GGUF model (never its data)."""

    paths: tuple[Path, ...]
    architecture: str
    name: str | None
    n_layer: int
    n_embd: int
    n_head: tuple[int, ...]  # per layer
    n_head_kv: tuple[int, ...]  # per layer
    head_dim_k: int
    head_dim_v: int
    n_ctx_train: int
    n_vocab: int
    layer_bytes: tuple[int, ...]  # sum of blk.<il>.* per layer
    token_embd_bytes: int
    output_bytes: int  # output.weight; 0 when tied
    output_norm_bytes: int
    output_tied: bool
    rope_freqs_bytes: int  # llama.cpp duplicates rope_freqs into every layer's buffer
    other_bytes: int  # tensors that are none of the above (rope_freqs included)
    total_bytes: int  # sum of all tensors
    file_size: int  # all shards together
    tensors: tuple[TensorInfo, ...]
    rules: ArchRules = GENERIC  # per-architecture memory rules (planning/architectures.py)
    n_swa: int = 0  # sliding window (tokens) of the layers that slide; 0 = none slide
    swa_layers: tuple[bool, ...] = ()  # per layer: True where it slides (empty = none): the one source

    @property
    def path(self) -> Path:
        """The path to give llama.cpp (the first shard of a split model)."""
        return self.paths[0]

    @property
    def output_layer_bytes(self) -> int:
        """Weights of the output layer on its device: output + output_norm, or a copy of token_embd."""
        head = self.token_embd_bytes if self.output_tied else self.output_bytes
        return head + self.output_norm_bytes

    def is_swa(self, il: int) -> bool:
        """Layer `il` attends through a sliding window (its KV goes to llama.cpp's SWA cache)."""
        return bool(self.swa_layers) and self.swa_layers[il]

    @property
    def swa_layer_ids(self) -> tuple[int, ...]:
        return tuple(il for il in range(self.n_layer) if self.is_swa(il))

    def n_embd_k_gqa(self, il: int) -> int:
        return self.head_dim_k * self.n_head_kv[il]

    def n_embd_v_gqa(self, il: int) -> int:
        return self.head_dim_v * self.n_head_kv[il]

    def n_embd_v_gqa_max(self) -> int:
        return self._v_gqa_max

    @cached_property
    def _v_gqa_max(self) -> int:  # the planner asks for every trial split
        return max(self.n_embd_v_gqa(il) for il in range(self.n_layer))

    def kv_bytes_per_token(
        self, layer: int, type_k: str = "f16", type_v: str = "f16", *, v_trans: bool = False
    ) -> int:
        """K + V cache bytes of one token (one cell) in `layer`.

        With `v_trans` (no flash attention) llama.cpp sizes every V row to the largest layer's width.
        Layers without KV heads hold no cache, nor do recurrent or shared-KV layers; MLA caches K only.
        """
        if self.n_head_kv[layer] == 0 or not self.rules.has_kv(layer):
            return 0
        n_v = self.n_embd_v_gqa_max() if v_trans else self.n_embd_v_gqa(layer)
        v = 0 if self.rules.mla else row_bytes(type_v, n_v)
        return row_bytes(type_k, self.n_embd_k_gqa(layer)) + v

    @cached_property
    def _layer_tensors(self) -> tuple[tuple[TensorInfo, ...], ...]:
        per: list[list[TensorInfo]] = [[] for _ in range(self.n_layer)]
        for t in self.tensors:
            m = _LAYER.match(t.name)
            if m:
                per[int(m.group(1))].append(t)
        return tuple(tuple(x) for x in per)

    def layer_tensors(self, il: int) -> tuple[TensorInfo, ...]:
        """The tensors of layer `il` (`blk.<il>.*`), grouped once: the planner asks for every trial split."""
        return self._layer_tensors[il]

    def layer_bytes_aligned(self, il: int, alignment: int = 1) -> int:
        """Bytes of layer `il` in a backend buffer: each tensor padded to `alignment`, plus rope_freqs
        (llama.cpp creates a copy of rope_freqs in every layer's buffer)."""
        sizes = [t.n_bytes for t in self._layer_tensors[il]]
        if self.rope_freqs_bytes:
            sizes.append(self.rope_freqs_bytes)
        return sum(_pad(n, alignment) for n in sizes)

    def largest_tensor(self, layers: Iterable[int]) -> int:
        """Bytes of the largest single tensor of `layers` (index n_layer: the output layer; 0: none). An
        rpc-server receives each tensor in one message, read whole into memory of its own before it is
        copied into the device's buffer: the most a load adds to what the plan puts on the server."""
        head = self.token_embd_bytes if self.output_tied else self.output_bytes
        sizes = [0]
        for il in layers:
            if il >= self.n_layer:
                sizes += [head, self.output_norm_bytes]
            else:
                sizes += [t.n_bytes for t in self._layer_tensors[il]] + [self.rope_freqs_bytes]
        return max(sizes)

    def expert_bytes_aligned(self, il: int, alignment: int = 1) -> int:
        """Bytes of layer `il`'s expert tensors, the ones --n-cpu-moe keeps on the CPU (common.h
        LLM_FFN_EXPS_REGEX: `blk.N.ffn_(up|down|gate|gate_up)_(ch|)exps`)."""
        return sum(_pad(t.n_bytes, alignment) for t in self._layer_tensors[il] if _EXPERTS.search(t.name))

    def output_layer_bytes_aligned(self, alignment: int = 1) -> int:
        head = self.token_embd_bytes if self.output_tied else self.output_bytes
        return _pad(head, alignment) + _pad(self.output_norm_bytes, alignment)


_EXPERTS = re.compile(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps")


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment if alignment > 1 else n


class _Cursor:
    """Sequential little-endian reads over a memory-mapped header; any overrun is a truncated file."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise ModelError(
                f"{self.path}: truncated GGUF header (needs byte {self.pos + n}, file has {len(self.buf)})"
            )

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        self._need(size)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        self._need(n)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            n = self.scalar("Q")
            self._need(n)
            self.pos += n

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            sub = self.scalar("I")
            count = self.scalar("Q")
            if sub == _STRING:
                # Vocabularies: skipped, never decoded; only the length is kept.
                self.skip_strings(count)
                return _SkippedStrings(count)
            if sub in _SCALARS:
                fmt = _SCALARS[sub]
                size = struct.calcsize("<" + fmt)
                self._need(size * count)
                if count > 4096:
                    # Long numeric arrays (token scores/types) are not needed: skip them too.
                    self.pos += size * count
                    return _SkippedArray(count)
                values = struct.unpack_from(f"<{count}{fmt}", self.buf, self.pos)
                self.pos += size * count
                return list(values)
            raise ModelError(f"{self.path}: unsupported GGUF array element type {sub}")
        raise ModelError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")


@dataclass(frozen=True)
class _SkippedStrings:
    count: int


@dataclass(frozen=True)
class _SkippedArray:
    count: int


@dataclass(frozen=True)
class _Header:
    path: Path
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    file_size: int


def _type_name(type_id: int, path: Path, tensor: str) -> tuple[str, int, int]:
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise ModelError(f"{path}: tensor {tensor} has unknown ggml type {type_id}") from None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return qtype.name, block_size, type_size


def _read_header(path: Path, shard: int) -> _Header:
    try:
        with path.open("rb") as f:
            size = path.stat().st_size
            if size < 24:
                raise ModelError(f"{path}: not a GGUF file (only {size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(buf, path, shard, size)
    except OSError as exc:
        raise ModelError(f"{path}: cannot read model: {exc.strerror or exc}") from exc


def _parse(buf: mmap.mmap, path: Path, shard: int, size: int) -> _Header:
    if buf[:4] != GGUF_MAGIC:
        raise ModelError(f"{path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.scalar("I")
    if version not in (2, 3):
        raise ModelError(f"{path}: unsupported GGUF version {version}")
    n_tensors = cur.scalar("Q")
    n_kv = cur.scalar("Q")
    # Each entry needs several bytes: absurd counts mean a corrupt header, not a 2^60-tensor model.
    if n_tensors > size or n_kv > size:
        raise ModelError(f"{path}: corrupt GGUF header (n_tensors={n_tensors}, n_kv={n_kv})")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("I"))
    raw: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("I")
        if n_dims > 8:
            raise ModelError(f"{path}: corrupt tensor info for {name} ({n_dims} dimensions)")
        shape = tuple(cur.scalar("Q") for _ in range(n_dims))
        type_id = cur.scalar("I")
        offset = cur.scalar("Q")
        raw.append((name, shape, type_id, offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ModelError(f"{path}: invalid general.alignment {alignment!r}")
    data_start = _pad(cur.pos, alignment)
    tensors: list[TensorInfo] = []
    for name, shape, type_id, offset in raw:
        type_name, block_size, type_size = _type_name(type_id, path, name)
        n_elements = 1
        for d in shape:
            n_elements *= d
        if shape and shape[0] % block_size:
            raise ModelError(f"{path}: tensor {name} row length {shape[0]} is not a multiple of {block_size}")
        n_bytes = n_elements // block_size * type_size
        if data_start + offset + n_bytes > size:
            raise ModelError(
                f"{path}: truncated: tensor {name} ends at byte {data_start + offset + n_bytes}, "
                f"file has {size}"
            )
        tensors.append(TensorInfo(name, type_name, shape, n_bytes, shard, data_start + offset))
    return _Header(path, metadata, tensors, size)


def read_tensors(path: Path) -> list[TensorInfo]:
    """The tensors of one GGUF file with their data offsets, from its header alone (fast: gguf-py's
    reader would turn every vocabulary entry into Python objects first)."""
    return _read_header(path, 0).tensors


def shard_paths(path: Path) -> tuple[Path, ...]:
    """All shards of a split model given any one of them (or just `path` for a single file)."""
    match = _SHARD.match(path.name)
    if not match:
        return (path,)
    count = int(match["count"])
    paths = tuple(
        path.with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)
    )
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise ModelError(f"{path}: split model is missing shard(s): {', '.join(missing)}")
    return paths


def _per_layer(value: Any, n_layer: int, key: str, path: Path) -> tuple[int, ...]:
    if isinstance(value, list):
        if len(value) != n_layer:
            raise ModelError(f"{path}: {key} has {len(value)} entries for {n_layer} layers")
        return tuple(int(v) for v in value)
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * n_layer
    raise ModelError(f"{path}: {key} must be an integer or an array of integers, got {value!r}")


def _required(meta: dict[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise ModelError(f"{path}: missing GGUF key {key}")
    return meta[key]


def _int(meta: dict[str, Any], key: str, path: Path, default: int | None = None) -> int:
    value = meta.get(key, default) if default is not None else _required(meta, key, path)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelError(f"{path}: {key} must be an integer, got {value!r}")
    return value


def profile_model(path: str | Path) -> ModelProfile:
    """Profile a GGUF model (any shard of a split model) from its header; raises ModelError."""
    path = Path(path)
    if not path.exists():
        raise ModelError(f"{path}: no such model file")
    paths = shard_paths(path)
    headers = [_read_header(p, i) for i, p in enumerate(paths)]
    first = headers[0]
    meta = first.metadata
    p0 = first.path
    count = meta.get("split.count", 1)
    if count != len(paths):
        raise ModelError(f"{p0}: split.count is {count} but {len(paths)} shard file(s) were found")

    arch = _required(meta, "general.architecture", p0)
    if not isinstance(arch, str):
        raise ModelError(f"{p0}: general.architecture must be a string")
    n_layer = _int(meta, f"{arch}.block_count", p0)
    n_embd = _int(meta, f"{arch}.embedding_length", p0)
    n_ctx_train = _int(meta, f"{arch}.context_length", p0)
    if n_layer <= 0 or n_embd <= 0:
        raise ModelError(f"{p0}: block_count and embedding_length must be positive")
    # Pure recurrent models have no attention heads (llama-model.cpp: "non-transformer models do not
    # have attention heads"): head_count may be absent, and their head sizes are 0.
    recurrent = arch in RECURRENT
    head_count = meta.get(f"{arch}.attention.head_count", 0) if recurrent else None
    if head_count is None:
        head_count = _required(meta, f"{arch}.attention.head_count", p0)
    n_head = _per_layer(head_count, n_layer, "head_count", p0)
    n_head_kv = _per_layer(
        meta.get(f"{arch}.attention.head_count_kv", list(n_head)), n_layer, "head_count_kv", p0
    )
    if n_head[0] <= 0 and not recurrent:
        raise ModelError(f"{p0}: attention.head_count must be positive")
    # llama.cpp: n_embd_head_k = n_embd / n_head(0) unless key_length says otherwise (likewise v).
    per_head = n_embd // n_head[0] if n_head[0] > 0 else 0
    head_dim_k = _int(meta, f"{arch}.attention.key_length", p0, default=per_head) if per_head else 0
    head_dim_v = _int(meta, f"{arch}.attention.value_length", p0, default=per_head) if per_head else 0

    tensors = tuple(t for h in headers for t in h.tensors)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ModelError(f"{p0}: duplicate tensor names across shards")
    expected = meta.get("split.tensors.count")
    if isinstance(expected, int) and expected != len(tensors):
        raise ModelError(
            f"{p0}: split.tensors.count is {expected} but the shards hold {len(tensors)} tensors"
        )

    layer_bytes = [0] * n_layer
    by_name = {t.name: t for t in tensors}
    other = 0
    for t in tensors:
        m = _LAYER.match(t.name)
        if m:
            il = int(m.group(1))
            if il >= n_layer:
                raise ModelError(f"{p0}: tensor {t.name} is beyond block_count {n_layer}")
            layer_bytes[il] += t.n_bytes
        elif t.name not in ("token_embd.weight", "output.weight", "output_norm.weight"):
            other += t.n_bytes
    if "token_embd.weight" not in by_name:
        raise ModelError(f"{p0}: missing tensor token_embd.weight")
    token_embd = by_name["token_embd.weight"]
    vocab = meta.get(f"{arch}.vocab_size")
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(vocab, int):
        n_vocab = vocab
    elif isinstance(tokens, _SkippedStrings):
        n_vocab = tokens.count
    else:
        n_vocab = token_embd.shape[1] if len(token_embd.shape) > 1 else 0
    rope = by_name.get("rope_freqs.weight")
    name = meta.get("general.name")
    n_swa, swa_layers = swa_layers_of(meta, arch, n_layer, p0)
    return ModelProfile(
        paths=paths,
        architecture=arch,
        name=name if isinstance(name, str) else None,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        n_ctx_train=n_ctx_train,
        n_vocab=n_vocab,
        layer_bytes=tuple(layer_bytes),
        token_embd_bytes=token_embd.n_bytes,
        output_bytes=by_name["output.weight"].n_bytes if "output.weight" in by_name else 0,
        output_norm_bytes=by_name["output_norm.weight"].n_bytes if "output_norm.weight" in by_name else 0,
        output_tied="output.weight" not in by_name,
        rope_freqs_bytes=rope.n_bytes if rope else 0,
        other_bytes=other,
        total_bytes=sum(t.n_bytes for t in tensors),
        file_size=sum(h.file_size for h in headers),
        tensors=tensors,
        rules=arch_rules(meta, arch, n_layer, n_embd, n_head[0], n_head_kv),
        n_swa=n_swa,
        swa_layers=swa_layers,
    )


def iter_metadata(path: str | Path) -> Iterator[tuple[str, Any]]:
    """Metadata of one GGUF file (long arrays shown as their length), for diagnostics."""
    header = _read_header(Path(path), 0)
    for key, value in header.metadata.items():
        if isinstance(value, _SkippedStrings | _SkippedArray):
            yield key, f"<array of {value.count}>"
        else:
            yield key, value


@dataclass(frozen=True)
class Vocab:
    """What llama.cpp compares of two vocabularies before it speculates with a draft model
    (`common_speculative_are_compatible`): the tokenizer's type, BOS/EOS and whether they are added, and
    the token texts."""

    model: str  # tokenizer.ggml.model: llama (SPM), gpt2 (BPE), ...
    tokens: tuple[bytes, ...]
    bos: int | None
    eos: int | None
    add_bos: bool
    add_eos: bool


_TOKENS = "tokenizer.ggml.tokens"


def read_vocab(path: str | Path) -> Vocab:
    """The vocabulary of a GGUF model (its first shard holds it), read from the header like the profile
    (the only string array decoded is the tokens'); raises ModelError."""
    path = Path(path)
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != GGUF_MAGIC:
                raise ModelError(f"{path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
            cur = _Cursor(buf, path)
            cur.pos = 8
            cur.scalar("Q")  # tensors
            n_kv = cur.scalar("Q")
            meta: dict[str, Any] = {}
            tokens: tuple[bytes, ...] = ()
            for _ in range(min(n_kv, len(buf))):
                key = cur.string()
                vtype = cur.scalar("I")
                if key == _TOKENS and vtype == _ARRAY and cur.scalar("I") == _STRING:
                    tokens = tuple(_raw_strings(cur, cur.scalar("Q")))
                    continue
                if key == _TOKENS:
                    raise ModelError(f"{path}: {_TOKENS} is not a list of strings")
                meta[key] = cur.value(vtype)
    except (OSError, ValueError) as exc:  # ValueError: mmap of an empty file
        raise ModelError(f"{path}: cannot read model: {getattr(exc, 'strerror', None) or exc}") from None

    def token_id(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        return value if isinstance(value, int) else None

    model = meta.get("tokenizer.ggml.model")
    return Vocab(
        model=model if isinstance(model, str) else "",
        tokens=tokens,
        bos=token_id("bos"),
        eos=token_id("eos"),
        # llama-vocab.cpp's defaults when the key is absent: SPM adds BOS, no tokenizer adds EOS
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    )


def _raw_strings(cur: _Cursor, count: int) -> Iterator[bytes]:
    for _ in range(count):
        n = cur.scalar("Q")
        cur._need(n)
        yield bytes(cur.buf[cur.pos : cur.pos + n])
        cur.pos += n
