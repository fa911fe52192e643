"""A degraded formation's rejoin: every `rejoin_interval` seconds it probes the selected nodes its plan
leaves out (only those: the serving ones are held by the engine); when one answers `ok`, the backend holds
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
from typing import TYPE_CHECKING

from orchestrator.core.errors import RpcfleetError
from orchestrator.core.log import get_logger
from orchestrator.serve.fleet import Round
from orchestrator.serve.metrics import Rejoin as RejoinRecord

if TYPE_CHECKING:
    from orchestrator.serve.backend import Backend


class Rejoin:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.declined: set[str] = set()  # answered, yet a rejoin's plan left them out

    async def watch(self) -> None:
        """Every `rejoin_interval` seconds until stopped: one watch round (bounded by the probe's
        timeout), and a rejoin when a node left out answers."""
        backend = self.backend
        while not backend.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(backend.stopping.wait(), backend.config.rejoin_interval)
            if backend.stopping.is_set():
                return
            try:
                await self.watch_round()
            except Exception as exc:  # one failed round must not end the watch
                get_logger().warning("serve_watch_failed", error=repr(exc))

    def left_out(self) -> tuple[str, ...]:
        backend = self.backend
        plan = backend.plan
        if backend.state != "degraded" or plan is None:
            return ()
        return tuple(ep for ep in backend.fleet.endpoints if ep not in plan.endpoints)

    async def watch_round(self) -> None:
        backend = self.backend
        left_out = self.left_out()
        if not left_out:
            return
        try:
            states = await backend.fleet.watch(left_out)
        except RpcfleetError as exc:
            get_logger().warning("serve_watch_failed", error=exc.message)
            return
        if self.left_out() != left_out:  # a recovery or reload ran meanwhile: its states are newer
            return
        for ep in left_out:
            backend.nodes[ep] = states.get(ep, "unknown")
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
        backend = self.backend
        started = time.monotonic()
        get_logger().info("serve_rejoin_waiting", back=list(back))
        # a recovery or reload under way (or one waiting) re-plans on every node that answers anyway
        if backend.state != "degraded" or backend.stopping.is_set() or backend.control.locked():
            return
        await backend.control.acquire()  # free: taken at once, nothing ran in between
        out = backend.others_serving is not None and backend.others_serving()
        backend.rejoining = {"back": list(back), "phase": "waiting for the engine"}
        if out:
            backend.state, backend.reason = "draining", f"taking back {', '.join(back)}"
        else:
            backend.hold += 1
        waiting = "draining" if out else "degraded"
        deadline = time.monotonic() + backend.config.queue_timeout

        def pending() -> int:
            return backend.admitted if out else backend.busy

        backend.changed.notify()
        while pending() and time.monotonic() < deadline and backend.state == waiting:
            await backend.changed.wait(max(0.0, deadline - time.monotonic()))
        if pending() or backend.state != waiting:  # the engine was lost meanwhile, or never idle
            backend.rejoining = None
            if out and backend.state == "draining":
                backend.state, backend.reason = "degraded", self.left_out_reason()
            if not out:
                backend.hold -= 1
            backend.changed.notify()
            backend.control.release()
            return
        backend.rejoining = {"back": list(back), "phase": "loading"}
        if out:
            backend.state = "recovering"  # out of the router until it serves again
        idle = time.monotonic() - started
        loaded = False
        try:
            await backend.stop_engine()
            result = await self.own_round(back) or await backend.plan_round()
            record = functools.partial(self.record, back, idle, time.monotonic())
            plan = result.fitting
            loaded = plan is not None and await backend.load(plan, before_serving=record)
            if loaded and plan is not None:
                self.declined |= {ep for ep in back if ep not in plan.endpoints}
            elif plan is None:
                backend.reason = f"waiting for the fleet: {result.reason}"
        finally:
            backend.rejoining = None
            if not out:
                backend.hold -= 1
            if not loaded:
                backend.state = "recovering"  # the requests waiting for a slot get 503
            backend.changed.notify()
            backend.control.release()
        if not loaded:
            get_logger().warning("serve_rejoin_failed", back=list(back), reason=backend.reason)
            await backend.recovery.recover(None)

    async def own_round(self, back: tuple[str, ...]) -> Round | None:
        """When this formation took spares and a node of its own is back: a round on its own nodes only;
        if the model fits there, the spares go back to the pool (the engine holding them is stopped). None:
        no spare taken, or its own nodes do not hold the model (it keeps the spares)."""
        backend = self.backend
        borrowed = {h.endpoint for h in backend.fleet.borrowed}
        if not borrowed or all(ep in borrowed for ep in back):
            return None
        laid = backend.fleet.lay_down_borrowed()
        result = await backend.plan_round(spare=False)
        if result.fitting is None:
            backend.fleet.keep_borrowed(laid)
            return None
        for host in laid:
            backend.nodes.pop(host.endpoint, None)
        backend.fleet.give_back(laid)
        return result

    def left_out_reason(self) -> str:
        backend = self.backend
        return f"{len(backend.lost)} node(s) left out: {', '.join(backend.lost)}" if backend.lost else ""

    def record(self, back: tuple[str, ...], idle: float, load_started: float) -> None:
        """Just before the new state shows: the rejoin is over and recorded, so /health never shows the
        new plan with the rejoin still under way."""
        backend = self.backend
        backend.rejoining = None
        backend.metrics.record_rejoin(
            RejoinRecord(
                back=back,
                idle_wait=round(idle, 6),
                reload=round(time.monotonic() - load_started, 6),
                at=time.time(),
            )
        )
