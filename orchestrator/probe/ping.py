"""`rpcfleet ping`: connect to a host and report who and what it is, and how far away."""

from __future__ import annotations

import time
from dataclasses import dataclass

from orchestrator.core.errors import HostError
from orchestrator.engine.executor import HostContext, StepOutcome
from orchestrator.facts.base import gather
from orchestrator.facts.system import OsFact, OsInfo, UserFact


@dataclass(frozen=True)
class PingResult:
    os: str
    arch: str
    user: str
    distribution: str | None  # PRETTY_NAME of /etc/os-release
    connect_seconds: float
    latency_seconds: float  # one command round trip on the open connection


async def ping_step(context: HostContext) -> StepOutcome[PingResult]:
    started = time.monotonic()
    connection = await context.connection()
    connected = time.monotonic()
    values = await gather(connection, [OsFact(), UserFact()], timeout=10)
    finished = time.monotonic()
    os_info: OsInfo = values[OsFact.name]
    user: str | None = values[UserFact.name]
    if os_info.system is None or os_info.machine is None or user is None:
        raise HostError(
            "the host did not say its kernel, machine and user (uname, id)", host=context.host.name
        )
    ping = PingResult(
        os_info.system, os_info.machine, user, os_info.pretty_name, connected - started, finished - connected
    )
    return StepOutcome(
        ping, message=f"{ping.os}/{ping.arch} as {user} in {ping.latency_seconds * 1000:.1f} ms"
    )
