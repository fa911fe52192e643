"""`rpcfleet ping` over real SSH (in-process asyncssh hosts running bash) and a refused host."""

from __future__ import annotations

import getpass
import platform
from collections.abc import Callable
from typing import Any

from orchestrator.engine.executor import Session
from orchestrator.probe.ping import PingResult, ping_step


async def test_ping_reports_os_arch_user_and_latency(fake_hosts: Callable[..., list[Any]]) -> None:
    up, down = fake_hosts(2)
    down.stop_listening()
    async with Session() as session:
        run = await session.run([up.host, down.host], ping_step, name="ping")
    ok, refused = run.results
    assert ok.status == "ok" and isinstance(ok.value, PingResult)
    assert (ok.value.os, ok.value.arch, ok.value.user) == ("Linux", platform.machine(), getpass.getuser())
    assert ok.value.distribution and 0 < ok.value.latency_seconds < 5
    assert refused.status == "unreachable" and "refused" in str(refused.error)
