"""Which tensors a plan sends to each RPC endpoint through the servers' tensor cache, and their names.

llama.cpp (`ggml-rpc.cpp`, 0.3.36) asks the server's cache only for tensors of a weight buffer larger than
`HASH_THRESHOLD` (10 MiB); the name is the FNV-1a-64 of the tensor's bytes. An endpoint's tensors are those
of its devices' layers (`blk.<il>.*`) plus, on the device that holds the output layer, `output.weight` and
`output_norm.weight` (a copy of `token_embd.weight` when the output is tied), exactly as the planner places
them (docs/llama-rpc.md §6). The bytes are the file's: a tensor is uploaded as it is stored.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from orchestrator.core.errors import RpcfleetError
from orchestrator.core.files import write_atomic
from orchestrator.core.fnv import cache_name, hash_file_range
from orchestrator.core.paths import rpcfleet_home
from orchestrator.engine.threads import thread_pool
from orchestrator.planning.plan import Plan
from orchestrator.planning.profile import read_tensors

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
    out: list[TensorSlice] = []
    for path in paths:
        out += [TensorSlice(t.name, Path(path), t.data_offset, t.n_bytes) for t in read_tensors(Path(path))]
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


def _memo_path(path: Path) -> Path:
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]
    return rpcfleet_home() / "hashes" / f"{digest}.json"


def _read_memo(path: Path) -> dict[str, int]:
    """Hashes remembered for this file ("offset:size" -> hash), valid while its size and mtime stay."""
    try:
        st = path.stat()
        data = json.loads(_memo_path(path).read_text())
        if data.get("size") == st.st_size and data.get("mtime_ns") == st.st_mtime_ns:
            return {k: int(v, 16) for k, v in data["hashes"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return {}


def _write_memo(path: Path, hashes: dict[str, int]) -> None:
    st = path.stat()
    text = json.dumps(
        {
            "path": str(path.resolve()),
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "hashes": {k: cache_name(v) for k, v in sorted(hashes.items())},
        }
    )
    with contextlib.suppress(OSError, RpcfleetError):  # a memo that cannot be written is only slower
        write_atomic(_memo_path(path), text, parents=True)


def remembered(tensors: Iterable[TensorSlice]) -> dict[TensorSlice, str]:
    """The cache names the memo holds for `tensors` (none is hashed)."""
    items = list(tensors)
    known = {p: _read_memo(p) for p in {t.path for t in items}}
    found = {t: known[t.path].get(f"{t.offset}:{t.size}") for t in items}
    return {t: cache_name(h) for t, h in found.items() if h is not None}


def remember(named: Iterable[tuple[Path, int, int, str]]) -> None:
    """Add names learned elsewhere (a warm names what it sends: `path, offset, size, name`) to the memo."""
    by_path: dict[Path, dict[str, int]] = {}
    for path, offset, size, name in named:
        by_path.setdefault(path, {})[f"{offset}:{size}"] = int(name, 16)
    for path, hashes in by_path.items():
        known = _read_memo(path)
        if any(k not in known for k in hashes):
            with contextlib.suppress(OSError):
                _write_memo(path, {**known, **hashes})


def hash_tensors(tensors: Iterable[TensorSlice], *, threads: int = 2, memo: bool = True) -> list[CacheTensor]:
    """Cache names for `tensors`, hashed natively in `threads` parallel threads (the C loop drops the GIL).
    With `memo`, hashes are remembered per model file (`$RPCFLEET_HOME/hashes/`, keyed by path, size and
    mtime), so planning the same model again costs no re-hash."""
    items = list(tensors)
    known: dict[Path, dict[str, int]] = {p: _read_memo(p) for p in {t.path for t in items}} if memo else {}

    def one(t: TensorSlice) -> int:
        found = known.get(t.path, {}).get(f"{t.offset}:{t.size}")
        return found if found is not None else hash_file_range(t.path, t.offset, t.size)

    with thread_pool(threads, "cache-hash") as pool:
        hashes = list(pool.map(one, items))
    if memo:
        for path in {t.path for t in items}:
            mine = {f"{t.offset}:{t.size}": h for t, h in zip(items, hashes, strict=True) if t.path == path}
            if any(k not in known.get(path, {}) for k in mine):
                _write_memo(path, {**known.get(path, {}), **mine})
    return [CacheTensor(cache_name(h), t) for h, t in zip(hashes, items, strict=True)]


def plan_tensors(plan: Plan, model_paths: Iterable[Path]) -> dict[str, list[TensorSlice]]:
    """Per endpoint, the tensors a load of `plan` asks its cache for (not hashed: `hash_tensors`)."""
    return endpoint_tensors(plan, gguf_tensors(model_paths))


def plan_cache(
    plan: Plan, model_paths: Iterable[Path], *, threads: int = 2, memo: bool = True
) -> dict[str, list[CacheTensor]]:
    """Per endpoint, the cache files a load of `plan` asks for (each hashed once even if shared)."""
    per_endpoint = plan_tensors(plan, model_paths)
    unique = {(t.path, t.offset, t.size): t for ts in per_endpoint.values() for t in ts}
    hashed = {
        (c.tensor.path, c.tensor.offset, c.tensor.size): c
        for c in hash_tensors(unique.values(), threads=threads, memo=memo)
    }
    return {ep: [hashed[(t.path, t.offset, t.size)] for t in ts] for ep, ts in per_endpoint.items()}
