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
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from orchestrator.caches.manifest import has_manifest, write_manifest
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


# Racy-git's rule: a file changed within this long before its stat could change again in the same tick
# of the file system's clock (a jiffy, at most 10 ms on Linux) and keep its ctime, so no memo is written
# from such a stat (the hashes are used once, and remembered on a later run).
RACY_NS = 50_000_000


@dataclass(frozen=True)
class FileIdentity:
    """What a memo of a file is valid for: the file (device, inode) and its last change (size, mtime, and
    ctime, which no one can set back: `touch -r` restores mtime, never ctime), stat'ed at `taken_ns`."""

    fields: tuple[tuple[str, int], ...]
    taken_ns: int

    @classmethod
    def of(cls, path: Path) -> FileIdentity:
        taken = time.time_ns()
        st = path.stat()
        values = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        return cls(tuple(zip(("dev", "ino", "size", "mtime_ns", "ctime_ns"), values, strict=True)), taken)

    @property
    def racy(self) -> bool:
        return self.taken_ns - dict(self.fields)["ctime_ns"] < RACY_NS


def _read_memo(path: Path) -> dict[str, int]:
    """Hashes remembered for this file ("offset:size" -> hash), valid while its identity stays."""
    try:
        identity = FileIdentity.of(path)
        data = json.loads(_memo_path(path).read_text())
        if all(data.get(k) == v for k, v in identity.fields):
            return {k: int(v, 16) for k, v in data["hashes"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return {}


def _by_range(hashes: Mapping[str, int]) -> dict[tuple[int, int], int]:
    """The memo's "offset:size" keys as (offset, size)."""
    return {(int(k.partition(":")[0]), int(k.partition(":")[2])): v for k, v in hashes.items()}


def _needs_write(path: Path, known: Mapping[str, int], mine: Mapping[str, int]) -> bool:
    """Whether the memo lacks one of `mine`, or the file's hash manifest (`caches.manifest`: what the
    client reads) is missing or behind the memo (written by an older rpcfleet, or removed)."""
    if any(k not in known for k in mine):
        return True
    with contextlib.suppress(OSError):
        return not has_manifest(dict(FileIdentity.of(path).fields), _by_range({**known, **mine}))
    return False


def _write_memo(path: Path, hashes: dict[str, int], identity: FileIdentity) -> None:
    """Remember `hashes`, read from the file as `identity` (its stat before they were read) says, and
    write its hash manifest with them: nothing is written when the file has changed since, or had
    changed just before (`RACY_NS`)."""
    with contextlib.suppress(OSError, RpcfleetError):  # a memo that cannot be written is only slower
        if identity.racy or FileIdentity.of(path).fields != identity.fields:
            return
        write_manifest(dict(identity.fields), _by_range(hashes))
        text = json.dumps(
            {
                "path": str(path.resolve()),
                **dict(identity.fields),
                "hashes": {k: cache_name(v) for k, v in sorted(hashes.items())},
            }
        )
        write_atomic(_memo_path(path), text, parents=True)


def remembered(tensors: Iterable[TensorSlice]) -> dict[TensorSlice, str]:
    """The cache names the memo holds for `tensors` (none is hashed)."""
    items = list(tensors)
    known = {p: _read_memo(p) for p in {t.path for t in items}}
    found = {t: known[t.path].get(f"{t.offset}:{t.size}") for t in items}
    return {t: cache_name(h) for t, h in found.items() if h is not None}


def identities(paths: Iterable[Path]) -> dict[Path, FileIdentity]:
    """Each readable file's identity now (taken before a warm reads its bytes: `remember`'s `since`)."""
    out: dict[Path, FileIdentity] = {}
    for path in set(paths):
        with contextlib.suppress(OSError):
            out[path] = FileIdentity.of(path)
    return out


def remember(
    named: Iterable[tuple[Path, int, int, str]], since: Mapping[Path, FileIdentity] | None = None
) -> None:
    """Add names learned elsewhere (a warm names what it sends: `path, offset, size, name`) to the memo;
    `since`: each file's identity before those bytes were read (a file changed since gets no memo)."""
    by_path: dict[Path, dict[str, int]] = {}
    for path, offset, size, name in named:
        by_path.setdefault(path, {})[f"{offset}:{size}"] = int(name, 16)
    for path, hashes in by_path.items():
        with contextlib.suppress(OSError):
            identity = (since or {}).get(path) or FileIdentity.of(path)
            known = _read_memo(path)
            if _needs_write(path, known, hashes):
                _write_memo(path, {**known, **hashes}, identity)


def hash_tensors(tensors: Iterable[TensorSlice], *, threads: int = 2, memo: bool = True) -> list[CacheTensor]:
    """Cache names for `tensors`, hashed natively in `threads` parallel threads (the C loop drops the GIL).
    With `memo`, hashes are remembered per model file (`$RPCFLEET_HOME/hashes/`, keyed by path and valid
    for the file's device, inode, size, mtime and ctime), so planning the same model again costs no
    re-hash, and written as the file's hash manifest, so the load's own client hashes none of them."""
    items = list(tensors)
    paths = {t.path for t in items}
    # Taken before any byte is read: a file changed while it is hashed gets no memo (`_write_memo`).
    before = {p: FileIdentity.of(p) for p in paths} if memo else {}
    known: dict[Path, dict[str, int]] = {p: _read_memo(p) for p in paths} if memo else {}

    def one(t: TensorSlice) -> int:
        found = known.get(t.path, {}).get(f"{t.offset}:{t.size}")
        return found if found is not None else hash_file_range(t.path, t.offset, t.size)

    with thread_pool(threads, "cache-hash") as pool:
        hashes = list(pool.map(one, items))
    if memo:
        for path in {t.path for t in items}:
            mine = {f"{t.offset}:{t.size}": h for t, h in zip(items, hashes, strict=True) if t.path == path}
            if _needs_write(path, known.get(path, {}), mine):
                _write_memo(path, {**known.get(path, {}), **mine}, before[path])
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
