"""YAML playbooks: named sequences of rpcfleet's operations over a host selection, run by the executor.

A playbook (one play per file)::

    name: rolling restart            # required
    hosts: all                       # an inventory pattern (default: all); --limit narrows it further
    serial: 1                        # hosts per batch: N, "N%", or a list such as [1, "50%"] (last repeats)
    max_fail_percentage: 0           # stop after a batch with more failures than this (default: a batch
                                     # whose hosts all failed stops the run, as in Ansible)
    vars:                            # variables for {{ name }} templates in step arguments and `hosts`
      model: /models/m.gguf          # (-e key=value on the command line wins)
    steps:
      - restart: {force: false}      # an operation and its arguments
      - name: wait for the servers   # an optional name, shown in the output
        wait_ready: {timeout: 20}
      - probe                        # an operation without arguments

Operations come from `REGISTRY`; each validates its own arguments through a small schema (`Arg`).
Host operations (install, deploy, start, stop, restart, wait_ready) run per host in batches of
`serial`; fleet operations (probe, plan, load_check, report) run once over the hosts still in the play
and give every host its own result. A host that fails leaves the play; a run stopped by the failure
threshold ends the play (the hosts it did not reach are `skipped`). A rolling restart is nothing more
than the `restart` step with `serial: 1`.

Every validation error names the file, line and column, quotes the line, and says which step; all
errors of a file are reported together (`PlaybookErrors`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import yaml

from orchestrator.errors import (
    LoaderError,
    PlanError,
    PlaybookError,
    ProbeError,
    RpcfleetError,
    SourceLocation,
    UsageError,
)
from orchestrator.executor import HostContext, HostResult, Recap, RunResult, Session, StepOutcome, batch_sizes
from orchestrator.files import write_atomic
from orchestrator.inventory import Host, Inventory, select_hosts
from orchestrator.yamlsource import Source, compose, did_you_mean, is_null, node_kind, node_value, type_name

if TYPE_CHECKING:  # imported lazily at run time: planning pulls in numpy
    from orchestrator.loader import MemoryBytes
    from orchestrator.planner import Plan, PlanOptions
    from orchestrator.probe import FleetProbe

__all__ = [
    "REGISTRY",
    "Arg",
    "DeviceCheck",
    "Document",
    "LoadCheckResult",
    "Op",
    "PlayState",
    "Playbook",
    "PlaybookErrors",
    "PlaybookResult",
    "PlaybookStep",
    "StepRun",
    "load_check",
    "load_playbook",
    "load_playbook_text",
    "parse_extra_vars",
    "play_hosts",
    "rolling_restart_playbook",
    "run_playbook",
]

Serial = int | str | tuple[int | str, ...] | None
Scope = Literal["host", "fleet"]
T = TypeVar("T")
Step = Callable[[HostContext], Awaitable[StepOutcome[Any]]]

_TEMPLATE = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_TOP_KEYS = ("name", "hosts", "serial", "max_fail_percentage", "vars", "steps")
_LOAD_CHECK_TIMEOUT = 300.0
_ROOT = str(Path(__file__).resolve().parent.parent)  # for the load-check child


# ---------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class PlaybookStep:
    """One step: the operation, its validated arguments, where it is written, its optional name."""

    op: str
    args: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    location: SourceLocation | None = field(default=None, compare=False)
    name: str | None = None
    index: int = 1  # 1-based position in the playbook

    @property
    def label(self) -> str:
        """How messages name the step: `step 2 (restart)` or `step 2 "name" (restart)`."""
        named = f' "{self.name}"' if self.name else ""
        return f"step {self.index}{named} ({self.op})"


@dataclass(frozen=True)
class Playbook:
    name: str
    steps: tuple[PlaybookStep, ...]
    hosts: str = "all"
    serial: Serial = None
    max_fail_percentage: float | None = None
    vars: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    path: Path | None = None


class PlaybookErrors(PlaybookError):
    """Several errors in one playbook: `errors` lists each, in file order; the message shows them all."""

    def __init__(self, errors: Sequence[PlaybookError]) -> None:
        self.errors = tuple(errors)
        super().__init__("\n".join(err.message for err in self.errors))
        self.location = self.errors[0].location


# ------------------------------------------------------------------------------------ argument schemas


@dataclass(frozen=True)
class Arg:
    """One argument of an operation: `parse` takes the raw value and returns the typed one or raises
    ValueError with a message for the user."""

    name: str
    parse: Callable[[Any], Any]
    default: Any = None
    required: bool = False
    help: str = ""


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "false", "no", "off"):
        return value.strip().lower() in ("true", "yes", "on")
    raise ValueError(f"expected true or false, got {type_name(value)} {value!r}")


def _int(minimum: int | None = None) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError(f"expected an integer, got {type_name(value)} {value!r}")
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"expected an integer, got {value!r}") from None
        if minimum is not None and number < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {number}")
        return number

    return parse


def _seconds(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number of seconds, got {type_name(value)} {value!r}") from None
    if not 0 < seconds < float("inf"):
        raise ValueError(f"expected a positive number of seconds, got {value!r}")
    return seconds


def _text(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"expected a string, got {type_name(value)} {value!r}")
    return str(value)


def _optional_text(value: Any) -> str | None:
    return None if value is None or value == "" else _text(value)


def _choice(*allowed: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value not in allowed:
            raise ValueError(
                f"expected one of {', '.join(allowed)}, got {value!r}{did_you_mean(value, allowed)}"
            )
        return str(value)

    return parse


def _size(value: Any) -> int:
    from orchestrator.units import parse_size

    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 256MiB, got {value!r}")
    try:
        return parse_size(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(str(exc)) from None


def _fraction(value: Any) -> float:
    """`5%` or `0.05` -> 0.05."""
    text = str(value).strip() if not isinstance(value, bool) else ""
    try:
        number = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ValueError(f"expected a fraction such as 5% or 0.05, got {value!r}") from None
    if not 0 <= number <= 1:
        raise ValueError(f"expected a fraction between 0% and 100%, got {value!r}")
    return number


def _list_of(parse_one: Callable[[Any], Any]) -> Callable[[Any], tuple[Any, ...]]:
    """A list, or a comma-separated string; empty or null is an empty tuple."""

    def parse(value: Any) -> tuple[Any, ...]:
        if value is None or value == "":
            return ()
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple):
            raise ValueError(f"expected a list, got {type_name(value)} {value!r}")
        return tuple(parse_one(item.strip() if isinstance(item, str) else item) for item in items)

    return parse


def _context(value: Any) -> int:
    """4096, or 32k (k = 1024)."""
    text = str(value).strip().lower() if not isinstance(value, bool) else "?"
    match = re.fullmatch(r"(\d+)(k?)", text)
    if match is None:
        raise ValueError(f"expected a context size such as 4096 or 32k, got {value!r}")
    return int(match.group(1)) * (1024 if match.group(2) else 1)


# ------------------------------------------------------------------------------------------ the registry


@dataclass
class PlayState:
    """What fleet steps leave for the steps after them (the latest probe and plan) and the documents
    (plans, reports) the run produced."""

    probe: FleetProbe | None = None
    plan: Plan | None = None
    documents: list[Document] = field(default_factory=list)


@dataclass(frozen=True)
class Document:
    """A text a step produced for the user (a plan, a report): the CLI prints it or says where it went."""

    step: str
    kind: str
    text: str
    path: str | None = None  # written there (None: not written)


@dataclass(frozen=True)
class _Play:
    """What an operation's factory gets besides its arguments."""

    session: Session
    hosts: tuple[Host, ...]  # the hosts still in play for this step
    check: bool
    state: PlayState
    step: PlaybookStep


@dataclass(frozen=True)
class Op:
    name: str
    scope: Scope
    summary: str
    args: tuple[Arg, ...]
    factory: Callable[[Mapping[str, Any], _Play], Step]

    def arg(self, name: str) -> Arg | None:
        return next((a for a in self.args if a.name == name), None)


class _Shared(Generic[T]):
    """A fleet computation made once, awaited by every host's step."""

    def __init__(self, make: Callable[[], Awaitable[T]]) -> None:
        self._make = make
        self._task: asyncio.Future[T] | None = None

    async def get(self) -> T:
        if self._task is None:
            self._task = asyncio.ensure_future(self._make())
        try:
            return await asyncio.shield(self._task)
        except RpcfleetError as exc:
            # A fresh error per host (the executor stamps the host on it), of the same type: an
            # UnreachableError must still count as unreachable.
            raise _clone_error(exc) from exc


def _clone_error(exc: RpcfleetError) -> RpcfleetError:
    """A shallow copy of `exc`, made without calling its `__init__` (some take other arguments than
    `args`, such as PlaybookErrors' list)."""
    clone = type(exc).__new__(type(exc), *exc.args)
    clone.__dict__.update(exc.__dict__)
    return clone


def _named(step: Step, name: str) -> Step:
    step.__name__ = name
    return step


def _install(args: Mapping[str, Any], play: _Play) -> Step:
    from orchestrator.install import ArtifactChooser, make_install_step

    chooser = ArtifactChooser(args["artifact"])
    return make_install_step(chooser, check=play.check, force=args["force"])


def _deploy(args: Mapping[str, Any], play: _Play) -> Step:
    from orchestrator.install import ArtifactChooser
    from orchestrator.service import make_deploy_step

    return make_deploy_step(ArtifactChooser(args["artifact"]), check=play.check, force=args["force"])


def _start(args: Mapping[str, Any], play: _Play) -> Step:
    from orchestrator.service import make_start_step

    return make_start_step(check=play.check)


def _stop(args: Mapping[str, Any], play: _Play) -> Step:
    from orchestrator.service import make_stop_step

    return make_stop_step(check=play.check)


def _restart(args: Mapping[str, Any], play: _Play) -> Step:
    from orchestrator.rolling import make_rolling_restart_step

    return make_rolling_restart_step(
        force=args["force"],
        check=play.check,
        ready_timeout=args["timeout"],
        busy_grace=args["busy_grace"],
        memory_tolerance=args["memory_tolerance"],
        memory_tolerance_min=args["memory_tolerance_min"],
        memory_timeout=args["memory_timeout"],
    )


def _wait_ready(args: Mapping[str, Any], play: _Play) -> Step:
    from orchestrator.service import read_node_state, wait_ready

    async def wait(ctx: HostContext) -> StepOutcome[None]:
        conn = await ctx.connection()
        state = await read_node_state(conn, ctx.host)
        svc = state.service
        if play.check and not (svc.ours and svc.pid):
            return StepOutcome(None, False, "would wait until HELLO answers (the server is not running now)")
        if not svc.ours or svc.pid is None:
            from orchestrator.errors import ServiceError

            raise ServiceError("the rpc-server is not running", host=ctx.host.name, hint="start it first")
        started = time.monotonic()
        result = await wait_ready(conn, ctx.host, state, svc.pid, limit_s=args["timeout"])
        what = result.message if result is not None else "listening"
        return StepOutcome(None, False, f"ready in {time.monotonic() - started:.2f} s ({what})")

    return _named(wait, "wait_ready")


def _probe_of(play: _Play, args: Mapping[str, Any]) -> _Shared[FleetProbe]:
    from orchestrator.probe import probe_fleet

    async def make() -> FleetProbe:
        fleet = await probe_fleet(
            play.hosts, timeout=args["timeout"], facts=args["facts"], session=play.session
        )
        play.state.probe = fleet
        return fleet

    return _Shared(make)


def _probe(args: Mapping[str, Any], play: _Play) -> Step:
    from orchestrator.units import format_size

    shared = _probe_of(play, args)

    async def probe(ctx: HostContext) -> StepOutcome[Any]:
        fleet = await shared.get()
        node = next(n for n in fleet.nodes if n.host == ctx.host.name)
        if not node.ok:
            raise ProbeError(f"{node.state}: {node.rpc.message}", host=ctx.host.name)
        usable = sum(d.usable for d in node.devices)
        return StepOutcome(node, False, f"{len(node.devices)} device(s), {format_size(usable)} usable")

    return _named(probe, "probe")


def _latest_probe(play: _Play) -> _Shared[FleetProbe]:
    """The play's latest probe, restricted to the hosts still in play; a fresh probe when there is none."""
    from orchestrator.probe import FleetProbe

    previous = play.state.probe
    if previous is None:
        return _probe_of(play, {"timeout": 3.0, "facts": True})
    names = {h.name for h in play.hosts}

    async def reuse() -> FleetProbe:
        nodes = [n for n in previous.nodes if n.host in names]
        return FleetProbe.of(
            nodes, protocol=previous.protocol, timeout=previous.timeout, facts=previous.facts
        )

    return _Shared(reuse)


def _plan_options(args: Mapping[str, Any]) -> PlanOptions:
    from orchestrator.planner import DEFAULT_MARGIN, PlanOptions

    return PlanOptions(
        n_ctx=args["ctx"],
        type_k=args["type_k"],
        type_v=args["type_v"],
        flash_attn=args["flash_attn"],
        margin=args["margin"] if args["margin"] is not None else DEFAULT_MARGIN,
        strategy=args["strategy"],
    )


def _plan(args: Mapping[str, Any], play: _Play) -> Step:
    from orchestrator.model import profile_model
    from orchestrator.planner import make_plan
    from orchestrator.probe import to_plan_devices
    from orchestrator.units import format_size

    fleet_of = _latest_probe(play)

    async def make() -> Plan:
        fleet = await fleet_of.get()
        profile = await asyncio.to_thread(profile_model, args["model"])
        plan = make_plan(to_plan_devices(fleet, failed="skip"), profile, _plan_options(args))
        play.state.plan = plan
        text = plan.to_json()
        path = args["output"]
        if path is not None and not play.check:
            await asyncio.to_thread(write_atomic, Path(path), text, parents=True)
        play.state.documents.append(Document(play.step.label, "plan", text, path if not play.check else None))
        if not plan.fit.fits:
            binding = plan.devices[plan.fit.binding_device or 0]
            raise PlanError(
                f"{Path(args['model']).name} does not fit at n_ctx {plan.n_ctx}: "
                f"{format_size(plan.fit.shortfall)} short on {binding.label}",
                hint=f"the largest context that fits is {plan.fit.largest_n_ctx}",
            )
        return plan

    shared = _Shared(make)

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


def _load_check(args: Mapping[str, Any], play: _Play) -> Step:
    async def make() -> LoadCheckResult:
        plan = play.state.plan
        if plan is None:
            raise PlanError("load_check needs a plan: put a `plan` step before it")
        model = args["model"] or plan.model_path
        return await load_check(plan, model, limit_s=args["timeout"])

    shared = _Shared(make)

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


def _report(args: Mapping[str, Any], play: _Play) -> Step:
    from datetime import UTC, datetime

    from orchestrator.model import profile_model
    from orchestrator.report import ReportOptions, build_report, render

    fleet_of = _latest_probe(play)

    async def make() -> FleetProbe:
        fleet = await fleet_of.get()
        models = [(str(m), await asyncio.to_thread(profile_model, m)) for m in args["model"]]
        options = ReportOptions(
            plan=_plan_options({**args, "ctx": 0}),
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

    shared = _Shared(make)

    async def report_step(ctx: HostContext) -> StepOutcome[Any]:
        fleet = await shared.get()
        node = next(n for n in fleet.nodes if n.host == ctx.host.name)
        if not node.ok:
            raise ProbeError(f"{node.state}: {node.rpc.message} (left out of the report)", host=ctx.host.name)
        return StepOutcome(node, False, "in the report")

    return _named(report_step, "report")


_FORCE = Arg("force", _bool, False, help="install: upload even when installed; restart: even a busy server")
_ARTIFACT = Arg("artifact", _optional_text, None, help="artifact id or spec (default: the host's)")
_TIMEOUT_PROBE = Arg("timeout", _seconds, 3.0, help="probe timeout per host, seconds")
_PLAN_ARGS = (
    Arg("type_k", _choice("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"), "f16"),
    Arg("type_v", _choice("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"), "f16"),
    Arg("flash_attn", _bool, False),
    Arg("margin", _size, None, help="headroom kept free per device (default 256MiB)"),
    Arg("strategy", _choice("proportional", "fewest"), "proportional"),
)

REGISTRY: Mapping[str, Op] = MappingProxyType(
    {
        op.name: op
        for op in (
            Op("install", "host", "install the pinned rpc-server artifact", (_ARTIFACT, _FORCE), _install),
            Op(
                "deploy",
                "host",
                "install, then start (or restart on the new version)",
                (_ARTIFACT, _FORCE),
                _deploy,
            ),
            Op("start", "host", "start the rpc-server where it is not running", (), _start),
            Op("stop", "host", "stop the rpc-server", (), _stop),
            Op(
                "restart",
                "host",
                "restart one node: refuse a busy one, stop, start, wait for HELLO and the memory baseline",
                (
                    _FORCE,
                    Arg("timeout", _seconds, 15.0, help="seconds until HELLO must answer"),
                    Arg("busy_grace", _seconds, 1.0, help="a client connected this long makes a node busy"),
                    Arg("memory_tolerance", _fraction, 0.05, help="of each device's total (5%)"),
                    Arg("memory_tolerance_min", _size, 256 * 1024 * 1024),
                    Arg("memory_timeout", _seconds, 30.0, help="seconds for the memory to come back"),
                ),
                _restart,
            ),
            Op(
                "wait_ready",
                "host",
                "wait until the running rpc-server answers HELLO",
                (Arg("timeout", _seconds, 15.0),),
                _wait_ready,
            ),
            Op(
                "probe",
                "fleet",
                "probe every server (RPC and host facts)",
                (_TIMEOUT_PROBE, Arg("facts", _bool, True)),
                _probe,
            ),
            Op(
                "plan",
                "fleet",
                "plan a model's placement on the probed devices (fails when it does not fit)",
                (
                    Arg("model", _text, required=True, help="the GGUF model"),
                    Arg("ctx", _context, 4096),
                    Arg("output", _optional_text, None, help="also write the plan (JSON) to this file"),
                    *_PLAN_ARGS,
                ),
                _plan,
            ),
            Op(
                "load_check",
                "fleet",
                "load the planned model over RPC in a child process and compare the placement",
                (
                    Arg("model", _optional_text, None, help="default: the plan's model"),
                    Arg("timeout", _seconds, _LOAD_CHECK_TIMEOUT),
                ),
                _load_check,
            ),
            Op(
                "report",
                "fleet",
                "a capacity report of the probed fleet for the given models and contexts",
                (
                    Arg("model", _list_of(_text), (), help="GGUF models (a list, or comma-separated)"),
                    Arg("ctx", _list_of(_context), (4096,)),
                    Arg("format", _choice("text", "md", "json", "html"), "text"),
                    Arg("output", _optional_text, None, help="write the report to this file"),
                    *_PLAN_ARGS,
                ),
                _report,
            ),
        )
    }
)


# ------------------------------------------------------------------------------------------- loading


class _Reader:
    """Walks the composed YAML, collecting errors with their location."""

    def __init__(self, path: Path | None, text: str, variables: Mapping[str, Any]) -> None:
        self.source = Source.of_text(path, text)
        self.vars = variables
        self.errors: list[PlaybookError] = []

    def loc(self, node: yaml.Node | None) -> SourceLocation:
        return self.source.at(None) if node is None else self.source.node(node)

    def error(self, message: str, node: yaml.Node | None) -> None:
        self.errors.append(PlaybookError(message, self.loc(node)))

    def items(self, node: yaml.MappingNode) -> list[tuple[str, yaml.Node, yaml.Node]]:
        out = []
        for key_node, value_node in node.value:
            key = node_value(key_node)
            if not isinstance(key, str):
                self.error(f"keys must be strings, got {key!r}", key_node)
                continue
            out.append((key, key_node, value_node))
        return out

    def render(self, value: Any, node: yaml.Node, where: str) -> Any:
        """Fill `{{ name }}` templates from the variables; a value that is one template keeps its type."""
        if isinstance(value, list):
            return [self.render(v, node, where) for v in value]
        if isinstance(value, dict):
            return {k: self.render(v, node, where) for k, v in value.items()}
        if not isinstance(value, str) or "{{" not in value:
            return value
        missing = [name for name in _TEMPLATE.findall(value) if name not in self.vars]
        if missing:
            raise ValueError(
                f"undefined variable {missing[0]!r}{did_you_mean(missing[0], self.vars)} "
                f"(define it under vars:, or pass -e {missing[0]}=...)"
            )
        whole = _TEMPLATE.fullmatch(value.strip())
        if whole:
            return self.vars[whole.group(1)]
        return _TEMPLATE.sub(lambda m: str(self.vars[m.group(1)]), value)


def parse_extra_vars(items: Sequence[str]) -> dict[str, Any]:
    """`-e key=value` items -> variables; each value is read as a YAML scalar (`3` an int, `true` a bool)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise UsageError(f"-e: expected key=value with a name such as model, got {item!r}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        out[key] = raw if isinstance(value, dict | list) or value is None else value
    return out


def _serial(reader: _Reader, node: yaml.Node) -> Serial:
    raw = node_value(node) if not isinstance(node, yaml.MappingNode) else None
    try:
        raw = reader.render(raw, node, "serial")
    except ValueError as exc:
        reader.error(f"serial: {exc}", node)
        return None
    if isinstance(raw, str) and raw.strip().startswith("["):
        raw = yaml.safe_load(raw)  # a list given with -e serial=[1,50%]
    if raw is None or isinstance(raw, bool | float) or not isinstance(raw, int | str | list):
        reader.error(
            f"serial: expected a number, a percentage or a list of them, got {node_kind(node)}", node
        )
        return None
    values = tuple(raw) if isinstance(raw, list) else raw
    try:
        batch_sizes(100, values if not isinstance(values, tuple) else list(values))
    except UsageError as exc:
        reader.error(exc.message, node)
        return None
    if isinstance(values, tuple) and any(isinstance(v, bool) or not isinstance(v, int | str) for v in values):
        reader.error(f"serial: a list of numbers and percentages, got {raw!r}", node)
        return None
    return values


def _max_fail(reader: _Reader, node: yaml.Node) -> float | None:
    raw = node_value(node) if isinstance(node, yaml.ScalarNode) else None
    try:
        raw = reader.render(raw, node, "max_fail_percentage")
    except ValueError as exc:
        reader.error(f"max_fail_percentage: {exc}", node)
        return None
    if isinstance(raw, str) and raw.strip().endswith("%"):
        raw = raw.strip()[:-1]
    try:
        if isinstance(raw, bool) or raw is None:
            raise ValueError
        value = float(raw)
    except ValueError:
        reader.error(f"max_fail_percentage: expected a number from 0 to 100, got {node_kind(node)}", node)
        return None
    if not 0 <= value <= 100:
        reader.error(f"max_fail_percentage: expected a number from 0 to 100, got {value:g}", node)
        return None
    return value


def _step(reader: _Reader, node: yaml.Node, index: int) -> PlaybookStep | None:
    label = f"step {index}"
    name: str | None = None
    op_node: yaml.Node
    args_node: yaml.Node | None
    if isinstance(node, yaml.ScalarNode) and isinstance(node_value(node), str):
        op_name, op_node, args_node = str(node_value(node)), node, None
    elif isinstance(node, yaml.MappingNode):
        found: list[tuple[str, yaml.Node, yaml.Node]] = []
        for key, key_node, value_node in reader.items(node):
            if key == "name":
                name = node_value(value_node) if isinstance(value_node, yaml.ScalarNode) else None
                if not isinstance(name, str):
                    reader.error(f"{label}: name must be a string", value_node)
                    name = None
            else:
                found.append((key, key_node, value_node))
        if name:
            label = f'step {index} "{name}"'
        if len(found) != 1:
            what = (
                "no operation"
                if not found
                else f"{len(found)} operations ({', '.join(k for k, _, _ in found)})"
            )
            reader.error(f"{label}: a step is one operation with its arguments; found {what}", node)
            return None
        op_name, op_node, args_node = found[0]
    else:
        reader.error(f"{label}: expected an operation name or `op: {{args}}`, got {node_kind(node)}", node)
        return None
    op = REGISTRY.get(op_name)
    if op is None:
        reader.error(
            f"{label}: unknown operation {op_name!r}{did_you_mean(op_name, REGISTRY)} "
            f"(known: {', '.join(REGISTRY)})",
            op_node,
        )
        return None
    label = f"{label} ({op_name})"
    raw: dict[str, tuple[yaml.Node, Any]] = {}
    if args_node is not None and not is_null(args_node):
        if not isinstance(args_node, yaml.MappingNode):
            reader.error(
                f"{label}: arguments must be a mapping (name: value), got {node_kind(args_node)}", args_node
            )
            return None
        for key, key_node, value_node in reader.items(args_node):
            if op.arg(key) is None:
                known = ", ".join(a.name for a in op.args) or "none"
                reader.error(
                    f"{label}: unknown argument {key!r}{did_you_mean(key, [a.name for a in op.args])} "
                    f"(arguments of {op_name}: {known})",
                    key_node,
                )
                continue
            raw[key] = (value_node, node_value(value_node))
    args: dict[str, Any] = {}
    ok = True
    for arg in op.args:
        if arg.name not in raw:
            if arg.required:
                reader.error(
                    f"{label}: missing required argument {arg.name!r} ({arg.help})", args_node or op_node
                )
                ok = False
            args[arg.name] = arg.default
            continue
        value_node, value = raw[arg.name]
        try:
            args[arg.name] = arg.parse(reader.render(value, value_node, label))
        except ValueError as exc:
            reader.error(f"{label}: {arg.name}: {exc}", value_node)
            ok = False
    if not ok:
        return None
    return PlaybookStep(op_name, MappingProxyType(args), reader.loc(node), name, index)


def load_playbook_text(
    text: str, path: Path | None = None, extra_vars: Mapping[str, Any] | None = None
) -> Playbook:
    """Parse and validate a playbook given as text (`path` only names it in messages)."""
    reader = _Reader(path, text, {})
    try:
        root = compose(text)
    except yaml.MarkedYAMLError as exc:
        where = reader.source.mark(exc.problem_mark or exc.context_mark)
        raise PlaybookError(f"invalid YAML: {exc.problem or exc}", where) from None
    except yaml.YAMLError as exc:
        raise PlaybookError(f"invalid YAML: {exc}", reader.source.at(None)) from None
    if root is None or not isinstance(root, yaml.MappingNode):
        got = "an empty file" if root is None else node_kind(root)
        raise PlaybookError(
            f"a playbook is a mapping with name, hosts and steps; got {got}", reader.loc(root)
        )
    found = {key: (key_node, value_node) for key, key_node, value_node in reader.items(root)}
    for key, (key_node, _) in found.items():
        if key not in _TOP_KEYS:
            reader.error(
                f"unknown key {key!r}{did_you_mean(key, _TOP_KEYS)} (keys: {', '.join(_TOP_KEYS)})", key_node
            )
    variables: dict[str, Any] = {}
    if "vars" in found and not is_null(found["vars"][1]):
        vars_node = found["vars"][1]
        if isinstance(vars_node, yaml.MappingNode):
            variables = {key: node_value(value_node) for key, _, value_node in reader.items(vars_node)}
        else:
            reader.error(f"vars must be a mapping, got {node_kind(vars_node)}", vars_node)
    variables.update(extra_vars or {})
    reader.vars = variables
    name = ""
    if "name" not in found:
        reader.error("missing required key 'name'", root)
    else:
        raw_name = node_value(found["name"][1]) if isinstance(found["name"][1], yaml.ScalarNode) else None
        if not isinstance(raw_name, str) or not raw_name.strip():
            reader.error("name must be a non-empty string", found["name"][1])
        else:
            name = raw_name
    hosts = "all"
    if "hosts" in found:
        node = found["hosts"][1]
        raw_hosts = node_value(node) if isinstance(node, yaml.ScalarNode) else None
        try:
            hosts = _text(reader.render(raw_hosts, node, "hosts")).strip()
            if not hosts:
                raise ValueError("an empty pattern")
        except ValueError as exc:
            reader.error(f"hosts: expected a host pattern such as all or gpu:!gpu03 ({exc})", node)
    serial = _serial(reader, found["serial"][1]) if "serial" in found else None
    max_fail = _max_fail(reader, found["max_fail_percentage"][1]) if "max_fail_percentage" in found else None
    steps: list[PlaybookStep] = []
    if "steps" not in found:
        reader.error("missing required key 'steps' (a list of operations)", root)
    else:
        steps_node = found["steps"][1]
        if not isinstance(steps_node, yaml.SequenceNode) or not steps_node.value:
            reader.error(f"steps must be a non-empty list, got {node_kind(steps_node)}", steps_node)
        else:
            for index, step_node in enumerate(steps_node.value, start=1):
                step = _step(reader, step_node, index)
                if step is not None:
                    steps.append(step)
    if reader.errors:
        errors = sorted(
            reader.errors,
            key=lambda e: (e.location.line or 0, e.location.column or 0) if e.location else (0, 0),
        )
        raise errors[0] if len(errors) == 1 else PlaybookErrors(errors)
    return Playbook(name, tuple(steps), hosts, serial, max_fail, MappingProxyType(variables), path)


def load_playbook(path: Path | str, extra_vars: Mapping[str, Any] | None = None) -> Playbook:
    """Read, parse and validate the playbook at `path`; `extra_vars` (-e) override its vars."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlaybookError(f"playbook not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlaybookError(f"cannot read playbook {path}: {exc}") from None
    return load_playbook_text(text, path, extra_vars)


def rolling_restart_playbook(
    *,
    serial: Serial = 1,
    max_fail_percentage: float | None = 0,
    force: bool = False,
    hosts: str = "all",
) -> Playbook:
    """The playbook `rpcfleet rolling-restart` runs: one `restart` step in batches of `serial`."""
    op = REGISTRY["restart"]
    args = {a.name: a.default for a in op.args}
    args["force"] = force
    step = PlaybookStep("restart", MappingProxyType(args), None, None, 1)
    return Playbook("rolling restart", (step,), hosts, serial, max_fail_percentage)


# ------------------------------------------------------------------------------------------- running


@dataclass(frozen=True)
class StepRun:
    step: PlaybookStep
    run: RunResult[Any]


@dataclass(frozen=True)
class PlaybookResult:
    playbook: Playbook
    hosts: tuple[Host, ...]
    steps: tuple[StepRun, ...]
    documents: tuple[Document, ...] = ()
    aborted: bool = False  # a failure threshold stopped the play
    check: bool = False

    @property
    def recap(self) -> Recap:
        recap = Recap()
        for step_run in self.steps:
            recap.add(step_run.run)
        return recap

    @property
    def ok(self) -> bool:
        return (
            not self.aborted
            and all(s.run.ok for s in self.steps)
            and len(self.steps) == len(self.playbook.steps)
        )

    def by_host(self) -> dict[str, list[HostResult[Any]]]:
        """Every result of each host, step by step."""
        out: dict[str, list[HostResult[Any]]] = {h.name: [] for h in self.hosts}
        for step_run in self.steps:
            for result in step_run.run.results:
                out.setdefault(result.host.name, []).append(result)
        return out


def play_hosts(playbook: Playbook, inventory: Inventory, limit: str | None = None) -> list[Host]:
    """The play's hosts: its `hosts` pattern, narrowed by --limit (both Ansible patterns)."""
    hosts = select_hosts(inventory, playbook.hosts)
    if limit:
        allowed = {h.name for h in select_hosts(inventory, limit)}
        hosts = [h for h in hosts if h.name in allowed]
        if not hosts:
            raise UsageError(f"--limit {limit!r} leaves none of the play's hosts ({playbook.hosts!r})")
    return hosts


async def run_playbook(
    playbook: Playbook,
    hosts: Sequence[Host],
    *,
    session: Session,
    check: bool = False,
    on_step: Callable[[StepRun], None] | None = None,
    on_result: Callable[[HostResult[Any]], None] | None = None,
) -> PlaybookResult:
    """Run every step over the hosts still in play (see the module docstring); never raises for a
    host's failure: it is in the result."""
    in_play = tuple(hosts)
    state = PlayState()
    runs: list[StepRun] = []
    aborted = False
    for step in playbook.steps:
        if not in_play:
            break
        op = REGISTRY[step.op]
        play = _Play(session, in_play, check, state, step)
        run = await session.run(
            in_play,
            op.factory(step.args, play),
            name=step.label,
            serial=(list(playbook.serial) if isinstance(playbook.serial, tuple) else playbook.serial)
            if op.scope == "host"
            else None,
            max_fail_percentage=playbook.max_fail_percentage,
            on_result=on_result,
        )
        step_run = StepRun(step, run)
        runs.append(step_run)
        if on_step is not None:
            on_step(step_run)
        if run.aborted:
            aborted = True
            break
        in_play = tuple(r.host for r in run.results if r.succeeded)
    return PlaybookResult(playbook, tuple(hosts), tuple(runs), tuple(state.documents), aborted, check)


# ------------------------------------------------------------------------------ load check (a child)


@dataclass(frozen=True)
class DeviceCheck:
    """One device of a load check: the layers the plan put there and those llama.cpp placed there, and
    the memory predicted and allocated (bytes)."""

    label: str
    endpoint: str | None
    index: int
    planned_layers: tuple[int, ...]
    actual_layers: tuple[int, ...]
    predicted: MemoryBytes
    actual: MemoryBytes

    @property
    def as_planned(self) -> bool:
        return self.planned_layers == self.actual_layers

    @classmethod
    def from_json(cls, data: Any) -> DeviceCheck:
        """From the child's JSON; ValueError when a field is missing or of the wrong type."""
        from orchestrator.loader import MemoryBytes

        if not isinstance(data, dict):
            raise ValueError(f"a device must be an object, got {type(data).__name__}")
        endpoint = data.get("endpoint")
        if endpoint is not None and not isinstance(endpoint, str):
            raise ValueError(f"endpoint must be a string or null, got {endpoint!r}")
        return cls(
            label=_typed(data, "label", str),
            endpoint=endpoint,
            index=_typed(data, "index", int),
            planned_layers=_int_tuple(data, "planned_layers"),
            actual_layers=_int_tuple(data, "actual_layers"),
            predicted=MemoryBytes(**_int_mapping(data, "predicted", ("weights", "kv", "compute"))),
            actual=MemoryBytes(**_int_mapping(data, "actual", ("weights", "kv", "compute"))),
        )


@dataclass(frozen=True)
class LoadCheckResult:
    """What `load_check` found: whether every device got the layers the plan gave it, how long the load
    took, and each device."""

    layers_as_planned: bool
    load_seconds: float
    devices: tuple[DeviceCheck, ...]

    @classmethod
    def from_json(cls, data: Any) -> LoadCheckResult:
        """From the child's JSON; ValueError when it is not the expected shape."""
        if not isinstance(data, dict):
            raise ValueError(f"the answer must be an object, got {type(data).__name__}")
        devices = data.get("devices")
        if not isinstance(devices, list):
            raise ValueError("devices must be a list")
        seconds = data.get("load_seconds")
        if not isinstance(seconds, int | float) or isinstance(seconds, bool):
            raise ValueError(f"load_seconds must be a number, got {seconds!r}")
        return cls(
            layers_as_planned=_typed(data, "layers_as_planned", bool),
            load_seconds=float(seconds),
            devices=tuple(DeviceCheck.from_json(d) for d in devices),
        )


def _typed(data: Mapping[str, Any], key: str, kind: type[T]) -> T:
    value = data.get(key)
    # bool is an int: an int field must not take true/false (and a bool field takes only those).
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{key} must be {kind.__name__}, got {value!r}")
    return value


def _int_tuple(data: Mapping[str, Any], key: str) -> tuple[int, ...]:
    value = data.get(key)
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise ValueError(f"{key} must be a list of integers, got {value!r}")
    return tuple(value)


def _int_mapping(data: Mapping[str, Any], key: str, keys: Sequence[str]) -> dict[str, int]:
    value = data.get(key)
    if not isinstance(value, dict) or not all(
        isinstance(value.get(k), int) and not isinstance(value.get(k), bool) for k in keys
    ):
        raise ValueError(f"{key} must be an object with integers {', '.join(keys)}, got {value!r}")
    return {k: value[k] for k in keys}


async def load_check(
    plan: Plan, model: str | Path, *, limit_s: float = _LOAD_CHECK_TIMEOUT
) -> LoadCheckResult:
    """Load `model` through `plan` in a child Python process and return where its layers went.

    A child, because a loaded model holds its servers for the life of the process that loaded it (one
    client per server) and the native client aborts its process when a server misbehaves. The child
    never outlives this call: on a timeout, a cancellation (Ctrl-C, an outer timeout) or any other
    error it is killed and reaped, so the servers are free again.
    """
    request = json.dumps({"plan": plan.to_json(), "model": str(model)}).encode()
    env = {
        **os.environ,
        "GGML_NO_BACKTRACE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")])),
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "from orchestrator.playbook import _load_check_child; _load_check_child()",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(request), limit_s)
    except TimeoutError:
        await _kill(process)
        raise LoaderError(f"loading {model} did not finish within {limit_s:g} s") from None
    except BaseException:
        await _kill(process)
        raise
    text = stderr.decode(errors="replace")
    try:
        answer = json.loads(stdout.decode(errors="replace").strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise LoaderError(
            f"the load check of {model} died (exit status {process.returncode})", stderr=text
        ) from None
    if isinstance(answer, dict) and "error" in answer:
        raise LoaderError(f"loading {model} failed: {answer['error']}", hint=answer.get("hint"), stderr=text)
    try:
        return LoadCheckResult.from_json(answer)
    except ValueError as exc:
        raise LoaderError(f"the load check of {model} answered malformed JSON: {exc}", stderr=text) from None


async def _kill(process: asyncio.subprocess.Process) -> None:
    """Kill `process` and reap it, even when the caller is being cancelled."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    # Shielded: a second cancellation must not leave a zombie (or a live child) behind.
    await asyncio.shield(process.wait())


def _load_check_child() -> None:
    """The child of `load_check`: a plan and a model path as JSON on stdin, one JSON line on stdout."""
    from orchestrator.loader import load_llama, placement_of
    from orchestrator.planner import Plan

    request = json.loads(sys.stdin.read())
    try:
        plan = Plan.from_json(request["plan"])
        llm = load_llama(plan, request["model"])
    except RpcfleetError as exc:
        print(json.dumps({"error": exc.message, "hint": exc.hint}), flush=True)
        return
    placement = placement_of(llm)
    devices = [
        {
            "label": d.label,
            "endpoint": d.endpoint,
            "index": d.index,
            "planned_layers": list(d.planned_layers),
            "actual_layers": list(d.actual_layers),
            "predicted": dataclasses.asdict(d.predicted),
            "actual": dataclasses.asdict(d.actual),
        }
        for d in placement.devices
    ]
    llm.close()
    answer = {
        "layers_as_planned": placement.layers_as_planned,
        "load_seconds": placement.load_seconds,
        "devices": devices,
    }
    print(json.dumps(answer), flush=True)
