"""The step registry: each playbook step name → its arguments and the operation it runs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from orchestrator.core import fields
from orchestrator.core.errors import (
    LoaderError,
    PlanError,
    ProbeError,
)
from orchestrator.core.files import write_atomic
from orchestrator.engine.executor import (
    HostContext,
    StepOutcome,
)
from orchestrator.engine.shared import SharedCall
from orchestrator.operations import BUSY_GRACE
from orchestrator.workflows.options import CTX, FACTS, PLAN_OPTIONS, TIMEOUT, plan_options, probe_settings

if TYPE_CHECKING:  # imported lazily at run time: planning pulls in numpy
    from orchestrator.operations.layer import OperationOptions
    from orchestrator.planning.plan import Plan
    from orchestrator.probe.fleet import FleetProbe
from orchestrator.playbooks.args import Arg, option_arg
from orchestrator.playbooks.load_check import LOAD_CHECK_TIMEOUT, LoadCheckResult, load_check
from orchestrator.playbooks.model import Document, Play, Scope, Step


@dataclass(frozen=True)
class Op:
    name: str
    scope: Scope
    summary: str
    args: tuple[Arg, ...]
    factory: Callable[[Mapping[str, Any], Play], Step]

    def arg(self, name: str) -> Arg | None:
        return next((a for a in self.args if a.name == name), None)


def _named(step: Step, name: str) -> Step:
    step.__name__ = name
    return step


def _options(args: Mapping[str, Any], play: Play) -> OperationOptions:
    from orchestrator.operations.layer import OperationOptions

    return OperationOptions(
        check=play.check,
        force=bool(args.get("force", False)),
        wait_lock=play.wait_lock,
        busy_grace=float(args.get("busy_grace", BUSY_GRACE)),
    )


def _install(args: Mapping[str, Any], play: Play) -> Step:
    from orchestrator.operations.install.ensure import ArtifactChooser, make_install_step

    chooser = ArtifactChooser(args["artifact"])
    return make_install_step(chooser, _options(args, play), reinstall=args["reinstall"])


def _deploy(args: Mapping[str, Any], play: Play) -> Step:
    from orchestrator.operations.install.ensure import ArtifactChooser
    from orchestrator.operations.server.steps import make_deploy_step

    return make_deploy_step(
        ArtifactChooser(args["artifact"]), _options(args, play), reinstall=args["reinstall"]
    )


def _start(args: Mapping[str, Any], play: Play) -> Step:
    from orchestrator.operations.server.steps import make_service_step

    return make_service_step("running", _options(args, play))


def _stop(args: Mapping[str, Any], play: Play) -> Step:
    from orchestrator.operations.server.steps import make_service_step

    return make_service_step("stopped", _options(args, play))


def _remove_unit(args: Mapping[str, Any], play: Play) -> Step:
    from orchestrator.operations.server.steps import make_remove_unit_step

    return make_remove_unit_step(_options(args, play))


def _restart(args: Mapping[str, Any], play: Play) -> Step:
    from orchestrator.operations.restart import make_restart_step

    return make_restart_step(
        _options(args, play),
        ready_timeout=args["timeout"],
        memory_tolerance=args["memory_tolerance"],
        memory_tolerance_min=args["memory_tolerance_min"],
        memory_timeout=args["memory_timeout"],
    )


def _wait_ready(args: Mapping[str, Any], play: Play) -> Step:
    from orchestrator.operations.server.process import wait_ready
    from orchestrator.operations.server.state import read_node_state

    async def wait(ctx: HostContext) -> StepOutcome[None]:
        conn = await ctx.connection()
        state = await read_node_state(conn, ctx.host)
        svc = state.service
        if play.check and not (svc.ours and svc.pid):
            return StepOutcome(None, False, "would wait until HELLO answers (the server is not running now)")
        if not svc.ours or svc.pid is None:
            from orchestrator.core.errors import ServiceError

            raise ServiceError("the rpc-server is not running", host=ctx.host.name, hint="start it first")
        started = time.monotonic()
        result = await wait_ready(conn, ctx.host, state, svc.pid, limit_s=args["timeout"])
        what = result.message if result is not None else "listening"
        return StepOutcome(None, False, f"ready in {time.monotonic() - started:.2f} s ({what})")

    return _named(wait, "wait_ready")


def _probe_of(play: Play, args: Mapping[str, Any]) -> SharedCall[FleetProbe]:
    from orchestrator.probe.fleet import probe_fleet

    settings = probe_settings(args)

    async def make() -> FleetProbe:
        fleet = await probe_fleet(
            play.hosts, timeout=settings.timeout, facts=settings.facts, session=play.session
        )
        play.state.probe = fleet
        return fleet

    return SharedCall(make)


def _probe(args: Mapping[str, Any], play: Play) -> Step:
    from orchestrator.core.units import format_size

    shared = _probe_of(play, args)

    async def probe(ctx: HostContext) -> StepOutcome[Any]:
        fleet = await shared.get()
        node = next(n for n in fleet.nodes if n.host == ctx.host.name)
        if not node.ok:
            raise ProbeError(f"{node.state}: {node.rpc.message}", host=ctx.host.name)
        usable = sum(d.usable for d in node.devices)
        return StepOutcome(node, False, f"{len(node.devices)} device(s), {format_size(usable)} usable")

    return _named(probe, "probe")


def _latest_probe(play: Play) -> SharedCall[FleetProbe]:
    """The play's latest probe, restricted to the hosts still in play; a fresh probe when there is none."""
    from orchestrator.probe.fleet import FleetProbe

    previous = play.state.probe
    if previous is None:
        return _probe_of(play, {})  # the declared defaults
    names = {h.name for h in play.hosts}

    async def reuse() -> FleetProbe:
        nodes = [n for n in previous.nodes if n.host in names]
        return FleetProbe.of(
            nodes, protocol=previous.protocol, timeout=previous.timeout, facts=previous.facts
        )

    return SharedCall(reuse)


def _plan(args: Mapping[str, Any], play: Play) -> Step:
    from orchestrator.planning.profile import profile_model
    from orchestrator.workflows.fit import PLAYBOOK_WORDS
    from orchestrator.workflows.options import ProbeSettings
    from orchestrator.workflows.plan import plan_for_fleet

    fleet_of = _latest_probe(play)

    async def make() -> Plan:
        fleet = await fleet_of.get()
        profile = await asyncio.to_thread(profile_model, args["model"])
        round_ = await plan_for_fleet(
            play.hosts,
            profile,
            plan_options(args),
            probe=ProbeSettings(),
            fleet=fleet,
            failed="skip",
            local_devices=[],  # the nodes' devices only: a playbook plans the fleet
            words=PLAYBOOK_WORDS,
        )
        plan = round_.plan
        if plan is None:
            raise round_.error or PlanError(round_.reason)
        play.state.plan = plan
        text = plan.to_text()
        path = args["output"]
        if path is not None and not play.check:
            await asyncio.to_thread(write_atomic, Path(path), text, parents=True)
        play.state.documents.append(Document(play.step.label, "plan", text, path if not play.check else None))
        if round_.misfit is not None:
            raise round_.misfit
        return plan

    shared = SharedCall(make)

    async def plan_step(ctx: HostContext) -> StepOutcome[Any]:
        plan = await shared.get()
        mine = [d for d in plan.devices if d.endpoint == ctx.host.endpoint]
        if not mine:
            return StepOutcome(plan, False, "no layers planned here")
        parts = [f"{d.label}: {_layer_range(d.layers, plan.n_layer)}" for d in mine]
        return StepOutcome(plan, False, "; ".join(parts))

    return _named(plan_step, "plan")


def _layer_range(layers: Sequence[int], n_layer: int) -> str:
    if not layers:
        return "no layers"
    names = [("output" if il == n_layer else str(il)) for il in layers]
    return f"layers {names[0]}-{names[-1]}" if len(names) > 1 else f"layer {names[0]}"


def _load_check(args: Mapping[str, Any], play: Play) -> Step:
    async def make() -> LoadCheckResult:
        plan = play.state.plan
        if plan is None:
            raise PlanError("load_check needs a plan: put a `plan` step before it")
        model = args["model"] or plan.model_path
        return await load_check(plan, model, limit_s=args["timeout"], hosts=play.hosts)

    shared = SharedCall(make)

    async def check_step(ctx: HostContext) -> StepOutcome[Any]:
        if play.check:
            model = args["model"] or (play.state.plan.model_path if play.state.plan else "the plan's model")
            return StepOutcome(None, False, f"would load {model} and compare the placement with the plan")
        placement = await shared.get()
        mine = [d for d in placement.devices if d.endpoint == ctx.host.endpoint]
        wrong = [d for d in mine if not d.as_planned]
        if wrong:
            listed = "; ".join(
                f"{d.label}: planned {list(d.planned_layers)}, got {list(d.actual_layers)}" for d in wrong
            )
            raise LoaderError(f"the placement differs from the plan: {listed}", host=ctx.host.name)
        if not mine:
            return StepOutcome(placement, False, "no layers here, as planned")
        parts = [f"{d.label}: layers {list(d.actual_layers)} as planned" for d in mine]
        return StepOutcome(placement, False, "; ".join(parts))

    return _named(check_step, "load_check")


def _cache_warm(args: Mapping[str, Any], play: Play) -> Step:
    """Put each node's share of the planned model into its tensor cache (all nodes at once)."""
    from orchestrator.operations.cache import WarmItem, warm_step

    async def make() -> dict[str, list[WarmItem]]:
        from orchestrator.caches.plan import plan_cache
        from orchestrator.caches.prep import warm_item
        from orchestrator.planning.profile import profile_model

        plan = play.state.plan
        if plan is None:
            raise PlanError("cache_warm needs a plan: put a `plan` step before it")
        paths = (await asyncio.to_thread(profile_model, plan.model_path)).paths
        per = await asyncio.to_thread(plan_cache, plan, paths)
        return {ep: [warm_item(c) for c in cs] for ep, cs in per.items()}

    shared = SharedCall(make)
    installs: dict[tuple[str, int, str], asyncio.Lock] = {}

    async def warm_host(ctx: HostContext) -> StepOutcome[Any]:
        items = (await shared.get()).get(ctx.host.endpoint, [])
        if not ctx.host.rpc_cache:
            return StepOutcome(None, False, "rpc_cache is off here: nothing to warm")
        if not items:
            return StepOutcome(None, False, "no cached tensors planned here")
        # The servers of one host (`rpc_servers`) share its install, its cache and its lock: warmed one
        # after the other, each would otherwise find the lock held by this very run.
        async with installs.setdefault(ctx.host.install_key, asyncio.Lock()):
            return await warm_step({ctx.host.name: items}, _options(args, play))(ctx)

    return _named(warm_host, "cache_warm")


def _serve_reload(args: Mapping[str, Any], play: Play) -> Step:
    from orchestrator.playbooks.serve_reload import read_key, serve_reload

    url, rolling = args["url"], args["rolling_restart"]
    shared = SharedCall(
        lambda: serve_reload(
            url,
            read_key(args["api_key_file"]),
            rolling_restart=rolling,
            limit=args["timeout"],
            admin_key=read_key(args["admin_key_file"], "RPCFLEET_ADMIN_KEY", "admin_key_file"),
        )
    )

    async def reload_step(ctx: HostContext) -> StepOutcome[Any]:
        if play.check:
            return StepOutcome(
                None, False, f"would reload serve at {url}" + (" with a rolling restart" if rolling else "")
            )
        health = await shared.get()
        serving = ctx.host.endpoint in (health.get("plan") or {}).get("endpoints", ())
        return StepOutcome(
            health, rolling, f"serve reloaded ({health['status']}): {'serving' if serving else 'not used'}"
        )

    return _named(reload_step, "serve_reload")


def _report(args: Mapping[str, Any], play: Play) -> Step:
    from datetime import UTC, datetime

    from orchestrator.planning.profile import profile_model
    from orchestrator.report.build import ReportOptions, build_report
    from orchestrator.report.render import render

    fleet_of = _latest_probe(play)

    async def make() -> FleetProbe:
        fleet = await fleet_of.get()
        models = [(str(m), await asyncio.to_thread(profile_model, m)) for m in args["model"]]
        options = ReportOptions(
            plan=plan_options(args, n_ctx=0),
            generated_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        report = build_report(fleet, models, list(args["ctx"]), options)
        text = render(report, args["format"])
        path = args["output"]
        if path is not None and not play.check:
            await asyncio.to_thread(write_atomic, Path(path), text, parents=True)
        play.state.documents.append(
            Document(play.step.label, "report", text, path if not play.check else None)
        )
        return fleet

    shared = SharedCall(make)

    async def report_step(ctx: HostContext) -> StepOutcome[Any]:
        fleet = await shared.get()
        node = next(n for n in fleet.nodes if n.host == ctx.host.name)
        if not node.ok:
            raise ProbeError(f"{node.state}: {node.rpc.message} (left out of the report)", host=ctx.host.name)
        return StepOutcome(node, False, "in the report")

    return _named(report_step, "report")


_FORCE = Arg("force", fields.boolean, False, help="stop a server even while a client is connected (kills it)")
_REINSTALL = Arg("reinstall", fields.boolean, False, help="upload and unpack even when installed")


_ARTIFACT = Arg(
    "artifact", fields.optional(fields.text), None, help="artifact id or spec (default: the host's)"
)


# The planning options but the context (`plan` takes one, `report` several), as the command line's flags.
_PLAN_ARGS = tuple(option_arg(option) for option in PLAN_OPTIONS if option is not CTX)


REGISTRY: Mapping[str, Op] = MappingProxyType(
    {
        op.name: op
        for op in (
            Op(
                "install", "host", "install the pinned rpc-server artifact", (_ARTIFACT, _REINSTALL), _install
            ),
            Op(
                "deploy",
                "host",
                "install, then start (or restart on the new version or launch line)",
                (_ARTIFACT, _REINSTALL, _FORCE),
                _deploy,
            ),
            Op("start", "host", "start the rpc-server where it is not running", (), _start),
            Op("stop", "host", "stop the rpc-server (refused while a client is connected)", (_FORCE,), _stop),
            Op(
                "remove_unit",
                "host",
                "stop the rpc-server and remove its systemd unit (the user rpcfleet with the last one)",
                (),
                _remove_unit,
            ),
            Op(
                "restart",
                "host",
                "restart one node: refuse a busy one, stop, start, wait for HELLO and the memory baseline",
                (
                    _FORCE,
                    Arg("timeout", fields.seconds, 15.0, help="seconds until HELLO must answer"),
                    Arg(
                        "busy_grace",
                        fields.seconds,
                        BUSY_GRACE,
                        help="a client connected this long makes a node busy",
                    ),
                    Arg("memory_tolerance", fields.fraction, 0.05, help="of each device's total (5%)"),
                    Arg("memory_tolerance_min", fields.size, 256 * 1024 * 1024),
                    Arg("memory_timeout", fields.seconds, 30.0, help="seconds for the memory to come back"),
                ),
                _restart,
            ),
            Op(
                "wait_ready",
                "host",
                "wait until the running rpc-server answers HELLO",
                (Arg("timeout", fields.seconds, 15.0),),
                _wait_ready,
            ),
            Op(
                "probe",
                "fleet",
                "probe every server (RPC and host facts)",
                (option_arg(TIMEOUT), option_arg(FACTS)),
                _probe,
            ),
            Op(
                "plan",
                "fleet",
                "plan a model's placement on the probed devices (fails when it does not fit)",
                (
                    Arg("model", fields.text, required=True, help="the GGUF model"),
                    option_arg(CTX),
                    Arg(
                        "output",
                        fields.optional(fields.text),
                        None,
                        help="also write the plan (JSON) to this file",
                    ),
                    *_PLAN_ARGS,
                ),
                _plan,
            ),
            Op(
                "load_check",
                "fleet",
                "load the planned model over RPC in a child process and compare the placement",
                (
                    Arg("model", fields.optional(fields.text), None, help="default: the plan's model"),
                    Arg("timeout", fields.seconds, LOAD_CHECK_TIMEOUT),
                ),
                _load_check,
            ),
            Op(
                "cache_warm",
                "fleet",
                "put each node's share of the planned model into its tensor cache (rpc_cache hosts)",
                (),
                _cache_warm,
            ),
            Op(
                "serve_reload",
                "fleet",
                "reload a running `rpcfleet serve`: drain, unload, [rolling restart], plan, load",
                (
                    Arg("url", fields.text, "http://127.0.0.1:8080", help="serve's base URL"),
                    Arg(
                        "api_key_file", fields.optional(fields.text), None, help="a file holding the API key"
                    ),
                    Arg(
                        "admin_key_file",
                        fields.optional(fields.text),
                        None,
                        help="a file holding serve's admin key (a rolling restart needs it)",
                    ),
                    Arg("rolling_restart", fields.boolean, True),
                    Arg("timeout", fields.seconds, 600.0, help="seconds until serve must serve again"),
                ),
                _serve_reload,
            ),
            Op(
                "report",
                "fleet",
                "a capacity report of the probed fleet for the given models and contexts",
                (
                    Arg(
                        "model",
                        fields.list_of(fields.text),
                        (),
                        help="GGUF models (a list, or comma-separated)",
                    ),
                    option_arg(CTX, many=True),
                    Arg("format", fields.choice(("text", "md", "json", "html")), "text"),
                    Arg("output", fields.optional(fields.text), None, help="write the report to this file"),
                    *_PLAN_ARGS,
                ),
                _report,
            ),
        )
    }
)
