"""The serving backend: the engine (llama-server) on the plan, the slots and queue, recovery after a lost
node, rejoin, reload (no HTTP here: the routes proxy to `engine.url` while they hold a slot).

States: `loading` (first load), `ready` (serving on every node that was selected), `degraded` (serving
on fewer: a node was lost and the model was re-planned on the others), `recovering` (a node or the
engine was lost: probing, planning, restarting the engine), `draining` (a reload waits for admitted
requests to finish), `failed` (recovery gave up after `recover_timeout`; the process exits).

Slots: the engine serves `parallel` requests at once (its slots, batched together); up to `queue_size`
more wait for a slot, each at most `queue_timeout`; beyond that a request is refused (429).

A lost node: llama-server aborts (a dead server, or a cut link once its connections' user timeout
expires, see `engine`), and a watch of the engine process sees it end. The backend then probes the
plan's endpoints (bounded) to name the lost ones, and every request in flight ends with the 503 that
names them (the routes ask `failure_of`); then it probes the fleet and starts the engine on a new plan on
the nodes that answer, as soon as the model fits there. A request that the engine leaves without an
answer for `event_timeout` seconds is a stalled engine: it is killed, and the same follows. Every wait is
bounded: probes by the fleet's probe timeout, loads by `load_timeout`, the whole recovery by
`recover_timeout`.

Rejoin: while `degraded`, a watch probes the selected nodes that the plan leaves out (only those: the
serving ones are held by the engine) every `rejoin_interval` seconds with the fleet probe's rules. When
one answers `ok`, the backend holds the slots (requests queued meanwhile wait), waits for the requests
being served to end, stops the engine, re-plans on every node that answers and starts it again, as a
reload does (when another formation of the model serves, it leaves the router instead, as a reload does).
A formation that took a spare re-plans on its own nodes first: when they hold the model, the spare goes
back to the pool. A node that this re-plan leaves out anyway is not tried again until it has stopped
answering once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from orchestrator.core.errors import RpcfleetError
from orchestrator.core.log import get_logger
from orchestrator.engine.shared import Pulse
from orchestrator.llama.worker.load_progress import LoadProgress
from orchestrator.planning.plan import Plan
from orchestrator.serve import settings
from orchestrator.serve.engine import DEFAULT_PARALLEL, Engine, EngineFactory, lost_message
from orchestrator.serve.fleet import FormationFleet, Round
from orchestrator.serve.metrics import Metrics, Recovery, Rejoin

SERVING = frozenset({"ready", "degraded"})


@dataclass(frozen=True)
class ServeConfig:
    parallel: int = DEFAULT_PARALLEL  # requests the engine serves at once (llama-server's --parallel)
    queue_size: int = settings.QUEUE_SIZE  # requests waiting for a slot beyond those served
    queue_timeout: float = settings.QUEUE_TIMEOUT  # seconds a request may wait for a slot
    load_timeout: float = 300.0
    event_timeout: float = 120.0  # seconds between two answers of the engine within a request
    link_timeout: float = settings.LINK_TIMEOUT
    recover_timeout: float = settings.RECOVER_TIMEOUT  # seconds of recovery before giving up
    retry_interval: float = 1.0  # seconds between two recovery rounds
    drain_timeout: float = 300.0  # seconds a reload waits for admitted requests
    retry_after: int = 2  # the Retry-After of a 503 (seconds)
    rejoin_interval: float = settings.REJOIN_INTERVAL  # seconds between two probes of the nodes left out
    diagnose_timeout: float = 15.0  # seconds a request waits for the diagnosis of a dead engine
    seed: int = settings.SEED


class Rejected(RpcfleetError):
    """A request that is not served: `status` (429, 503) and `retry_after` (seconds, for a 503)."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        self.status = status
        self.retry_after = retry_after
        super().__init__(message)


@dataclass(frozen=True)
class Failure:
    """The end of a request that was not served to the end: HTTP status, message, lost endpoints."""

    status: int
    message: str
    kind: str  # OpenAI error type: node_lost, unavailable, invalid_request_error, server_error
    lost: tuple[str, ...] = ()
    retry_after: int | None = None


@dataclass(frozen=True)
class NoRound:
    """A round that could not be made (the error's message): the states known before it."""

    states: dict[str, str]
    reason: str
    fitting: None = None


@dataclass(eq=False)
class Running:
    """The engine serving now, and how it ended (set once, by its watch)."""

    engine: Engine
    plan: Plan
    stopping: bool = False  # stopped on purpose (reload, rejoin, shutdown): no recovery
    busy: int = 0  # requests holding one of its slots
    failure: Failure | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False)
class Ticket:
    """One admitted request: the slot it holds, when it holds one."""

    admitted: float = field(default_factory=time.monotonic)
    running: Running | None = None
    first_token: float | None = None  # seconds from admission to the first text

    def saw_text(self) -> None:
        if self.first_token is None:
            self.first_token = time.monotonic() - self.admitted


class Backend:
    def __init__(
        self,
        fleet: FormationFleet,
        config: ServeConfig,
        engines: EngineFactory,
        metrics: Metrics | None = None,
    ) -> None:
        """`engines` makes the engine for a plan (llama-server: `engine.default_engines`). Everything
        runs on the loop that serves: `start` there, the rest from its tasks and routes."""
        self.fleet = fleet
        self.config = config
        self.engines = engines
        self.metrics = metrics or Metrics()
        self.state = "loading"
        self.reason = ""  # why the state is not ready (the last recovery round, the lost endpoints)
        self.plan: Plan | None = None
        self.nodes: dict[str, str] = dict.fromkeys(fleet.endpoints, "unknown")
        self.lost: tuple[str, ...] = ()
        self.load_seconds: float | None = None  # the last engine start and load
        self.on_failed: Callable[[], None] | None = None  # called when recovery gives up
        # whether another formation of this model serves now (the router's): a rejoin then leaves the
        # router while it reloads instead of holding the requests in its queue
        self.others_serving: Callable[[], bool] | None = None
        self.on_progress: Callable[[LoadProgress], None] | None = None  # during each load
        # after each load: its plan and the phases' seconds (cache: the check and warm; load)
        self.on_loaded: Callable[[Plan, dict[str, float]], None] | None = None
        self.load_progress: LoadProgress | None = None  # the load under way, if any
        self.skipped: dict[str, int] = {}  # per endpoint, bytes of cache hits of the load under way
        self.template: dict[str, Any] | None = None  # the chat template in use (for /health)
        self._running: Running | None = None
        self._changed = Pulse()  # wakes the requests waiting for a slot, and a drain, on every change
        self._admitted = 0  # requests admitted (served and waiting)
        self._hold = 0  # a rejoin holds the slots: none is given out
        self._control = asyncio.Lock()  # one load, recovery or reload at a time
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()  # its work in flight: loads, watches, reloads
        self.rejoining: dict[str, Any] | None = None  # the rejoin under way: endpoints, phase
        self._declined: set[str] = set()  # answered, yet a rejoin's plan left them out
        self._last_answer = time.monotonic()

    # -- life
    def start(self, plan: Plan | None = None) -> asyncio.Task[None]:
        """Load `plan` (default: probe and plan) in a task (`loading` meanwhile); should that load fail,
        the task goes on as a recovery does. It ends serving, or `failed`. On the serving loop."""
        task = self.spawn(self._first_load(plan), "serve-load")
        if self.config.rejoin_interval > 0:
            self.spawn(self._watch(), "serve-watch")
        return task

    def spawn(self, work: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """`work` as a task of this backend's (cancelled by `stop`); its failure is logged."""
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
        self._stopping.set()
        running, self._running = self._running, None
        self._changed.notify()
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
        running = self._running
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
                "admitted": self._admitted,
                "served": self._busy,
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
            "rejoining": self.rejoining,
            "last_rejoin": None if rejoin is None else rejoin.__dict__ | {"back": list(rejoin.back)},
        }

    def endpoint_up(self) -> dict[str, bool]:
        return {ep: state in ("ok", "busy", "serving") for ep, state in self.nodes.items()}

    # -- requests
    def admit(self) -> Ticket:
        """Admit a request (or raise Rejected: 503 when not serving, 429 when the queue is full)."""
        if self.state not in SERVING:
            raise Rejected(503, self._unavailable(), self.config.retry_after)
        if self._admitted >= self.config.queue_size + self.config.parallel:
            raise Rejected(
                429,
                f"the queue is full ({self.config.queue_size} waiting and {self.config.parallel} served)",
            )
        self._admitted += 1
        return Ticket()

    @property
    def _busy(self) -> int:
        """Requests holding a slot of the engine serving now (those of a dead one do not count)."""
        running = self._running
        return running.busy if running is not None else 0

    @property
    def admitted(self) -> int:
        """Requests admitted now (served and waiting): the router's measure of load."""
        return self._admitted

    def unavailable(self) -> str:
        """Why a request is not served now (the 503's message)."""
        return self._unavailable()

    def _unavailable(self) -> str:
        why = f": {self.reason}" if self.reason else ""
        return f"the model is {self.state}{why}"

    async def acquire(self, ticket: Ticket) -> Running | Failure:
        """Wait (at most `queue_timeout`) for a slot of a serving engine: the engine to send the request
        to, or the Failure to answer."""
        deadline = ticket.admitted + self.config.queue_timeout
        while True:
            # A drain serves what it admitted, those waiting for a slot too.
            if self.state not in (*SERVING, "draining"):
                return Failure(503, self._unavailable(), "unavailable", retry_after=self.config.retry_after)
            running = self._running
            if running is not None and not self._hold and running.busy < self.config.parallel:
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
            await self._changed.wait(left)

    def release(self, ticket: Ticket) -> None:
        """The request is over (answered, failed or gone): its slot and its place in the queue."""
        if ticket.running is not None:
            ticket.running.busy -= 1
            ticket.running = None
        self._admitted -= 1
        self._changed.notify()

    def answered(self) -> None:
        """The engine answered something (the detection time of a loss counts from the last answer)."""
        self._last_answer = time.monotonic()

    async def failure_of(self, running: Running, error: str) -> Failure:
        """A request's connection to the engine broke (`error`): the engine's end as its watch diagnosed
        it (the lost nodes named), waiting for that diagnosis at most `diagnose_timeout`."""
        try:
            await asyncio.wait_for(running.ended.wait(), self.config.diagnose_timeout)
        except TimeoutError:
            return Failure(502, f"the engine broke the request off: {error}", "server_error")
        failure = running.failure
        if failure is None:  # stopped on purpose under the request (a drain past its timeout)
            return Failure(503, "the engine was stopped", "unavailable", retry_after=self.config.retry_after)
        return failure

    def stalled(self, running: Running) -> None:
        """A request got nothing from the engine for `event_timeout`: the engine is stuck, end it (its
        watch diagnoses and recovers)."""
        get_logger().warning("serve_engine_stalled", pid=running.engine.pid)
        self.spawn(running.engine.kill(), "serve-kill-stalled")

    # -- the engine's end
    async def _watch_engine(self, running: Running) -> None:
        how = await running.engine.wait()
        if running.stopping or self._stopping.is_set():
            running.ended.set()
            return
        detection = time.monotonic() - self._last_answer
        lost = await running.engine.diagnose()
        message = lost_message(lost, "serving", how)
        endpoints = tuple(ep for ep, _ in lost)
        failure = Failure(
            503, message, "node_lost" if endpoints else "server_error", endpoints, self.config.retry_after
        )
        running.failure = failure
        if self._running is running:
            self._running = None
            self.state = "recovering"
            self.lost = endpoints
            self.reason = message
            for ep in endpoints:
                self.nodes[ep] = "lost"
        self._changed.notify()
        running.ended.set()
        tail = running.engine.log_tail()
        get_logger().warning("serve_node_lost", lost=list(endpoints), error=message, engine_log=tail)
        await self._recover((endpoints, detection, time.time()))

    # -- recovery and reload
    async def _first_load(self, plan: Plan | None) -> None:
        if plan is not None:
            async with self._control:
                if await self._load(plan):
                    return
        await self._recover(None)

    async def _recover(self, lost: tuple[tuple[str, ...], float, float] | None) -> None:
        """Probe, plan and load until serving (bounded by recover_timeout); `lost`: after a loss."""
        async with self._control:
            started = time.monotonic()
            replan = 0.0
            while not self._stopping.is_set():
                if self.state in SERVING:  # another recovery (a reload's) got there first
                    return
                round_started = time.monotonic()
                result = await self._plan_round()
                plan = result.fitting
                replan += time.monotonic() - round_started
                if plan is not None:
                    record = None
                    if lost is not None:
                        record = functools.partial(
                            self._record_recovery, lost, replan, time.monotonic(), started
                        )
                    if await self._load(plan, before_serving=record):
                        return
                else:
                    self.reason = f"waiting for the fleet: {result.reason}"
                if time.monotonic() - started > self.config.recover_timeout:
                    self.state = "failed"
                    self.reason = f"gave up after {self.config.recover_timeout:g} s: {self.reason}"
                    self._changed.notify()
                    get_logger().error("serve_failed", reason=self.reason)
                    if self.on_failed is not None:
                        self.on_failed()
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), self.config.retry_interval)

    def _record_recovery(
        self, lost: tuple[tuple[str, ...], float, float], replan: float, load_started: float, started: float
    ) -> None:
        now = time.monotonic()
        self.metrics.record_recovery(
            Recovery(
                lost=lost[0],
                detection=round(lost[1], 6),
                replan=round(replan, 6),
                reload=round(now - load_started, 6),
                total=round(now - started, 6),
                detected_at=lost[2],
            )
        )

    async def _plan_round(self, *, spare: bool = True) -> Round:
        try:
            result = await self.fleet.plan_round(spare=spare)
        except RpcfleetError as exc:
            return NoRound(dict(self.nodes), exc.message)
        self.nodes = {ep: result.states.get(ep, "unknown") for ep in self.fleet.endpoints}
        return result

    async def _load(self, plan: Plan, before_serving: Callable[[], None] | None = None) -> bool:
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
        await self._stop_engine()  # none should be left; never two
        if self._stopping.is_set():
            running.stopping = True
            await engine.close()
            return True
        if before_serving is not None:
            before_serving()
        self._running = running
        self.plan = plan
        self.load_seconds = round(seconds, 3)
        for ep in plan.endpoints:
            self.nodes[ep] = "serving"
        self.lost = tuple(ep for ep in self.fleet.endpoints if ep not in plan.endpoints)
        self.state = "degraded" if self.lost else "ready"
        self.reason = f"{len(self.lost)} node(s) left out: {', '.join(self.lost)}" if self.lost else ""
        self._changed.notify()
        self.spawn(self._watch_engine(running), "serve-engine")
        get_logger().info("serve_loaded", endpoints=list(plan.endpoints), state=self.state, pid=engine.pid)
        if self.on_loaded is not None:
            self.on_loaded(plan, {**phases, "load": time.monotonic() - started})
        return True

    async def _stop_engine(self) -> None:
        """Stop the engine on purpose (its watch starts no recovery). Under `_control`."""
        running, self._running = self._running, None
        if running is not None:
            running.stopping = True
            await running.engine.close()
            running.ended.set()

    # -- the watch of the nodes left out, and their rejoin
    async def _watch(self) -> None:
        """Every `rejoin_interval` seconds until stopped: one watch round (bounded by the probe's
        timeout), and a rejoin when a node left out answers."""
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.config.rejoin_interval)
            if self._stopping.is_set():
                return
            try:
                await self._watch_round()
            except Exception as exc:  # one failed round must not end the watch
                get_logger().warning("serve_watch_failed", error=repr(exc))

    def _left_out(self) -> tuple[str, ...]:
        plan = self.plan
        if self.state != "degraded" or plan is None:
            return ()
        return tuple(ep for ep in self.fleet.endpoints if ep not in plan.endpoints)

    async def _watch_round(self) -> None:
        left_out = self._left_out()
        if not left_out:
            return
        try:
            states = await self.fleet.watch(left_out)
        except RpcfleetError as exc:
            get_logger().warning("serve_watch_failed", error=exc.message)
            return
        if self._left_out() != left_out:  # a recovery or reload ran meanwhile: its states are newer
            return
        for ep in left_out:
            self.nodes[ep] = states.get(ep, "unknown")
        answering = {ep for ep in left_out if states.get(ep) == "ok"}
        self._declined &= answering  # one that stopped answering is tried again when it is back
        back = tuple(ep for ep in left_out if ep in answering and ep not in self._declined)
        if back:
            await self._rejoin(back)

    async def _rejoin(self, back: tuple[str, ...]) -> None:
        """Take the nodes back: stop the engine, re-plan on every node that answers and start it again (a
        failed load goes on as a recovery). Meanwhile, when another formation of the model serves
        (`others_serving`), this one is out of the router as in a reload (it serves what it admitted, then
        new requests go to the others); else it holds the slots (new requests wait in its queue) and waits
        for the requests being served. When its own nodes hold the model again, the spares it took go back
        to the pool."""
        started = time.monotonic()
        get_logger().info("serve_rejoin_waiting", back=list(back))
        # a recovery or reload under way (or one waiting) re-plans on every node that answers anyway
        if self.state != "degraded" or self._stopping.is_set() or self._control.locked():
            return
        await self._control.acquire()  # free: taken at once, nothing ran in between
        out = self.others_serving is not None and self.others_serving()
        self.rejoining = {"back": list(back), "phase": "waiting for the engine"}
        if out:
            self.state, self.reason = "draining", f"taking back {', '.join(back)}"
        else:
            self._hold += 1
        waiting = "draining" if out else "degraded"
        deadline = time.monotonic() + self.config.queue_timeout

        def pending() -> int:
            return self._admitted if out else self._busy

        self._changed.notify()
        while pending() and time.monotonic() < deadline and self.state == waiting:
            await self._changed.wait(max(0.0, deadline - time.monotonic()))
        if pending() or self.state != waiting:  # the engine was lost meanwhile, or never idle
            self.rejoining = None
            if out and self.state == "draining":
                self.state, self.reason = "degraded", self._left_out_reason()
            if not out:
                self._hold -= 1
            self._changed.notify()
            self._control.release()
            return
        self.rejoining = {"back": list(back), "phase": "loading"}
        if out:
            self.state = "recovering"  # out of the router until it serves again
        idle = time.monotonic() - started
        loaded = False
        try:
            await self._stop_engine()
            result = await self._own_round(back) or await self._plan_round()
            record = functools.partial(self._record_rejoin, back, idle, time.monotonic())
            plan = result.fitting
            loaded = plan is not None and await self._load(plan, before_serving=record)
            if loaded and plan is not None:
                self._declined |= {ep for ep in back if ep not in plan.endpoints}
            elif plan is None:
                self.reason = f"waiting for the fleet: {result.reason}"
        finally:
            self.rejoining = None
            if not out:
                self._hold -= 1
            if not loaded:
                self.state = "recovering"  # the requests waiting for a slot get 503
            self._changed.notify()
            self._control.release()
        if not loaded:
            get_logger().warning("serve_rejoin_failed", back=list(back), reason=self.reason)
            await self._recover(None)

    async def _own_round(self, back: tuple[str, ...]) -> Round | None:
        """When this formation took spares and a node of its own is back: a round on its own nodes only;
        if the model fits there, the spares go back to the pool (the engine holding them is stopped). None:
        no spare taken, or its own nodes do not hold the model (it keeps the spares)."""
        borrowed = {h.endpoint for h in self.fleet.borrowed}
        if not borrowed or all(ep in borrowed for ep in back):
            return None
        laid = self.fleet.lay_down_borrowed()
        result = await self._plan_round(spare=False)
        if result.fitting is None:
            self.fleet.keep_borrowed(laid)
            return None
        for host in laid:
            self.nodes.pop(host.endpoint, None)
        self.fleet.give_back(laid)
        return result

    def _left_out_reason(self) -> str:
        return f"{len(self.lost)} node(s) left out: {', '.join(self.lost)}" if self.lost else ""

    def _record_rejoin(self, back: tuple[str, ...], idle: float, load_started: float) -> None:
        """Just before the new state shows: the rejoin is over and recorded, so /health never shows the
        new plan with the rejoin still under way."""
        self.rejoining = None
        self.metrics.record_rejoin(
            Rejoin(
                back=back,
                idle_wait=round(idle, 6),
                reload=round(time.monotonic() - load_started, 6),
                at=time.time(),
            )
        )

    def _progress(self, progress: LoadProgress) -> None:
        self.load_progress = progress
        if self.on_progress is not None:
            try:
                self.on_progress(progress)
            except Exception as exc:  # a display's bug must not stop the load (nor leave us recovering)
                get_logger().warning("serve_progress_failed", error=repr(exc))

    async def reload(self, *, rolling_restart: bool = False) -> None:
        """Drain (admitted requests finish, new ones get 503), stop the engine, optionally restart every
        node one at a time (`restart --rolling`), re-plan and start it; returns once it serves again (or
        gave up)."""
        async with self._control:
            self.metrics.record_reload()
            self.state, self.reason = "draining", "reloading"
            self._changed.notify()
            deadline = time.monotonic() + self.config.drain_timeout
            while self._admitted and time.monotonic() < deadline:
                await self._changed.wait(max(0.0, deadline - time.monotonic()))
            self.state = "recovering"
            self._changed.notify()
            # a request still admitted past the drain timeout is ended by the stop (a 503)
            await self._stop_engine()
            if rolling_restart:
                self.reason = "rolling restart of the fleet"
                failed = await self.fleet.rolling_restart()
                if failed:
                    get_logger().warning("serve_rolling_restart_failed", failed=failed)
                    self.reason = f"rolling restart failed: {'; '.join(failed)}"
        await self._recover(None)

    # -- the engine's counters
    def engine_states(self) -> Mapping[str, Any]:
        """Slots and queue as the backend sees them (for /metrics)."""
        return {"admitted": self._admitted, "served": self._busy, "parallel": self.config.parallel}
