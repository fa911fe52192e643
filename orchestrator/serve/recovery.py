"""A formation's recovery: the watch of its engine (llama-server aborts when a node dies, or when a cut
link outlasts its connections' user timeout, see `engine`; the end is diagnosed with bounded probes of the
plan's endpoints: the lost nodes named, and every request in flight answered with the 503 that names
them), and the rounds that probe, plan and load until it serves again, bounded by `recover_timeout` (then
`failed`). A recovery holds the formation's `control`: one load, recovery, rejoin or reload at a time. It
sees the formation through `Recovering`, and asks it to move (`lose`, `give_up`): it writes no state."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from typing import Protocol

from orchestrator.core.log import get_logger
from orchestrator.planning.plan import Plan
from orchestrator.serve.engine import lost_message
from orchestrator.serve.fleet import Round
from orchestrator.serve.metrics import Metrics
from orchestrator.serve.metrics import Recovery as RecoveryRecord
from orchestrator.serve.states import SERVING, Failure, FormationState, Running, ServeConfig


class Recovering(Protocol):
    """What a recovery needs of its formation (`serve.formation.Formation`)."""

    config: ServeConfig
    metrics: Metrics
    reason: str
    control: asyncio.Lock
    stopping: asyncio.Event
    last_answer: float

    @property
    def state(self) -> FormationState: ...

    def lose(self, running: Running, lost: tuple[str, ...], message: str) -> None: ...

    def give_up(self, reason: str) -> None: ...

    def wait_for_fleet(self, reason: str) -> None: ...

    async def plan_round(self, *, spare: bool = True) -> Round: ...

    async def load(self, plan: Plan, before_serving: Callable[[], None] | None = None) -> bool: ...


class Recovery:
    def __init__(self, formation: Recovering) -> None:
        self.formation = formation

    async def watch_engine(self, running: Running) -> None:
        """Until `running`'s engine ends: stopped on purpose, nothing; else the lost nodes diagnosed, the
        requests in flight told (`Running.failure`), and a recovery."""
        formation = self.formation
        how = await running.engine.wait()
        if running.stopping or formation.stopping.is_set():
            running.ended.set()
            return
        detection = time.monotonic() - formation.last_answer
        lost = await running.engine.diagnose()
        message = lost_message(lost, "serving", how)
        endpoints = tuple(ep for ep, _ in lost)
        failure = Failure(
            503,
            message,
            "node_lost" if endpoints else "server_error",
            endpoints,
            formation.config.retry_after,
        )
        running.failure = failure
        formation.lose(running, endpoints, message)
        running.ended.set()
        tail = running.engine.log_tail()
        get_logger().warning("serve_node_lost", lost=list(endpoints), error=message, engine_log=tail)
        await self.recover((endpoints, detection, time.time()))

    async def recover(self, lost: tuple[tuple[str, ...], float, float] | None) -> None:
        """Probe, plan and load until serving (bounded by recover_timeout); `lost`: after a loss."""
        formation = self.formation
        async with formation.control:
            started = time.monotonic()
            replan = 0.0
            while not formation.stopping.is_set():
                if formation.state in SERVING:  # another recovery (a reload's) got there first
                    return
                round_started = time.monotonic()
                result = await formation.plan_round()
                plan = result.fitting
                replan += time.monotonic() - round_started
                if plan is not None:
                    record = None
                    if lost is not None:
                        record = functools.partial(self.record, lost, replan, time.monotonic(), started)
                    if await formation.load(plan, before_serving=record):
                        return
                else:
                    formation.wait_for_fleet(result.reason)
                if time.monotonic() - started > formation.config.recover_timeout:
                    why = f"gave up after {formation.config.recover_timeout:g} s: {formation.reason}"
                    get_logger().error("serve_failed", reason=why)
                    formation.give_up(why)
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(formation.stopping.wait(), formation.config.retry_interval)

    def record(
        self, lost: tuple[tuple[str, ...], float, float], replan: float, load_started: float, started: float
    ) -> None:
        now = time.monotonic()
        self.formation.metrics.record_recovery(
            RecoveryRecord(
                lost=lost[0],
                detection=round(lost[1], 6),
                replan=round(replan, 6),
                reload=round(now - load_started, 6),
                total=round(now - started, 6),
                detected_at=lost[2],
            )
        )
