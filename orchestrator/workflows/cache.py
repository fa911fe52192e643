"""The servers' tensor caches as use cases: `cache_fleet` (status, verify, prune, clear) and `warm_fleet`
(plan the model as `run` does, then put each node's share of its tensors into that node's cache, all nodes
in parallel). `cache_items` is the plan's files per host that both use (prune keeps them)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from orchestrator.caches.plan import plan_cache
from orchestrator.caches.prep import warm_items
from orchestrator.inventory.model import Host
from orchestrator.operations.cache import WarmItem, cache_step, status_step, warm_step
from orchestrator.operations.layer import OperationOptions
from orchestrator.workflows.change import Batches, FleetChange, change_fleet
from orchestrator.workflows.options import ModelPlanning
from orchestrator.workflows.plan import plan_model

CacheItems = dict[str, Sequence[WarmItem]]  # host name -> the cache files its share of the plan reads


@dataclass(frozen=True)
class Warmed:
    """What `warm_fleet` planned (the files per host) and did, with each phase's seconds."""

    items: CacheItems
    change: FleetChange
    phases: dict[str, float] = field(default_factory=dict)


def cache_items(
    hosts: Sequence[Host], planning: ModelPlanning, phases: dict[str, float] | None = None
) -> CacheItems:
    """Plan the model on `hosts`; per host name, the cache files its share needs. `phases` gets the
    probe's, the plan's and the hashing's seconds."""
    times = phases if phases is not None else {}
    started = time.monotonic()
    profile, round_ = plan_model(planning, lambda: hosts)
    times["probe"] = time.monotonic() - started - round_.plan_seconds
    times["plan"] = round_.plan_seconds
    assert round_.plan is not None  # failed="raise": no plan is an error
    hashed = time.monotonic()
    per_endpoint = plan_cache(round_.plan, profile.paths)
    times["hash"] = time.monotonic() - hashed
    return dict(warm_items(per_endpoint, hosts))


def warm_fleet(
    hosts: Sequence[Host], planning: ModelPlanning, options: OperationOptions, batches: Batches
) -> Warmed:
    """Plan, then put into each `rpc_cache` host's cache the tensors the plan gives it that it lacks."""
    phases: dict[str, float] = {}
    items = cache_items(hosts, planning, phases)
    chosen = [h for h in hosts if h.name in items and h.rpc_cache]
    started = time.monotonic()
    change = change_fleet(chosen, warm_step(items, options), "cache-warm", batches)
    phases["upload"] = time.monotonic() - started
    return Warmed(items, change, phases)


def cache_fleet(
    hosts: Sequence[Host],
    action: Literal["status", "verify", "prune", "clear"],
    options: OperationOptions,
    batches: Batches,
    *,
    keep_for: ModelPlanning | None = None,
) -> FleetChange:
    """Read (status) or change each host's cache; `prune` with `keep_for` keeps the files that model's
    plan reads whatever their age."""
    if action == "status":
        return change_fleet(hosts, status_step, "cache-status", batches)
    keep: dict[str, list[str]] = {}
    if action == "prune" and keep_for is not None:
        keep = {h: [i.name for i in items if i.name] for h, items in cache_items(hosts, keep_for).items()}
    return change_fleet(hosts, cache_step(action, options, keep=keep), f"cache-{action}", batches)
