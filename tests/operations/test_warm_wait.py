"""A load beside the warm: the `warm-wait` patch of the servers rpcfleet builds, against real servers with
`-c` on this machine (the cached CPU artifact's), and `load_on_fleet` choosing to overlap.

- A server asked for a file it lacks while its cache's mark names a live warm waits for the file, then
  reads it as a hit.
- A mark whose process is gone (a warm killed before its trap ran) holds nothing: the tensor is sent.
- `load_on_fleet` runs the load beside the warm where every warming node's installed server has the patch
  (its manifest lists it): the big tensors never cross the RPC link, and no mark is left behind. Without
  the patch in the manifest, the load waits for the warm's end. A signal during a load beside the warm
  stops the worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from orchestrator.artifacts.patches import PATCHES, WARM_WAIT, WARM_WAIT_MARK
from orchestrator.caches.plan import RACY_NS, CacheTensor, TensorSlice, plan_cache, plan_tensors
from orchestrator.caches.prep import CachePrep, check_caches, warm_misses
from orchestrator.inventory.model import Host
from orchestrator.llama.worker.load_progress import LoadProgress, planned_bytes
from orchestrator.llama.worker.parent import Worker
from orchestrator.planning.plan import Plan
from orchestrator.workflows.load import load_on_fleet
from tests.plugins.cache import Node, cache_hosts, plan_on_nodes
from tests.waits import wait_until

pytestmark = pytest.mark.llama


def _folder(node: Node) -> Path:
    return node.install / "cache" / "rpc"


def _hosts(nodes: list[Node], *, patched: bool) -> list[Host]:
    """The nodes as `rpc_cache` hosts, each with an installed manifest that lists the server's patches
    (as `deploy` leaves it), with or without `warm-wait`."""
    label = next(p.label for p in PATCHES if p.name == WARM_WAIT)
    for node in nodes:
        current = node.install / "current"
        current.mkdir(exist_ok=True)
        (current / "manifest.json").write_text(json.dumps({"patches": [label] if patched else []}))
    return cache_hosts(nodes)


def _empty(nodes: list[Node]) -> None:
    for node in nodes:
        for path in _folder(node).iterdir():
            path.unlink()


def _cached_sent(
    seen: list[LoadProgress], plan: Plan, cached: dict[str, list[CacheTensor]]
) -> dict[str, float]:
    """Per endpoint, the share of its cached tensors' bytes that crossed the link: the bytes sent beyond
    those of the other tensors (near 0: every cached tensor a hit; near 1: every one sent)."""
    last = {n.endpoint: n for n in seen[-1].nodes}
    planned = planned_bytes(plan)
    shares = {}
    for endpoint, tensors in cached.items():
        hits = sum(c.tensor.size for c in tensors)
        shares[endpoint] = (last[endpoint].sent - (planned[endpoint] - hits)) / hits
    return shares


def _load_in_thread(
    pool: ThreadPoolExecutor, plan: Plan, model: Path, seen: list[LoadProgress]
) -> Future[None]:
    def load() -> None:
        with Worker.start(plan, model, {"seed": 0}, on_progress=seen.append) as worker:
            assert worker.placement is not None

    return pool.submit(load)


def _land(node: Node, tensor: CacheTensor) -> None:
    """Put one file in place as the warm does: whole under a temporary name, then renamed."""
    with tensor.tensor.path.open("rb") as fh:
        fh.seek(tensor.tensor.offset)
        data = fh.read(tensor.tensor.size)
    temp = _folder(node) / f".warm-{tensor.file}.test"
    temp.write_bytes(data)
    temp.rename(_folder(node) / tensor.file)


def test_a_mark_holds_the_server_while_its_warm_lives_and_not_after(
    nodes: list[Node], big_model: Path
) -> None:
    plan = plan_on_nodes(nodes, big_model)
    cached = plan_cache(plan, [big_model])
    by_endpoint = {n.server.endpoint: n for n in nodes if n.server is not None}
    holder = subprocess.Popen(["sleep", "600"])  # stands for a live warm's shell
    try:
        for node in nodes:
            (_folder(node) / WARM_WAIT_MARK).write_text(f"{holder.pid}\n")
        seen: list[LoadProgress] = []
        with ThreadPoolExecutor(1) as pool:
            loading = _load_in_thread(pool, plan, big_model, seen)
            wait_until(lambda: any(p.sent > 0 for p in seen), 60, "the load to start sending")
            time.sleep(3.0)  # a load of this model takes about a second when nothing holds it
            assert not loading.done() and seen[-1].fraction < 1.0  # held at the first file it lacks
            for endpoint, tensors in cached.items():  # the warm lands every file: the load goes on
                for c in tensors:
                    _land(by_endpoint[endpoint], c)
            loading.result(timeout=120)
        assert all(share < 0.1 for share in _cached_sent(seen, plan, cached).values())  # every one a hit
    finally:
        holder.kill()
        holder.wait()

    # Marks of a warm that is gone (its pid dead) hold nothing: the servers take the tensors themselves.
    _empty(nodes)
    for node in nodes:
        (_folder(node) / WARM_WAIT_MARK).write_text(f"{holder.pid}\n")
    seen = []
    with ThreadPoolExecutor(1) as pool:
        _load_in_thread(pool, plan, big_model, seen).result(timeout=120)
    assert all(share > 0.9 for share in _cached_sent(seen, plan, cached).values())
    for endpoint, tensors in cached.items():  # written by the server on its misses
        names = {p.name for p in _folder(by_endpoint[endpoint]).iterdir()}
        assert {c.file for c in tensors} <= names


@pytest.mark.parametrize("patched", [True, False], ids=["warm-wait", "stock"])
def test_load_on_fleet_runs_the_load_beside_the_warm_only_on_servers_that_wait(
    nodes: list[Node], big_model: Path, patched: bool
) -> None:
    plan = plan_on_nodes(nodes, big_model)
    cached = plan_cache(plan, [big_model])
    hosts = _hosts(nodes, patched=patched)
    seen: list[LoadProgress] = []
    phases: list[tuple[str, bool]] = []
    with Worker.spawn() as worker:
        done = load_on_fleet(
            plan,
            hosts,
            worker,
            big_model,
            warm="always",
            on_prepared=lambda d: phases.append(("prepared", d.warm is None)),
            on_warmed=lambda d: phases.append(("warmed", d.warm is None)),
            on_progress=seen.append,
        )
    assert done.placement is not None and done.warm is not None and done.warm.ok
    assert done.cache is not None and done.cache.misses == 0
    assert done.overlapped is patched
    # Beside the warm, the front end hears of the load before the warm ends, and of the warm's end after.
    assert phases == ([("prepared", True), ("warmed", False)] if patched else [("prepared", False)])
    assert all(share < 0.1 for share in _cached_sent(seen, plan, cached).values())  # all hits either way
    for node, host in zip(nodes, hosts, strict=True):
        names = {p.name for p in _folder(node).iterdir()}
        assert names == {c.file for c in cached[host.endpoint]}  # whole files, no mark left


@pytest.mark.soak
def test_a_signal_during_a_load_beside_the_warm_stops_both(
    nodes: list[Node], big_model: Path, rounds: int
) -> None:
    """SIGINT as the load starts beside the warm: the worker is stopped (it was mid-load: nothing is
    loaded), the warm stops at its next file, and no mark is left behind. 20 rounds (soak)."""
    plan = plan_on_nodes(nodes, big_model)
    hosts = _hosts(nodes, patched=True)
    interrupt = lambda _done: os.kill(os.getpid(), signal.SIGINT)  # noqa: E731
    for round_ in range(rounds):
        _empty(nodes)
        with Worker.spawn() as worker:
            done = load_on_fleet(plan, hosts, worker, big_model, interruptible=True, on_prepared=interrupt)
            assert done.overlapped and done.interrupted and done.placement is None, round_
            assert not worker.alive, round_  # the interrupt landed: the load's worker is gone
        for node in nodes:  # the files that landed are whole; the marks are gone
            assert not (_folder(node) / WARM_WAIT_MARK).exists(), round_


def test_the_check_names_only_what_a_cached_file_could_be(
    nodes: list[Node], big_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Empty caches: nothing is hashed, every tensor is an unnamed miss (the warm names it). A file on a
    node that could be one of its tensors (no larger than it: a truncated copy?) makes that node's
    tensors be hashed, and only that node's; a warm's names go to the memo."""
    from orchestrator.caches import prep
    from orchestrator.engine.executor import Session

    os.utime(big_model)  # nothing remembered for this file
    # past the memo's racy window: hashes of a file changed just before they were taken are not kept
    time.sleep(2 * RACY_NS / 1e9)
    plan = plan_on_nodes(nodes, big_model)
    hosts = _hosts(nodes, patched=True)
    slices = plan_tensors(plan, [big_model])
    hashed: list[TensorSlice] = []
    real = prep.hash_tensors
    monkeypatch.setattr(prep, "hash_tensors", lambda ts: (hashed.extend(ts), real(ts))[1])

    async def check() -> CachePrep:
        async with Session() as session:
            return await check_caches(session, hosts, slices, full=False)

    cold = asyncio.run(check())
    assert not hashed and cold.hits == 0
    assert all(i.name is None for items in cold.missing.values() for i in items)
    (_folder(nodes[0]) / "0123456789abcdef").write_bytes(b"x")
    assert asyncio.run(check()).hits == 0
    assert sorted(hashed, key=str) == sorted(slices[hosts[0].endpoint], key=str)  # node 0's only

    async def warm_all() -> None:
        async with Session() as session:
            await warm_misses(session, await check_caches(session, hosts, slices, full=False))

    hashed.clear()
    asyncio.run(warm_all())
    warm = asyncio.run(check())  # every name from the memo: the warm's, and the hashes above
    assert warm.misses == 0 and warm.hits == sum(len(ts) for ts in slices.values()) and not hashed
