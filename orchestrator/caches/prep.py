"""Before a load on `rpc_cache` hosts: the cache files it will hit and miss, and warming the misses first.

llama.cpp sends tensors one at a time, one node after the other, so a cold load uses one link at a time
and makes each server hash and write its files on the way. Warming the misses over SSH (`cache warm`'s
operation, every node in parallel) uses all the links at once; the load is then a warm one. Where every
node's server waits for the files being warmed (the `warm-wait` patch of the servers rpcfleet builds),
the load starts as soon as the warm has marked its files and trails it tensor by tensor
(`overlaps`); with any other server it starts when the warm has ended. A hit
that is truncated (or, with `full`, corrupt) is refused before any load: llama.cpp would read it back as
weights without a check.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from orchestrator.caches.plan import CacheTensor, plan_cache
from orchestrator.core.errors import LoaderError
from orchestrator.engine.executor import RunResult, Session
from orchestrator.inventory.model import Host
from orchestrator.operations.cache import CacheChange, CacheCheck, WarmItem, check_step, warm_step
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
        """`auto`: when the misses are on two nodes or more (their links then carry them in parallel)."""
        nodes = sum(1 for items in self.missing.values() if items)
        return nodes > 0 and (choice == "always" or (choice == "auto" and nodes >= 2))

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


async def check_caches(
    session: Session,
    hosts: Sequence[Host],
    per_endpoint: Mapping[str, Sequence[CacheTensor]] | asyncio.Future[dict[str, list[CacheTensor]]],
    *,
    full: bool,
) -> CachePrep:
    """Read each host's cache against the files `per_endpoint` says its share needs (a future: the
    hashing still under way while the nodes list their caches); raise LoaderError naming the host when
    one the load would read is truncated (or, with `full`, corrupt)."""

    async def table() -> Mapping[str, Sequence[CacheTensor]]:
        return per_endpoint if isinstance(per_endpoint, Mapping) else await per_endpoint

    async def expected_files() -> dict[str, dict[str, int]]:
        return {name: {i.name: i.size for i in its} for name, its in warm_items(await table(), hosts).items()}

    expected = asyncio.ensure_future(expected_files())
    try:
        run = await session.run(list(hosts), check_step(expected, full=full), name="cache-check")
        items = warm_items(await table(), hosts)  # a hashing that failed raises its own error here
    finally:
        expected.cancel()
    hit_bytes: dict[str, int] = {}
    missing: dict[str, tuple[WarmItem, ...]] = {}
    hits = 0
    waiting: set[str] = set()
    for r in run.results:
        if r.status == "skipped":  # an interrupt stopped the check first: the caller sees session.interrupted
            continue
        if not isinstance(r.value, CacheCheck):
            raise LoaderError(f"cannot read the tensor cache: {r.error}", host=r.host.name)
        if r.value.bad:
            raise LoaderError(
                f"the tensor cache holds {len(r.value.bad)} truncated or corrupt file(s) this load "
                f"would read ({', '.join(r.value.bad[:3])})",
                host=r.host.name,
                hint=f"run `rpcfleet cache verify -l {r.host.name}` (it removes them), then load again",
            )
        absent = set(r.value.misses)
        host_items = items.get(r.host.name, [])
        hit_bytes[r.host.endpoint] = sum(i.size for i in host_items if i.name not in absent)
        missing[r.host.name] = tuple(i for i in host_items if i.name in absent)
        hits += len(r.value.hits)
        if r.value.waits:
            waiting.add(r.host.name)
    return CachePrep(tuple(hosts), hit_bytes, missing, hits, frozenset(waiting))


def warming_hosts(prep: CachePrep) -> list[Host]:
    """The hosts a warm of `prep` sends files to."""
    return [h for h in prep.hosts if prep.missing.get(h.name)]


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
    step = warm_step(prep.missing, options or OperationOptions(), on_ready)
    run = await session.run(chosen, step, name="cache-warm")
    hit_bytes = dict(prep.hit_bytes)
    missing = dict(prep.missing)
    hits = prep.hits
    for r in run.results:
        if not r.succeeded or not isinstance(r.value, CacheChange):
            continue
        there = set(r.value.added) | set(r.value.hits)
        now_hits = [i for i in missing[r.host.name] if i.name in there]
        hit_bytes[r.host.endpoint] += sum(i.size for i in now_hits)
        hits += len(now_hits)
        missing[r.host.name] = tuple(i for i in missing[r.host.name] if i.name not in there)
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
    hashing = asyncio.ensure_future(asyncio.to_thread(plan_cache, plan, paths))  # beside the nodes' listing
    try:
        prep = await check_caches(session, cached, hashing, full=full)
    finally:
        if not hashing.done():
            hashing.cancel()
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
