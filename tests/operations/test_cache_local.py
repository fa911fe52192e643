"""A node warms its cache from its own copy of the model (`model_path_on_nodes`), checked tensor by tensor
by the hashes this machine computed (the memo's manifest); a missing or differing copy falls back to this
machine's stream with a warning naming the host and the path; a full disk names the bytes needed; the
memo is exact (device, inode, ctime: `touch -r` cannot fool it).

The node-side script runs over a local connection here (the same shell script an SSH node runs); the lab
test (tests/operations/test_cache_local_lab.py) runs it over SSH on namespaced nodes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from orchestrator.caches import plan as memo
from orchestrator.caches.plan import TensorSlice, hash_tensors
from orchestrator.connectors.connect import connect
from orchestrator.core import fnv
from orchestrator.core.errors import HostError
from orchestrator.inventory.model import Host
from orchestrator.operations.cache import CacheChange, WarmItem, warm
from orchestrator.operations.cache_local import CopyReport, read_report, why_not
from tests.plugins.cache import local_host, warm_items


def _warm(host: Host, items: list[WarmItem]) -> CacheChange:
    async def go() -> CacheChange:
        async with await connect(host) as conn:
            return await warm(conn, host, items)

    return asyncio.run(go())


def _folder(host: Host) -> Path:
    return Path(host.install_dir) / "cache" / "rpc"


def _assert_whole(host: Host, items: list[WarmItem]) -> None:
    """Exactly the items' files, each one's bytes hashing to its name, no temporary left."""
    folder = _folder(host)
    assert sorted(p.name for p in folder.iterdir()) == sorted(str(i.name) for i in items)
    for item in items:
        assert fnv.hash_file_range(folder / str(item.name), 0, item.size) == int(str(item.name), 16)


def _node(tmp_path: Path, name: str, model: Path | None) -> Host:
    """A local node whose model folder holds `model` under its own name (None: an empty folder)."""
    models = tmp_path / f"{name}-models"
    models.mkdir()
    if model is not None:
        shutil.copyfile(model, models / model.name)
    return local_host(name, tmp_path / name, model_path_on_nodes=str(models))


ITEMS = [WarmItem(f"{k:016x}", Path("/m/model.gguf"), 1000 * k, 100) for k in range(1, 4)]


def test_the_reports_of_the_node_script_are_read_in_order() -> None:
    assert read_report(["ready", f"ok {ITEMS[0].name}", f"ok {ITEMS[1].name}"], ITEMS) == CopyReport((0, 1))
    everything = ["ready", *(f"ok {i.name}" for i in ITEMS), "done"]
    assert read_report(everything, ITEMS) == CopyReport((0, 1, 2), ended=True)
    # An `ok` out of order names no item; `done` without every item is no success.
    assert read_report(["ready", f"ok {ITEMS[1].name}", "done"], ITEMS) == CopyReport((), ended=False)
    differs = read_report(["ready", f"ok {ITEMS[0].name}", "differs 1 00000000000000ff"], ITEMS)
    assert differs == CopyReport((0,), stop=("differs", 1, "00000000000000ff"))
    assert read_report(["full 300 20"], ITEMS) == CopyReport((), full=(300, 20))
    host = Host(name="n1", address="10.0.0.1", model_path_on_nodes="/mnt/models/")
    warning = why_not(host, ITEMS, differs, [])
    assert warning is not None and warning.startswith(
        "n1: the node-local copy /mnt/models/model.gguf differs"
    )
    assert "bytes 2000..2100" in warning and "expected 0000000000000002" in warning
    missing = why_not(host, ITEMS, read_report(["ready", "missing 0"], ITEMS), [])
    assert missing is not None and "/mnt/models/model.gguf is missing" in missing
    assert why_not(host, ITEMS, read_report(everything, ITEMS), []) is None


def test_a_node_copies_its_share_from_its_own_file(big_model: Path, tmp_path: Path) -> None:
    items = warm_items(big_model)
    host = _node(tmp_path, "n", big_model)
    change = _warm(host, items)
    assert (change.via, change.bytes_sent, change.warnings) == ("node-local copy", 0, ())
    assert change.bytes_local == sum(i.size for i in items) and change.added == tuple(i.name for i in items)
    _assert_whole(host, items)
    again = _warm(host, items)
    assert not again.added and again.hits == tuple(i.name for i in items) and again.bytes_local == 0


def test_a_missing_copy_falls_back_to_this_machine_with_a_warning(big_model: Path, tmp_path: Path) -> None:
    items = warm_items(big_model)
    host = _node(tmp_path, "m", None)
    change = _warm(host, items)
    assert change.via == "local shell" and change.bytes_local == 0
    assert change.bytes_sent == sum(i.size for i in items)
    path = Path(str(host.model_path_on_nodes)) / big_model.name
    assert len(change.warnings) == 1 and change.warnings[0].startswith(
        f"m: the node-local copy {path} is missing"
    )
    _assert_whole(host, items)


def test_a_copy_differing_in_one_byte_loads_nothing_of_it(big_model: Path, tmp_path: Path) -> None:
    """One byte changed in the middle of the second tensor: the first is copied on the node, the others
    come from this machine; the cache holds only this machine's bytes."""
    items = warm_items(big_model)
    host = _node(tmp_path, "d", big_model)
    copy = Path(str(host.model_path_on_nodes)) / big_model.name
    with copy.open("r+b") as fh:
        fh.seek(items[1].offset + items[1].size // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    change = _warm(host, items)
    assert change.via == "node-local copy + local shell"
    assert change.bytes_local == items[0].size and change.bytes_sent == sum(i.size for i in items[1:])
    (warning,) = change.warnings
    assert warning.startswith(f"d: the node-local copy {copy} differs from this machine's at bytes ")
    assert f"expected {items[1].name}" in warning
    _assert_whole(host, items)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_names_the_host_and_the_bytes_needed(big_model: Path, tmp_path: Path) -> None:
    items = warm_items(big_model)
    host = _node(tmp_path, "f", big_model)
    folder = _folder(host)
    folder.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(folder)], check=True)
    try:
        with pytest.raises(HostError) as caught:
            _warm(host, items)
        need = sum(i.size for i in items)
        assert caught.value.host == "f" and "disk is full" in str(caught.value)
        assert f"({need} bytes) needed" in str(caught.value)
        assert not list(folder.iterdir())  # nothing landed, no temporary left
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_the_memo_is_exact_touch_r_cannot_fool_it(tmp_path: Path) -> None:
    """A byte changed in place, then the mtime set back (`touch -r`): same path, size and mtime, but
    ctime moved, so the memo is not used and the tensor is hashed again."""
    path = tmp_path / "w.gguf"
    path.write_bytes(bytes(range(256)) * 64)
    reference = tmp_path / "ref"
    reference.touch()
    subprocess.run(["touch", "-r", str(reference), str(path)], check=True)
    time.sleep(memo.RACY_NS / 1e9 + 0.02)  # a memo is written only for a file not changed just now
    tensor = TensorSlice("t", path, 100, 4000)
    (first,) = hash_tensors([tensor])
    assert memo.remembered([tensor]) == {tensor: first.file}
    stored = json.loads(memo._memo_path(path).read_text())
    assert {"dev", "ino", "size", "mtime_ns", "ctime_ns"} <= set(stored)
    with path.open("r+b") as fh:
        fh.seek(2000)
        fh.write(b"\xff")
    subprocess.run(["touch", "-r", str(reference), str(path)], check=True)
    assert path.stat().st_mtime_ns == stored["mtime_ns"] and path.stat().st_size == stored["size"]
    assert memo.remembered([tensor]) == {}
    (second,) = hash_tensors([tensor])
    assert second.file != first.file
    assert second.file == fnv.cache_name(fnv.hash_file_range(path, 100, 4000))


def test_a_memo_is_not_written_for_a_file_changed_just_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file changed within RACY_NS of its stat could change again within the same tick of the file
    system's clock, its ctime unmoved: its hashes are used, not remembered."""
    monkeypatch.setattr(memo, "RACY_NS", 3600 * 10**9)  # "just now": whatever this machine's load
    path = tmp_path / "fresh.gguf"
    path.write_bytes(b"x" * 4096)
    tensor = TensorSlice("t", path, 0, 4096)
    hash_tensors([tensor])
    assert memo.remembered([tensor]) == {}
    monkeypatch.setattr(memo, "RACY_NS", 0)
    hash_tensors([tensor])
    assert len(memo.remembered([tensor])) == 1


def test_auto_warms_one_node_that_holds_the_model() -> None:
    """`--warm auto` warms misses on one node only when its warm sends no weights (its own copy)."""
    from orchestrator.caches.prep import CachePrep

    plain = Host(name="a", address="10.0.0.1")
    holder = Host(name="b", address="10.0.0.2", model_path_on_nodes="/mnt/models")
    other = Host(name="c", address="10.0.0.3")
    one = (ITEMS[0],)
    assert not CachePrep((plain, other), {}, {"a": one, "c": ()}, 0).worth_warming("auto")
    assert CachePrep((holder, other), {}, {"b": one, "c": ()}, 0).worth_warming("auto")
    assert not CachePrep((holder, other), {}, {"b": (), "c": one}, 0).worth_warming("auto")
    assert not CachePrep((holder,), {}, {"b": one}, 0).worth_warming("never")
