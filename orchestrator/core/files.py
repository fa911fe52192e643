"""Writing files so that a reader never sees half of one: plans, reports, the artifact cache, lab state."""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from orchestrator.core.errors import RpcfleetError


@contextlib.contextmanager
def atomic_path(path: str | Path, *, parents: bool = False) -> Iterator[Path]:
    """A uniquely named temporary path in `path`'s folder, for the block to write; flushed to disk and
    renamed over `path` when the block ends (the folder flushed too, so a crash leaves the old file or
    the whole new one), removed when it raises (its exception goes on unchanged).

    `parents`: create missing folders first. For writers that stream (a download, a copy, a generated
    model); `write_atomic` for a text or bytes already in memory.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path()
    if parents:
        directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        tmp.chmod(0o644)  # mkstemp makes it 0600: give it what an ordinary write would
        replace_durably(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: str | Path, data: str | bytes, *, parents: bool = False) -> None:
    """Write `data` (text as UTF-8) to `path` through a temporary file in the same folder, synced to disk
    before the rename. The temporary file never stays behind; a failure is an RpcfleetError naming
    `path`."""
    try:
        with atomic_path(path, parents=parents) as tmp, tmp.open("wb") as out:
            out.write(data.encode() if isinstance(data, str) else data)
    except OSError as exc:
        raise RpcfleetError(f"cannot write {path}: {exc.strerror or exc}") from None


def replace_durably(source: Path, target: Path) -> None:
    """Rename `source` over `target` (one file system) with both on disk first: the file's bytes before
    the rename, the folder's entry after it."""
    with source.open("rb") as f:
        os.fsync(f.fileno())
    source.replace(target)
    folder = os.open(target.parent if str(target.parent) else ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def sha256_file(path: Path, *, chunk: int = 1 << 20) -> str:
    """The hex sha256 of a file, read in blocks (no file is held in memory)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def loose_write_mode(path: Path) -> int | None:
    """`path`'s permission bits when its group or other users may write it, else None (missing or
    unreadable too): a key file others may change lets them add a key of their own, or swap one."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None
    return mode if mode & (stat.S_IWGRP | stat.S_IWOTH) else None
