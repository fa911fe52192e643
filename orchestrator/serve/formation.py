"""One formation: a model served by one engine on its own servers, under its name (`MODEL#N`). Its life
(start, stop, the loads), its slots and queue, its reload, and its state: the one owner of that state, which
moves only through its named moves (`serve_on`, `lose`, `give_up`, `drain`, `restart`, `resume`) and
only as `states.MOVES` allows. No HTTP here (the routes proxy to `engine.url` while they hold a slot). Its
recovery after a lost node is `serve/recovery.py`, its rejoin of nodes that answer again `serve/rejoin.py`
(both see it through a narrow Protocol, and ask it to move); its records `serve/states.py`. All of it runs
on the loop that serves, its work as tasks (`spawn`).

Slots: the engine serves `parallel` requests at once (its slots, batched together); up to `queue_size`
more wait for a slot, each at most `queue_timeout`; beyond that a request is refused (429). A request
that the engine leaves without an answer for `event_timeout` seconds is a stalled engine: it is killed,
and its recovery follows. Every wait is bounded: probes by the fleet's probe timeout, loads by
`load_timeout`, the whole recovery by `recover_timeout`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from orchestrator.core.errors import RpcfleetError
from orchestrator.core.log import get_logger
from orchestrator.engine.shared import Pulse
from orchestrator.llama.worker.load_progress import LoadProgress
from orchestrator.planning.plan import Plan
from orchestrator.serve.engine import Engine, EngineFactory
from orchestrator.serve.fleet import FormationFleet, Round
from orchestrator.serve.metrics import Metrics
from orchestrator.serve.recovery import Recovery
from orchestrator.serve.rejoin import Rejoin
from orchestrator.serve.states import (
    SERVING,
    Failure,
    FormationState,
    NoRound,
    Rejected,
    Running,
    ServeConfig,
    Ticket,
    moved,
)

State = FormationState


@dataclass(frozen=True)
class FormationHooks:
    """What a formation tells the one that made it (each optional): its recovery gave up (or, for an
    on-demand model, its first load failed), each load's progress, and each load's end (its plan and the
    phases' seconds: cache, the check and warm; load)."""

    on_failed: Callable[[Formation], None] | None = None
    on_progress: Callable[[LoadProgress], None] | None = None
    on_loaded: Callable[[Formation, Plan, dict[str, float]], None] | None = None


class Peers(Protocol):
    """The formations beside this one (the router's): whether another of its model serves now."""

    def others_serving(self, formation: Formation) -> bool: ...


class Roster:
    """The formations served now, in order (each model's together), shared by the router (which changes
    the list, a new one each time: a request reading the old one is not disturbed) and the formations
    (which ask it whether another of their model serves: a rejoin then leaves the router while it
    reloads, instead of holding the requests in its queue)."""

    def __init__(self, formations: Sequence[Formation] = ()) -> None:
        self.formations: list[Formation] = list(formations)

    def others_serving(self, formation: Formation) -> bool:
        return any(
            f.model == formation.model and f is not formation and f.state in SERVING for f in self.formations
        )


class Formation:
    """One model served by one engine on its own servers: its life, slots, queue and loads, and the one
    writer of its state (`state`, moved by `_move` only, from the named moves below)."""

    def __init__(
        self,
        name: str,
        model: str,
        fleet: FormationFleet,
        config: ServeConfig,
        engines: EngineFactory,
        metrics: Metrics | None = None,
        *,
        hooks: FormationHooks | None = None,
        peers: Peers | None = None,
        template: dict[str, Any] | None = None,
        recover_first_load: bool = True,
    ) -> None:
        """`name`: `MODEL#N` (or the model's name when it is the only one); `model`: the model's API id.
        `engines` makes the engine for a plan (llama-server: `engine.default_engines`). `peers`: the
        formations beside it (none: it is alone). `template`: the chat template in use (for /health).
        `recover_first_load` False: a failed first load ends `failed` at once (an on-demand model: its
        backoff retries). Everything runs on the loop that serves: `start` there, the rest from its tasks
        and routes."""
        self.name = name
        self.model = model
        self.fleet = fleet
        self.config = config
        self.engines = engines
        self.metrics = metrics or Metrics()
        self.hooks = hooks or FormationHooks()
        self.peers = peers
        self.template = template
        self.recover_first_load = recover_first_load
        self._state = State.LOADING
        self.reason = ""  # why the state is not ready (the last recovery round, the lost endpoints)
        self.plan: Plan | None = None
        self.nodes: dict[str, str] = dict.fromkeys(fleet.endpoints, "unknown")
        self.lost: tuple[str, ...] = ()
        self.load_seconds: float | None = None  # the last engine start and load
        self.load_progress: LoadProgress | None = None  # the load under way, if any
        self.skipped: dict[str, int] = {}  # per endpoint, bytes of cache hits of the load under way
        self.current: Running | None = None
        self.changed = Pulse()  # wakes the requests waiting for a slot, and a drain, on every change
        self.admitted = 0  # requests admitted (served and waiting): the router's measure of load
        self._held = 0  # a rejoin holds the slots: none is given out
        self.control = asyncio.Lock()  # one load, recovery or reload at a time
        self.stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()  # its work in flight: loads, watches, reloads
        self.last_answer = time.monotonic()  # the engine's last answer (a loss's detection counts from it)
        self.recovery = Recovery(self)
        self.rejoin = Rejoin(self)

    # -- the state and its moves (`states.MOVES`): the only writer of `_state`
    @property
    def state(self) -> FormationState:
        return self._state

    def _move(self, to: FormationState, reason: str | None = None) -> None:
        self._state = moved(self._state, to)
        if reason is not None:
            self.reason = reason
        self.changed.notify()

    def serve_on(self, running: Running) -> None:
        """A load ended well: `running` serves, ready on every node selected, else degraded (those left
        out named)."""
        self.current = running
        self.plan = running.plan
        for ep in running.plan.endpoints:
            self.nodes[ep] = "serving"
        self.lost = tuple(ep for ep in self.fleet.endpoints if ep not in running.plan.endpoints)
        self._move(State.DEGRADED if self.lost else State.READY, self.left_out_reason())

    def lose(self, running: Running, lost: tuple[str, ...], message: str) -> None:
        """`running`'s engine ended unasked (`lost`: the nodes its diagnosis names): recovering, when it
        was the engine serving."""
        if self.current is running:
            self.current = None
            self.lost = lost
            for ep in lost:
                self.nodes[ep] = "lost"
            self._move(State.RECOVERING, message)
        self.changed.notify()

    def give_up(self, reason: str) -> None:
        """Recovery gave up (or an on-demand model's first load failed): failed, and the maker told."""
        self._move(State.FAILED, reason)
        if self.hooks.on_failed is not None:
            self.hooks.on_failed(self)

    def drain(self, reason: str) -> None:
        """A reload or a rejoin: admitted requests finish, new ones go elsewhere (503 here)."""
        self._move(State.DRAINING, reason)

    def restart(self, reason: str | None = None) -> None:
        """Out of the router until it serves again: a reload or rejoin restarts the engine, or its load
        failed (the requests waiting for a slot get 503)."""
        self._move(State.RECOVERING, reason)

    def resume(self) -> None:
        """A rejoin that did not drain in time: serving on as it was."""
        self._move(State.DEGRADED, self.left_out_reason())

    def hold(self) -> None:
        """A rejoin holds the slots (new requests wait in the queue) while the served ones end."""
        self._held += 1
        self.changed.notify()

    def unhold(self) -> None:
        self._held -= 1
        self.changed.notify()

    def wait_for_fleet(self, reason: str) -> None:
        """No plan fits the nodes that answer: why, for /health and the 503s."""
        self.reason = f"waiting for the fleet: {reason}"

    def node_states(self, states: Mapping[str, str]) -> None:
        """The probe states of some of its nodes (a rejoin's watch of those left out)."""
        self.nodes.update(states)

    def forget_nodes(self, endpoints: Sequence[str]) -> None:
        """Nodes no longer its own (spares given back to the pool)."""
        for ep in endpoints:
            self.nodes.pop(ep, None)

    async def changed_within(self, limit: float) -> None:
        """Until its next change, at most `limit` seconds."""
        await self.changed.wait(limit)

    def left_out_reason(self) -> str:
        return f"{len(self.lost)} node(s) left out: {', '.join(self.lost)}" if self.lost else ""

    def others_serving(self) -> bool:
        """Whether another formation of its model serves now."""
        return self.peers is not None and self.peers.others_serving(self)

    # -- life
    def start(self, plan: Plan | None = None) -> asyncio.Task[None]:
        """Load `plan` (default: probe and plan) in a task (`loading` meanwhile); should that load fail,
        the task goes on as a recovery does. It ends serving, or `failed`. On the serving loop."""
        task = self.spawn(self.first_load(plan), "serve-load")
        if self.config.rejoin_interval > 0:
            self.spawn(self.rejoin.watch(), "serve-watch")
        return task

    def spawn(self, work: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """`work` as a task of this formation's (cancelled by `stop`); its failure is logged."""
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)

        def done(finished: asyncio.Task[Any]) -> None:
            self._tasks.discard(finished)
            if not finished.cancelled() and finished.exception() is not None:
                get_logger().error("serve_task_failed", task=name, error=repr(finished.exception()))

        task.add_done_callback(done)
        return task

    async def stop(self) -> None:
        """Stop: its tasks cancelled (a load under way kills its engine), the engine closed."""
        self.stopping.set()
        running, self.current = self.current, None
        self.changed.notify()
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if running is not None:
            running.stopping = True
            await running.engine.close()
            running.ended.set()

    @property
    def engine(self) -> Engine | None:
        running = self.current
        return running.engine if running is not None else None

    @property
    def worker_pid(self) -> int | None:
        engine = self.engine
        return engine.pid if engine is not None else None

    def health(self) -> dict[str, Any]:
        """One snapshot (one loop: a state change shows whole or not at all)."""
        plan = self.plan
        last = self.metrics.recoveries[-1] if self.metrics.recoveries else None
        rejoin = self.metrics.rejoins[-1] if self.metrics.rejoins else None
        engine = self.engine
        return {
            "status": self.state,
            "reason": self.reason or None,
            "model": str(self.fleet.model_path),
            "pid": os.getpid(),
            "worker_pid": self.worker_pid,
            "engine": None
            if engine is None
            else {
                "pid": engine.pid,
                "url": engine.url,
                "parallel": self.config.parallel,
                "log": str(engine.log_path) if engine.log_path else None,
                "chat_template": self.template,
            },
            "load_seconds": self.load_seconds,
            "loading": None if self.load_progress is None else self.load_progress.as_log(),
            "queue": {
                "admitted": self.admitted,
                "served": self.busy,
                "parallel": self.config.parallel,
                "size": self.config.queue_size,
            },
            "plan": None
            if plan is None
            else {
                "endpoints": list(plan.endpoints),
                "tensor_split": list(plan.tensor_split),
                "layers": list(plan.layer_counts),
                "n_ctx": plan.n_ctx,
            },
            "nodes": [{"endpoint": ep, "state": state} for ep, state in self.nodes.items()],
            "lost": list(self.lost),
            "reloads": self.metrics.reloads,
            "last_recovery": None if last is None else last.__dict__ | {"lost": list(last.lost)},
            "rejoining": self.rejoin.under_way,
            "last_rejoin": None if rejoin is None else rejoin.__dict__ | {"back": list(rejoin.back)},
        }

    def endpoint_up(self) -> dict[str, bool]:
        return {ep: state in ("ok", "busy", "serving") for ep, state in self.nodes.items()}

    # -- requests
    def admit(self) -> Ticket:
        """Admit a request (or raise Rejected: 503 when not serving, 429 when the queue is full)."""
        if self.state not in SERVING:
            raise Rejected(503, self.unavailable(), self.config.retry_after)
        if self.admitted >= self.config.queue_size + self.config.parallel:
            raise Rejected(
                429,
                f"the queue is full ({self.config.queue_size} waiting and {self.config.parallel} served)",
            )
        self.admitted += 1
        return Ticket()

    @property
    def busy(self) -> int:
        """Requests holding a slot of the engine serving now (those of a dead one do not count)."""
        running = self.current
        return running.busy if running is not None else 0

    @property
    def recovers(self) -> bool:
        """A recovery is under way (after a loss, a reload's or a failed rejoin's restart), or a reload's or
        a rejoin's drain (its restart follows): the formation should serve again, so a request may wait
        for it. Given up (`failed`) or stopping (serve's end): not."""
        return self.state in (State.RECOVERING, State.DRAINING) and not self.stopping.is_set()

    def unavailable(self) -> str:
        """Why a request is not served now (the 503's message), naming the lost nodes."""
        why = f": {self.reason}" if self.reason else ""
        missing = [ep for ep in self.lost if ep not in self.reason]  # a later round's reason may not
        lost = f" (lost: {', '.join(missing)})" if missing and self.state not in SERVING else ""
        return f"the model is {self.state}{why}{lost}"

    async def acquire(self, ticket: Ticket, deadline: float | None = None) -> Running | Failure:
        """Wait (until `deadline`, time.monotonic(); default `queue_timeout` after admission) for a slot
        of a serving engine: the engine to send the request to, or the Failure to answer."""
        if deadline is None:
            deadline = ticket.admitted + self.config.queue_timeout
        while True:
            # A drain serves what it admitted, those waiting for a slot too.
            if self.state not in (*SERVING, State.DRAINING):
                return Failure(503, self.unavailable(), "unavailable", retry_after=self.config.retry_after)
            running = self.current
            if running is not None and not self._held and running.busy < self.config.parallel:
                running.busy += 1
                ticket.running = running
                return running
            left = deadline - time.monotonic()
            if left <= 0:
                return Failure(
                    503,
                    f"waited {self.config.queue_timeout:g} s for a slot",
                    "unavailable",
                    retry_after=self.config.retry_after,
                )
            await self.changed.wait(left)

    def release(self, ticket: Ticket) -> None:
        """The request is over (answered, failed or gone): its slot and its place in the queue."""
        if ticket.running is not None:
            ticket.running.busy -= 1
            ticket.running = None
        self.admitted -= 1
        self.changed.notify()

    def answered(self) -> None:
        """The engine answered something (the detection time of a loss counts from the last answer)."""
        self.last_answer = time.monotonic()

    async def failure_of(self, running: Running, error: str) -> Failure:
        """A request's connection to the engine broke (`error`): the engine's end as its watch diagnosed
        it (the lost nodes named), waiting for that diagnosis at most `diagnose_timeout`."""
        try:
            await asyncio.wait_for(running.ended.wait(), self.config.diagnose_timeout)
        except TimeoutError:
            return Failure(
                502, f"the engine broke the request off: {error}", "server_error", engine_alive=True
            )
        failure = running.failure
        if failure is None:  # stopped on purpose under the request (a drain past its timeout)
            return Failure(503, "the engine was stopped", "unavailable", retry_after=self.config.retry_after)
        return failure

    def stalled(self, running: Running) -> None:
        """A request got nothing from the engine for `event_timeout`: the engine is stuck, end it (its
        watch diagnoses and recovers)."""
        get_logger().warning("serve_engine_stalled", pid=running.engine.pid)
        self.spawn(running.engine.kill(), "serve-kill-stalled")

    # -- recovery and reload
    async def first_load(self, plan: Plan | None) -> None:
        if plan is not None:
            async with self.control:
                if await self.load(plan):
                    return
            if not self.recover_first_load:
                get_logger().warning("serve_first_load_failed", reason=self.reason)
                self.give_up(self.reason)
                return
        await self.recovery.recover(None)

    async def plan_round(self, *, spare: bool = True) -> Round:
        try:
            result = await self.fleet.plan_round(spare=spare)
        except RpcfleetError as exc:
            return NoRound(dict(self.nodes), exc.message)
        self.nodes = {ep: result.states.get(ep, "unknown") for ep in self.fleet.endpoints}
        return result

    async def load(self, plan: Plan, before_serving: Callable[[], None] | None = None) -> bool:
        """Check the caches, start the engine on `plan` and serve it; `before_serving` runs just before
        the new state shows (a recovery's record, so that /health never shows one without the other)."""
        started = time.monotonic()
        try:
            prep = await self.fleet.prepare_cache(plan)
        except RpcfleetError as exc:  # a truncated cache file: refused before llama.cpp reads it
            self.reason = f"loading failed: {exc}"
            get_logger().warning("serve_load_failed", error=str(exc))
            return False
        self.skipped = dict(prep.hit_bytes) if prep is not None else {}
        phases = {"cache": time.monotonic() - started} if prep is not None else {}
        started = time.monotonic()
        try:
            engine = self.engines(plan, self.fleet.targets())
        except RpcfleetError as exc:
            self.reason = f"loading failed: {exc.message}"
            return False
        try:
            seconds = await engine.load(self.config.load_timeout, self._progress, self.skipped)
        except RpcfleetError as exc:
            await engine.kill()
            self.reason = f"loading failed: {exc.message}"
            get_logger().warning("serve_load_failed", error=exc.message, engine_log=exc.stderr_tail)
            return False
        finally:
            self.load_progress = None
        running = Running(engine, plan)
        await self.stop_engine()  # none should be left; never two
        if self.stopping.is_set():
            running.stopping = True
            await engine.close()
            return True
        if before_serving is not None:
            before_serving()
        self.load_seconds = round(seconds, 3)
        self.serve_on(running)
        self.spawn(self.recovery.watch_engine(running), "serve-engine")
        get_logger().info("serve_loaded", endpoints=list(plan.endpoints), state=self.state, pid=engine.pid)
        if self.hooks.on_loaded is not None:
            self.hooks.on_loaded(self, plan, {**phases, "load": time.monotonic() - started})
        return True

    async def stop_engine(self) -> None:
        """Stop the engine on purpose (its watch starts no recovery). Under `_control`."""
        running, self.current = self.current, None
        if running is not None:
            running.stopping = True
            await running.engine.close()
            running.ended.set()

    def _progress(self, progress: LoadProgress) -> None:
        self.load_progress = progress
        if self.hooks.on_progress is not None:
            try:
                self.hooks.on_progress(progress)
            except Exception as exc:  # a display's bug must not stop the load (nor leave us recovering)
                get_logger().warning("serve_progress_failed", error=repr(exc))

    async def reload(self, *, rolling_restart: bool = False) -> None:
        """Drain (admitted requests finish, new ones get 503), stop the engine, optionally restart every
        node one at a time (`restart --rolling`), re-plan and start it; returns once it serves again (or
        gave up)."""
        async with self.control:
            self.metrics.record_reload()
            self.drain("reloading")
            deadline = time.monotonic() + self.config.drain_timeout
            while self.admitted and time.monotonic() < deadline:
                await self.changed.wait(max(0.0, deadline - time.monotonic()))
            self.restart()
            # a request still admitted past the drain timeout is ended by the stop (a 503)
            await self.stop_engine()
            if rolling_restart:
                self.reason = "rolling restart of the fleet"
                failed = await self.fleet.rolling_restart()
                if failed:
                    get_logger().warning("serve_rolling_restart_failed", failed=failed)
                    self.reason = f"rolling restart failed: {'; '.join(failed)}"
        await self.recovery.recover(None)

    # -- the engine's counters
    def engine_states(self) -> Mapping[str, Any]:
        """Slots and queue as the formation sees them (for /metrics)."""
        return {"admitted": self.admitted, "served": self.busy, "parallel": self.config.parallel}
