"""A formation's records: its state and the moves allowed between states (`FormationState`, `MOVES`), its
serving limits (`ServeConfig`), the states that serve requests, a refusal, a request's end that was not
served, the engine serving now and how it ended, an admitted request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from orchestrator.core.errors import RpcfleetError
from orchestrator.planning.plan import Plan
from orchestrator.serve import settings
from orchestrator.serve.engine import DEFAULT_PARALLEL, Engine


class FormationState(StrEnum):
    """A formation's state (its value is what /health, /metrics and the logs show).

    `loading` (first load), `ready` (serving on every node that was selected), `degraded` (serving on
    fewer: a node was lost and the model was re-planned on the others), `recovering` (a node or the engine
    was lost, or a reload or rejoin restarts it: probing, planning, loading), `draining` (a reload, or a
    rejoin while another formation of the model serves, waits for admitted requests to finish), `failed`
    (recovery gave up after `recover_timeout`, or an on-demand model's first load failed)."""

    LOADING = "loading"
    READY = "ready"
    DEGRADED = "degraded"
    RECOVERING = "recovering"
    DRAINING = "draining"
    FAILED = "failed"


_S = FormationState
# The moves a formation's state may make (`Formation` makes them, nothing else): from -> the states it may
# go to. A move not listed is a programming error (`IllegalMove`), never a request's or a node's fault.
MOVES: Mapping[FormationState, frozenset[FormationState]] = {
    # served after its load; an on-demand model's failed first load; a reload before the load ended
    _S.LOADING: frozenset({_S.READY, _S.DEGRADED, _S.FAILED, _S.DRAINING}),
    # the engine lost (a node, or its own end); a reload's drain; and a first load that a reload overtook
    # (a SIGHUP as serve starts takes the control first) serves once more
    _S.READY: frozenset({_S.RECOVERING, _S.DRAINING, _S.READY, _S.DEGRADED}),
    # as ready; and a rejoin: its drain (another formation serves), its reload (ready, or degraded again
    # with a node still left out), its failed load (recovering)
    _S.DEGRADED: frozenset({_S.RECOVERING, _S.DRAINING, _S.READY, _S.DEGRADED}),
    # served again, or given up; a reload that took the control first; a reload or a rejoin restarting
    # a formation whose engine was lost meanwhile
    _S.RECOVERING: frozenset({_S.READY, _S.DEGRADED, _S.FAILED, _S.DRAINING, _S.RECOVERING}),
    # drained: the reload or rejoin restarts it, or the engine was lost; a rejoin that did not drain in
    # time serves on as it was
    _S.DRAINING: frozenset({_S.RECOVERING, _S.DEGRADED}),
    # a reload tries again; and a recovery queued behind one that gave up (a reload's, whose drain saw the
    # engine lost and recovered first) tries on: it serves, or gives up once more
    _S.FAILED: frozenset({_S.DRAINING, _S.READY, _S.DEGRADED, _S.FAILED}),
}

SERVING = frozenset({FormationState.READY, FormationState.DEGRADED})


class IllegalMove(RuntimeError):
    """A formation's state asked to make a move that `MOVES` does not allow: a bug in serve."""

    def __init__(self, was: FormationState, to: FormationState) -> None:
        super().__init__(f"a formation may not go from {was} to {to}")
        self.was, self.to = was, to


def moved(was: FormationState, to: FormationState) -> FormationState:
    """`to`, when `MOVES` allows it from `was` (else IllegalMove)."""
    if to not in MOVES[was]:
        raise IllegalMove(was, to)
    return to


@dataclass(frozen=True)
class ServeConfig:
    parallel: int = DEFAULT_PARALLEL  # requests the engine serves at once (llama-server's --parallel)
    queue_size: int = settings.QUEUE_SIZE  # requests waiting for a slot beyond those served
    queue_timeout: float = settings.QUEUE_TIMEOUT  # seconds a request may wait for a slot
    load_timeout: float = 300.0
    event_timeout: float = 120.0  # seconds between two answers of the engine within a request
    link_timeout: float = settings.LINK_TIMEOUT
    recover_timeout: float = settings.RECOVER_TIMEOUT  # seconds of recovery before giving up
    retry_interval: float = 1.0  # seconds between two recovery rounds
    drain_timeout: float = 300.0  # seconds a reload waits for admitted requests
    retry_after: int = 2  # the Retry-After of a 503 (seconds)
    rejoin_interval: float = settings.REJOIN_INTERVAL  # seconds between two probes of the nodes left out
    diagnose_timeout: float = 15.0  # seconds a request waits for the diagnosis of a dead engine
    seed: int = settings.SEED
    routing: str = settings.ROUTING  # which formation of a model takes a request: affine or least-loaded
    min_resident: float = settings.MIN_RESIDENT  # on-demand: seconds loaded before a swap may unload it
    swap_cooldown: float = settings.SWAP_COOLDOWN  # on-demand: seconds unused before a swap may unload it


class Rejected(RpcfleetError):
    """A request that is not served: `status` (429, 503), `retry_after` (seconds, for a 503) and the lost
    nodes it names (a formation that recovers from their loss)."""

    def __init__(
        self, status: int, message: str, retry_after: int | None = None, lost: tuple[str, ...] = ()
    ) -> None:
        self.status = status
        self.retry_after = retry_after
        self.lost = lost
        super().__init__(message)


@dataclass(frozen=True)
class Failure:
    """The end of a request that was not served to the end: HTTP status, message, lost endpoints."""

    status: int
    message: str
    kind: str  # OpenAI error type: node_lost, unavailable, invalid_request_error, server_error
    lost: tuple[str, ...] = ()
    retry_after: int | None = None
    engine_alive: bool = False  # the engine runs on: it broke this request alone off (no other serves it)


@dataclass(frozen=True)
class NoRound:
    """A round that could not be made (the error's message): the states known before it."""

    states: dict[str, str]
    reason: str
    fitting: None = None


@dataclass(eq=False)
class Running:
    """The engine serving now, and how it ended (set once, by its watch)."""

    engine: Engine
    plan: Plan
    stopping: bool = False  # stopped on purpose (reload, rejoin, shutdown): no recovery
    busy: int = 0  # requests holding one of its slots
    failure: Failure | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False)
class Ticket:
    """One admitted request: the slot it holds, when it holds one."""

    admitted: float = field(default_factory=time.monotonic)
    running: Running | None = None
    first_token: float | None = None  # seconds from admission to the first text

    def saw_text(self) -> None:
        if self.first_token is None:
            self.first_token = time.monotonic() - self.admitted
