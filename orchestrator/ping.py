"""`rpcfleet ping`: connect to a host and report who and what it is, and how far away."""

from __future__ import annotations

import time
from dataclasses import dataclass

from orchestrator.errors import HostError
from orchestrator.executor import HostContext, StepOutcome

# One round trip: kernel, machine, user. Output: three lines.
_PING_COMMAND = "uname -s; uname -m; id -un"


@dataclass(frozen=True)
class PingResult:
    os: str
    arch: str
    user: str
    connect_seconds: float
    latency_seconds: float  # one command round trip on the open connection


def parse_ping(stdout: str, host: str) -> tuple[str, str, str]:
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if len(lines) != 3:
        raise HostError(f"unexpected answer to {_PING_COMMAND!r}: {stdout!r}", host=host)
    return lines[0], lines[1], lines[2]


async def ping_step(context: HostContext) -> StepOutcome[PingResult]:
    started = time.monotonic()
    connection = await context.connection()
    connected = time.monotonic()
    result = await connection.run(_PING_COMMAND, timeout=10, check=True)
    finished = time.monotonic()
    os_name, arch, user = parse_ping(result.stdout, context.host.name)
    ping = PingResult(os_name, arch, user, connected - started, finished - connected)
    return StepOutcome(ping, message=f"{os_name}/{arch} as {user} in {ping.latency_seconds * 1000:.1f} ms")
