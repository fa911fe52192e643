"""The fleet a formation of `serve` runs on (`serve.fleet.FormationFleet`): hosts → endpoints, probe and
plan on the nodes that answer (`plan_for_fleet`, `probe_hosts`, `prepare_load` and `fleet_targets`), and
the rolling restart of `restart --rolling` (the same operation, in batches of one).

Every probe, plan and cache check of serve's life runs on the serving loop over one `SharedSession`: the
SSH connections of the first probe are those of every later round (a host's is opened anew once it
failed, so a node that comes back is reached again).

`endpoint_of` is the one place that turns a host into the endpoint the worker connects to: a transport
that forwards endpoints (an SSH tunnel) replaces that function and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from orchestrator.caches.prep import CachePrep
from orchestrator.connectors.base import ConnectOptions
from orchestrator.core.log import get_logger
from orchestrator.core.target import Target
from orchestrator.engine.executor import DEFAULT_FORKS, Session
from orchestrator.inventory.model import Host
from orchestrator.llama.worker.parent import list_local_gpus
from orchestrator.operations.layer import OperationOptions
from orchestrator.operations.restart import make_restart_step
from orchestrator.planning.devices import to_plan_devices
from orchestrator.planning.draft import DraftModel
from orchestrator.planning.plan import Plan, PlanDevice, PlanOptions
from orchestrator.planning.profile import ModelProfile, profile_model
from orchestrator.planning.recovery import Attempt, next_spare
from orchestrator.probe.fleet import FleetProbe
from orchestrator.probe.settings import DEFAULT_TIMEOUT
from orchestrator.serve.pool import SparePool
from orchestrator.workflows.fit import SERVE_WORDS
from orchestrator.workflows.load import fleet_targets, prepare_load
from orchestrator.workflows.options import ProbeSettings
from orchestrator.workflows.plan import PlanRound, plan_for_fleet, probe_hosts, states_of


def endpoint_of(host: Host) -> str:
    """The endpoint that names `host` in plans, health and errors (the only host → endpoint mapping of
    serve); with `rpc_transport: ssh` the engine dials a forward instead (`ServeFleet.targets`)."""
    return host.endpoint


class SharedSession:
    """One executor session for serve's whole life (made on first use, on the serving loop): its probes,
    plans, cache checks and rolling restarts share its SSH connections."""

    def __init__(self, forks: int | None, connect_timeout: float) -> None:
        self.forks = forks or DEFAULT_FORKS
        self.connect_timeout = connect_timeout
        self._session: Session | None = None

    def get(self) -> Session:
        if self._session is None:
            options = ConnectOptions(connect_timeout=self.connect_timeout)
            self._session = Session(forks=self.forks, options=options)
        return self._session

    async def settle(self, hosts: Sequence[Host], states: dict[str, str]) -> None:
        """After a probe: the connections of the hosts that did not answer are dropped (a failed connect
        sticks to a session), so the next round connects to them anew."""
        if self._session is None:
            return
        for host in hosts:
            if states.get(endpoint_of(host)) not in ("ok", "busy"):
                await self._session.drop(host)

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


@dataclass
class ServeFleet:
    """The selected hosts and how to probe and plan them. Every probe is bounded by `probe_timeout`."""

    hosts: Sequence[Host]
    model_path: str
    options: PlanOptions
    probe_timeout: float = DEFAULT_TIMEOUT
    facts: bool = True
    trust_rpc_memory: bool = False
    forks: int | None = None
    local_devices: list[str] | None = field(default_factory=list)
    # Servers no formation holds (`pool.SparePool`): one is taken when the model no longer fits here.
    spares: SparePool | None = None
    # The spares this formation took (`with_spare`): given back once it fits on its own nodes again.
    borrowed: list[Host] = field(default_factory=list)
    # The connections every formation's rounds share (copies of a fleet share its session).
    shared: SharedSession | None = None
    _profile: ModelProfile | None = None
    draft: DraftModel | None = None  # speculative decoding's draft, planned with the model each round
    _local_gpus: list[PlanDevice] | None = None

    def __post_init__(self) -> None:
        if self.shared is None:
            self.shared = SharedSession(self.forks, self.probe_timeout)

    @property
    def session(self) -> Session:
        assert self.shared is not None
        return self.shared.get()

    def local_gpus(self) -> list[PlanDevice]:
        """This machine's GPUs, listed once by a worker child (this process never loads libllama), and
        only when some are wanted. Once: a later listing would count serve's own worker's allocations
        as used memory."""
        if self.local_devices == []:
            return []
        if self._local_gpus is None:
            self._local_gpus = list_local_gpus()
        return self._local_gpus

    def targets(self) -> dict[str, Target]:
        """Plan endpoint -> its target, what the engine dials (`workflows.load.fleet_targets`)."""
        return fleet_targets(self.hosts)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(endpoint_of(h) for h in self.hosts))

    def profile(self) -> ModelProfile:
        if self._profile is None:
            self._profile = profile_model(self.model_path)
        return self._profile

    @property
    def probe_settings(self) -> ProbeSettings:
        return ProbeSettings(self.probe_timeout, self.facts, self.forks, self.trust_rpc_memory)

    async def probe(self, hosts: Sequence[Host] | None = None) -> FleetProbe:
        """Probe `hosts` (default: every selected host) with the probe's own rules: bounded by the
        timeout, a server with a client is `busy` and is left alone."""
        hosts = self.hosts if hosts is None else hosts
        probe = await probe_hosts(hosts, self.probe_settings, session=self.session)
        assert self.shared is not None
        await self.shared.settle(hosts, states_of(probe))
        return probe

    async def plan_round(self, *, spare: bool = True) -> PlanRound:
        """Probe every host; plan on those that answer `ok` (a server still held by a dead engine of
        ours is `busy` until its keepalive drops that connection). No fitting plan (`fitting` None) when
        none answer or it does not fit: then a spare, when there is one (and `spare`), joins and the
        round is made again."""
        round_ = await plan_for_fleet(
            self.hosts,
            self.profile(),
            self.options,
            probe=self.probe_settings,
            local_devices=self.local_devices,
            local_gpus=self.local_gpus,
            failed="skip",
            words=SERVE_WORDS,
            session=self.session,
            draft=self.draft,
        )
        assert self.shared is not None
        await self.shared.settle(self.hosts, round_.states)
        if spare:  # the recovery rule the report's N-1 follows too: none answers or it does not fit
            attempt = Attempt(round_.plan, round_.error.message if round_.error is not None else None)
            chosen = next_spare(attempt, self.spares.snapshot() if self.spares is not None else [])
            if chosen is not None:
                return await self.with_spare(chosen) or round_
        return round_

    async def with_spare(self, spare: Host) -> PlanRound | None:
        """A plan with one more server, `spare` (`recovery.next_spare`'s choice), taken from the pool
        (None: it is no longer free)."""
        if self.spares is None or not self.spares.take_this(spare):
            return None
        get_logger().info("serve_spare_taken", spare=endpoint_of(spare))
        self.hosts = [*self.hosts, spare]
        self.borrowed.append(spare)
        return await self.plan_round()

    def lay_down_borrowed(self) -> list[Host]:
        """The spares this formation took, out of its hosts (not yet back in the pool: `give_back`, or
        `keep_borrowed` to take them again)."""
        borrowed, self.borrowed = self.borrowed, []
        gone = {h.endpoint for h in borrowed}
        self.hosts = [h for h in self.hosts if h.endpoint not in gone]
        return borrowed

    def keep_borrowed(self, hosts: Sequence[Host]) -> None:
        self.hosts = [*self.hosts, *hosts]
        self.borrowed += hosts

    def give_back(self, hosts: Sequence[Host]) -> None:
        """Spares laid down, back in the pool (free for the next loss, or for a new formation)."""
        if hosts and self.spares is not None:
            get_logger().info("serve_spare_given_back", spares=[endpoint_of(h) for h in hosts])
            self.spares.put(hosts)

    async def probe_spares(self, hosts: Sequence[Host]) -> tuple[dict[str, str], list[PlanDevice]]:
        """Probe free spares: their states and the devices of those that answer."""
        probe = await self.probe(hosts)
        return states_of(probe), to_plan_devices(probe, failed="skip")

    async def watch(self, endpoints: Sequence[str]) -> dict[str, str]:
        """The probe states of `endpoints` only (serve's watch of the nodes it does not use). One held by
        a dead engine of ours (a cut link hid its reset) stays `busy` until the server's keepalive drops
        that connection (about 30 s)."""
        hosts = [h for h in self.hosts if endpoint_of(h) in endpoints]
        if not hosts:
            return {}
        return states_of(await self.probe(hosts))

    async def prepare_cache(self, plan: Plan) -> CachePrep | None:
        """Before loading `plan`: refuse a truncated cache file it would read (LoaderError naming the
        host) and warm the misses of the `rpc_cache` hosts when two nodes or more lack files."""
        return (await prepare_load(self.session, self.hosts, plan, self.model_path)).cache

    async def rolling_restart(self, *, serial: int = 1, force: bool = False) -> list[str]:
        """`restart --rolling` on the selected hosts; returns the failures (host: message), empty when
        every node restarted."""
        step = make_restart_step(OperationOptions(force=force))
        run = await self.session.run(
            list(self.hosts), step, name="restart", serial=serial, max_fail_percentage=0.0
        )
        return [f"{r.host.name}: {r.message}" for r in run.results if r.status == "failed"]
