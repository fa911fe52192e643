"""The restart step: one node, refused when busy, back to its memory baseline.

`service restart` and the playbooks' `restart` run it on their hosts; a rolling restart is the ordinary
executor with `serial` (docs/architecture.md): `Session.run(hosts, make_restart_step(...), serial=1,
max_fail_percentage=0)`. This module holds only what one node needs, built from the server package's
own functions (`read_node_state`, `classify`, `stop_server`, `start_server`, `wait_ready`):

1. Read the node. A *busy* server (a client is connected: killing it would kill an inference mid-way)
   is refused unless `force`; the stop checks again on the node, in the same step as the kill
   (`operations.server.process.stop_script`: a connection lasting `BUSY_GRACE` is a model, not a probe).
2. Baseline: the server's free device memory before the stop (an RPC probe of every device).
3. Stop, start, wait until HELLO answers (`server.process.wait_ready`), then until every device's free memory
   is back to its baseline within a tolerance. CPU servers report a constant (physical RAM), so for them
   this holds at once.

`check`: the node is read and the busy rule applied; nothing is stopped or started.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.connectors.base import Connection
from orchestrator.connectors.nodescript import would_run
from orchestrator.connectors.tunnel import target_of
from orchestrator.core.errors import ServiceError
from orchestrator.core.poll import poll_async
from orchestrator.core.units import format_size
from orchestrator.engine.executor import HostContext, Step, StepOutcome
from orchestrator.inventory.model import Host
from orchestrator.operations.layer import DEFAULT_OPTIONS, OperationOptions, node_operation
from orchestrator.operations.server.process import (
    planned_start,
    refuse_if_busy,
    run_as_warning,
    start_server,
    stop_node_script,
    stop_server,
    wait_ready,
)
from orchestrator.operations.server.state import (
    READY_TIMEOUT,
    ServerStatus,
    bind_policy,
    classify,
    probe_server,
    read_node_state,
)
from orchestrator.rpc.client import probe_endpoint
from orchestrator.rpc.records import DeviceMemory

DEFAULT_MEMORY_TOLERANCE = 0.05  # of each device's total


DEFAULT_MEMORY_TOLERANCE_MIN = 256 * 1024 * 1024  # bytes: free memory moves a little on a GPU


DEFAULT_MEMORY_TIMEOUT = 30.0


_MEMORY_PROBE_TIMEOUT = 2.0


class MemoryNotBackError(ServiceError):
    """The restarted server answers, but its devices' free memory did not return to the baseline."""


@dataclass(frozen=True)
class RestartReport:
    """What the step did on one node, with its timings (seconds)."""

    host: str
    action: str  # "restarted", "started", "would restart", "would start"
    pid_before: int | None
    pid_after: int | None
    state_before: str
    baseline: tuple[DeviceMemory, ...] = ()  # free memory before the stop (empty: not measurable)
    after: tuple[DeviceMemory, ...] = ()
    stop_seconds: float = 0.0  # stop command
    start_to_ready: float = 0.0  # launch to HELLO: the server's own start time and our polling
    stop_to_ready: float = 0.0  # stop begins to HELLO and memory back: the node's downtime
    warnings: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.action.startswith("would"):
            pid = f" (pid {self.pid_before})" if self.pid_before else ""
            return f"{self.action}{pid}"
        before = f"pid {self.pid_before} -> " if self.pid_before else ""
        return (
            f"{self.action}: {before}pid {self.pid_after}, down {self.stop_to_ready:.2f} s "
            f"(start to HELLO {self.start_to_ready:.2f} s)"
        )

    def to_json(self) -> dict[str, object]:
        return {
            "host": self.host,
            "action": self.action,
            "pid_before": self.pid_before,
            "pid_after": self.pid_after,
            "state_before": self.state_before,
            "baseline_free": [d.free for d in self.baseline],
            "after_free": [d.free for d in self.after],
            "stop_seconds": round(self.stop_seconds, 4),
            "start_to_ready": round(self.start_to_ready, 4),
            "stop_to_ready": round(self.stop_to_ready, 4),
            "warnings": list(self.warnings),
        }


def memory_back(
    baseline: Sequence[DeviceMemory],
    now: Sequence[DeviceMemory],
    *,
    tolerance: float = DEFAULT_MEMORY_TOLERANCE,
    tolerance_min: int = DEFAULT_MEMORY_TOLERANCE_MIN,
) -> str | None:
    """Pure: None when every baseline device is back (free within max(tolerance * total, tolerance_min)
    of its baseline), else why not."""
    by_index = {d.index: d for d in now}
    for before in baseline:
        after = by_index.get(before.index)
        if after is None:
            return f"device {before.index} is missing after the restart"
        slack = max(int(tolerance * max(before.total, after.total)), tolerance_min)
        if after.free + slack < before.free:
            return (
                f"device {before.index}: {format_size(after.free)} free, baseline "
                f"{format_size(before.free)} (tolerance {format_size(slack)})"
            )
    return None


async def _device_memory(host: Host) -> tuple[DeviceMemory, ...] | None:
    if host.binds_own_loopback:
        return None
    result = await probe_endpoint(
        await target_of(host),
        connect_timeout=_MEMORY_PROBE_TIMEOUT,
        read_timeout=_MEMORY_PROBE_TIMEOUT,
        deadline=_MEMORY_PROBE_TIMEOUT * 1.5,
    )
    return result.devices if result.ok else None


def make_restart_step(
    options: OperationOptions = DEFAULT_OPTIONS,
    *,
    ready_timeout: float = READY_TIMEOUT,
    memory_tolerance: float = DEFAULT_MEMORY_TOLERANCE,
    memory_tolerance_min: int = DEFAULT_MEMORY_TOLERANCE_MIN,
    memory_timeout: float = DEFAULT_MEMORY_TIMEOUT,
) -> Step[RestartReport]:
    """The executor step restarting one node (see the module docstring). Run it with `serial`."""

    async def restart(ctx: HostContext, conn: Connection) -> StepOutcome[RestartReport]:
        host = ctx.host
        warning = bind_policy(host)  # a bad bind is refused before anything is stopped
        state = await read_node_state(conn, host)
        status = classify(host, state, await probe_server(host, state))
        running = _has_process(status)
        root = run_as_warning(host, state)
        warnings = ((warning,) if warning else ()) + ((root,) if root else ())
        if options.check:
            if status.pid is not None and not options.force:
                await refuse_if_busy(conn, host, "restart", busy_grace=options.busy_grace)
            stop = stop_node_script(host, state, force=options.force, busy_grace=options.busy_grace)
            would_run(host.name, [stop, *planned_start(host, state)])
            action = "would restart" if running else "would start"
            report = RestartReport(host.name, action, status.pid, None, status.state, warnings=warnings)
            return StepOutcome(report, True, report.describe())
        # One `ss` sample may catch a probe passing by ("busy"); a server that really serves a client
        # does not answer this probe either, and then there is simply no baseline.
        baseline = await _device_memory(host) if status.state in ("running", "busy") else None
        started = time.monotonic()
        # The stop re-checks for clients on the node, in the step of the kill (operations.server.process).
        await stop_server(
            conn,
            host,
            state,
            force=options.force,
            busy_grace=options.busy_grace,
            action="restart",
        )
        stopped = time.monotonic()
        pid = await start_server(conn, host, state)  # its launch script waits for the port to listen
        await wait_ready(conn, host, state, pid, limit_s=ready_timeout)
        ready = time.monotonic()
        after = await _wait_memory(host, baseline, memory_tolerance, memory_tolerance_min, memory_timeout)
        report = RestartReport(
            host=host.name,
            action="restarted" if running else "started",
            pid_before=status.pid if running else None,
            pid_after=pid,
            state_before=status.state,
            baseline=baseline or (),
            after=after,
            stop_seconds=stopped - started,
            start_to_ready=ready - stopped,
            stop_to_ready=time.monotonic() - started,
            warnings=warnings,
        )
        ctx.log.info("rolling_restart_node", **report.to_json())
        return StepOutcome(report, True, report.describe())

    return node_operation("restart", restart, options)


def _has_process(status: ServerStatus) -> bool:
    return status.state in ("running", "busy", "unhealthy")


async def _wait_memory(
    host: Host,
    baseline: tuple[DeviceMemory, ...] | None,
    tolerance: float,
    tolerance_min: int,
    limit_s: float,
) -> tuple[DeviceMemory, ...]:
    """Poll the devices' free memory until it is back to `baseline` (nothing to wait for without one)."""
    if not baseline:
        return ()
    why = "no answer"

    async def back() -> tuple[DeviceMemory, ...] | None:
        nonlocal why
        now = await _device_memory(host)
        if now is None:
            return None
        missing = memory_back(baseline, now, tolerance=tolerance, tolerance_min=tolerance_min)
        why = missing or why
        return now if missing is None else None

    now = await poll_async(back, limit=limit_s, interval=0.25)
    if now is None:
        raise MemoryNotBackError(
            f"the restarted server answers, but its memory is not back within {limit_s:g} s: {why}",
            host=host.name,
        )
    return now
