"""A formation's records: its serving limits (`ServeConfig`), the states that serve requests, a refusal, a
request's end that was not served, the engine serving now and how it ended, an admitted request."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from orchestrator.core.errors import RpcfleetError
from orchestrator.planning.plan import Plan
from orchestrator.serve import settings
from orchestrator.serve.engine import DEFAULT_PARALLEL, Engine

SERVING = frozenset({"ready", "degraded"})


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
