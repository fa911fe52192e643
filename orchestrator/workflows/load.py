"""`load_on_fleet`: load a plan through the fleet: the caches' check and warm (one session, all nodes in
parallel), the targets to dial (SSH forwards), then the worker's load. `fleet_targets` is the one place
that gives the plan's endpoints the addresses the worker dials."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.caches.prep import CachePrep, WarmChoice, prepare_caches
from orchestrator.connectors.tunnel import default_tunnels
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
    run (None: none), whether a signal interrupted the check or the warm (then nothing was loaded), the
    phases' seconds, and the placement once loaded."""

    cache: CachePrep | None = None
    warm: RunResult[Any] | None = None
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
) -> FleetLoad:
    """Before a load through `hosts`' `rpc_cache` servers: count each node's hits and misses, refuse
    (LoaderError) a file the load would read that is truncated (`verify`: or corrupt), and warm the
    misses when `warm` says so. `interruptible`: Ctrl-C / SIGTERM stop it between hosts (the CLI)."""
    hosts = list(hosts)
    done = FleetLoad()
    if not hosts:
        return done
    started = time.monotonic()

    def checked(prep: CachePrep) -> None:
        done.phases["cache check"] = time.monotonic() - started
        if on_checked is not None:
            on_checked(prep)

    async def go() -> None:
        done.cache, done.warm = await prepare_caches(
            session, hosts, plan, model, full=verify, warm=warm, on_checked=checked
        )

    if interruptible:
        async with session.catching_signals():
            await go()
    else:
        await go()
    if done.warm is not None:
        done.phases["warm"] = time.monotonic() - started - done.phases["cache check"]
    done.interrupted = session.interrupted is not None
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
    on_progress: Callable[[LoadProgress], None] | None = None,
    forks: int | None = None,
) -> FleetLoad:
    """Check (and warm) the caches of `hosts` for `plan`, then load it in `worker` through the dialed
    endpoints: the placement is in the result. `runtime`: the command's (its loop and its session, whose
    connections the probe opened); without one a session is made for the check. `on_prepared` sees the
    caches before the load (to report them, or to stop: an interrupted check loads nothing)."""
    hosts = list(hosts)
    if runtime is not None:
        done = runtime.run(
            prepare_load(
                runtime.session,
                hosts,
                plan,
                model,
                verify=verify,
                warm=warm,
                interruptible=interruptible,
                on_checked=on_checked,
            )
        )
    else:

        async def own() -> FleetLoad:
            async with Session(forks=forks or DEFAULT_FORKS) as session:
                return await prepare_load(
                    session, hosts, plan, model, verify=verify, warm=warm, on_checked=on_checked
                )

        done = run_sync(own())
    if on_prepared is not None:
        on_prepared(done)
    if done.interrupted:
        return done
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
    return done
