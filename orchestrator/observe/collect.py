"""The exporter's probe loop: one round every `interval` seconds, on the command's loop (`rpcfleet
exporter` and `serve`: beside the HTTP server) or on a `LoopThread` of the runtime's (`start`).

A round reads each node over its SSH connection (kept open from round to round; a round with an
unreachable host opens fresh ones next time), in one round trip: the server's state as `rpcfleet status`
reads it (`operations.server`: pid file, supervisor, unit, listeners, clients, restarts), the probe's
host facts (MemAvailable, GPUs) and the tensor cache's usage; then the stale-client proof of
`operations.stale` when a client holds the server. Then an RPC probe (HELLO, devices, memory) of the
servers that run with no client, and only those: the probe's rule, a server serving a client is never
connected to (its one client at a time would make the probe wait, or the client), and neither are the
nodes a formation holds or probes itself (serve's plans, recoveries and rejoins). A server not probed
keeps its last RPC reading (its age in `measured_at`), its CPU memory refreshed from the host's
MemAvailable (`probe.capacity`). Each round ends by replacing the snapshot whole: readers never wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from orchestrator.artifacts.local_protocol import cached_local_protocol_version
from orchestrator.connectors.base import ConnectOptions
from orchestrator.connectors.tunnel import target_of
from orchestrator.core.errors import RpcfleetError
from orchestrator.core.log import get_logger
from orchestrator.engine.executor import DEFAULT_FORKS, HostContext, Session, StepOutcome
from orchestrator.engine.runtime import LoopThread
from orchestrator.engine.shared import gather_bounded
from orchestrator.facts.base import Fact, gather
from orchestrator.inventory.model import Host
from orchestrator.observe.snapshot import (
    CacheView,
    DeviceView,
    Event,
    FormationView,
    NodeView,
    Point,
    Snapshot,
    changes,
    formation_changes,
)
from orchestrator.operations.cache import cache_path
from orchestrator.operations.server.state import (
    STATE_TIMEOUT,
    NodeState,
    classify,
    needs_probe,
    node_facts,
    node_state_from_facts,
)
from orchestrator.operations.stale import find_stale
from orchestrator.probe.capacity import DeviceCapacity, fleet_capacity
from orchestrator.probe.host import HostFacts, probe_facts
from orchestrator.rpc.client import probe_endpoint
from orchestrator.rpc.records import Outcome, ProbeResult, ProtocolVersion

DEFAULT_INTERVAL = 15.0
HISTORY_SECONDS = 600.0  # the page's requests and tokens/s go back this far
MAX_EVENTS = 50
HOLDING = frozenset({"loading", "ready", "degraded", "draining"})  # a formation's nodes hold its worker


@dataclass(frozen=True)
class CacheUsageFact(Fact[CacheView | None]):
    """Bytes and files in the node's tensor cache, counted on the node (None: unreadable)."""

    path: str  # a shell word (`operations.cache.cache_path`)
    name = "cache_usage"

    def command(self) -> str:
        return (
            f'D={self.path}; [ -d "$D" ] || exit 3; '
            "find \"$D\" -maxdepth 1 -type f -printf '%s\\n' | awk '{n++; s+=$1} END {print n+0, s+0}'"
        )

    def parse(self, stdout: str, stderr: str, exit_status: int) -> CacheView | None:
        if exit_status == 3:  # no cache folder (no server ever ran with `-c`): an empty cache
            return CacheView(bytes=0, files=0)
        words = stdout.split()
        if exit_status != 0 or len(words) != 2 or not all(w.isdigit() for w in words):
            return None
        return CacheView(bytes=int(words[1]), files=int(words[0]))


@dataclass(frozen=True)
class NodeRead:
    """What one round read over a node's SSH connection."""

    state: NodeState
    facts: HostFacts | None
    stale: tuple[str, ...]
    cache: CacheView | None


def cache_view(host: Host, cache: CacheView | None) -> CacheView | None:
    """A cache read on `host`, named by its install: the servers of one install share its folder."""
    if cache is None:
        return None
    address, port, install_dir = host.install_key
    return replace(
        cache, host=host.node_name, install_dir=install_dir, install=f"{address}:{port}:{install_dir}"
    )


def device_view(d: DeviceCapacity, measured_at: float) -> DeviceView:
    """What the exporter shows of a probed device, `total_share` with it (free's like-for-like total)."""
    return DeviceView(
        d.index, d.name, d.description, d.kind, d.total, d.free, d.usable, 0, measured_at, d.total_share
    )


class Collector:
    """Probes `hosts` every `interval` seconds in a thread; `snapshot` is the last complete round's."""

    def __init__(
        self,
        hosts: Sequence[Host],
        *,
        interval: float = DEFAULT_INTERVAL,
        timeout: float = 3.0,
        forks: int | None = None,
        formations: Callable[[], Sequence[FormationView]] = tuple,
        trust_rpc_memory: bool = False,
        cache: bool = True,
        events: Callable[[], Sequence[Event]] = tuple,
    ) -> None:
        """`events`: whoever serves tells its own events (on-demand loads, unloads): those since the
        last call, added to the page's at each round."""
        if interval <= 0 or timeout <= 0:
            raise ValueError("interval and timeout must be positive")
        self.hosts = list(hosts)
        self.interval = interval
        self.timeout = timeout
        self.forks = forks or DEFAULT_FORKS
        self.formations = formations
        self.news = events
        self.trust_rpc_memory = trust_rpc_memory
        self.cache = cache
        self.snapshot = Snapshot(0.0, interval)  # replaced whole by each round (one reference: atomic)
        self.first_round = threading.Event()
        self._last_ok: dict[str, ProbeResult] = {}  # endpoint -> its last OK full RPC reading
        self._measured: dict[str, float] = {}
        self._events: deque[Event] = deque(maxlen=MAX_EVENTS)
        self._history: deque[Point] = deque()
        self._session: Session | None = None
        self._runner: LoopThread | None = None
        self._rounds: Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stopping = False

    # -- the rounds
    def start(self) -> None:
        """The rounds on a loop thread of the runtime's, until `stop` (for a caller whose own loop does
        not run yet, or never: serve waits for the first round before its server starts)."""
        self._runner = LoopThread("observe")
        self._rounds = self._runner.submit(self.run())

    def stop(self) -> None:
        """End the rounds (from any thread); with `start`'s thread, wait for them to close their
        connections."""
        self._stopping = True
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(stop.set)
        runner, rounds = self._runner, self._rounds
        if runner is not None and rounds is not None:
            with contextlib.suppress(BaseException):  # a round's end is logged by `run`
                rounds.result(self.timeout * 4 + 5)
            runner.stop()

    async def run(self) -> None:
        """One round every `interval` on the running loop, until `stop`; the connections closed at the end."""
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        if self._stopping:  # stopped before the rounds began
            self._stop.set()
        started = time.monotonic()
        ticks = 0
        try:
            while not self._stop.is_set():
                try:
                    await self.round()
                except Exception as exc:  # a round's bug must not end the loop: the next round retries
                    get_logger().warning("observe_round_failed", error=repr(exc))
                self.first_round.set()
                # A fixed grid: a slow round skips ticks instead of drifting.
                ticks = max(ticks + 1, int((time.monotonic() - started) / self.interval) + 1)
                delay = started + ticks * self.interval - time.monotonic()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), max(0.0, delay))
        finally:
            await self.close()

    async def close(self) -> None:
        """Close the SSH connections the rounds keep open (the loop does it when stopped)."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    # -- one round
    async def round(self) -> Snapshot:
        """Probe the fleet once and replace the snapshot."""
        began = time.monotonic()
        formations = tuple(self.formations())
        held = {ep for f in formations if f.state in HOLDING for ep in f.nodes}
        held |= {ep for f in formations for ep in f.probes_itself}
        if self._session is None:
            self._session = Session(forks=self.forks, options=ConnectOptions(connect_timeout=self.timeout))
        session = self._session
        run = await session.run(self.hosts, self._read_step, name="observe")
        reads: dict[str, NodeRead | None] = {}
        ssh: dict[str, bool] = {}
        for result in run.results:
            reads[result.host.name] = result.value if result.succeeded else None
            ssh[result.host.name] = result.status != "unreachable"
        if not all(r.succeeded for r in run.results):  # a failed connect sticks to a session: reopen
            self._session = None
            await session.close()
        client = cached_local_protocol_version()
        probes = await self._rpc_round(reads, held, client)
        now = time.time()
        nodes = self._nodes(reads, ssh, probes, now)
        before = self.snapshot
        events = changes(before.nodes, nodes, now) + formation_changes(before.formations, formations, now)
        events = sorted([*events, *self.news()], key=lambda e: e.at)
        self._events.extend(events)
        self._history.append(
            Point(now, sum(f.request_count for f in formations), sum(f.completion_tokens for f in formations))
        )
        while self._history and self._history[0].at < now - HISTORY_SECONDS:
            self._history.popleft()
        self.snapshot = Snapshot(
            at=now,
            interval=self.interval,
            nodes=nodes,
            formations=formations,
            events=tuple(self._events),
            history=tuple(self._history),
            round_seconds=time.monotonic() - began,
            rounds=before.rounds + 1,
        )
        return self.snapshot

    async def _read_step(self, ctx: HostContext) -> StepOutcome[NodeRead]:
        """The server's state (as `status` reads it), the probe's host facts and the cache's usage, in
        one round trip; the stale-client proof when a client holds the server."""
        conn = await ctx.connection()
        host = ctx.host
        facts: dict[str, Fact[Any]] = {f.name: f for f in node_facts(host)}
        facts |= {f.name: f for f in probe_facts(host) if f.name not in facts}  # `ss` clients: once
        if self.cache:
            facts[CacheUsageFact.name] = CacheUsageFact(cache_path(host))
        values = await gather(conn, list(facts.values()), timeout=min(STATE_TIMEOUT, self.timeout * 2))
        state = node_state_from_facts(host.name, values, host.supervisor)
        stale: tuple[str, ...] = ()
        if state.service.ours and state.service.clients:  # busy, unless every client is proven gone
            stale = tuple(c.peer for c in await find_stale(conn, host))
        read = NodeRead(state, HostFacts.from_values(values), stale, values.get(CacheUsageFact.name))
        return StepOutcome(read, message="read")

    async def _rpc_round(
        self, reads: dict[str, NodeRead | None], held: set[str], client: ProtocolVersion
    ) -> dict[str, ProbeResult | None]:
        """A full RPC probe of each distinct endpoint whose server runs with no client (None: not probed)."""
        chosen: dict[str, Host] = {}
        for host in self.hosts:
            read = reads.get(host.name)
            if host.endpoint in held or host.binds_own_loopback:
                continue
            if read is not None and not needs_probe(read.state):
                continue  # stopped, crashed, or serving a client: nothing to ask it, or not now
            chosen.setdefault(host.endpoint, host)

        async def one(host: Host) -> ProbeResult:
            try:
                target = await target_of(host)
            except RpcfleetError as exc:
                return ProbeResult(
                    host.endpoint, Outcome.REFUSED, None, (), f"SSH forward: {exc.message}", 0.0
                )
            return await probe_endpoint(
                target,
                expected=client,
                connect_timeout=self.timeout,
                read_timeout=self.timeout,
                deadline=self.timeout,
            )

        results = await gather_bounded([functools.partial(one, h) for h in chosen.values()], self.forks)
        return dict(zip(chosen, results, strict=True))

    def _nodes(
        self,
        reads: dict[str, NodeRead | None],
        ssh: dict[str, bool],
        probes: dict[str, ProbeResult | None],
        now: float,
    ) -> tuple[NodeView, ...]:
        for endpoint, result in probes.items():
            if result is not None and result.outcome is Outcome.OK:
                self._last_ok[endpoint] = result
                self._measured[endpoint] = now
        rows: list[tuple[Host, ProbeResult, HostFacts | None]] = []
        for host in self.hosts:
            read = reads.get(host.name)
            known = self._last_ok.get(host.endpoint)
            fresh = probes.get(host.endpoint)
            use = fresh if fresh is not None and fresh.outcome is Outcome.OK else None
            if use is None and known is not None:
                # Busy, down or unreachable: the device is still there. Its last reading (its age in
                # `measured_at`), the CPU memory refreshed from the host's MemAvailable when read.
                use = known
            empty = ProbeResult(host.endpoint, Outcome.REFUSED, None, (), "not probed", 0.0)
            rows.append((host, use or empty, read.facts if read is not None else None))
        capacities = fleet_capacity(rows, trust_rpc_memory=self.trust_rpc_memory)
        nodes = []
        for (host, used, _), devices in zip(rows, capacities, strict=True):
            read = reads.get(host.name)
            fresh = probes.get(host.endpoint)
            measured = self._measured.get(host.endpoint, 0.0)
            views = tuple(device_view(d, measured) for d in devices if used.outcome is Outcome.OK)
            if read is None:
                state, message, version, protocol, restarts, pid = (
                    "unknown",
                    "SSH unreachable",
                    None,
                    None,
                    None,
                    None,
                )
                if fresh is not None:
                    protocol = str(fresh.version) if fresh.version else None
                    message = f"SSH unreachable; RPC {fresh.outcome.value}: {fresh.message}".rstrip(": ")
            else:
                status = classify(host, read.state, fresh, read.stale)
                state, message = status.state, status.message
                if state == "running" and fresh is None and not host.binds_own_loopback:
                    message = "not probed over RPC: a formation holds it or probes it itself"
                version, protocol = status.running_version or status.version, status.protocol
                restarts, pid = status.restarts, status.pid if read.state.service.ours else None
            nodes.append(
                NodeView(
                    host=host.name,
                    endpoint=host.endpoint,
                    ssh=ssh.get(host.name, False),
                    state=state,
                    probe=fresh.outcome.value if fresh is not None else "skipped",
                    message=message.splitlines()[0] if message else "",
                    version=version,
                    protocol=protocol,
                    restarts=restarts,
                    pid=pid,
                    devices=views,
                    cache=cache_view(host, read.cache) if read is not None else None,
                    probed_at=now,
                )
            )
        return tuple(nodes)
