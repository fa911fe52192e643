"""A formation's recovery: the watch of its engine (llama-server aborts when a node dies, or when a cut
link outlasts its connections' user timeout, see `engine`; the end is diagnosed with bounded probes of the
plan's endpoints: the lost nodes named, and every request in flight answered with the 503 that names
them), and the rounds that probe, plan and load until it serves again, bounded by `recover_timeout` (then
`failed`). A recovery holds the backend's `control`: one load, recovery, rejoin or reload at a time."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from typing import TYPE_CHECKING

from orchestrator.core.log import get_logger
from orchestrator.serve.engine import lost_message
from orchestrator.serve.metrics import Recovery as RecoveryRecord
from orchestrator.serve.states import SERVING, Failure, Running

if TYPE_CHECKING:
    from orchestrator.serve.backend import Backend


class Recovery:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    async def watch_engine(self, running: Running) -> None:
        """Until `running`'s engine ends: stopped on purpose, nothing; else the lost nodes diagnosed, the
        requests in flight told (`Running.failure`), and a recovery."""
        backend = self.backend
        how = await running.engine.wait()
        if running.stopping or backend.stopping.is_set():
            running.ended.set()
            return
        detection = time.monotonic() - backend.last_answer
        lost = await running.engine.diagnose()
        message = lost_message(lost, "serving", how)
        endpoints = tuple(ep for ep, _ in lost)
        failure = Failure(
            503,
            message,
            "node_lost" if endpoints else "server_error",
            endpoints,
            backend.config.retry_after,
        )
        running.failure = failure
        if backend.current is running:
            backend.current = None
            backend.state = "recovering"
            backend.lost = endpoints
            backend.reason = message
            for ep in endpoints:
                backend.nodes[ep] = "lost"
        backend.changed.notify()
        running.ended.set()
        tail = running.engine.log_tail()
        get_logger().warning("serve_node_lost", lost=list(endpoints), error=message, engine_log=tail)
        await self.recover((endpoints, detection, time.time()))

    async def recover(self, lost: tuple[tuple[str, ...], float, float] | None) -> None:
        """Probe, plan and load until serving (bounded by recover_timeout); `lost`: after a loss."""
        backend = self.backend
        async with backend.control:
            started = time.monotonic()
            replan = 0.0
            while not backend.stopping.is_set():
                if backend.state in SERVING:  # another recovery (a reload's) got there first
                    return
                round_started = time.monotonic()
                result = await backend.plan_round()
                plan = result.fitting
                replan += time.monotonic() - round_started
                if plan is not None:
                    record = None
                    if lost is not None:
                        record = functools.partial(self.record, lost, replan, time.monotonic(), started)
                    if await backend.load(plan, before_serving=record):
                        return
                else:
                    backend.reason = f"waiting for the fleet: {result.reason}"
                if time.monotonic() - started > backend.config.recover_timeout:
                    backend.state = "failed"
                    backend.reason = f"gave up after {backend.config.recover_timeout:g} s: {backend.reason}"
                    backend.changed.notify()
                    get_logger().error("serve_failed", reason=backend.reason)
                    if backend.on_failed is not None:
                        backend.on_failed()
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(backend.stopping.wait(), backend.config.retry_interval)

    def record(
        self, lost: tuple[tuple[str, ...], float, float], replan: float, load_started: float, started: float
    ) -> None:
        backend = self.backend
        now = time.monotonic()
        backend.metrics.record_recovery(
            RecoveryRecord(
                lost=lost[0],
                detection=round(lost[1], 6),
                replan=round(replan, 6),
                reload=round(now - load_started, 6),
                total=round(now - started, 6),
                detected_at=lost[2],
            )
        )
