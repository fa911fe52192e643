"""The hash manifest of a model file: what the RPC client rpcfleet builds reads instead of hashing.

llama.cpp's RPC client hashes every weight tensor over HASH_THRESHOLD (FNV-1a-64) on every load to ask
the servers' caches for it. rpcfleet already knows those hashes: the memo of each model file
(`caches.plan`) holds them, valid for the file's device, inode, size, mtime and ctime. Wherever that
memo is written, the same hashes are also written here, in a form the client's `hash-manifest` patch
(artifacts/patches.py, `hash_manifest.cpp`) parses in a few lines: one file per model file, named by its
device and inode (what the client finds from a tensor's mapping in /proc/self/maps and a stat):

    rpcfleet-fnv-manifest 1
    dev 65024 ino 2146377 size 1234567 mtime_ns 1700000000000000000 ctime_ns 1700000000000000000
    4096 26214400 918e0b60fb7af1b5
    ...
    end

then one `offset size hash` line per tensor (absolute file offset, bytes, 16 hex digits), sorted by
offset, and `end` (a file cut short is no manifest). The client uses an entry only for a tensor whose
bytes it reads through a read-only mapping of that very file, unchanged since (all five fields), at
exactly that offset and size; anything else it hashes as stock llama.cpp does. Engines rpcfleet starts
get `$GGML_RPC_HASH_MANIFESTS` (`engine_environment`).
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from orchestrator.artifacts.patches import HASH_LOG_ENV, HASH_MANIFEST_ENV
from orchestrator.core.errors import RpcfleetError
from orchestrator.core.files import write_atomic
from orchestrator.core.paths import rpcfleet_home

MAGIC = "rpcfleet-fnv-manifest 1"
IDENTITY_FIELDS = ("dev", "ino", "size", "mtime_ns", "ctime_ns")

__all__ = ["HASH_LOG_ENV", "HASH_MANIFEST_ENV"]


def manifest_dir() -> Path:
    """Where manifests are kept: beside the memos (`$RPCFLEET_HOME/hashes`)."""
    return rpcfleet_home() / "hashes"


def manifest_path(identity: Mapping[str, int], folder: Path | None = None) -> Path:
    """The manifest of the file `identity` names (its `dev` and `ino`)."""
    return (folder or manifest_dir()) / f"{identity['dev']}-{identity['ino']}.fnv"


def format_manifest(identity: Mapping[str, int], hashes: Mapping[tuple[int, int], int]) -> str:
    """Pure: the manifest text of a file with `identity` (IDENTITY_FIELDS) and `hashes` ((offset,
    size) -> FNV-1a-64), sorted by offset."""
    head = " ".join(f"{k} {int(identity[k])}" for k in IDENTITY_FIELDS)
    lines = [f"{offset} {size} {h:016x}" for (offset, size), h in sorted(hashes.items())]
    return "\n".join([MAGIC, head, *lines, "end"]) + "\n"


@dataclass(frozen=True)
class HashManifest:
    identity: dict[str, int]
    hashes: dict[tuple[int, int], int]


_HEAD = re.compile(r"^" + r" ".join(rf"{k} (\d+)" for k in IDENTITY_FIELDS) + r"$")
_ENTRY = re.compile(r"^(\d+) (\d+) ([0-9a-f]{16})$")


def parse_manifest(text: str) -> HashManifest | None:
    """Pure: a manifest's identity and entries, or None when it is not a whole manifest."""
    lines = text.splitlines()
    if len(lines) < 3 or lines[0] != MAGIC or lines[-1] != "end" or not (head := _HEAD.match(lines[1])):
        return None
    hashes: dict[tuple[int, int], int] = {}
    for line in lines[2:-1]:
        if not (m := _ENTRY.match(line)):
            return None
        hashes[(int(m.group(1)), int(m.group(2)))] = int(m.group(3), 16)
    return HashManifest(dict(zip(IDENTITY_FIELDS, map(int, head.groups()), strict=True)), hashes)


def write_manifest(identity: Mapping[str, int], hashes: Mapping[tuple[int, int], int]) -> None:
    """Write the manifest of a file (atomically: a reader sees the old one or the new one). A manifest
    that cannot be written only costs the client its hashing, so that is not an error."""
    with contextlib.suppress(OSError, RpcfleetError):
        write_atomic(manifest_path(identity), format_manifest(identity, hashes), parents=True)


def has_manifest(identity: Mapping[str, int], keys: Mapping[tuple[int, int], int]) -> bool:
    """Whether the manifest of `identity` exists, for that identity, and lists every key of `keys`."""
    try:
        found = parse_manifest(manifest_path(identity).read_text())
    except (OSError, UnicodeDecodeError):
        return False
    return (
        found is not None
        and all(found.identity[k] == identity[k] for k in IDENTITY_FIELDS)
        and all(found.hashes.get(k) == v for k, v in keys.items())
    )


def engine_environment() -> dict[str, str]:
    """The environment an engine rpcfleet starts gets, so its RPC client finds the manifests (a value the
    caller's environment already gives, even empty, which turns the lookup off, wins)."""
    return {HASH_MANIFEST_ENV: str(manifest_dir())}


def hash_log_counts(text: str) -> Counter[str]:
    """Pure: from the patched client's `$GGML_RPC_HASH_LOG` (one `how why size hash` line per weight
    tensor), how many tensors took their hash from a manifest (`manifest`) and how many were hashed, by
    reason (`hashed no-manifest`, `hashed file-changed`, ...)."""
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4:
            counts["manifest" if parts[0] == "manifest" else f"hashed {parts[1]}"] += 1
    return counts
