"""The fleet as `serve` sees it: hosts → endpoints, probe and plan on the nodes that answer, and the
rolling restart of `restart --rolling` (the same playbook step, through the operations layer).

`endpoint_of` is the one place that turns a host into the endpoint the worker connects to: a transport
that forwards endpoints (an SSH tunnel) replaces that function and nothing else.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from orchestrator.connectors.tunnel import default_tunnels
from orchestrator.core.errors import PlanError, ProbeError
from orchestrator.core.log import get_logger
from orchestrator.engine.executor import DEFAULT_FORKS, Session
from orchestrator.inventory.model import Host
from orchestrator.llama.cache_prep import CachePrep, prepare_caches
from orchestrator.llama.worker import list_local_gpus
from orchestrator.operations.stale import release_stale_on
from orchestrator.planning.devices import to_plan_devices
from orchestrator.planning.placement import order_devices
from orchestrator.planning.plan import Plan, PlanDevice, PlanOptions
from orchestrator.planning.profile import ModelProfile, profile_model
from orchestrator.planning.strategy import make_plan
from orchestrator.playbooks.reader import rolling_restart_playbook
from orchestrator.playbooks.runner import run_playbook
from orchestrator.probe.fleet import FleetProbe, probe_fleet
from orchestrator.serve.forming import SparePool


def endpoint_of(host: Host) -> str:
    """The endpoint that names `host` in plans, health and errors (the only host → endpoint mapping of
    serve); with `rpc_transport: ssh` the worker dials a forward instead (`ServeFleet.dial_map`)."""
    return host.endpoint


def states_of(fleet: FleetProbe) -> dict[str, str]:
    """Endpoint -> probe state; an answering node whose memory is not measured is `unmeasured`."""
    return {n.endpoint: ("unmeasured" if n.ok and n.untrusted else n.state) for n in fleet.nodes}


@dataclass(frozen=True)
class PlanRound:
    """One probe and plan: the plan (None: nothing fits), the nodes by state, and its timings."""

    plan: Plan | None
    states: dict[str, str]  # endpoint -> probe state ("ok", "refused", "timeout", ...)
    probe_seconds: float
    plan_seconds: float
    reason: str = ""  # why there is no plan


@dataclass
class ServeFleet:
    """The selected hosts and how to probe and plan them. Every probe is bounded by `probe_timeout`."""

    hosts: Sequence[Host]
    model_path: str
    options: PlanOptions
    probe_timeout: float = 3.0
    facts: bool = True
    trust_rpc_memory: bool = False
    forks: int | None = None
    local_devices: list[str] | None = field(default_factory=list)
    # Servers no formation holds (`forming.SparePool`): one is taken when the model no longer fits here.
    spares: SparePool | None = None
    _profile: ModelProfile | None = None
    _local_gpus: list[PlanDevice] | None = None

    def local_gpus(self) -> list[PlanDevice]:
        """This machine's GPUs, listed once by a worker child (this process never loads libllama), and
        only when some are wanted. Once: a later listing would count serve's own worker's allocations
        as used memory."""
        if self.local_devices == []:
            return []
        if self._local_gpus is None:
            self._local_gpus = list_local_gpus()
        return self._local_gpus

    def dial_map(self) -> dict[str, str]:
        """Plan endpoint -> the endpoint the worker dials: SSH forwards for `rpc_transport: ssh` hosts,
        opened (or reopened, after a dropped tunnel) here; empty when every host is plain tcp."""
        return default_tunnels().mapping(self.hosts)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(endpoint_of(h) for h in self.hosts))

    def profile(self) -> ModelProfile:
        if self._profile is None:
            self._profile = profile_model(self.model_path)
        return self._profile

    def probe(self, hosts: Sequence[Host] | None = None) -> FleetProbe:
        """Probe `hosts` (default: every selected host) with the probe's own rules: bounded by the
        timeout, a server with a client is `busy` and is left alone."""
        return asyncio.run(
            probe_fleet(
                self.hosts if hosts is None else hosts,
                timeout=self.probe_timeout,
                facts=self.facts,
                forks=self.forks,
                trust_rpc_memory=self.trust_rpc_memory,
            )
        )

    def probe_released(self) -> FleetProbe:
        """Probe every host; a node held by a dead client of ours is released and probed again."""
        fleet = self.probe()
        busy = [h for h in self.hosts if any(n.host == h.name and n.state == "busy" for n in fleet.nodes)]
        if busy and self.release_stale(busy):  # a node held by a dead client of ours: usable again
            fleet = self.probe()
        return fleet

    def plan_round(self) -> PlanRound:
        """Probe every host; plan on those that answer `ok`. No plan when none answer or it does not fit."""
        started = time.monotonic()
        fleet = self.probe_released()
        probed = time.monotonic()
        states = states_of(fleet)
        devices = to_plan_devices(fleet, failed="skip")
        if not devices:
            return self.with_spare() or PlanRound(None, states, probed - started, 0.0, "no node answers")
        try:
            plan = make_plan(
                order_devices(devices, self.local_gpus(), self.local_devices), self.profile(), self.options
            )
        except (PlanError, ProbeError) as exc:
            return PlanRound(None, states, probed - started, time.monotonic() - probed, exc.message)
        planned = time.monotonic() - probed
        if not plan.fit.fits:
            return self.with_spare() or PlanRound(
                None,
                states,
                probed - started,
                planned,
                f"the model does not fit on {len(plan.endpoints)} node(s)",
            )
        return PlanRound(plan, states, probed - started, planned)

    def with_spare(self) -> PlanRound | None:
        """A plan with one more server, a spare no formation holds (None: no spare left)."""
        spare = self.spares.take() if self.spares is not None else None
        if spare is None:
            return None
        get_logger().info("serve_spare_taken", spare=endpoint_of(spare))
        self.hosts = [*self.hosts, spare]
        return self.plan_round()

    def watch(self, endpoints: Sequence[str]) -> dict[str, str]:
        """The probe states of `endpoints` only (serve's watch of the nodes it does not use). A busy one
        held by a dead worker of ours (a cut link hid its reset) is released first, as `plan_round` does:
        nothing else would ever free it."""
        hosts = [h for h in self.hosts if endpoint_of(h) in endpoints]
        if not hosts:
            return {}
        fleet = self.probe(hosts)
        busy = [h for h in hosts if any(n.host == h.name and n.state == "busy" for n in fleet.nodes)]
        if busy and self.release_stale(busy):
            fleet = self.probe(hosts)
        return states_of(fleet)

    def release_stale(self, hosts: Sequence[Host]) -> list[str]:
        """Close the connections of `hosts`' servers whose client is proven gone (a worker of this
        controller that died while a cut link hid its reset, `operations.stale`); returns the closed."""
        closed = asyncio.run(release_stale_on(hosts, forks=self.forks))
        if closed:
            get_logger().info("serve_stale_closed", closed=closed)
        return closed

    def prepare_cache(self, plan: Plan) -> CachePrep | None:
        """Before loading `plan`: refuse a truncated cache file it would read (LoaderError naming the
        host) and warm the misses of the `rpc_cache` hosts when two nodes or more lack files."""

        async def go() -> CachePrep | None:
            async with Session(forks=self.forks or DEFAULT_FORKS) as session:
                prep, _ = await prepare_caches(session, self.hosts, plan, self.model_path)
                return prep

        return asyncio.run(go())

    def rolling_restart(self, *, serial: int = 1, force: bool = False) -> list[str]:
        """`restart --rolling` on the selected hosts; returns the failures (host: message), empty when
        every node restarted."""

        async def go() -> list[str]:
            playbook = rolling_restart_playbook(serial=serial, max_fail_percentage=0.0, force=force)
            async with Session(forks=self.forks or DEFAULT_FORKS) as session:
                result = await run_playbook(playbook, list(self.hosts), session=session)
            failed = []
            for step_run in result.steps:
                failed += [
                    f"{r.host.name}: {r.message}" for r in step_run.run.results if r.status == "failed"
                ]
            return failed

        return asyncio.run(go())
