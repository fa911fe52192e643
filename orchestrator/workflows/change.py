"""The server lifecycle's use cases: `deploy_fleet`, `service_fleet` (start, stop, restart),
`rollback_fleet`, `status_fleet` and `logs_fleet`. Each builds its operation's step and runs it on the
selected hosts through the executor (`change_fleet`: one interruptible session, batches, the failure
threshold); deploy and status then look, in the same session, for the servers of the hosts' installs that
the inventory no longer declares."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from orchestrator.engine.executor import DEFAULT_FORKS, RunResult, Session, Step
from orchestrator.engine.runtime import run_once
from orchestrator.inventory.model import Host, Inventory
from orchestrator.operations.install.ensure import ArtifactChooser, BuildLogFactory, ProgressFactory
from orchestrator.operations.layer import OperationOptions
from orchestrator.operations.restart import make_restart_step
from orchestrator.operations.server.steps import (
    make_deploy_step,
    make_logs_step,
    make_rollback_step,
    make_service_step,
    make_status_step,
)
from orchestrator.operations.undeclared import LiveServer, undeclared_step

Undeclared = list[tuple[Host, LiveServer]]  # (the machine, a server of its install it does not declare)


@dataclass(frozen=True)
class Batches:
    """How a change runs over the hosts: hosts at once, hosts per batch (a number or a percentage; None:
    one batch), the failure percentage that stops the next batches, and how a caught signal is reported
    (Ctrl-C / SIGTERM stop the run between hosts)."""

    forks: int | None = None
    serial: int | str | None = None
    max_fail_percentage: float | None = None
    on_interrupt: Callable[[str, int], None] | None = None


@dataclass(frozen=True)
class FleetChange:
    """The run's per-host results, and the undeclared servers found after it (when looked for)."""

    run: RunResult[Any]
    undeclared: Undeclared = field(default_factory=list)


def change_fleet(
    hosts: Sequence[Host], step: Step[Any], name: str, batches: Batches, *, inventory: Inventory | None = None
) -> FleetChange:
    """Run `step` on `hosts`; with the `inventory`, then look in the same session for the servers of
    their installs that it does not declare."""

    async def go() -> FleetChange:
        async with fleet_session(batches) as session:
            run = await session.run(
                hosts, step, name=name, serial=batches.serial, max_fail_percentage=batches.max_fail_percentage
            )
            if inventory is None or run.interrupted:
                return FleetChange(run)
            # not the machines the run could not reach: a second connect would only time out again
            reached = [r.host for r in run.results if r.status not in ("unreachable", "skipped")]
            found, interrupted = await find_undeclared_in(session, inventory, reached)
            if interrupted:  # landed after the run itself: still 130 and `interrupted`
                run = dataclasses.replace(run, interrupted=True)
            return FleetChange(run, found)

    return run_once(go())


def deploy_fleet(
    inventory: Inventory,
    hosts: Sequence[Host],
    options: OperationOptions,
    batches: Batches,
    *,
    artifact: str | None = None,
    reinstall: bool = False,
    progress: ProgressFactory | None = None,
    build_log: BuildLogFactory | None = None,
) -> FleetChange:
    """Install the pinned artifact (`artifact`: an id or spec file; None: each host's `rpc_artifact`),
    start or restart the server, wait for its HELLO; then the undeclared servers."""
    choose = ArtifactChooser(artifact)
    step = make_deploy_step(choose, options, reinstall=reinstall, progress=progress, build_log=build_log)
    return change_fleet(hosts, step, "deploy", batches, inventory=inventory)


def service_fleet(
    hosts: Sequence[Host],
    action: Literal["start", "stop", "restart"],
    options: OperationOptions,
    batches: Batches,
) -> FleetChange:
    """Start, stop or restart the servers of `hosts` (restart: the same operation as a rolling one's)."""
    if action == "restart":
        step: Step[Any] = make_restart_step(options)
    else:
        step = make_service_step("running" if action == "start" else "stopped", options)
    return change_fleet(hosts, step, action, batches)


def rollback_fleet(
    hosts: Sequence[Host], options: OperationOptions, batches: Batches, *, to: str | None = None
) -> FleetChange:
    """Switch back to the previous installed version (or `to`) and restart on it."""
    return change_fleet(hosts, make_rollback_step(options, to=to), "rollback", batches)


def status_fleet(inventory: Inventory, hosts: Sequence[Host], batches: Batches) -> FleetChange:
    """Each server's state (read-only); then the undeclared servers."""
    return change_fleet(hosts, make_status_step(), "status", batches, inventory=inventory)


def logs_fleet(hosts: Sequence[Host], lines: int, batches: Batches, *, noise: bool = False) -> FleetChange:
    """The last `lines` of each server's log (read-only)."""
    return change_fleet(hosts, make_logs_step(lines, noise=noise), "logs", batches)


def find_undeclared(inventory: Inventory, hosts: Sequence[Host], batches: Batches) -> tuple[Undeclared, bool]:
    """The undeclared servers of `hosts`' installs, in a session of their own; whether a signal cut it."""

    async def go() -> tuple[Undeclared, bool]:
        async with fleet_session(batches) as session:
            return await find_undeclared_in(session, inventory, hosts)

    return run_once(go())


async def find_undeclared_in(
    session: Session, inventory: Inventory, hosts: Sequence[Host]
) -> tuple[Undeclared, bool]:
    """The servers of the installs of `hosts` (servers' views) that their machines do not declare; a
    machine that cannot be read is left out (the run's own result says why)."""
    machines = [inventory.host(name) for name in dict.fromkeys(h.node_name for h in hosts)]
    run = await session.run(machines, undeclared_step, name="undeclared")
    found = [(r.host, live) for r in run.results if isinstance(r.value, tuple) for live in r.value]
    return found, run.interrupted


def fleet_session(batches: Batches) -> Session:
    """The executor session of a change: its forks, and Ctrl-C / SIGTERM stop it between hosts."""
    return Session(
        forks=batches.forks or DEFAULT_FORKS, interruptible=True, on_interrupt=batches.on_interrupt
    )
