"""Atomic writes: a reader sees the old file or the new one, never half of one, and no temporary file
stays behind."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from orchestrator.core.errors import RpcfleetError
from orchestrator.core.files import atomic_path, write_atomic


def test_write_atomic(tmp_path: Path) -> None:
    target = tmp_path / "r.json"
    target.write_text("old")
    write_atomic(target, "new")
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
    assert target.stat().st_mode & 0o777 == 0o644
    write_atomic(target, b"\x00bytes")
    assert target.read_bytes() == b"\x00bytes"
    with pytest.raises(RpcfleetError, match="cannot write"):
        write_atomic(tmp_path / "missing" / "r.json", "x")
    write_atomic(tmp_path / "made" / "deeper" / "r.json", "x", parents=True)
    assert (tmp_path / "made" / "deeper" / "r.json").read_text() == "x"
    # A failed rename (the target is a folder) leaves no temporary file behind.
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(RpcfleetError, match="cannot write"):
        write_atomic(tmp_path / "dir.json", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.json", "made", "r.json"]


def test_a_block_that_raises_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "model.gguf"
    target.write_text("old")
    with pytest.raises(ValueError, match="half written"), atomic_path(target) as tmp:
        tmp.write_text("new, but")
        raise ValueError("half written")  # the block's own error goes on unchanged
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]
    with atomic_path(tmp_path / "a" / "b.bin", parents=True) as tmp:
        assert tmp.parent == tmp_path / "a" and not tmp.read_bytes()
        tmp.write_bytes(b"done")
    assert (tmp_path / "a" / "b.bin").read_bytes() == b"done"


def test_concurrent_writers_never_mix(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    contents = [str(i) * 200_000 for i in range(4)]
    for _ in range(20):
        threads = [threading.Thread(target=write_atomic, args=(target, text)) for text in contents]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert target.read_text() in contents
        assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_the_bytes_reach_the_disk_before_the_rename_and_the_folder_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a power cut finds: the old file or the whole new one, never a renamed empty file."""
    target = tmp_path / "state.json"
    events: list[str] = []
    real_fsync, real_replace = os.fsync, Path.replace

    def fsync(fd: int) -> None:
        events.append("fsync dir" if Path(f"/proc/self/fd/{fd}").is_dir() else "fsync file")
        real_fsync(fd)

    def replace(self: Path, other: Path) -> Path:
        events.append("rename")
        return real_replace(self, other)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "replace", replace)
    write_atomic(target, "{}")
    assert events == ["fsync file", "rename", "fsync dir"]
    events.clear()
    with atomic_path(target) as tmp:  # a streaming writer: the same order
        tmp.write_text("[]")
    assert events == ["fsync file", "rename", "fsync dir"] and target.read_text() == "[]"
