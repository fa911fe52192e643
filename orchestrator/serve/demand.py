"""What the router, the front and serve's life ask of the on-demand models' loads (`serve.on_demand`,
which holds the router: the router sees it through this Protocol only)."""

from __future__ import annotations

from typing import Protocol

from orchestrator.planning.formations import ServedModel
from orchestrator.serve.metrics import ModelView


class Demand(Protocol):
    @property
    def models(self) -> dict[str, ServedModel]:
        """The on-demand models, by name."""
        ...

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
