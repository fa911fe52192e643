"""A degraded formation's rejoin: every `rejoin_interval` seconds it probes the selected nodes its plan
leaves out (only those: the serving ones are held by the engine); when one answers `ok`, the formation holds
the slots (requests queued meanwhile wait; or, when another formation of the model serves, it leaves the
router as in a reload), waits for the requests being served to end, stops the engine, re-plans on every
node that answers and starts it again. A formation that took a spare re-plans on its own nodes first:
when they hold the model, the spare goes back to the pool. A node that this re-plan leaves out anyway is
not tried again until it has stopped answering once."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from orchestrator.core.errors import RpcfleetError
from orchestrator.core.log import get_logger
from orchestrator.planning.plan import Plan
from orchestrator.serve.fleet import FormationFleet, Round
from orchestrator.serve.metrics import Metrics
from orchestrator.serve.metrics import Rejoin as RejoinRecord
from orchestrator.serve.recovery import Recovery
from orchestrator.serve.states import FormationState, ServeConfig


class Rejoining(Protocol):
    """What a rejoin needs of its formation (`serve.formation.Formation`)."""

    fleet: FormationFleet
    config: ServeConfig
    metrics: Metrics
    plan: Plan | None
    lost: tuple[str, ...]
    reason: str
    admitted: int
    control: asyncio.Lock
    stopping: asyncio.Event
    recovery: Recovery

    @property
    def state(self) -> FormationState: ...

    @property
    def busy(self) -> int: ...

    def others_serving(self) -> bool: ...

    def drain(self, reason: str) -> None: ...

    def restart(self, reason: str | None = None) -> None: ...

    def resume(self) -> None: ...

    def hold(self) -> None: ...

    def unhold(self) -> None: ...

    def wait_for_fleet(self, reason: str) -> None: ...

    def node_states(self, states: Mapping[str, str]) -> None: ...

    def forget_nodes(self, endpoints: Sequence[str]) -> None: ...

    async def changed_within(self, limit: float) -> None: ...

    async def stop_engine(self) -> None: ...

    async def plan_round(self, *, spare: bool = True) -> Round: ...

    async def load(self, plan: Plan, before_serving: Callable[[], None] | None = None) -> bool: ...


class Rejoin:
    def __init__(self, formation: Rejoining) -> None:
        self.formation = formation
        self.declined: set[str] = set()  # answered, yet a rejoin's plan left them out
        self.under_way: dict[str, Any] | None = None  # the rejoin under way: endpoints, phase

    async def watch(self) -> None:
        """Every `rejoin_interval` seconds until stopped: one watch round (bounded by the probe's
        timeout), and a rejoin when a node left out answers."""
        formation = self.formation
        while not formation.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(formation.stopping.wait(), formation.config.rejoin_interval)
            if formation.stopping.is_set():
                return
            try:
                await self.watch_round()
            except Exception as exc:  # one failed round must not end the watch
                get_logger().warning("serve_watch_failed", error=repr(exc))

    def left_out(self) -> tuple[str, ...]:
        formation = self.formation
        plan = formation.plan
        if formation.state != FormationState.DEGRADED or plan is None:
            return ()
        return tuple(ep for ep in formation.fleet.endpoints if ep not in plan.endpoints)

    async def watch_round(self) -> None:
        formation = self.formation
        left_out = self.left_out()
        if not left_out:
            return
        try:
            states = await formation.fleet.watch(left_out)
        except RpcfleetError as exc:
            get_logger().warning("serve_watch_failed", error=exc.message)
            return
        if self.left_out() != left_out:  # a recovery or reload ran meanwhile: its states are newer
            return
        formation.node_states({ep: states.get(ep, "unknown") for ep in left_out})
        answering = {ep for ep in left_out if states.get(ep) == "ok"}
        self.declined &= answering  # one that stopped answering is tried again when it is back
        back = tuple(ep for ep in left_out if ep in answering and ep not in self.declined)
        if back:
            await self.rejoin(back)

    async def rejoin(self, back: tuple[str, ...]) -> None:
        """Take the nodes back: stop the engine, re-plan on every node that answers and start it again (a
        failed load goes on as a recovery). Meanwhile, when another formation of the model serves
        (`others_serving`), this one is out of the router as in a reload (it serves what it admitted, then
        new requests go to the others); else it holds the slots (new requests wait in its queue) and waits
        for the requests being served. When its own nodes hold the model again, the spares it took go back
        to the pool."""
        formation = self.formation
        started = time.monotonic()
        get_logger().info("serve_rejoin_waiting", back=list(back))
        # a recovery or reload under way (or one waiting) re-plans on every node that answers anyway
        if (
            formation.state != FormationState.DEGRADED
            or formation.stopping.is_set()
            or formation.control.locked()
        ):
            return
        await formation.control.acquire()  # free: taken at once, nothing ran in between
        out = formation.others_serving()
        self.under_way = {"back": list(back), "phase": "waiting for the engine"}
        if out:
            formation.drain(f"taking back {', '.join(back)}")
        else:
            formation.hold()
        waiting = FormationState.DRAINING if out else FormationState.DEGRADED
        deadline = time.monotonic() + formation.config.queue_timeout

        def pending() -> int:
            return formation.admitted if out else formation.busy

        while pending() and time.monotonic() < deadline and self.state() == waiting:
            await formation.changed_within(max(0.0, deadline - time.monotonic()))
        if pending() or self.state() != waiting:  # the engine was lost meanwhile, or never idle
            self.under_way = None
            if out and self.state() == FormationState.DRAINING:
                formation.resume()
            if not out:
                formation.unhold()
            formation.control.release()
            return
        self.under_way = {"back": list(back), "phase": "loading"}
        if out:
            formation.restart()  # out of the router until it serves again
        idle = time.monotonic() - started
        loaded = False
        try:
            await formation.stop_engine()
            result = await self.own_round(back) or await formation.plan_round()
            record = functools.partial(self.record, back, idle, time.monotonic())
            plan = result.fitting
            loaded = plan is not None and await formation.load(plan, before_serving=record)
            if loaded and plan is not None:
                self.declined |= {ep for ep in back if ep not in plan.endpoints}
            elif plan is None:
                formation.wait_for_fleet(result.reason)
        finally:
            self.under_way = None
            if not out:
                formation.unhold()
            if not loaded:
                formation.restart()  # the requests waiting for a slot get 503
            formation.control.release()
        if not loaded:
            get_logger().warning("serve_rejoin_failed", back=list(back), reason=formation.reason)
            await formation.recovery.recover(None)

    def state(self) -> FormationState:
        """The formation's state now (read anew after each wait: a loss changes it meanwhile)."""
        return self.formation.state

    async def own_round(self, back: tuple[str, ...]) -> Round | None:
        """When this formation took spares and a node of its own is back: a round on its own nodes only;
        if the model fits there, the spares go back to the pool (the engine holding them is stopped). None:
        no spare taken, or its own nodes do not hold the model (it keeps the spares)."""
        formation = self.formation
        borrowed = {h.endpoint for h in formation.fleet.borrowed}
        if not borrowed or all(ep in borrowed for ep in back):
            return None
        laid = formation.fleet.lay_down_borrowed()
        result = await formation.plan_round(spare=False)
        if result.fitting is None:
            formation.fleet.keep_borrowed(laid)
            return None
        formation.forget_nodes([host.endpoint for host in laid])
        formation.fleet.give_back(laid)
        return result

    def record(self, back: tuple[str, ...], idle: float, load_started: float) -> None:
        """Just before the new state shows: the rejoin is over and recorded, so /health never shows the
        new plan with the rejoin still under way."""
        self.under_way = None
        self.formation.metrics.record_rejoin(
            RejoinRecord(
                back=back,
                idle_wait=round(idle, 6),
                reload=round(time.monotonic() - load_started, 6),
                at=time.time(),
            )
        )
