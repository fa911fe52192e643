"""The on-demand models' decisions (pure: no I/O, the clock passed in): which idle formations a load
unloads (`swap`), how long a loaded model is kept before another may take its nodes (`residency`, the
swap cooldown), and how long a model whose load failed waits before the next try (`backoff`).

Under pressure (models that cannot all be loaded at once), the rules that keep serve from thrashing:
- a formation loaded on demand stays at least `residency` (the larger of `--models-min-resident` and
  twice its load time): a request for another model waits for it, or is refused with the time left;
- a formation used in the last `--models-swap-cooldown` seconds is not swapped out: a user's next turn
  finds it loaded;
- a model whose load failed is not loaded again before its `backoff` ends (1, 2, 4... times the first,
  at most `BACKOFF_MAX`): meanwhile its requests get a 503 with the failure and nothing is evicted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.inventory.model import Host
from orchestrator.planning.formations import FormationError, PlannedFormation, ServedModel, form
from orchestrator.planning.plan import PlanDevice

BACKOFF_FIRST = 5.0  # seconds a model waits after its first failed load
BACKOFF_MAX = 300.0  # seconds: the backoff's cap


@dataclass(frozen=True)
class Occupant:
    """A formation occupying nodes, as the swap sees it: idle (no request admitted or waiting, serving),
    on-demand or always loaded, when its model was last asked for, and (on-demand) when it may be
    swapped out at the earliest (`swappable_at`: its residency and cooldown; 0: any time)."""

    name: str
    model: str
    endpoints: tuple[str, ...]
    on_demand: bool
    idle: bool
    last_used: float
    admitted: int = 0
    swappable_at: float = 0.0


@dataclass(frozen=True)
class Swap:
    """What a load needs: `unload` these idle formations first (none: the free nodes hold it), or `wait`
    for busy or protected ones (the reason; `ready_in`: seconds until the protected ones may go, 0 when
    busy ones are waited for), or `never`: the nodes open to the model cannot hold it (the reason)."""

    unload: tuple[str, ...] = ()
    wait: str | None = None
    never: str | None = None
    ready_in: float = 0.0


def residency(min_resident: float, load_seconds: float | None) -> float:
    """Seconds a formation loaded on demand is kept at least: `min_resident`, or twice its load when
    that is longer (at most a third of the time goes to loads while two models take turns)."""
    return max(min_resident, 2 * (load_seconds or 0.0))


def swappable_at(
    loaded_at: float | None,
    load_seconds: float | None,
    last_used: float,
    min_resident: float,
    cooldown: float,
) -> float:
    """When a formation of an on-demand model may be swapped out: past its residency and `cooldown`
    seconds after its last request."""
    kept = loaded_at + residency(min_resident, load_seconds) if loaded_at is not None else 0.0
    return max(kept, last_used + cooldown)


def backoff(failures: int, first: float = BACKOFF_FIRST, cap: float = BACKOFF_MAX) -> float:
    """Seconds before the next load of a model whose last `failures` loads failed in a row."""
    return 0.0 if failures <= 0 else min(cap, first * 2 ** (failures - 1))


def fits_on(
    model: ServedModel, hosts: Sequence[Host], devices: Sequence[PlanDevice]
) -> PlannedFormation | None:
    """The formation of `model` on the fewest of `hosts` that hold it (None: they do not)."""
    some = [d for d in devices if d.endpoint in {h.endpoint for h in hosts}]
    if not some:
        return None
    try:
        formed, _ = form([dataclasses.replace(model, replicas=1, split=False)], hosts, some)
    except FormationError:
        return None
    return formed[0] if formed else None


def swap(
    model: ServedModel,
    free: Sequence[Host],
    occupants: Sequence[Occupant],
    hosts: Sequence[Host],
    known: dict[str, list[PlanDevice]],
    now: float = 0.0,
) -> Swap:
    """Which idle on-demand formations to unload so that `model` fits (least recently used first, the
    fewest that make room), judged on each node's devices when last probed (`known`); an idle one not
    swappable yet at `now` (its residency, its cooldown) is waited for as a busy one is."""
    by_endpoint = {h.endpoint: h for h in hosts}

    def fits(endpoints: Sequence[str]) -> bool:
        chosen = [by_endpoint[ep] for ep in endpoints if ep in by_endpoint]
        devices = [d for ep in endpoints for d in known.get(ep, [])]
        return fits_on(model, chosen, devices) is not None

    free_eps = [h.endpoint for h in free]
    if fits(free_eps):
        return Swap()
    others = [h for h in occupants if h.model != model.name]
    idle = sorted(
        (h for h in others if h.on_demand and h.idle and h.swappable_at <= now), key=lambda h: h.last_used
    )
    for count in range(1, len(idle) + 1):
        if fits([*free_eps, *(ep for h in idle[:count] for ep in h.endpoints)]):
            return Swap(unload=tuple(h.name for h in idle[:count]))
    kept = [h for h in others if h.on_demand and h.idle and h.swappable_at > now]
    busy = [h for h in others if h.on_demand and not h.idle]
    if fits([*free_eps, *(ep for h in [*idle, *kept, *busy] for ep in h.endpoints)]):
        held = [f"{h.name} ({h.admitted} request(s)) holds {', '.join(h.endpoints)}" for h in busy]
        held += [
            f"{h.name} holds {', '.join(h.endpoints)}, kept {h.swappable_at - now:.0f} s more" for h in kept
        ]
        ready_in = 0.0 if busy else min(h.swappable_at for h in kept) - now
        return Swap(wait=f"{model.name} waits for nodes in use: {'; '.join(held)}", ready_in=ready_in)
    always = [h for h in others if not h.on_demand]
    held_always = "; ".join(f"{h.name} holds {', '.join(h.endpoints)}" for h in always) or "none is held"
    open_to = ", ".join(free_eps + [ep for h in [*idle, *kept, *busy] for ep in h.endpoints]) or "none"
    return Swap(
        never=f"{model.name} does not fit on the nodes open to on-demand models ({open_to}); "
        f"always loaded: {held_always}"
    )
