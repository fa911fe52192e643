"""The operations layer: every change to a node is one `node_operation`, whichever front end asks.

The CLI, the playbooks and the Python API build their executor steps here, so each change gets the same
four guarantees:
1. the host lock (`operations.lock`) for the whole change, released when it ends or the controller dies;
   a second operator waits (`wait_lock`) or fails with `HostLockedError`;
2. busy protection: a server with a client connected is never stopped without `force` (the stop itself
   re-checks on the node, `operations.process.stop_script`);
3. check mode: the node is read and the change computed, nothing is locked or changed;
4. interrupts: once a host's change has begun it runs to its end (a cancelled caller waits for it), and
   the executor starts no new host after an interrupt (`Session.interrupt`), so no node is left with a new
   version switched in and not started.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from orchestrator.connectors.base import Connection
from orchestrator.core.errors import NotStartedError
from orchestrator.core.log import Logger, get_logger
from orchestrator.engine.executor import HostContext, Step, StepOutcome
from orchestrator.inventory.model import Host
from orchestrator.operations import BUSY_GRACE
from orchestrator.operations.lock import acquire

T = TypeVar("T")

Body = Callable[[HostContext, Connection], Awaitable[StepOutcome[T]]]


@dataclass(frozen=True)
class OperationOptions:
    """How an operation runs: `check` changes nothing, `force` stops busy servers, `wait_lock` is how
    long to wait for another operator's lock (0: fail at once)."""

    check: bool = False
    force: bool = False
    wait_lock: float = 0.0
    busy_grace: float = BUSY_GRACE  # a client connected this long is a model, not a probe passing by


DEFAULT_OPTIONS = OperationOptions()


async def run_to_completion(work: Awaitable[T], log: Logger | None = None) -> T:
    """Await `work`; if the caller is cancelled meanwhile, let `work` finish first, then re-raise.

    A host step changes a node in several commands (switch the version, start it): cutting it between two
    of them would leave the node neither old nor new. When the step fails meanwhile (a start that failed
    after the version switch), its error is raised in place of the cancellation: the executor records
    the host as failed with that error, so the recap shows what state the node was left in.
    """
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        try:
            await task
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            (log or get_logger()).warning("host_step_failed_after_cancel", error=str(exc))
            raise
        raise


def node_operation(name: str, body: Body[T], options: OperationOptions) -> Step[T]:
    """The executor step running `body` on one host under the operations layer's rules."""

    async def step(ctx: HostContext) -> StepOutcome[T]:
        conn = await ctx.connection()
        if options.check:
            return await body(ctx, conn)

        def waiting(host: Host, holder: str) -> None:
            if options.wait_lock > 0:
                ctx.log.warning("host_lock_waiting", holder=holder, wait_s=options.wait_lock)

        # Waiting for another operator's lock changes nothing: an interrupt ends the wait.
        lock = await ctx.session.unless_interrupted(
            acquire(conn, ctx.host, name, wait_s=options.wait_lock, on_wait=waiting)
        )
        try:
            if ctx.session.interrupted is not None:
                raise NotStartedError(f"not started: {ctx.session.interrupted}", host=ctx.host.name)
            return await run_to_completion(body(ctx, conn), ctx.log)
        finally:
            await lock.release()

    step.__name__ = name
    return step
