"""Running a playbook: plays over host selections in batches, with a recap."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from orchestrator.core.errors import (
    UsageError,
)
from orchestrator.engine.executor import (
    HostResult,
    Session,
)
from orchestrator.inventory.model import Host, Inventory, select_servers

if TYPE_CHECKING:  # imported lazily at run time: planning pulls in numpy
    pass
from orchestrator.playbooks.model import Play, Playbook, PlaybookResult, PlayState, StepRun
from orchestrator.playbooks.ops import REGISTRY


def play_hosts(playbook: Playbook, inventory: Inventory, limit: str | None = None) -> list[Host]:
    """The play's hosts: its `hosts` pattern, narrowed by --limit (both Ansible patterns)."""
    hosts = select_servers(inventory, playbook.hosts)  # each rpc-server of a host is a host of the play
    if limit:
        allowed = {h.name for h in select_servers(inventory, limit)}
        hosts = [h for h in hosts if h.name in allowed]
        if not hosts:
            raise UsageError(f"--limit {limit!r} leaves none of the play's hosts ({playbook.hosts!r})")
    return hosts


async def run_playbook(
    playbook: Playbook,
    hosts: Sequence[Host],
    *,
    session: Session,
    check: bool = False,
    wait_lock: float = 0.0,
    on_step: Callable[[StepRun], None] | None = None,
    on_result: Callable[[HostResult[Any]], None] | None = None,
) -> PlaybookResult:
    """Run every step over the hosts still in play (see the module docstring); never raises for a
    host's failure: it is in the result."""
    in_play = tuple(hosts)
    state = PlayState()
    runs: list[StepRun] = []
    aborted = False
    for step in playbook.steps:
        if not in_play:
            break
        op = REGISTRY[step.op]
        play = Play(session, in_play, check, state, step, wait_lock)
        run = await session.run(
            in_play,
            op.factory(step.args, play),
            name=step.label,
            serial=(list(playbook.serial) if isinstance(playbook.serial, tuple) else playbook.serial)
            if op.scope == "host"
            else None,
            max_fail_percentage=playbook.max_fail_percentage,
            on_result=on_result,
        )
        step_run = StepRun(step, run)
        runs.append(step_run)
        if on_step is not None:
            on_step(step_run)
        if run.aborted:
            aborted = True
            break
        in_play = tuple(r.host for r in run.results if r.succeeded)
    return PlaybookResult(playbook, tuple(hosts), tuple(runs), tuple(state.documents), aborted, check)
