"""The servers' tensor cache: names equal what a real `-c` server writes, verify, LRU, warm, full disk.

Real ggml-rpc-servers on loopback with `-c` and LLAMA_CACHE under a local "install dir", a generated model
whose FFN matrices exceed HASH_THRESHOLD (10 MiB), real loads through llama-cpp-python, and the node-side
operations over a local connection (the same shell scripts an SSH node runs).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from orchestrator.artifacts.patches import WARM_WAIT_MARK
from orchestrator.caches.plan import HASH_THRESHOLD, gguf_tensors, plan_cache
from orchestrator.connectors.connect import connect
from orchestrator.core import fnv
from orchestrator.core.errors import HostError
from orchestrator.inventory.model import Host
from orchestrator.operations.cache import (
    CacheFile,
    WarmItem,
    choose_evictions,
    clear,
    prune,
    read_cache,
    verify,
    warm,
)
from orchestrator.operations.cache_stream import TEMP_PREFIX
from orchestrator.planning.plan import Plan, PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan
from tests.plugins.cache import Node, local_host, plan_on_nodes, warm_items
from tests.plugins.llama import plan_devices
from tests.plugins.servers import launch_rpc_server
from tests.waits import until

PROMPT = "The quick brown fox"


def _cache_files(install: Path) -> dict[str, int]:
    folder = install / "cache" / "rpc"
    return {p.name: p.stat().st_size for p in folder.iterdir()} if folder.exists() else {}


def _generate(plan: Plan, model: Path) -> str:
    from orchestrator.llama.native.loader import load_llama

    llm = load_llama(plan, model, seed=0)
    try:
        out = llm(PROMPT, max_tokens=8, temperature=0.0, seed=0)
        return str(out["choices"][0]["text"])
    finally:
        llm.close()


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def _with(host: Host, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    async with await connect(host) as conn:
        return await fn(conn, host, *args, **kwargs)


def test_native_hash_matches_the_definition(tmp_path: Path) -> None:
    data = os.urandom(4096)
    (tmp_path / "f").write_bytes(b"xx" + data + b"yy")
    assert fnv.fnv1a64(data) == fnv.fnv1a64_py(data)
    assert fnv.hash_file_range(tmp_path / "f", 2, len(data)) == fnv.fnv1a64_py(data)
    assert fnv.fnv1a64(b"") == fnv.OFFSET_BASIS
    with pytest.raises(fnv.NativeHashError, match="too short"):
        fnv.hash_file_range(tmp_path / "f", 2, len(data) + 10)
    line = subprocess.run(
        [str(fnv.helper_binary()), str(tmp_path / "f")], capture_output=True, text=True
    ).stdout
    assert line.split()[0] == fnv.cache_name(fnv.fnv1a64_py(b"xx" + data + b"yy"))


def test_lru_eviction_under_a_quota() -> None:
    files = [CacheFile(f"{i:016x}", 10, float(t)) for i, t in enumerate([5, 1, 4, 2, 3])]
    evict, over = choose_evictions(files, 30, keep=())
    assert [f.last_use for f in evict] == [1.0, 2.0] and over == 0  # oldest first, down to the quota
    evict, over = choose_evictions(files, 30, keep=[files[1].name, files[3].name])
    assert [f.last_use for f in evict] == [3.0, 4.0] and over == 0  # what the plan needs stays
    evict, over = choose_evictions(files, 15, keep=[f.name for f in files])
    assert evict == [] and over == 35  # never below the plan: kept, reported over the quota
    assert choose_evictions(files, None)[0] == []


@pytest.mark.llama
def test_server_names_equal_plan_hashes_verify_and_warm(
    nodes: list[Node], big_model: Path, tmp_path: Path, rpc_server_binary: Path
) -> None:
    # The reference: the same plan on servers without a cache.
    plain = [launch_rpc_server(rpc_server_binary, tmp_path, log_prefix=f"plain{i}") for i in range(2)]
    try:
        devices = plan_devices([s.endpoint for s in plain])
        reference = _generate(make_plan(devices, profile_model(big_model), PlanOptions(n_ctx=256)), big_model)
    finally:
        for server in plain:
            server.stop()
    plan = plan_on_nodes(nodes, big_model)
    wanted = plan_cache(plan, [big_model])
    assert all(len(v) == 3 for v in wanted.values()), wanted  # the 3 FFN matrices of each node's layer
    assert all(c.tensor.size > HASH_THRESHOLD for v in wanted.values() for c in v)
    text = _generate(plan, big_model)  # cold: the servers write their cache files
    assert text == reference
    for node in nodes:
        assert node.server is not None
        assert set(_cache_files(node.install)) == {c.file for c in wanted[node.server.endpoint]}

    # A truncated file is found and removed by verify; the next load is correct.
    victim = nodes[0]
    name = sorted(_cache_files(victim.install))[0]
    path = victim.install / "cache" / "rpc" / name
    path.write_bytes(path.read_bytes()[: 1 << 20])
    change = _run(_with(victim.host, verify))
    assert change.corrupt == (name,) and name not in _cache_files(victim.install)
    assert _generate(plan, big_model) == text

    # Warm fresh nodes (new servers, empty caches): exactly the plan's tensors, and the load writes nothing.
    for node in nodes:
        node.stop()
        for p in (node.install / "cache" / "rpc").iterdir():
            p.unlink()
        node.start()
    plan = plan_on_nodes(nodes, big_model)
    wanted = plan_cache(plan, [big_model])
    for node in nodes:
        assert node.server is not None
        items = [
            WarmItem(c.file, c.tensor.path, c.tensor.offset, c.tensor.size)
            for c in wanted[node.server.endpoint]
        ]
        change = _run(_with(node.host, warm, items))
        assert set(change.added) == {c.file for c in wanted[node.server.endpoint]} and not change.hits
    before = {
        n.name: {p.name: p.stat().st_mtime_ns for p in (n.install / "cache" / "rpc").iterdir()} for n in nodes
    }
    assert _generate(plan, big_model) == text
    after = {
        n.name: {p.name: p.stat().st_mtime_ns for p in (n.install / "cache" / "rpc").iterdir()} for n in nodes
    }
    assert after == before  # every tensor was a hit: no file written by the load


def test_prune_keeps_the_plan_and_clear(big_model: Path, tmp_path: Path) -> None:
    items = warm_items(big_model)
    size = items[0].size
    host = local_host("q", tmp_path / "q", rpc_cache_max=3 * size)
    change = _run(_with(host, warm, items))  # 6 files; quota of 3; all 6 are wanted: none evicted
    assert len(change.added) == 6 and change.kept_over_quota == 3 * size
    folder = tmp_path / "q" / "cache" / "rpc"
    for age, item in enumerate(items):  # the first file is the oldest
        os.utime(folder / item.name, (1000 + age, 1000 + age))
    change = _run(_with(host, prune, keep=[items[0].name]))
    assert set(change.removed) == {items[1].name, items[2].name, items[3].name}
    assert set(_cache_files(tmp_path / "q")) == {items[0].name, items[4].name, items[5].name}
    assert len(_run(_with(host, clear)).removed) == 3 and _cache_files(tmp_path / "q") == {}

    # A warm makes its room before its files land: the least recently used files not wanted go first.
    _run(_with(host, warm, items[:3]))
    for age, item in enumerate(items[:3]):
        os.utime(folder / item.name, (1000 + age, 1000 + age))
    change = _run(_with(host, warm, [items[1], items[3]]))
    assert change.removed == (items[0].name,) and change.added == (items[3].name,)
    assert set(_cache_files(tmp_path / "q")) == {items[1].name, items[2].name, items[3].name}
    assert change.after is not None
    assert {f.name for f in change.after.files} == set(_cache_files(tmp_path / "q"))


def test_interrupted_warm_leaves_no_partial_file(big_model: Path, tmp_path: Path) -> None:
    items = warm_items(big_model)

    def is_temp(name: str) -> bool:  # a file being written (not the warm's mark)
        return name.startswith(TEMP_PREFIX) and name != WARM_WAIT_MARK

    host = local_host("i", tmp_path / "i")

    async def interrupted() -> None:
        task = asyncio.ensure_future(_with(host, warm, items))
        folder = tmp_path / "i" / "cache" / "rpc"
        temps: list[str] = []
        for _ in range(20000):  # until the first upload is under way
            temps = [p.name for p in folder.iterdir() if is_temp(p.name)] if folder.exists() else []
            if temps:
                break
            await asyncio.sleep(0.001)
        shell = int(temps[0].rsplit(".", 1)[1])  # the temporary file is named after its shell's pid ($$)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The interrupt landed: the command was killed and reaped. The rest runs in this loop, so that its
        # exit reaches the loop that started it.
        await until(lambda: not Path(f"/proc/{shell}").exists(), what="the killed command reaped")
        files, _ = await _with(host, read_cache)
        for f in files:  # whatever is there under a hash name is whole
            assert fnv.hash_file_range(folder / f.name, 0, f.size) == int(f.name, 16)
        await _with(host, verify)

    _run(interrupted())
    assert not [p for p in (tmp_path / "i" / "cache" / "rpc").iterdir() if p.name.startswith(".")]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_full_disk_during_warm_is_clear_and_consistent(big_model: Path, tmp_path: Path) -> None:
    items = warm_items(big_model)
    folder = tmp_path / "d" / "cache" / "rpc"
    folder.mkdir(parents=True)
    mb = (items[0].size * 2 + (4 << 20)) >> 20  # room for two files, not three
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(folder)], check=True)
    try:
        host = local_host("d", tmp_path / "d")
        with pytest.raises(HostError, match="disk is full") as caught:
            _run(_with(host, warm, items))
        assert "rpc_cache_max" in str(caught.value)
        names = sorted(p.name for p in folder.iterdir())
        assert len(names) == 2 and not [n for n in names if n.startswith(".")]
        for name in names:
            assert fnv.hash_file_range(folder / name, 0, (folder / name).stat().st_size) == int(name, 16)
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_cli_errors_and_the_quota_variable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from orchestrator.cli import main
    from orchestrator.inventory.load import load_inventory
    from tests.plugins.servers import write_local_inventory

    inv = write_local_inventory(
        tmp_path / "inv.yml", {"a": {"install_dir": str(tmp_path / "a"), "rpc_cache_max": "2GiB"}}
    )
    assert load_inventory(inv).host("a").rpc_cache_max == 2 << 30
    assert main(["cache", "warm", "-i", str(inv), "-m", str(tmp_path / "nope.gguf")]) == 2
    assert "no selected host has rpc_cache: true" in capsys.readouterr().err
    on = write_local_inventory(tmp_path / "on.yml", {"a": {"rpc_cache": True}})
    assert main(["cache", "warm", "-i", str(on), "-m", str(tmp_path / "nope.gguf")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["cache", "frob", "-i", str(inv)]) == 2
    capsys.readouterr()
    bad = write_local_inventory(tmp_path / "bad.yml", {"a": {"rpc_cache_max": "lots"}})
    assert main(["cache", "status", "-i", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.yml:" in err and "rpc_cache_max" in err and "Traceback" not in err
    assert main(["cache", "status", "-i", str(inv), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    row = status["hosts"][0]
    assert (row["files"], row["bytes"], row["max_bytes"], row["hits_since_start"]) == (0, 0, 2 << 30, None)


def test_a_helper_that_cannot_run_removes_nothing(big_model: Path, tmp_path: Path) -> None:
    items = warm_items(big_model)[:2]
    host = local_host("x", tmp_path / "x")
    _run(_with(host, warm, items))
    broken = tmp_path / "x" / "tools" / fnv.tools_dir().name / "fnv1a"
    broken.parent.mkdir(parents=True, exist_ok=True)
    broken.write_text("#!/bin/sh\necho 'cannot execute binary file: Exec format error' >&2\nexit 126\n")
    broken.chmod(0o755)
    with pytest.raises(HostError, match="did not hash"):
        _run(_with(host, verify))
    assert set(_cache_files(tmp_path / "x")) == {i.name for i in items}


def test_warm_replaces_a_truncated_file_under_its_name(big_model: Path, tmp_path: Path) -> None:
    """llama.cpp writes its cache files in place: a crash leaves a short one under the right name."""
    items = warm_items(big_model)[:2]
    host = local_host("t", tmp_path / "t")
    _run(_with(host, warm, items))
    short = tmp_path / "t" / "cache" / "rpc" / items[0].name
    short.write_bytes(short.read_bytes()[:4096])
    checked = _run(_with(host, warm, items, check=True))
    assert checked.corrupt == (items[0].name,) and checked.added == (items[0].name,)
    change = _run(_with(host, warm, items))
    assert change.corrupt == (items[0].name,) and change.hits == (items[1].name,)
    assert fnv.hash_file_range(short, 0, items[0].size) == int(items[0].name, 16)


@pytest.mark.llama
def test_a_playbook_load_check_refuses_a_truncated_file(nodes: list[Node], big_model: Path) -> None:
    from orchestrator.core.errors import LoaderError
    from orchestrator.playbooks.load_check import load_check

    plan = plan_on_nodes(nodes, big_model)
    _generate(plan, big_model)  # the servers write their cache files
    assert nodes[0].server is not None
    hosts = [
        dataclasses.replace(n.host, rpc_host="127.0.0.1", rpc_port=n.server.port, rpc_cache=True)
        for n in nodes
        if n.server is not None
    ]
    assert asyncio.run(load_check(plan, big_model, hosts=hosts)).layers_as_planned
    victim = sorted((nodes[0].install / "cache" / "rpc").iterdir())[0]
    victim.write_bytes(victim.read_bytes()[:4096])
    with pytest.raises(LoaderError, match="truncated or corrupt") as caught:
        asyncio.run(load_check(plan, big_model, hosts=hosts))
    assert caught.value.host == nodes[0].name


def test_tensor_offsets_come_from_the_header_reader_and_match_gguf_py(tiny_model: Path) -> None:
    """The cache's tensor list (name, absolute offset, size) from rpcfleet's own header reader equals
    gguf-py's; that reader turned every vocabulary entry into Python objects (34 s of a Gemma 3 run)."""
    import gguf

    ours = [(t.name, t.offset, t.size) for t in gguf_tensors([tiny_model])]
    reference = [
        (t.name, int(t.data_offset), int(t.n_bytes)) for t in gguf.GGUFReader(str(tiny_model), "r").tensors
    ]
    assert ours == reference and ours


def test_a_cache_shared_by_the_servers_of_one_install_is_one_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The servers of one host (`rpc_servers`) share its install's cache folder: `cache status` shows it
    once, named by the machine, with the servers it stands for (was a row per server, the same files
    under each, so the table added up to twice the bytes)."""
    from orchestrator.cli import main
    from tests.plugins.servers import write_local_inventory

    folder = tmp_path / "a" / "cache" / "rpc"
    folder.mkdir(parents=True)
    for name, size in (("0123456789abcdef", 1000), ("fedcba9876543210", 24)):
        (folder / name).write_bytes(b"x" * size)
    variables = {"install_dir": str(tmp_path / "a"), "rpc_servers": [50052, 50053]}
    inv = write_local_inventory(
        tmp_path / "inv.yml", {"a": variables, "b": {"install_dir": str(tmp_path / "b"), "rpc_port": 50054}}
    )
    assert main(["cache", "status", "-i", str(inv), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["hosts"]
    assert [(r["host"], r["servers"], r["files"], r["bytes"]) for r in rows] == [
        ("a", ["a/50052", "a/50053"], 2, 1024),
        ("b", ["b"], 0, 0),
    ]
    assert main(["cache", "status", "-i", str(inv)]) == 0
    table = capsys.readouterr().out
    assert "a (a/50052, a/50053)" in table and table.count("1.00 KiB") == 1, table
