"""The serving backend: one worker, a bounded queue, recovery after a lost node, reload (no HTTP here).

States: `loading` (first load), `ready` (serving on every node that was selected), `degraded` (serving
on fewer: a node was lost and the model was re-planned on the others), `recovering` (a node or the
worker was lost: probing, planning, reloading), `draining` (a reload waits for admitted requests to
finish), `failed` (recovery gave up after `recover_timeout`; the process exits).

One request at a time holds the worker (`_gate`); up to `queue_size` more wait for it, each at most
`queue_timeout`; beyond that a request is refused (429). Requests run in threads and hand their events
to the caller through `Job` (an asyncio queue fed thread-safely), so the HTTP loop never blocks.

A lost node (`NodeLostError`) or a dead worker ends the request in flight with a 503 naming the lost
endpoints; the backend then re-probes the fleet and loads a new plan on the nodes that answer, as soon as
the model fits there (so either on the remaining nodes, or once the lost node is back). Every wait is
bounded: probes by the fleet's probe timeout, loads by `load_timeout`, the whole recovery by
`recover_timeout`.

Rejoin: while `degraded`, a watch probes the selected nodes that the plan leaves out (only those: the
serving ones are held by the worker) every `rejoin_interval` seconds with the fleet probe's rules (a
server with a client is `busy` and left alone; one held by a dead worker of ours is released first).
When one answers `ok`, the backend takes the worker's gate after the request being served (in turn with
the queued ones, which then wait for the new worker; continuous load leaves no idle moment to wait for),
unloads, re-plans on every node that answers and loads, as a reload does. A node that this re-plan
leaves out anyway is not tried again until it has stopped answering once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.core.errors import RpcfleetError
from orchestrator.core.log import get_logger
from orchestrator.llama.load_progress import LoadProgress
from orchestrator.llama.worker import (
    Done,
    Event,
    NodeLostError,
    Token,
    Worker,
    WorkerCrashedError,
    WorkerError,
    WorkerTimeoutError,
)
from orchestrator.planning.plan import Plan
from orchestrator.serve.fleet import PlanRound, ServeFleet
from orchestrator.serve.metrics import Metrics, Recovery, Rejoin

SERVING = frozenset({"ready", "degraded"})


@dataclass(frozen=True)
class ServeConfig:
    queue_size: int = 8  # requests waiting for the worker beyond the one it serves
    queue_timeout: float = 120.0  # seconds a request may wait for the worker
    load_timeout: float = 300.0
    event_timeout: float = 120.0  # seconds between two answers of the worker
    link_timeout: float = 10.0
    recover_timeout: float = 600.0  # seconds of recovery before giving up
    retry_interval: float = 1.0  # seconds between two recovery rounds
    drain_timeout: float = 300.0  # seconds a reload waits for admitted requests
    retry_after: int = 2  # the Retry-After of a 503 (seconds)
    rejoin_interval: float = 5.0  # seconds between two probes of the nodes left out (0: no watch)
    seed: int = 0
    log_dir: Path | None = None


class Rejected(RpcfleetError):
    """A request that is not served: `status` (429, 503) and `retry_after` (seconds, for a 503)."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


@dataclass(frozen=True)
class Failure:
    """The end of a job that was not served to the end: HTTP status, message, lost endpoints."""

    status: int
    message: str
    kind: str  # OpenAI error type: node_lost, unavailable, invalid_request_error, server_error
    lost: tuple[str, ...] = ()
    retry_after: int | None = None


class Job:
    """One admitted request: its events, read by the caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Token | Done | Failure] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.admitted = time.monotonic()
        self.first_token: float | None = None  # seconds from admission to the first text

    def put(self, item: Token | Done | Failure) -> None:
        if isinstance(item, Token) and self.first_token is None and item.text:
            self.first_token = time.monotonic() - self.admitted
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody reads any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def events(self) -> Any:
        """Tokens, then one Done or Failure (an async iterator)."""
        while True:
            item = await self._queue.get()
            yield item
            if not isinstance(item, Token):
                return


class Backend:
    def __init__(self, fleet: ServeFleet, config: ServeConfig, metrics: Metrics | None = None) -> None:
        self.fleet = fleet
        self.config = config
        self.metrics = metrics or Metrics()
        self.state = "loading"
        self.reason = ""  # why the state is not ready (the last recovery round, the lost endpoints)
        self.plan: Plan | None = None
        self.nodes: dict[str, str] = dict.fromkeys(fleet.endpoints, "unknown")
        self.lost: tuple[str, ...] = ()
        self.load_seconds: float | None = None  # the last load's, in the worker
        self.on_failed: Callable[[], None] | None = None  # called when recovery gives up
        self.on_progress: Callable[[LoadProgress], None] | None = None  # during each load
        # after each load: its plan and the phases' seconds (cache: the check and warm; load)
        self.on_loaded: Callable[[Plan, dict[str, float]], None] | None = None
        self.load_progress: LoadProgress | None = None  # the load under way, if any
        self.skipped: dict[str, int] = {}  # per endpoint, bytes of cache hits of the load under way
        self._worker: Worker | None = None
        self._gate = threading.Lock()  # the worker serves one request at a time
        self._cond = threading.Condition()
        self._admitted = 0
        self._control = threading.Lock()  # one load, recovery or reload at a time
        self._stopping = threading.Event()
        self.rejoining: dict[str, Any] | None = None  # the rejoin under way: endpoints, phase
        self._declined: set[str] = set()  # answered, yet a rejoin's plan left them out
        self._last_answer = time.monotonic()

    # -- life
    def start(self, plan: Plan | None = None) -> threading.Thread:
        """Load `plan` (default: probe and plan) in a thread (`loading` meanwhile); should that load fail,
        the thread goes on as a recovery does. It ends serving, or `failed`."""
        thread = threading.Thread(target=self._first_load, args=(plan,), name="serve-load", daemon=True)
        thread.start()
        if self.config.rejoin_interval > 0:
            threading.Thread(target=self._watch, name="serve-watch", daemon=True).start()
        return thread

    def stop(self) -> None:
        self._stopping.set()
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()

    @property
    def worker_pid(self) -> int | None:
        return self._worker.pid if self._worker is not None else None

    def health(self) -> dict[str, Any]:
        with self._cond:  # one snapshot: a state change (under `_cond`) shows whole or not at all
            return self._health()

    def _health(self) -> dict[str, Any]:
        plan = self.plan
        last = self.metrics.recoveries[-1] if self.metrics.recoveries else None
        rejoin = self.metrics.rejoins[-1] if self.metrics.rejoins else None
        return {
            "status": self.state,
            "reason": self.reason or None,
            "model": str(self.fleet.model_path),
            "pid": os.getpid(),
            "worker_pid": self.worker_pid,
            "load_seconds": self.load_seconds,
            "loading": None if self.load_progress is None else self.load_progress.as_log(),
            "queue": {"admitted": self._admitted, "size": self.config.queue_size},
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
    def submit(self, op: str, payload: Any, max_tokens: int, temperature: float, seed: int | None) -> Job:
        """Admit a request (or raise Rejected) and start it; its events come through the Job."""
        with self._cond:
            if self.state not in SERVING:
                raise Rejected(503, self._unavailable(), self.config.retry_after)
            if self._admitted >= self.config.queue_size + 1:
                raise Rejected(429, f"the queue is full ({self.config.queue_size} waiting and one served)")
            self._admitted += 1
        job = Job(asyncio.get_running_loop())
        args = (job, op, payload, max_tokens, temperature, seed)
        threading.Thread(target=self._serve, args=args, name="serve-request", daemon=True).start()
        return job

    def _unavailable(self) -> str:
        why = f": {self.reason}" if self.reason else ""
        return f"the model is {self.state}{why}"

    def _serve(
        self, job: Job, op: str, payload: Any, max_tokens: int, temperature: float, seed: int | None
    ) -> None:
        try:
            if not self._gate.acquire(timeout=self.config.queue_timeout):
                job.put(
                    Failure(
                        503,
                        f"waited {self.config.queue_timeout:g} s for the worker",
                        "unavailable",
                        retry_after=self.config.retry_after,
                    )
                )
                return
            try:
                self._generate(job, op, payload, max_tokens, temperature, seed)
            finally:
                self._gate.release()
        finally:
            with self._cond:
                self._admitted -= 1
                self._cond.notify_all()

    def _generate(
        self, job: Job, op: str, payload: Any, max_tokens: int, temperature: float, seed: int | None
    ) -> None:
        worker = self._worker
        # A drain waits for the requests it admitted, those queued behind the gate too: they are served.
        if worker is None or self.state not in (*SERVING, "draining"):
            job.put(Failure(503, self._unavailable(), "unavailable", retry_after=self.config.retry_after))
            return
        seed = self.config.seed if seed is None else seed
        events: Iterator[Event] | None = None
        try:
            if op == "chat":
                events = worker.chat(payload, max_tokens=max_tokens, temperature=temperature, seed=seed)
            else:
                events = worker.complete(payload, max_tokens=max_tokens, temperature=temperature, seed=seed)
            for event in events:
                self._last_answer = time.monotonic()
                if job.cancelled.is_set():
                    break
                job.put(event)
                if isinstance(event, Done):
                    self.metrics.record_done(
                        event.prompt_tokens, event.completion_tokens, event.tokens_per_second, job.first_token
                    )
        except (NodeLostError, WorkerCrashedError, WorkerTimeoutError) as exc:
            self._lost(job, worker, exc)
        except WorkerError as exc:
            if worker.alive:  # the request was refused (too long a prompt...): the worker keeps serving
                job.put(Failure(400, exc.message, "invalid_request_error"))
            else:
                self._lost(job, worker, exc)
        finally:
            if events is not None and hasattr(events, "close"):
                events.close()  # a cancelled request: the worker stops generating

    def _lost(self, job: Job, worker: Worker, exc: WorkerError) -> None:
        lost = tuple(getattr(exc, "endpoints", ()))
        detection = time.monotonic() - self._last_answer
        with self._cond:
            if self._worker is worker:
                self._worker = None
                self.state = "recovering"
                self.lost = lost
                self.reason = exc.message
                for ep in lost:
                    self.nodes[ep] = "lost"
        job.put(
            Failure(503, exc.message, "node_lost" if lost else "server_error", lost, self.config.retry_after)
        )
        get_logger().warning("serve_node_lost", lost=list(lost), error=exc.message)
        threading.Thread(
            target=self._recover, args=((lost, detection, time.time()),), name="serve-recover", daemon=True
        ).start()

    # -- recovery and reload
    def _first_load(self, plan: Plan | None) -> None:
        if plan is not None:
            with self._control:
                if self._load(plan):
                    return
        self._recover(None)

    def _recover(self, lost: tuple[tuple[str, ...], float, float] | None) -> None:
        """Probe, plan and load until serving (bounded by recover_timeout); `lost`: after a loss."""
        with self._control:
            started = time.monotonic()
            replan = 0.0
            while not self._stopping.is_set():
                round_started = time.monotonic()
                result = self._plan_round()
                if result.plan is not None:
                    replan += time.monotonic() - round_started
                    record = None
                    if lost is not None:
                        record = functools.partial(
                            self._record_recovery, lost, replan, time.monotonic(), started
                        )
                    if self._load(result.plan, before_serving=record):
                        return
                else:
                    replan += time.monotonic() - round_started
                    self.reason = f"waiting for the fleet: {result.reason}"
                if time.monotonic() - started > self.config.recover_timeout:
                    self.state = "failed"
                    self.reason = f"gave up after {self.config.recover_timeout:g} s: {self.reason}"
                    get_logger().error("serve_failed", reason=self.reason)
                    if self.on_failed is not None:
                        self.on_failed()
                    return
                self._stopping.wait(self.config.retry_interval)

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

    def _plan_round(self) -> PlanRound:
        try:
            result = self.fleet.plan_round()
        except RpcfleetError as exc:
            return PlanRound(None, dict(self.nodes), 0.0, 0.0, exc.message)
        self.nodes = {ep: result.states.get(ep, "unknown") for ep in self.fleet.endpoints}
        return result

    def _load(self, plan: Plan, before_serving: Callable[[], None] | None = None) -> bool:
        """Check the caches, load `plan` in a new worker and serve it; `before_serving` runs just before
        the new state shows (a recovery's record, so that /health never shows one without the other)."""
        started = time.monotonic()
        try:
            prep = self.fleet.prepare_cache(plan)
        except RpcfleetError as exc:  # a truncated cache file: refused before llama.cpp reads it
            self.reason = f"loading failed: {exc}"
            get_logger().warning("serve_load_failed", error=str(exc))
            return False
        self.skipped = dict(prep.hit_bytes) if prep is not None else {}
        phases = {"cache": time.monotonic() - started} if prep is not None else {}
        worker = Worker.spawn(
            self.config.log_dir / f"worker-{int(time.time() * 1000)}.log" if self.config.log_dir else None,
            event_timeout=self.config.event_timeout,
            link_timeout=self.config.link_timeout,
        )
        started = time.monotonic()
        try:
            worker.load(
                plan,
                self.fleet.model_path,
                {"seed": self.config.seed},
                timeout=self.config.load_timeout,
                dial=self.fleet.dial_map(),
                on_progress=self._progress,
                cache_hits=self.skipped,
            )
        except RpcfleetError as exc:
            worker.kill()
            self.reason = f"loading failed: {exc.message}"
            get_logger().warning("serve_load_failed", error=exc.message)
            return False
        finally:
            self.load_progress = None
        with self._cond:
            if before_serving is not None:
                before_serving()
            self._worker = worker
            self.plan = plan
            self.load_seconds = round(worker.placement.load_seconds, 3) if worker.placement else None
            for ep in plan.endpoints:
                self.nodes[ep] = "serving"
            self.lost = tuple(ep for ep in self.fleet.endpoints if ep not in plan.endpoints)
            self.state = "degraded" if self.lost else "ready"
            self.reason = f"{len(self.lost)} node(s) left out: {', '.join(self.lost)}" if self.lost else ""
        get_logger().info("serve_loaded", endpoints=list(plan.endpoints), state=self.state, pid=worker.pid)
        if self.on_loaded is not None:
            self.on_loaded(plan, {**phases, "load": time.monotonic() - started})
        return True

    # -- the watch of the nodes left out, and their rejoin
    def _watch(self) -> None:
        """Every `rejoin_interval` seconds until stopped: one watch round (bounded by the probe's
        timeout), and a rejoin when a node left out answers."""
        while not self._stopping.wait(self.config.rejoin_interval):
            try:
                self._watch_round()
            except Exception as exc:  # one failed round must not end the watch
                get_logger().warning("serve_watch_failed", error=repr(exc))

    def _left_out(self) -> tuple[str, ...]:
        plan = self.plan
        if self.state != "degraded" or plan is None:
            return ()
        return tuple(ep for ep in self.fleet.endpoints if ep not in plan.endpoints)

    def _watch_round(self) -> None:
        left_out = self._left_out()
        if not left_out:
            return
        try:
            states = self.fleet.watch(left_out)
        except RpcfleetError as exc:
            get_logger().warning("serve_watch_failed", error=exc.message)
            return
        with self._cond:
            if self._left_out() != left_out:  # a recovery or reload ran meanwhile: its states are newer
                return
            for ep in left_out:
                self.nodes[ep] = states.get(ep, "unknown")
        answering = {ep for ep in left_out if states.get(ep) == "ok"}
        self._declined &= answering  # one that stopped answering is tried again when it is back
        back = tuple(ep for ep in left_out if ep in answering and ep not in self._declined)
        if back:
            self._rejoin(back)

    def _rejoin(self, back: tuple[str, ...]) -> None:
        """Between two requests: unload, re-plan on every node that answers and load (as a reload, with
        the requests queued meanwhile waiting for the new worker). A failed load goes on as a recovery."""
        started = time.monotonic()
        get_logger().info("serve_rejoin_waiting", back=list(back))
        with self._cond:
            self.rejoining = {"back": list(back), "phase": "waiting for the worker"}
        # The worker's gate, in turn with the queued requests: continuous load never leaves an idle
        # moment to wait for. One blocking wait (a timed-out one would go back to the queue's end).
        if not self._gate.acquire(timeout=self.config.queue_timeout):
            self.rejoining = None
            return
        with self._cond:
            # a recovery or reload under way (or one waiting) re-plans on every node that answers anyway
            if self.state != "degraded" or self._stopping.is_set() or not self._control.acquire(False):
                self.rejoining = None
                self._gate.release()
                return
            worker, self._worker = self._worker, None
            self.rejoining = {"back": list(back), "phase": "loading"}
        idle = time.monotonic() - started
        loaded = False
        try:
            if worker is not None:
                worker.close()
            result = self._plan_round()
            record = functools.partial(self._record_rejoin, back, idle, time.monotonic())
            loaded = result.plan is not None and self._load(result.plan, before_serving=record)
            if loaded and result.plan is not None:
                self._declined |= {ep for ep in back if ep not in result.plan.endpoints}
            elif result.plan is None:
                self.reason = f"waiting for the fleet: {result.reason}"
        finally:
            with self._cond:
                self.rejoining = None
                if not loaded:
                    self.state = "recovering"  # the requests waiting at the gate get 503
            self._gate.release()
            self._control.release()
        if not loaded:
            get_logger().warning("serve_rejoin_failed", back=list(back), reason=self.reason)
            self._recover(None)

    def _record_rejoin(self, back: tuple[str, ...], idle: float, load_started: float) -> None:
        """Just before the new state shows (under `_cond`): the rejoin is over and recorded, so /health
        never shows the new plan with the rejoin still under way."""
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

    def reload(self, *, rolling_restart: bool = False, wait: bool = False) -> threading.Thread:
        """Drain (admitted requests finish, new ones get 503), unload, optionally restart every node one
        at a time (`restart --rolling`), re-plan and load. In a thread; `wait` joins it."""
        thread = threading.Thread(
            target=self._reload, args=(rolling_restart,), name="serve-reload", daemon=True
        )
        thread.start()
        if wait:
            thread.join()
        return thread

    def _reload(self, rolling_restart: bool) -> None:
        with self._control:
            self.metrics.record_reload()
            with self._cond:
                self.state, self.reason = "draining", "reloading"
                deadline = time.monotonic() + self.config.drain_timeout
                while self._admitted and time.monotonic() < deadline:
                    self._cond.wait(max(0.0, deadline - time.monotonic()))
                worker, self._worker = self._worker, None
                self.state = "recovering"
            # a request still admitted past the drain timeout is ended by the unload (the worker's error)
            if worker is not None:
                worker.close()
            if rolling_restart:
                self.reason = "rolling restart of the fleet"
                failed = self.fleet.rolling_restart()
                if failed:
                    get_logger().warning("serve_rolling_restart_failed", failed=failed)
                    self.reason = f"rolling restart failed: {'; '.join(failed)}"
        self._recover(None)
