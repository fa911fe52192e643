"""Before a load on `rpc_cache` hosts: the cache files it will hit and miss, and warming the misses first.

llama.cpp sends tensors one at a time, one node after the other, so a cold load uses one link at a time
and makes each server hash and write its files on the way. Warming the misses (`cache warm`'s operation,
every node in parallel) uses all the links at once; the load is then a warm one. Where every node's
server waits while its cache is being warmed (the `warm-wait` patch of the servers rpcfleet builds), the
load starts as soon as the warm has marked the folders and trails it tensor by tensor (`overlaps`);
with any other server it starts when the warm has ended.

Nothing is hashed before the warm that need not be: the check lists each node's cache, and only a tensor
a file there could be (that size, or shorter: a truncated copy) needs its name, from the memo or hashed
here; the others are misses whatever their name, and the warm's stream names them as it sends them (the
names then go to the memo). A hit that is truncated (or, with `full`, corrupt) is refused before any
load: llama.cpp would read it back as weights without a check.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from orchestrator.caches.plan import (
    CacheTensor,
    TensorSlice,
    hash_tensors,
    identities,
    plan_tensors,
    remember,
    remembered,
)
from orchestrator.core.errors import LoaderError
from orchestrator.engine.executor import RunResult, Session
from orchestrator.inventory.model import Host
from orchestrator.operations.cache import (
    CacheChange,
    CacheListing,
    WarmItem,
    listing_step,
    rehash_step,
    warm_step,
)
from orchestrator.operations.layer import OperationOptions
from orchestrator.planning.plan import Plan

WarmChoice = Literal["auto", "always", "never"]


def warm_item(tensor: CacheTensor) -> WarmItem:
    """The cache file of a planned tensor, as `cache warm` uploads it."""
    return WarmItem(tensor.file, tensor.tensor.path, tensor.tensor.offset, tensor.tensor.size)


def warm_items(
    per_endpoint: Mapping[str, Sequence[CacheTensor]], hosts: Iterable[Host]
) -> dict[str, list[WarmItem]]:
    """Per host name, the cache files its share of the plan needs (`plan_cache`'s answer by endpoint)."""
    by_endpoint = {h.endpoint: h for h in hosts}
    return {
        by_endpoint[ep].name: [warm_item(c) for c in tensors]
        for ep, tensors in per_endpoint.items()
        if ep in by_endpoint
    }


@dataclass(frozen=True)
class CachePrep:
    """What a load will find in the caches of `hosts` (the plan's `rpc_cache` hosts)."""

    hosts: tuple[Host, ...]
    hit_bytes: dict[str, int]  # per endpoint: bytes of tensors the load will not send
    missing: dict[str, tuple[WarmItem, ...]]  # per host name: files its cache lacks
    hits: int
    waiting: frozenset[str] = frozenset()  # host names whose server waits for files being warmed

    @property
    def misses(self) -> int:
        return sum(len(items) for items in self.missing.values())

    @property
    def miss_bytes(self) -> int:
        return sum(i.size for items in self.missing.values() for i in items)

    def worth_warming(self, choice: WarmChoice) -> bool:
        """`auto`: when the misses are on two nodes or more (their links then carry them in parallel), or
        on a node that holds the model (`model_path_on_nodes`: its warm sends no weights at all)."""
        nodes = sum(1 for items in self.missing.values() if items)
        local = any(h.model_path_on_nodes is not None and self.missing.get(h.name) for h in self.hosts)
        return nodes > 0 and (choice == "always" or (choice == "auto" and (nodes >= 2 or local)))

    @property
    def overlaps(self) -> bool:
        """Whether a load may run beside the warm: every node with misses has a server that waits."""
        return all(name in self.waiting for name, items in self.missing.items() if items)

    def all_warm(self) -> CachePrep:
        """The caches as a load finds them once every miss is warm."""
        hit_bytes = dict(self.hit_bytes)
        for host in self.hosts:
            hit_bytes[host.endpoint] = hit_bytes.get(host.endpoint, 0) + sum(
                i.size for i in self.missing.get(host.name, ())
            )
        missing: dict[str, tuple[WarmItem, ...]] = dict.fromkeys(self.missing, ())
        return CachePrep(self.hosts, hit_bytes, missing, self.hits + self.misses, self.waiting)

    def as_json(self) -> dict[str, Any]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "miss_bytes": self.miss_bytes,
            "hit_bytes": dict(self.hit_bytes),
        }


def could_be_there(tensor: TensorSlice, sizes: Iterable[int]) -> bool:
    """Whether a file of a node's cache could be `tensor`'s: one of its size, or shorter (a truncated
    copy under its name). Only such a tensor needs its name before the load; the others are misses
    whatever their name, and the warm names them as it sends them."""
    return any(size <= tensor.size for size in sizes)


async def check_caches(
    session: Session, hosts: Sequence[Host], per_endpoint: Mapping[str, Sequence[TensorSlice]], *, full: bool
) -> CachePrep:
    """Read each host's cache against the tensors `per_endpoint` says its share needs; hash (here, or
    from the memo) only the tensors a file there could be; raise LoaderError naming the host when a
    file the load would read is truncated (or, with `full`, corrupt)."""
    run = await session.run(list(hosts), listing_step(), name="cache-check")
    listings = {r.host.name: r.value for r in run.results if isinstance(r.value, CacheListing)}
    for r in run.results:
        if r.status != "skipped" and r.host.name not in listings:
            raise LoaderError(f"cannot read the tensor cache: {r.error}", host=r.host.name)
    by_host = {h.name: list(per_endpoint.get(h.endpoint, ())) for h in hosts if h.name in listings}
    memo = await asyncio.to_thread(remembered, {t for ts in by_host.values() for t in ts})
    to_hash = {
        t
        for name, ts in by_host.items()
        for t in ts
        if t not in memo and could_be_there(t, listings[name].files.values())
    }
    hashed = {c.tensor: c.file for c in await asyncio.to_thread(hash_tensors, to_hash)} if to_hash else {}
    names = {**memo, **hashed}
    hit_bytes: dict[str, int] = {}
    missing: dict[str, tuple[WarmItem, ...]] = {}
    hits = 0
    hit_names: dict[str, list[str]] = {}
    for host in hosts:
        if host.name not in by_host:
            continue
        files = listings[host.name].files
        items = [WarmItem(names.get(t), t.path, t.offset, t.size) for t in by_host[host.name]]
        bad = [i.name for i in items if i.name in files and files[i.name] != i.size]
        _refuse(host, [n for n in bad if n])
        there = [i for i in items if i.name is not None and files.get(i.name) == i.size]
        hit_names[host.name] = [str(i.name) for i in there]
        hit_bytes[host.endpoint] = sum(i.size for i in there)
        missing[host.name] = tuple(i for i in items if i not in there)
        hits += len(there)
    if full and any(hit_names.values()):
        rehashed = await session.run(list(hosts), rehash_step(hit_names), name="cache-verify")
        for done in rehashed.results:
            if done.status == "skipped":
                continue
            if not isinstance(done.value, tuple):
                raise LoaderError(f"cannot re-hash the tensor cache: {done.error}", host=done.host.name)
            _refuse(done.host, list(done.value))
    waiting = frozenset(name for name, listing in listings.items() if listing.waits)
    return CachePrep(tuple(hosts), hit_bytes, missing, hits, waiting)


def _refuse(host: Host, bad: Sequence[str]) -> None:
    if bad:
        raise LoaderError(
            f"the tensor cache holds {len(bad)} truncated or corrupt file(s) this load "
            f"would read ({', '.join(bad[:3])})",
            host=host.name,
            hint=f"run `rpcfleet cache verify -l {host.name}` (it removes them), then load again",
        )


def warming_hosts(prep: CachePrep) -> list[Host]:
    """The hosts a warm of `prep` sends files to."""
    return [h for h in prep.hosts if prep.missing.get(h.name)]


async def name_for_local_copies(prep: CachePrep) -> CachePrep:
    """`prep` with every miss of a host that holds the model (`model_path_on_nodes`) named: the node
    keeps a tensor it copies from its own file only when its hash is this name (the model's manifest:
    hashed here once, then from the memo). Other hosts' misses stay unnamed (their stream names them)."""
    local = {h.name for h in prep.hosts if h.model_path_on_nodes is not None}
    unnamed = {
        TensorSlice("", i.path, i.offset, i.size)
        for name, items in prep.missing.items()
        if name in local
        for i in items
        if i.name is None
    }
    if not unnamed:
        return prep
    names = {
        (c.tensor.path, c.tensor.offset, c.tensor.size): c.file
        for c in await asyncio.to_thread(hash_tensors, unnamed)
    }
    missing = {
        name: tuple(
            replace(i, name=names[(i.path, i.offset, i.size)]) if name in local and i.name is None else i
            for i in items
        )
        for name, items in prep.missing.items()
    }
    return replace(prep, missing=missing)


async def warm_misses(
    session: Session,
    prep: CachePrep,
    options: OperationOptions | None = None,
    on_ready: Callable[[Host], None] | None = None,
) -> tuple[RunResult[CacheChange], CachePrep]:
    """Warm every host's missing files, all hosts in parallel (the operations layer's `cache-warm`);
    returns the run and the prep as the load will now find the caches (what a host could not warm stays
    a miss: the load sends those tensors itself). `on_ready(host)`: as `operations.cache.warm`."""
    chosen = warming_hosts(prep)
    # Before any byte is read: a file changed during the warm gets none of its names remembered.
    since = await asyncio.to_thread(identities, {i.path for items in prep.missing.values() for i in items})
    prep = await name_for_local_copies(prep)
    step = warm_step(prep.missing, options or OperationOptions(), on_ready)
    run = await session.run(chosen, step, name="cache-warm")
    hit_bytes = dict(prep.hit_bytes)
    missing = dict(prep.missing)
    hits = prep.hits
    learned = [
        (i.path, i.offset, i.size, str(i.name))
        for r in run.results
        if isinstance(r.value, CacheChange)
        for i in r.value.landed
    ]
    await asyncio.to_thread(remember, learned, since)  # the next check of these caches need not hash them
    for r in run.results:
        if not r.succeeded or not isinstance(r.value, CacheChange):
            continue
        there = {(i.path, i.offset, i.size) for i in r.value.landed} | set(r.value.hits)
        now_hits = [i for i in missing[r.host.name] if (i.path, i.offset, i.size) in there or i.name in there]
        hit_bytes[r.host.endpoint] += sum(i.size for i in now_hits)
        hits += len(now_hits)
        missing[r.host.name] = tuple(i for i in missing[r.host.name] if i not in now_hits)
    return run, CachePrep(prep.hosts, hit_bytes, missing, hits, prep.waiting)


async def warm_beside(
    session: Session, prep: CachePrep, beside: Callable[[], Awaitable[None]]
) -> tuple[RunResult[CacheChange], CachePrep]:
    """Warm the misses and, once every warming node has marked its files (or ended), run `beside` (the
    load) next to the rest of the warm; returns as `warm_misses` once both have ended. An error from
    `beside` cancels the warm (its trap removes the marks: no server waits on)."""
    pending = {h.name for h in warming_hosts(prep)}
    marked = asyncio.Event()

    def ready(host: Host) -> None:
        pending.discard(host.name)
        if not pending:
            marked.set()

    warming = asyncio.ensure_future(warm_misses(session, prep, on_ready=ready))
    marks = asyncio.ensure_future(marked.wait())
    try:
        await asyncio.wait({warming, marks}, return_when=asyncio.FIRST_COMPLETED)
        await beside()
        return await warming
    finally:
        marks.cancel()
        if not warming.done():
            warming.cancel()
            await asyncio.gather(warming, return_exceptions=True)


async def prepare_caches(
    session: Session,
    hosts: Sequence[Host],
    plan: Plan,
    model: str | Path | None = None,
    *,
    full: bool = False,
    warm: WarmChoice = "auto",
    on_checked: Callable[[CachePrep], None] | None = None,
    beside: Callable[[CachePrep], Awaitable[None]] | None = None,
) -> tuple[CachePrep | None, RunResult[CacheChange] | None]:
    """Before a load of `plan`: check the caches of its `rpc_cache` hosts among `hosts` (LoaderError on a
    file the load would read that is truncated, or with `full` corrupt), then warm the misses when `warm`
    says so. `model`: the file the load reads (default: the plan's). Returns what the load will find (None:
    no cached host) and the warm's run (None: none). `beside(prep)`: the load, run during the warm where
    the prep `overlaps` (`warm_beside`; `prep` as the load will find the caches once warm); the caller
    runs it otherwise."""
    from orchestrator.planning.profile import profile_model

    cached = [h for h in hosts if h.rpc_cache and h.endpoint in plan.endpoints]
    if not cached:
        return None, None
    paths = (await asyncio.to_thread(profile_model, model or plan.model_path)).paths
    per_endpoint = await asyncio.to_thread(plan_tensors, plan, paths)
    prep = await check_caches(session, cached, per_endpoint, full=full)
    if on_checked is not None:
        on_checked(prep)
    if session.interrupted is not None or not prep.worth_warming(warm):
        return prep, None
    if beside is not None and prep.overlaps:
        expected = prep.all_warm()
        run, prep = await warm_beside(session, prep, lambda: beside(expected))
    else:
        run, prep = await warm_misses(session, prep)
    return prep, run
