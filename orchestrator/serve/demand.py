"""What the router, the front and serve's life ask of the on-demand models' loads (`serve.on_demand`,
which holds the router: the router sees it through this Protocol only), and one on-demand event."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from orchestrator.planning.formations import ServedModel
from orchestrator.serve.metrics import ModelView


@dataclass(frozen=True)
class DemandEvent:
    """One on-demand event: `kind` load, resume, loaded, load_failed, unload or swap; `at` wall clock."""

    at: float
    kind: str
    model: str
    formation: str
    message: str


class Demand(Protocol):
    @property
    def models(self) -> dict[str, ServedModel]:
        """The on-demand models, by name."""
        ...

    @property
    def events(self) -> Sequence[DemandEvent]:
        """The latest events, oldest first (`event_count`: events ever, a reader's cursor over them)."""
        ...

    @property
    def event_count(self) -> int: ...

    def state(self, model: str) -> str:
        """As /v1/models shows it: loaded, loading, unloaded..."""
        ...

    def loading(self) -> list[str]: ...

    def health(self) -> dict[str, dict[str, object]]: ...

    def views(self) -> list[ModelView]: ...

    async def ensure(self, name: str, wait: float) -> None:
        """`name` loaded (the request waits, at most `wait` s; Rejected 503 when it cannot be)."""
        ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...
