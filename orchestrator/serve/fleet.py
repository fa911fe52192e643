"""What a formation needs of its fleet (`Formation`'s view): its endpoints, a probe-and-plan round, the
caches' check before a load, the targets the engine dials, a watch of the nodes it leaves out, the spares
it took, and the fleet's rolling restart. `workflows.serving.ServeFleet` is the fleet serve runs on; the
tests' fleets answer as a test says."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from orchestrator.caches.prep import CachePrep
from orchestrator.core.target import Target
from orchestrator.inventory.model import Host
from orchestrator.planning.plan import Plan


class Round(Protocol):
    """One probe and plan (`workflows.plan.PlanRound`): the plan to load (None: none fits), each
    endpoint's probe state, and why there is no plan to load."""

    @property
    def fitting(self) -> Plan | None: ...

    @property
    def states(self) -> dict[str, str]: ...

    @property
    def reason(self) -> str: ...


class FormationFleet(Protocol):
    model_path: str
    borrowed: list[Host]

    @property
    def hosts(self) -> Sequence[Host]:
        """Its own servers (an on-demand formation's go back to the pool when it is unloaded)."""
        ...

    @property
    def endpoints(self) -> tuple[str, ...]: ...

    async def plan_round(self, *, spare: bool = True) -> Round:
        """Probe every node and plan on those that answer (a spare joins when it no longer fits, if
        `spare`). Raises RpcfleetError when no round could be made."""
        ...

    async def watch(self, endpoints: Sequence[str]) -> dict[str, str]:
        """The probe states of `endpoints` only."""
        ...

    async def prepare_cache(self, plan: Plan) -> CachePrep | None:
        """Before loading `plan`: the caches' check and warm (what it found: `hit_bytes`), None without
        caches; raises RpcfleetError for a cache file that would break the load."""
        ...

    def targets(self) -> dict[str, Target]: ...

    def lay_down_borrowed(self) -> list[Host]: ...

    def keep_borrowed(self, hosts: Sequence[Host]) -> None: ...

    def give_back(self, hosts: Sequence[Host]) -> None: ...

    async def rolling_restart(self, *, serial: int = 1, force: bool = False) -> list[str]:
        """`restart --rolling` on the fleet; the failures (host: message)."""
        ...
