"""bench/load.py's pure parts (issue 41): the projection of a large model's load from measured per-byte
costs, and the conditions every load figure names; bench/_common's page-cache helpers on a real file."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]

Importer = Callable[[str], ModuleType]
GB = 1e9


@pytest.fixture
def bench() -> Iterator[Importer]:
    """Import bench scripts as their folder does (they import `_common` beside them)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_projection_adds_the_hash_today_and_takes_the_slower_side_after(bench: Importer) -> None:
    load = bench("load")
    # 1 s/GB hashing, a link carrying 100% of 8 Gbit/s (1 GB/s), nodes reading, writing 4 GB/s, servers
    # filling their buffers at 10 GB/s: the wire bounds the loads through the controller.
    costs = load.ByteCosts(hash=1 / GB, efficiency=1.0, read=0.25 / GB, write=0.25 / GB, from_cache=0.1 / GB)
    rows = load.projection(100 * GB, 4, 8e9, costs)
    today, _ = rows["today: the client hashes, then sends (stock)"]
    through, _ = rows["the manifest, through the controller"]
    local, parts = rows["the manifest, from node-local copies"]
    assert today == pytest.approx(100 + 100)  # hash, then wire (100 GB at 1 GB/s)
    assert through == pytest.approx(100)
    assert local == pytest.approx(25 * (0.25 + 1 + 0.25))  # each node's share: read + hash + write
    assert "per node read 6 s + hash 25 s + write 6 s = 38 s and servers 10 s" in parts


def test_projection_is_bound_by_the_servers_when_they_are_slower_than_the_rest(bench: Importer) -> None:
    load = bench("load")
    costs = load.ByteCosts(hash=1 / GB, efficiency=0.5, read=0.1 / GB, write=0.1 / GB, from_cache=3 / GB)
    rows = load.projection(10 * GB, 8, 8e9, costs)
    assert rows["today: the client hashes, then sends (stock)"][0] == pytest.approx(10 + 30)
    assert rows["the manifest, through the controller"][0] == pytest.approx(30)  # wire 20 s < servers 30 s
    assert rows["the manifest, from node-local copies"][0] == pytest.approx(30)


def test_conditions_name_rate_page_cache_caches_and_transport(bench: Importer) -> None:
    common = bench("_common")
    said = common.LoadConditions("1gbit", "cold", "empty", "ssh").text()
    assert said == "controller 1gbit, page cache cold, caches empty, ssh"


def file_system(path: Path) -> str:
    """The type of the file system `path` is on (the longest mount point above it in /proc/mounts)."""
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        point = fields[1]
        if (str(path) + "/").startswith(point.rstrip("/") + "/") and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def test_a_dropped_file_leaves_the_page_cache_and_a_read_brings_it_back(
    bench: Importer, tmp_path: Path
) -> None:
    common = bench("_common")
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(4 << 20))
    with path.open("rb") as fh:
        fh.read()
    assert common.page_cache_resident(path) == 1.0
    common.drop_page_cache(path)
    # A tmpfs file is its pages: DONTNEED cannot drop them, and the bench's models are on a disk.
    assert common.page_cache_resident(path) == (1.0 if file_system(tmp_path) == "tmpfs" else 0.0)
    path.read_bytes()
    assert common.page_cache_resident(path) == 1.0
