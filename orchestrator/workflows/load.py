"""`load_on_fleet`: load a plan through the fleet: the caches' check and warm (one session, all nodes in
parallel), the targets to dial (SSH forwards), then the worker's load: beside the warm where every warming
node's server waits for the files being warmed (`CachePrep.overlaps`), else after it. `fleet_targets` is
the one place that gives the plan's endpoints the addresses the worker dials."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.caches.prep import CachePrep, WarmChoice, prepare_caches
from orchestrator.connectors.tunnel import default_tunnels
from orchestrator.core.errors import RpcfleetError
from orchestrator.core.target import Target
from orchestrator.engine.executor import DEFAULT_FORKS, RunResult, Session
from orchestrator.engine.runtime import Runtime, run_sync
from orchestrator.inventory.model import Host
from orchestrator.planning.plan import Plan

if TYPE_CHECKING:
    from orchestrator.llama.observed_placement import Placement
    from orchestrator.llama.worker.load_progress import LoadProgress
    from orchestrator.llama.worker.parent import Worker


def fleet_targets(hosts: Iterable[Host], endpoints: Iterable[str] | None = None) -> dict[str, Target]:
    """Plan endpoint -> its target, for `hosts` (those serving `endpoints`, when given): the
    `rpc_transport: ssh` ones through their SSH forwards, opened now (or reopened after a dropped
    tunnel) or reused from the probe; the others dialed directly."""
    wanted = None if endpoints is None else set(endpoints)
    return default_tunnels().targets(h for h in hosts if wanted is None or h.endpoint in wanted)


@dataclass
class FleetLoad:
    """What `load_on_fleet` found and did: the caches (None: no `rpc_cache` host in the plan), the warm's
    run (None: none, or not ended yet), whether the load ran beside the warm (`overlapped`), whether a
    signal interrupted the check or the warm (then nothing was loaded), the phases' seconds, and the
    placement once loaded."""

    cache: CachePrep | None = None
    warm: RunResult[Any] | None = None
    overlapped: bool = False
    interrupted: bool = False
    phases: dict[str, float] = field(default_factory=dict)
    placement: Placement | None = None


async def prepare_load(
    session: Session,
    hosts: Iterable[Host],
    plan: Plan,
    model: str | Path | None = None,
    *,
    verify: bool = False,
    warm: WarmChoice = "auto",
    interruptible: bool = False,
    on_checked: Callable[[CachePrep], None] | None = None,
    beside: Callable[[FleetLoad], Awaitable[None]] | None = None,
) -> FleetLoad:
    """Before a load through `hosts`' `rpc_cache` servers: count each node's hits and misses, refuse
    (LoaderError) a file the load would read that is truncated (`verify`: or corrupt), and warm the
    misses when `warm` says so. `interruptible`: Ctrl-C / SIGTERM stop it between hosts (the CLI).
    `beside(done)`: the load, run during the warm where it may overlap it (then `done.overlapped`, and
    `done.cache` is the caches as they will be once warm); the caller loads otherwise."""
    hosts = list(hosts)
    done = FleetLoad()
    if not hosts:
        return done
    started = time.monotonic()

    async def load_beside(expected: CachePrep) -> None:
        assert beside is not None
        done.cache, done.overlapped = expected, True
        await beside(done)

    def checked(prep: CachePrep) -> None:
        done.phases["cache check"] = time.monotonic() - started
        if on_checked is not None:
            on_checked(prep)

    async def go() -> None:
        done.cache, done.warm = await prepare_caches(
            session,
            hosts,
            plan,
            model,
            full=verify,
            warm=warm,
            on_checked=checked,
            beside=None if beside is None else load_beside,
        )

    if interruptible:
        async with session.catching_signals():
            await go()
    else:
        await go()
    if done.warm is not None:
        done.phases["warm"] = time.monotonic() - started - done.phases["cache check"]
    done.interrupted = session.interrupted is not None and done.placement is None
    return done


def load_on_fleet(
    plan: Plan,
    hosts: Iterable[Host],
    worker: Worker,
    model: str | Path | None = None,
    *,
    runtime: Runtime | None = None,
    interruptible: bool = False,
    verify: bool = False,
    warm: WarmChoice = "auto",
    llama_kwargs: Mapping[str, Any] | None = None,
    on_checked: Callable[[CachePrep], None] | None = None,
    on_prepared: Callable[[FleetLoad], None] | None = None,
    on_warmed: Callable[[FleetLoad], None] | None = None,
    on_progress: Callable[[LoadProgress], None] | None = None,
    forks: int | None = None,
) -> FleetLoad:
    """Check (and warm) the caches of `hosts` for `plan`, then load it in `worker` through the dialed
    endpoints: the placement is in the result. `runtime`: the command's (its loop and its session, whose
    connections the probe opened); without one a session is made for the check. `on_prepared` sees the
    caches before the load (to report them, or to stop: an interrupted check loads nothing); where the
    load runs beside the warm, `on_warmed` sees the warm's end after the load. A signal during a load
    beside the warm stops the worker (`interrupted`, nothing loaded)."""
    hosts = list(hosts)

    def load(done: FleetLoad) -> None:
        targets = fleet_targets(hosts, plan.endpoints)
        started = time.monotonic()
        done.placement = worker.load(
            plan,
            model,
            llama_kwargs,
            targets=targets,
            on_progress=on_progress,
            cache_hits=done.cache.hit_bytes if done.cache is not None else None,
        )
        done.phases["load"] = time.monotonic() - started

    async def beside(session: Session, done: FleetLoad) -> None:
        if on_prepared is not None:
            on_prepared(done)
        loading = asyncio.ensure_future(asyncio.to_thread(load, done))
        while not loading.done():  # the load runs in a thread: a signal reaches it through the worker
            await asyncio.wait({loading}, timeout=0.1)
            if session.interrupted is not None and not loading.done():
                worker.kill()
                with contextlib.suppress(RpcfleetError):
                    await loading
                return
        loading.result()

    async def prepare(session: Session) -> FleetLoad:
        return await prepare_load(
            session,
            hosts,
            plan,
            model,
            verify=verify,
            warm=warm,
            interruptible=interruptible,
            on_checked=on_checked,
            beside=lambda done: beside(session, done),
        )

    if runtime is not None:
        done = runtime.run(prepare(runtime.session))
    else:

        async def own() -> FleetLoad:
            async with Session(forks=forks or DEFAULT_FORKS) as session:
                return await prepare(session)

        done = run_sync(own())
    if done.overlapped:
        if on_warmed is not None:
            on_warmed(done)
        return done
    if on_prepared is not None:
        on_prepared(done)
    if not done.interrupted:
        load(done)
    return done
