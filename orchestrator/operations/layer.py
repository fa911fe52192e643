"""The operations layer: every change to a node is one `node_operation`, whichever front end asks.

The CLI, the playbooks and the Python API build their executor steps here, so each change gets the same
four guarantees:
1. the host lock (`operations.lock`) for the whole change, released when it ends or the controller dies;
   a second operator waits (`wait_lock`) or fails with `HostLockedError`. A run takes the locks of all
   its hosts before it changes any (`HostLocks`, the executor's run gate), one after the other in one
   order: of two runs started at once over the same hosts one gets every host and the other waits, or
   changes nothing and fails (exit 3), instead of each getting some. A change whose lock stops being
   acknowledged is stopped before the node can give the lock away (`HostLock.guard`, `LockLostError`);
2. busy protection: a server with a client connected is never stopped without `force` (the stop itself
   re-checks on the node, `operations.server.process.stop_script`);
3. check mode: the node is read and the change computed, nothing is locked or changed;
4. interrupts: once a host's change has begun it runs to its end (a cancelled caller waits for it), and
   the executor starts no new host after an interrupt (`Session.interrupt`), so no node is left with a new
   version switched in and not started.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from orchestrator.connectors.base import Connection
from orchestrator.core.errors import NotStartedError, RpcfleetError
from orchestrator.core.log import Logger, get_logger
from orchestrator.engine.executor import HostContext, Session, StepOutcome
from orchestrator.engine.shared import gather_bounded
from orchestrator.inventory.model import Host
from orchestrator.operations import BUSY_GRACE
from orchestrator.operations.lock import HostLock, HostLockedError, ReadyLock, acquire, ready, take

T = TypeVar("T")
# How long a readied lock command waits for its turn beyond --wait-lock, per host locked before it (each
# answers within lock._ANSWER_SLACK's 10 s or fails)
_TURN_SLACK_S = 10.0

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


def lock_order(host: Host) -> tuple[str, int, str, str]:
    """The one order every run takes host locks in: the node, then the install (a lock's identity)."""
    return (*host.install_key, host.name)


InstallKey = tuple[str, int, str]


class HostLocks:
    """A run's host locks (the executor's `RunGate`): taken before any host starts, released as each
    host's change ends.

    One after the other in `lock_order`, so two runs never split the hosts between them: both ask for
    the first host first, and the one refused stops there, giving back what it took. A refusal (another
    operator) fails that host with `HostLockedError` and leaves the run's other hosts not started; a host
    that cannot be reached or locked for another reason fails alone. `wait_lock` bounds the whole wait.

    The several servers of one host (`rpc_servers`) share their install, so they share its lock: taken
    once, given back when the last of them ends, and their changes run one after the other (`serial`):
    the first switches a new version in, the next find it there. Two operators changing two servers of
    one host are two changes of one install: one waits (or exits 3), as for one server.
    """

    def __init__(self, name: str, options: OperationOptions) -> None:
        self.name = name
        self.options = options
        self._locks: dict[InstallKey, HostLock] = {}
        self._members: dict[InstallKey, set[str]] = {}
        self._serial: dict[InstallKey, asyncio.Lock] = {}
        self._claimed: set[InstallKey] = set()

    def holds(self, host: Host) -> bool:
        return host.name in self._members.get(host.install_key, ())

    def lock_of(self, host: Host) -> HostLock:
        return self._locks[host.install_key]

    def serial(self, host: Host) -> asyncio.Lock:
        """Held while one server of an install is changed: its other servers wait their turn."""
        return self._serial.setdefault(host.install_key, asyncio.Lock())

    def first_of_install(self, host: Host) -> bool:
        """Whether `host` is the first server of its install this run changes: the one that changes
        the install itself (`deploy --reinstall`, `rollback`'s switch), once for all its servers."""
        if host.install_key in self._claimed:
            return False
        self._claimed.add(host.install_key)
        return True

    async def enter(self, session: Session, hosts: Sequence[Host]) -> dict[str, RpcfleetError]:
        installs: dict[InstallKey, list[Host]] = {}
        for host in sorted(hosts, key=lock_order):
            installs.setdefault(host.install_key, []).append(host)
        ordered = [servers[0] for servers in installs.values()]  # one lock per install

        # Connecting and readying the locks is the slow part and takes no lock: all at once (the locks'
        # own connections too); then one lock after the other, a round trip each.
        turn_s = self.options.wait_lock + _TURN_SLACK_S * len(ordered)

        async def reach(host: Host) -> tuple[Connection, ReadyLock | RpcfleetError | None] | None:
            conn, lock_conn = await asyncio.gather(
                session.connection(host), session.unshared_connection(host), return_exceptions=True
            )
            for failed in (conn, lock_conn):
                if isinstance(failed, BaseException) and not isinstance(failed, RpcfleetError):
                    raise failed
            if isinstance(conn, BaseException):
                if not isinstance(lock_conn, BaseException):
                    await lock_conn.close()
                return None  # the session keeps the failure: the host's step reports it
            if isinstance(lock_conn, BaseException):
                return conn, None  # `acquire` tries again, and says why it cannot
            try:
                return conn, await ready(conn, host, self.name, turn_s=turn_s, lock_conn=lock_conn)
            except RpcfleetError as exc:
                return conn, exc  # reported at its turn

        connections = await gather_bounded([functools.partial(reach, h) for h in ordered], session.forks)
        wait = self.options.wait_lock
        deadline = time.monotonic() + wait
        errors: dict[str, RpcfleetError] = {}

        def waiting(host: Host, holder: str) -> None:
            if wait > 0:
                log = get_logger(host=host.name, run_id=session.run_id)
                log.warning("host_lock_waiting", holder=holder, wait_s=wait)

        unused = [pair[1] for pair in connections if pair is not None and isinstance(pair[1], ReadyLock)]
        for host, pair in zip(ordered, connections, strict=True):
            if pair is None:
                continue
            conn, prepared = pair
            left = max(0.0, deadline - time.monotonic()) if wait > 0 else 0.0
            try:
                if isinstance(prepared, RpcfleetError):
                    raise prepared
                if prepared is None:
                    work = acquire(conn, host, self.name, wait_s=left, on_wait=waiting, asked_wait_s=wait)
                else:
                    unused.remove(prepared)  # the lock owns it from here: released with the lock
                    work = take(prepared, wait_s=left, on_wait=waiting, asked_wait_s=wait)
                # Waiting for another operator's lock changes nothing: an interrupt ends the wait.
                lock = await session.unless_interrupted(work)
            except (HostLockedError, NotStartedError) as exc:
                for left_over in [*unused, *([prepared] if isinstance(prepared, ReadyLock) else [])]:
                    await left_over.abandon()  # the hosts not locked: their lock commands go unused
                await self.close()
                return {
                    h.name: exc if h.install_key == host.install_key else _not_started(h, exc) for h in hosts
                }
            except RpcfleetError as exc:
                errors.update((server.name, exc) for server in installs[host.install_key])
                continue
            self._locks[host.install_key] = lock
            self._members[host.install_key] = {server.name for server in installs[host.install_key]}
        return errors

    async def leave(self, host: Host) -> None:
        members = self._members.get(host.install_key)
        if members is None or host.name not in members:
            return
        members.discard(host.name)
        if members:  # another server of this install is still to be changed
            return
        del self._members[host.install_key]
        lock = self._locks.pop(host.install_key, None)
        if lock is not None:
            await lock.release()

    async def close(self) -> None:
        self._members = {}
        locks, self._locks = list(self._locks.values()), {}
        for lock in locks:
            await lock.release()


def _not_started(host: Host, why: RpcfleetError) -> NotStartedError:
    if isinstance(why, NotStartedError):
        return NotStartedError(why.message, host=host.name)
    return NotStartedError(f"not started: {why.message}", host=host.name)


class NodeOperation(Generic[T]):
    """The executor step running `body` on one host under the operations layer's rules."""

    def __init__(self, name: str, body: Body[T], options: OperationOptions) -> None:
        self.__name__ = name  # the step's name in results (a playbook renames it to its label)
        self.operation = name  # what the lock file says is going on
        self.body = body
        self.options = options

    def run_gate(self) -> HostLocks | None:
        """Every run of a change takes its hosts' locks first (check mode takes none)."""
        return None if self.options.check else HostLocks(self.operation, self.options)

    async def __call__(self, ctx: HostContext) -> StepOutcome[T]:
        conn = await ctx.connection()
        if self.options.check:
            return await self.body(ctx, conn)
        if isinstance(ctx.gate, HostLocks) and ctx.gate.holds(ctx.host):
            # The run holds this host's lock (the executor gives it back when this returns).
            async with ctx.gate.serial(ctx.host):
                if ctx.session.interrupted is not None:
                    raise NotStartedError(f"not started: {ctx.session.interrupted}", host=ctx.host.name)
                lock = ctx.gate.lock_of(ctx.host)
                return await run_to_completion(lock.guard(self.body(ctx, conn), conn))
        # Run without the gate (called directly): this host's lock alone, for this change.
        options = self.options

        def waiting(host: Host, holder: str) -> None:
            if options.wait_lock > 0:
                ctx.log.warning("host_lock_waiting", holder=holder, wait_s=options.wait_lock)

        lock = await ctx.session.unless_interrupted(
            acquire(conn, ctx.host, self.operation, wait_s=options.wait_lock, on_wait=waiting)
        )
        try:
            if ctx.session.interrupted is not None:
                raise NotStartedError(f"not started: {ctx.session.interrupted}", host=ctx.host.name)
            return await run_to_completion(lock.guard(self.body(ctx, conn), conn), ctx.log)
        finally:
            await lock.release()


def first_of_install(ctx: HostContext) -> bool:
    """Whether this step is the first of its run on its host's install (True outside a gated run)."""
    return not isinstance(ctx.gate, HostLocks) or ctx.gate.first_of_install(ctx.host)


def node_operation(name: str, body: Body[T], options: OperationOptions) -> NodeOperation[T]:
    """The executor step running `body` on one host under the operations layer's rules."""
    return NodeOperation(name, body, options)
