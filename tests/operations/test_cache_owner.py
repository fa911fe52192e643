"""A warm as root writes as the owner of the cache folder (`cache_stream.as_cache_owner`): the server's
user, whose process it must see and whose folder it must not write in as root."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from orchestrator.core import fnv
from orchestrator.inventory.model import Host
from orchestrator.operations.cache import WarmItem, upload_script
from orchestrator.operations.cache_stream import BLOCK, stream_script


def _source(tmp_path: Path, sizes: list[int]) -> list[WarmItem]:
    data = os.urandom(sum(sizes))
    path = tmp_path / "source.bin"
    path.write_bytes(data)
    items, offset = [], 0
    for size in sizes:
        items.append(WarmItem(f"{fnv.hash_file_range(path, offset, size):016x}", path, offset, size))
        offset += size
    return items


def _stdin(items: list[WarmItem]) -> bytes:
    out = b""
    for item in items:
        with item.path.open("rb") as fh:
            fh.seek(item.offset)
            out += fh.read(item.size) + f"{item.name}\n".encode()
    return out


def test_as_root_the_warm_writes_as_the_cache_folders_owner(tmp_path: Path) -> None:
    """Root's warm of a folder another user owns (the server's: a system unit's `rpcfleet`) runs as that
    user: the mark holds a process of that user (a server under ProtectProc=invisible sees only its own)
    and every file it writes is that user's, so a link planted there leads nowhere that user could not
    write. Below a 0700 folder that user cannot pass (an install dir in root's home), as the unit's
    bind mount lets the server reach it. Both ways of writing: the stream and a file at a time."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the warm takes on another user only as root")
    user = subprocess.run(["id", "-u", "nobody"], capture_output=True, text=True, check=True).stdout.strip()
    home = tmp_path / "home"
    cache = home / "install" / "cache"
    cache.mkdir(parents=True)
    home.chmod(0o700)
    os.chown(cache, int(user), int(user))
    items = _source(tmp_path, [5000, BLOCK + 1])
    folder = cache / "rpc"  # not there yet: the owner of the folder above makes it
    warm = subprocess.Popen(
        ["sh", "-c", stream_script(str(folder), items)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert warm.stdout is not None and warm.stdout.readline() == b"ready\n"
    mark = folder / ".warm-wait"
    pid = int(mark.read_text())
    assert pid == warm.pid  # the script's own process, now the folder owner's
    uids = next(
        line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Uid:")
    )
    assert uids.split()[1:] == [user] * 4
    out, err = warm.communicate(_stdin(items), timeout=60)
    assert warm.returncode == 0, err
    assert out.decode().split() == [w for i in items for w in ("ok", str(i.name))]
    assert {p.name: str(p.stat().st_uid) for p in [folder, *folder.iterdir()]} == {
        "rpc": user,
        **{str(i.name): user for i in items},
    }
    # A file at a time (no `ssh` binary): the same owner.
    host = Host(name="n1", address="127.0.0.1", install_dir=str(home / "install"))
    data = b"x" * 10
    name = f"{fnv.fnv1a64(data):016x}"
    done = subprocess.run(["sh", "-c", upload_script(host, name, len(data))], input=data, capture_output=True)
    assert done.returncode == 0, done.stderr
    assert str((folder / name).stat().st_uid) == user
