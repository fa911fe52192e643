"""`serve_fleet`: the use case of `rpcfleet serve`, its whole start and life in flow order: read the models
(their GGUF headers and chat templates, so a bad file fails before anything starts), read the hosts, probe
once and plan the formations (`planning.formations`), start each formation's engine (llama-server on its
plan, `serve.formation`), serve the OpenAI API in front of them (`serve.app`, on the command's one loop) with
the fleet exporter beside it; while it serves, each formation watches its engine and recovers from a lost
node, takes nodes back (rejoin), reloads on SIGHUP, and the spare watch grows new formations.

The front end gives a typed `ServeRequest` and `ServeEvents` for what it shows, and prints the
`ServeOutcome`; it holds no orchestration of its own."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.core import signals
from orchestrator.core.errors import InputError, PlanError, UsageError
from orchestrator.core.log import get_logger
from orchestrator.core.poll import poll_async
from orchestrator.engine.children import socket_access_denied
from orchestrator.engine.runtime import run_once
from orchestrator.facts.system import parse_meminfo
from orchestrator.inventory.model import Host, Inventory, select_servers
from orchestrator.observe.prometheus import RequestTimes
from orchestrator.planning.devices import to_plan_devices
from orchestrator.planning.draft import DraftModel, vocab_mismatch
from orchestrator.planning.formations import Formations, PlannedFormation, ServedModel
from orchestrator.planning.profile import ModelProfile, profile_model, read_vocab
from orchestrator.planning.settings import DRAFT_DEVICES, DRAFT_N_MAX, DRAFT_N_MIN
from orchestrator.serve.demand import Demand
from orchestrator.serve.engine import EngineFactory, default_engines
from orchestrator.serve.formation import Formation, FormationHooks, Roster
from orchestrator.serve.keys import KeyRing, exposed, read_keys_file
from orchestrator.serve.models_file import ModelEntry, parse_models_file
from orchestrator.serve.news import News, ServeEvent
from orchestrator.serve.on_demand import OnDemand
from orchestrator.serve.pool import SparePool
from orchestrator.serve.router import Router
from orchestrator.serve.spares import SpareWatch
from orchestrator.serve.states import FormationState, ServeConfig
from orchestrator.serve.templates import ChatTemplate, model_chat_template
from orchestrator.serve.upstream import Upstream
from orchestrator.workflows.plan import plan_formations, states_of
from orchestrator.workflows.serving import ServeFleet

if TYPE_CHECKING:
    from uvicorn import Server

    from orchestrator.llama.worker.load_progress import LoadProgress
    from orchestrator.observe.web import Exporter
    from orchestrator.planning.plan import Plan, PlanDevice, PlanOptions
    from orchestrator.workflows.options import ProbeSettings


@dataclass(frozen=True)
class ServeRequest:
    """What `rpcfleet serve` was asked, parsed once: the models (-m files, a --models file, the one
    model's API name), how to read the hosts, how to plan and probe, the formations wanted (`replicas`:
    "auto", a number, or "split"), the socket bound for the API, its keys, and the serving limits
    (`limits`: each formation's `ServeConfig`, its `parallel` from its model's plan options)."""

    model_paths: Sequence[Path]
    models_file: Path | None
    model_name: str | None
    hosts: Callable[[], tuple[Inventory, list[Host]]]
    options: PlanOptions
    probe: ProbeSettings
    local_devices: Sequence[str] | None
    replicas: str
    listen: socket.socket
    host: str
    port: int
    api_key: str | None = None
    admin_key: str | None = None
    keys_file: Path | None = None  # per-user keys (`serve.keys`), in place of the two keys above
    chat_template: str | None = None
    limits: ServeConfig = field(default_factory=ServeConfig)
    reload_rolling: bool = False
    observe_interval: float = 15.0
    draft: SpeculativeRequest | None = None  # --draft: each model's draft unless its entry names one


@dataclass(frozen=True)
class SpeculativeRequest:
    """serve's speculative decoding flags: the draft model (None: none unless a models-file entry names
    one), llama-server's draft lengths, and where the draft goes ("none": this machine's CPU)."""

    draft: Path | None = None
    n_max: int = DRAFT_N_MAX
    n_min: int = DRAFT_N_MIN
    device: str = DRAFT_DEVICES[0]


@dataclass(frozen=True)
class Loaded:
    """A formation serving after a load: its name (None when it is the only one), its state, its nodes,
    the phases' seconds (the first load also the probe's and the plan's), bytes from the nodes' caches."""

    formation: str | None
    state: str
    nodes: int
    phases: dict[str, float]
    cache_hits: int


@dataclass(frozen=True)
class ServeEvents:
    """What the front end is told (each optional): a warning before serving, the formations chosen (with
    the URL), each load's progress while one formation loads, and each load's end."""

    warning: Callable[[str], None] | None = None
    # the formations chosen, the API's URL and the on-demand models
    formed: Callable[[Sequence[PlannedFormation], str, Sequence[str]], None] | None = None
    progress: Callable[[LoadProgress], None] | None = None
    loaded: Callable[[Loaded], None] | None = None
    engine_build: Callable[[str], None] | None = None  # llama-server's build, when it is built first
    news: Callable[[ServeEvent], None] | None = None  # an on-demand load, unload, swap; a resumed request


@dataclass
class Ending:
    """Ends serving once every formation of `roster` (the router's) has given up recovering (the others
    still serve). `stop`: the HTTP server's stop, once it is made (after the formations, which tell this
    when they give up)."""

    roster: Roster
    stop: Callable[[], None] | None = None

    def formation_failed(self, _formation: Formation) -> None:
        if self.stop is not None and self.failed():
            self.stop()

    def failed(self) -> bool:
        return all(f.state == FormationState.FAILED for f in self.roster.formations)


@dataclass(frozen=True)
class ServeOutcome:
    """How serving ended: `failed` when every formation gave up recovering (`reasons` says why each)."""

    failed: bool
    reasons: str = ""


def read_models(request: ServeRequest) -> list[ModelEntry]:
    """The models to serve: the -m files, then the --models file's (errors name the file and line)."""
    entries = [ModelEntry(path) for path in request.model_paths]
    if request.models_file is not None:
        try:
            text = request.models_file.read_text()
        except OSError as exc:
            raise UsageError(f"--models {request.models_file}: {exc.strerror}") from None
        entries += parse_models_file(request.models_file, text)
    if not entries:
        raise UsageError("no model to serve", hint="give -m FILE (several: one per model) or --models FILE")
    if request.model_name is not None:
        if len(entries) > 1:
            raise UsageError("--model-name names one model; name several in a --models file")
        entries[0] = ModelEntry(entries[0].model, name=request.model_name)
    names: dict[str, Path] = {}
    for entry in entries:
        name = entry.name or entry.model.stem
        if name in names:
            raise UsageError(
                f"two models named {name!r} ({names[name]} and {entry.model})",
                hint="name them in a --models file (name: ...)",
            )
        names[name] = entry.model
    return entries


def serve_fleet(request: ServeRequest, events: ServeEvents) -> ServeOutcome:
    """Serve until interrupted (outcome not failed), or until every formation gave up (failed)."""
    entries = read_models(request)
    ring = read_keys(request, [entry.name or entry.model.stem for entry in entries], events)
    profiles, templates = read_profiles(request, entries)
    drafts = read_drafts(request, entries)
    inventory, hosts = request.hosts()
    if not hosts:
        raise UsageError("no hosts selected")
    served = [
        dataclasses.replace(served_model(request, inventory, hosts, entry, profile), draft=draft)
        for entry, profile, draft in zip(entries, profiles, drafts, strict=True)
    ]
    whole = ServeFleet(
        hosts,
        served[0].path,
        request.options,
        probe_timeout=request.probe.timeout,
        facts=request.probe.facts,
        trust_rpc_memory=request.probe.trust_rpc_memory,
        forks=request.probe.forks,
        local_devices=None if request.local_devices is None else list(request.local_devices),
    )
    whole.local_gpus()  # listed once, by a worker child, before the loop runs
    return run_once(life(request, events, served, templates, hosts, whole, ring))  # serve's one loop


def read_keys(request: ServeRequest, models: Sequence[str], events: ServeEvents) -> KeyRing | None:
    """The per-user keys (None: no --keys), read before anything starts: a bad line is exit 2 naming the
    file and line. A file that holds keys in clear and that others may read is a warning, not a refusal:
    mounted secrets (Kubernetes' default mode 0644, Docker's) are readable so inside a one-user container,
    where refusing would only stop serve."""
    if request.keys_file is None:
        return None
    if request.reload_rolling:
        raise UsageError(
            "--reload-rolling is a SIGHUP reload's, and with --keys SIGHUP re-reads the keys",
            hint='reload with POST /admin/reload {"rolling_restart": true} and an admin-scoped key',
        )
    keys = read_keys_file(request.keys_file, models)
    why = exposed(keys)
    if why is not None:
        get_logger().warning("serve_keys_exposed", path=str(keys.path))
        if events.warning is not None:
            events.warning(why)
    return KeyRing(keys)


def reload_keys(ring: KeyRing, models: Sequence[str]) -> bool:
    """Re-read the keys file (SIGHUP with --keys): the new keys replace the old ones whole; a bad file is
    logged with its file and line and the keys in force stay (nothing half-changed)."""
    path = ring.keys.path
    try:
        keys = read_keys_file(path, models)
    except UsageError as exc:
        get_logger().error("serve_keys_reload_refused", error=exc.message, kept=len(ring.keys.entries))
        return False
    ring.keys = keys
    get_logger().warning(  # the answer to the operator's SIGHUP: shown at the default level
        "serve_keys_reloaded", path=str(path), keys=[entry.name for entry in keys.entries]
    )
    if exposed(keys) is not None:
        get_logger().warning("serve_keys_exposed", path=str(path))
    return True


async def life(
    request: ServeRequest,
    events: ServeEvents,
    served: list[ServedModel],
    templates: list[ChatTemplate],
    hosts: list[Host],
    whole: ServeFleet,
    ring: KeyRing | None = None,
) -> ServeOutcome:
    """Everything from the first probe on, on one loop: one SSH session (`whole.shared`) and one HTTP
    client to the engines (`http`) for serve's whole life, closed at its end."""
    http = Upstream()
    try:
        first = await first_round(request, served, hosts, whole)
        warn(request, served, templates, events)
        maker = FormationMaker(request, events, served, templates, whole, first, http)
        formations = [
            maker.make(
                one, one.model.name if not maker.several else one.choice.name, first.times, local=i == 0
            )
            for i, one in enumerate(first.formed)
        ]
        on_demand = [model for model in served if model.on_demand]

        def demand(router: Router) -> OnDemand:
            return on_demand_loads(router, maker, on_demand, hosts, whole, first.devices)

        times = RequestTimes() if request.observe_interval else None  # the exporter's histograms
        loads = demand if on_demand else None
        news = News(events.news)
        router = make_router(
            request, served, formations, maker.spares, http, maker.roster, loads, times, news
        )
        watch = spare_watch(request, router, maker, [] if on_demand else served, whole)
        return await run_formations(
            request, router, watch, hosts, first.formed, events, maker.ending, ring, times
        )
    finally:
        assert whole.shared is not None
        await whole.shared.close()
        await http.aclose()


@dataclass(frozen=True)
class FirstRound:
    """serve's first probe of every server and the formations chosen from it: the formations to load and
    the spares, each endpoint's probe state, the devices found, and the probe's and plan's seconds."""

    formed: list[PlannedFormation]
    spares: tuple[Host, ...]
    states: dict[str, str]
    devices: list[PlanDevice]
    times: dict[str, float]


async def first_round(
    request: ServeRequest, served: Sequence[ServedModel], hosts: list[Host], whole: ServeFleet
) -> FirstRound:
    """One probe of every server, and the formations of the models loaded at start planned on it (a model
    that does not fit at start is an error, not a wait)."""
    started = time.monotonic()
    probe = await whole.probe()
    probe_seconds = time.monotonic() - started
    states = states_of(probe)
    devices = to_plan_devices(probe, failed="skip")
    at_start = loaded_at_start(served)
    try:
        chosen = (
            Formations((), tuple(hosts), request.replicas)
            if not at_start
            else plan_formations(
                at_start,
                hosts,
                [*devices, *whole.local_gpus()],
                request.replicas,
                local_devices=request.local_devices,
            )
        )
    except PlanError as exc:
        listed = ", ".join(f"{ep} {state}" for ep, state in states.items())
        raise PlanError(f"cannot serve: {exc.message} ({listed})", hint="rpcfleet plan shows why") from None
    times = {"probe": probe_seconds, "plan": time.monotonic() - started - probe_seconds}
    return FirstRound(list(chosen.formed), tuple(chosen.spares), states, devices, times)


class FormationMaker:
    """Makes serve's formations, at start and while it serves (the spare watch's, the on-demand loads'):
    each on its own hosts of the one fleet, with its model's engines, chat template and serving limits, and
    what it tells (`FormationHooks`) given when it is made. The engines are built here (llama-server on a
    fresh machine: its lines go to `engine_build`)."""

    def __init__(
        self,
        request: ServeRequest,
        events: ServeEvents,
        served: Sequence[ServedModel],
        templates: Sequence[ChatTemplate],
        whole: ServeFleet,
        first: FirstRound,
        http: Upstream,
    ) -> None:
        self.request, self.events, self.whole, self.states = request, events, whole, first.states
        self.engines = {model.name: engine_factory(request, model, events, http) for model in served}
        self.spares = SparePool(list(first.spares), order=whole.endpoints)
        self.several = len(first.formed) > 1 or any(model.on_demand for model in served)
        self.roster = Roster()  # the router's formations, each formation's peers
        self.ending = Ending(self.roster)
        # by name: a formation's model may be a copy of its entry (`loaded_at_start` sets replicas)
        self.templates = {model.name: template for model, template in zip(served, templates, strict=True)}

    def make(
        self,
        one: PlannedFormation,
        name: str,
        times: dict[str, float],
        *,
        local: bool = False,
        on_failed: Callable[[Formation], None] | None = None,
    ) -> Formation:
        """`one`'s formation under `name` (`times`: the probe's and plan's, for its first load's event;
        `local`: it may use this machine's GPUs). Loaded at start, its recovery giving up may end serve
        (`Ending`); on demand, a failed load is its model's (`on_failed`), never recovered."""
        whole = self.whole
        fleet = dataclasses.replace(
            whole,
            hosts=list(one.hosts),
            model_path=one.model.path,
            options=one.model.options,
            local_devices=whole.local_devices if local else [],
            spares=self.spares,
            borrowed=[],
            _profile=one.model.profile,
            draft=one.model.draft,
        )
        template = self.templates[one.model.name]
        reported = name if self.several or not times else None
        # one load's bars; several loads print a line each
        progress = self.events.progress if not self.several else None
        hooks = FormationHooks(
            on_failed=on_failed if one.model.on_demand else self.ending.formation_failed,
            on_progress=progress if times else None,
            on_loaded=loaded_reporter(reported, times, self.events),
        )
        formation = Formation(
            name,
            one.model.name,
            fleet,
            dataclasses.replace(self.request.limits, parallel=one.model.options.parallel),
            self.engines[one.model.name],
            hooks=hooks,
            peers=self.roster,
            template={"source": template.source, "warning": template.warning},
            recover_first_load=not one.model.on_demand,
        )
        formation.node_states({ep: self.states.get(ep, "unknown") for ep in fleet.endpoints})
        return formation


def on_demand_loads(
    router: Router,
    maker: FormationMaker,
    on_demand: Sequence[ServedModel],
    hosts: Sequence[Host],
    whole: ServeFleet,
    devices: Sequence[PlanDevice],
) -> OnDemand:
    """The on-demand models' loads and unloads, on the nodes left free at start (`devices`: what the first
    probe found on them)."""
    known: dict[str, list[PlanDevice]] = {}
    for device in devices:
        if device.endpoint is not None:
            known.setdefault(device.endpoint, []).append(device)
    return OnDemand(
        router,
        maker.spares,
        on_demand,
        hosts,
        whole.probe_spares,
        lambda one, name, failed: maker.make(one, name, {}, on_failed=failed),
        known,
    )


def spare_watch(
    request: ServeRequest,
    router: Router,
    maker: FormationMaker,
    growing: Sequence[ServedModel],
    whole: ServeFleet,
) -> SpareWatch:
    """A node silent at start (or a spare given back) that answers again makes a new formation when the
    answering spares hold a model of `growing`, served with --replicas auto (`serve.spares`); with
    on-demand models the free nodes are theirs (`growing` is empty)."""
    return SpareWatch(
        router,
        maker.spares,
        growing,
        whole.probe_spares,
        lambda one, name: maker.make(one, name, {}),  # the start's times are not its own
        request.limits.rejoin_interval,
    )


def loaded_at_start(served: Sequence[ServedModel]) -> list[ServedModel]:
    """The models loaded at start (not `load: on-demand`). Beside on-demand models, `--replicas auto`
    takes one formation, not every node: the nodes left are the on-demand models' pool."""
    if not any(model.on_demand for model in served):
        return list(served)
    return [
        dataclasses.replace(model, replicas=1) if model.replicas is None and not model.split else model
        for model in served
        if not model.on_demand
    ]


def read_profiles(
    request: ServeRequest, entries: Sequence[ModelEntry]
) -> tuple[list[ModelProfile], list[ChatTemplate]]:
    """Each model's GGUF profile and chat template (a file that is no model fails before the probe)."""
    profiles, templates = [], []
    for entry in entries:
        where = f"{request.models_file}:{entry.line}: " if entry.line is not None else ""
        if not entry.model.is_file():
            what = "does not exist" if not entry.model.exists() else "is not a file"
            raise UsageError(f"{where}model {entry.model} {what}")
        try:
            profiles.append(profile_model(entry.model))
        except UsageError as exc:
            raise UsageError(f"{where}{exc.message}") from None
        templates.append(model_chat_template(entry.model, request.chat_template))  # bad: exit 2
    return profiles, templates


def read_drafts(request: ServeRequest, entries: Sequence[ModelEntry]) -> list[DraftModel | None]:
    """Each model's draft for speculative decoding (its entry's `draft:`, else --draft; None: none), read
    before the probe: a draft that is no GGUF, or whose vocabulary llama-server would refuse for its model
    ("the target and draft vocabs are not compatible": it would start and never speculate), is exit 2
    naming it. A draft on this machine's CPU is planned against its available memory."""
    flags = request.draft or SpeculativeRequest()
    drafts: list[DraftModel | None] = []
    available: int | None = None
    for entry in entries:
        path = entry.draft or flags.draft
        if path is None:
            drafts.append(None)
            continue
        where = f"{request.models_file}:{entry.line}: " if entry.line is not None else ""
        if not path.is_file():
            what = "does not exist" if not path.exists() else "is not a file"
            raise UsageError(f"{where}draft model {path} {what}")
        try:
            profile = profile_model(path)
            mismatch = vocab_mismatch(read_vocab(entry.model), read_vocab(path))
        except InputError as exc:  # not a GGUF, or one rpcfleet cannot read
            raise UsageError(f"{where}draft model {exc.message}") from None
        if mismatch is not None:
            raise UsageError(
                f"{where}draft model {path} cannot draft for {entry.model}: {mismatch}",
                hint="llama-server speculates only with a draft of the model's own vocabulary",
            )
        n_max = entry.draft_max if entry.draft_max is not None else flags.n_max
        n_min = entry.draft_min if entry.draft_min is not None else flags.n_min
        if n_min > n_max:
            raise UsageError(f"{where}--draft-min {n_min} is more than --draft-max {n_max}")
        device = entry.device_draft or flags.device
        if device == "none" and available is None:
            available = host_available()
        drafts.append(DraftModel(profile, device, n_max, n_min, available))
    return drafts


def host_available() -> int | None:
    """This machine's available memory (MemAvailable), None when it cannot be read."""
    try:
        return parse_meminfo(Path("/proc/meminfo").read_text()).get("MemAvailable")
    except OSError:
        return None


def served_model(
    request: ServeRequest, inventory: Inventory, hosts: list[Host], entry: ModelEntry, profile: ModelProfile
) -> ServedModel:
    """A models-file or -m entry as a `ServedModel`: serve's flags where it sets nothing, its hosts among
    the selected ones (a pattern that selects none of them: exit 2, naming the line)."""
    return entry_model(
        entry, profile, inventory, hosts, request.options, request.replicas, request.models_file
    )


def entry_model(
    entry: ModelEntry,
    profile: ModelProfile,
    inventory: Inventory,
    hosts: list[Host],
    options: PlanOptions,
    replicas_flag: str,
    models_file: Path | None,
) -> ServedModel:
    """`served_model` from its parts: serve's and `report --models`' one rule for an entry (its context,
    parallel slots, replicas and hosts over the flags')."""
    where = f"{models_file}:{entry.line}: " if entry.line is not None else ""
    endpoints = None
    if entry.hosts is not None:
        try:
            picked = {h.endpoint for h in select_servers(inventory, entry.hosts)}
        except InputError as exc:  # a bad host pattern, or one that matches nothing
            raise UsageError(f"{where}hosts: {exc.message}") from None
        endpoints = tuple(h.endpoint for h in hosts if h.endpoint in picked)
        if not endpoints:
            raise UsageError(f"{where}hosts {entry.hosts!r} selects none of the selected servers")
    replicas: str | int = entry.replicas if entry.replicas is not None else replicas_flag
    return ServedModel(
        path=str(entry.model),
        name=entry.name or entry.model.stem,
        profile=profile,
        options=dataclasses.replace(
            options,
            n_ctx=entry.context if entry.context is not None else options.n_ctx,
            parallel=entry.parallel if entry.parallel is not None else options.parallel,
        ),
        replicas=int(replicas) if str(replicas).isdigit() else None,
        split=replicas == "split",
        endpoints=endpoints,
        on_demand=entry.on_demand,
        idle_unload=entry.idle_unload,
    )


def warn(
    request: ServeRequest,
    served: Sequence[ServedModel],
    templates: Sequence[ChatTemplate],
    events: ServeEvents,
) -> None:
    """The warnings before serving: a chat template guessed, and a link timeout that cannot be set."""
    if events.warning is None:
        return
    for model, template in zip(served, templates, strict=True):
        if template.warning:
            who = f"{model.name}: " if len(served) > 1 else ""
            events.warning(who + template.warning)
    denied = socket_access_denied()
    if denied:  # the link timeout is set on the engine's own sockets: without them, the stall detector
        link = request.limits.link_timeout
        events.warning(
            f"serve may not take the engine's sockets ({denied}): --link-timeout {link:g} does nothing; a "
            f"cut link is found when a request gets nothing for {request.limits.event_timeout:g} s (the "
            "stall detector)"
        )
        get_logger().warning("serve_link_timeout_off", why=denied)


def engine_factory(
    request: ServeRequest, model: ServedModel, events: ServeEvents, http: Upstream
) -> EngineFactory:
    """llama-server engines for `model` (`serve.engine.default_engines`)."""
    factory, _template = default_engines(
        model.path,
        model.name,
        http,
        parallel=model.options.parallel,
        link_timeout=request.limits.link_timeout,
        chat_template=request.chat_template,
        progress=events.engine_build,
    )
    return factory


def loaded_reporter(
    name: str | None, first_times: dict[str, float], events: ServeEvents
) -> Callable[[Formation, Plan, dict[str, float]], None]:
    """The `Loaded` event after each load of a formation (its first with the probe's and plan's times)."""
    loads = 0

    def on_loaded(formation: Formation, plan: Plan, phases: dict[str, float]) -> None:
        nonlocal loads
        times = first_times if loads == 0 else {}
        loads += 1
        if events.loaded is not None:
            hits = sum(formation.skipped.values())
            events.loaded(Loaded(name, formation.state, len(plan.endpoints), {**times, **phases}, hits))

    return on_loaded


def make_router(
    request: ServeRequest,
    served: Sequence[ServedModel],
    formations: list[Formation],
    spares: SparePool,
    http: Upstream,
    roster: Roster,
    demand: Callable[[Router], Demand] | None = None,
    times: RequestTimes | None = None,
    news: News | None = None,
) -> Router:
    """The router over the formations (made with `roster` as their peers; `demand`: the on-demand loads
    over it, if any; `times`: the exporter's histograms of each formation's requests; `news`: the events
    told as they happen). One formation: the
    front counts on its metrics, as before formations; unless the spare watch may add formations
    (--replicas auto): the front's counters must then be its own."""
    growing = any(not m.split and m.replicas is None for m in served) and request.limits.rejoin_interval > 0
    shared = len(formations) == 1 and not growing and not any(m.on_demand for m in served)
    return Router(
        formations,
        formations[0].metrics if shared else None,
        http,
        config=request.limits,
        models=[m.name for m in served],
        roster=roster,
        spares=lambda: [h.endpoint for h in spares.snapshot()],
        demand=demand,
        observe=times.observe if times is not None else None,
        news=news,
    )


async def run_formations(
    request: ServeRequest,
    router: Router,
    watch: SpareWatch,
    hosts: Sequence[Host],
    formed: Sequence[PlannedFormation],
    events: ServeEvents,
    ending: Ending,
    ring: KeyRing | None = None,
    times: RequestTimes | None = None,
) -> ServeOutcome:
    """Serve: the exporter's rounds, the app, SIGHUP as a reload, each formation's first load and the
    spare watch, all tasks of this one loop; all stopped when serving ends."""
    exporter, rounds = await start_exporter(request, router, hosts, times)
    server = front(request, router, exporter, ring)
    ending.stop = lambda: setattr(server, "should_exit", True)
    if events.formed is not None:
        on_demand = list(router.demand.models) if router.demand is not None else []
        events.formed(formed, f"http://{request.host}:{request.port}/v1", on_demand)
    with signals.handling(signal.SIGHUP, sighup(request, router, ring)):  # until serve ends
        router.start([one.plan for one in formed])
        watch.start()
        if router.demand is not None:
            router.demand.start()
        try:
            await server.serve(sockets=[request.listen])
        finally:
            await stop_serving(router, watch, exporter, rounds)
    if ending.failed():
        return ServeOutcome(True, "; ".join(f"{f.name}: {f.reason}" for f in router.formations))
    return ServeOutcome(False)


async def start_exporter(
    request: ServeRequest, router: Router, hosts: Sequence[Host], times: RequestTimes | None
) -> tuple[Exporter | None, asyncio.Task[None] | None]:
    """The fleet exporter beside serve (none with --observe-interval 0) and its rounds' task, once its
    first round has read the nodes (before the loads hold them)."""
    from orchestrator.serve.observed import observe

    if not request.observe_interval:
        return None, None
    exporter = observe(
        router,
        hosts,
        interval=request.observe_interval,
        timeout=request.probe.timeout,
        forks=request.probe.forks,
        trust_rpc_memory=request.probe.trust_rpc_memory,
        times=times,
    )
    rounds = asyncio.get_running_loop().create_task(exporter.collector.run(), name="serve-observe")
    first_round_seen = exporter.collector.first_round

    async def first_round_done() -> bool | None:
        return True if first_round_seen.is_set() or rounds.done() else None

    await poll_async(first_round_done, limit=request.probe.timeout * 4 + 5, interval=0.05)
    return exporter, rounds


def front(request: ServeRequest, router: Router, exporter: Exporter | None, ring: KeyRing | None) -> Server:
    """The API's HTTP server over the router: its connections, heads and bodies bounded (observe.server,
    HttpGuard)."""
    from orchestrator.observe.server import http_server
    from orchestrator.serve.app import create_app

    app = create_app(
        router,
        api_key=request.api_key,
        admin_key=request.admin_key,
        keys=ring,
        exporter=exporter,
    )
    return http_server(app, request.host, request.port, timeout_graceful_shutdown=5)


def sighup(request: ServeRequest, router: Router, ring: KeyRing | None) -> Callable[..., None]:
    """SIGHUP's handler: reload the engines; with per-user keys (`ring`) re-read them instead and reload
    no engine (an admin-scoped key's POST /admin/reload does): a change of who may call must not drain
    every formation. The signal lands between two of the loop's steps: the work is handed over."""
    loop = asyncio.get_running_loop()
    models = router.models

    def reload(*_: object) -> None:
        if ring is not None:
            loop.call_soon_threadsafe(lambda: reload_keys(ring, models))
        else:
            loop.call_soon_threadsafe(lambda: router.reload(rolling_restart=request.reload_rolling))

    return reload


async def stop_serving(
    router: Router, watch: SpareWatch, exporter: Exporter | None, rounds: asyncio.Task[None] | None
) -> None:
    """Serving ended: the spare watch, the on-demand loads, the exporter and every formation stopped."""
    await watch.stop()
    if router.demand is not None:
        await router.demand.stop()
    if exporter is not None and rounds is not None:
        exporter.collector.stop()
        await asyncio.gather(rounds, return_exceptions=True)
    await router.stop()
