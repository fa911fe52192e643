"""Which tensors a plan sends to each RPC endpoint through the servers' tensor cache, and their names.

llama.cpp (`ggml-rpc.cpp`, 0.3.36) asks the server's cache only for tensors of a weight buffer larger than
`HASH_THRESHOLD` (10 MiB); the name is the FNV-1a-64 of the tensor's bytes. An endpoint's tensors are those
of its devices' layers (`blk.<il>.*`) plus, on the device that holds the output layer, `output.weight` and
`output_norm.weight` (a copy of `token_embd.weight` when the output is tied), exactly as the planner places
them (docs/llama-rpc.md §6). The bytes are the file's: a tensor is uploaded as it is stored.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from orchestrator.core.fnv import cache_name, hash_file_range
from orchestrator.planning.plan import Plan

HASH_THRESHOLD = 10 * 1024 * 1024  # ggml-rpc.cpp: tensors strictly larger than this use the cache

_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class TensorSlice:
    """One tensor's bytes in a GGUF file."""

    name: str
    path: Path
    offset: int
    size: int


@dataclass(frozen=True)
class CacheTensor:
    """A tensor a node's cache should hold: its cache file name (the hash) and where its bytes are."""

    file: str  # 16 hex digits
    tensor: TensorSlice


def gguf_tensors(paths: Iterable[Path]) -> list[TensorSlice]:
    """Every tensor of the model's shards with its absolute data offset."""
    import gguf

    out: list[TensorSlice] = []
    for path in paths:
        reader = gguf.GGUFReader(str(path), "r")
        out += [TensorSlice(t.name, Path(path), int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
    return out


def endpoint_tensors(plan: Plan, tensors: Iterable[TensorSlice]) -> dict[str, list[TensorSlice]]:
    """Pure: per RPC endpoint, the tensors over HASH_THRESHOLD that the plan gives its devices."""
    by_name = {t.name: t for t in tensors}
    out: dict[str, list[TensorSlice]] = {ep: [] for ep in plan.endpoints}
    for device in plan.devices:
        if device.endpoint is None:
            continue
        layers = {il for il in device.layers if il < plan.n_layer}
        chosen = [t for t in by_name.values() if (m := _BLOCK.match(t.name)) and int(m.group(1)) in layers]
        if device.has_output:
            output = by_name.get("output.weight") or by_name.get("token_embd.weight")
            chosen += [t for t in (output, by_name.get("output_norm.weight")) if t is not None]
        out[device.endpoint] += [t for t in chosen if t.size > HASH_THRESHOLD]
    return out


def hash_tensors(tensors: Iterable[TensorSlice], *, threads: int = 2) -> list[CacheTensor]:
    """Cache names for `tensors`, hashed natively in `threads` parallel threads (the C loop drops the GIL)."""
    items = list(tensors)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        hashes = list(pool.map(lambda t: hash_file_range(t.path, t.offset, t.size), items))
    return [CacheTensor(cache_name(h), t) for h, t in zip(hashes, items, strict=True)]


def plan_cache(plan: Plan, model_paths: Iterable[Path], *, threads: int = 2) -> dict[str, list[CacheTensor]]:
    """Per endpoint, the cache files a load of `plan` asks for (each hashed once even if shared)."""
    per_endpoint = endpoint_tensors(plan, gguf_tensors(model_paths))
    unique = {(t.path, t.offset, t.size): t for ts in per_endpoint.values() for t in ts}
    hashed = {
        (c.tensor.path, c.tensor.offset, c.tensor.size): c
        for c in hash_tensors(unique.values(), threads=threads)
    }
    return {ep: [hashed[(t.path, t.offset, t.size)] for t in ts] for ep, ts in per_endpoint.items()}
