"""`run_on_fleet`: the use case of `rpcfleet run`, its stages in flow order: read the model (or a saved
plan), start the worker, probe and plan on the command's one runtime, apply the fit policy, load through
the fleet (caches, targets, the worker), and generate. The front end gives typed options and callbacks,
and prints what they report and what this returns; it holds no orchestration of its own."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.core import signals
from orchestrator.engine.runtime import Runtime
from orchestrator.llama.worker.parent import Worker
from orchestrator.llama.worker.wire import Done
from orchestrator.planning.plan import Plan
from orchestrator.planning.profile import profile_model
from orchestrator.workflows.fit import check_fit
from orchestrator.workflows.load import FleetLoad, load_on_fleet
from orchestrator.workflows.plan import plan_for_fleet

if TYPE_CHECKING:
    from orchestrator.caches.prep import CachePrep, WarmChoice
    from orchestrator.inventory.model import Host
    from orchestrator.llama.observed_placement import Placement
    from orchestrator.llama.worker.load_progress import LoadProgress
    from orchestrator.planning.plan import PlanOptions
    from orchestrator.workflows.options import ProbeSettings


@dataclass(frozen=True)
class RunRequest:
    """What `rpcfleet run` was asked, parsed once: the model and the saved plan to load instead of planning
    (None: plan), how to read the hosts to plan on and those whose caches, tunnels and names the load uses,
    how to probe and plan, and what to generate."""

    model: Path
    saved_plan: Path | None
    hosts: Callable[[], tuple[Sequence[Host], Sequence[Host]]]  # read after the model, see `run_on_fleet`
    options: PlanOptions
    probe: ProbeSettings
    local_devices: Sequence[str] | None
    prompt: str
    n_predict: int
    temperature: float = 0.0
    seed: int = 0
    force: bool = False  # load a plan that does not fit (its refusal becomes a warning)
    verify_cache: bool = False
    warm: WarmChoice = "auto"
    llama_log_to_stderr: bool = False


@dataclass(frozen=True)
class RunEvents:
    """What the front end is told as the run goes (each optional), in this order: the signal a session
    caught (any time), the fit warning under `force`, the plan made (with the hosts the load goes
    through), the caches checked, the caches prepared (an interrupted check or warm ends the run there:
    nothing is loaded; a load beside the warm starts as the warm does), the load starting, its progress,
    the warm's end (a load beside it), the load's end (also when it failed), each piece of text (and a
    silence before one, every few seconds), the text's end (also when it failed)."""

    interrupt: Callable[[str, int], None] | None = None
    fit_warning: Callable[[str], None] | None = None
    planned: Callable[[Plan, Sequence[Host]], None] | None = None
    checked: Callable[[CachePrep], None] | None = None
    prepared: Callable[[FleetLoad], None] | None = None
    loading: Callable[[Plan], None] | None = None
    progress: Callable[[LoadProgress], None] | None = None
    warmed: Callable[[FleetLoad], None] | None = None
    load_ended: Callable[[], None] | None = None
    text: Callable[[str], None] | None = None
    text_ended: Callable[[], None] | None = None
    # the generation's silence, every few seconds: seconds without an answer (the first token waits for
    # the prompt's evaluation, in which a fresh Vulkan server compiles its shaders: minutes on llvmpipe)
    waiting: Callable[[float], None] | None = None


@dataclass
class RunOutcome:
    """The plan loaded, what the load found and did (`load.interrupted`: a signal during the caches'
    check or warm stopped the run before the load), the completion (None then), the phases' seconds and
    the worker's log (llama.cpp's own; None: it went to stderr)."""

    plan: Plan
    load: FleetLoad
    done: Done | None = None
    phases: dict[str, float] = field(default_factory=dict)
    log_path: Path | None = None

    @property
    def placement(self) -> Placement | None:
        return self.load.placement


def run_on_fleet(request: RunRequest, events: RunEvents, *, forks: int | None = None) -> RunOutcome:
    """Read, spawn, plan, judge the fit, load and generate, in that order; errors are the stages' own.
    The model is read first: a file that is no model (or no plan) is named before the inventory is read,
    the worker starts and the fleet is probed."""
    read = profile_model(request.model) if request.saved_plan is None else Plan.from_path(request.saved_plan)
    # llama.cpp runs in a worker process: a node lost mid-inference aborts the worker, not this process.
    # Spawned first, so its imports overlap with the probe and the plan. One loop and one session for the
    # command: the probe's SSH connections serve the cache check.
    with (
        Worker.spawn(log_to_stderr=request.llama_log_to_stderr) as worker,
        Runtime(forks=forks, on_interrupt=events.interrupt) as runtime,
    ):
        hosts, cache_hosts = request.hosts()
        phases: dict[str, float] = {}
        if isinstance(read, Plan):
            plan, phases["plan"] = read, 0.0
        else:
            round_ = runtime.run(
                plan_for_fleet(
                    hosts,
                    read,
                    request.options,
                    probe=request.probe,
                    session=runtime.session,
                    local_devices=request.local_devices,
                    local_gpus=worker.local_gpus,
                )
            )
            assert round_.plan is not None  # failed="raise": no plan is an error
            plan, phases["probe"], phases["plan"] = round_.plan, round_.probe_seconds, round_.plan_seconds
        warning = check_fit(plan, force=request.force)
        if warning is not None and events.fit_warning is not None:
            events.fit_warning(warning)
        if events.planned is not None:
            events.planned(plan, cache_hosts)

        def prepared(done: FleetLoad) -> None:
            if events.prepared is not None:
                events.prepared(done)
            if done.interrupted:
                return  # load_on_fleet loads nothing
            signals.raise_if_interrupted()  # one swallowed during the probe or the plan: no load follows
            if events.loading is not None:
                events.loading(plan)

        try:
            loaded = load_on_fleet(
                plan,
                cache_hosts,
                worker,
                request.model,
                runtime=runtime,
                interruptible=True,
                verify=request.verify_cache,
                warm=request.warm,
                llama_kwargs={"seed": request.seed},
                on_checked=events.checked,
                on_prepared=prepared,
                on_warmed=events.warmed,
                on_progress=events.progress,
            )
        finally:
            if events.load_ended is not None:
                events.load_ended()
        outcome = RunOutcome(plan, loaded, None, phases | loaded.phases, worker.log_path)
        if loaded.interrupted:
            return outcome
        try:
            outcome.done = generate(
                worker,
                request.prompt,
                request.n_predict,
                request.temperature,
                request.seed,
                events.text,
                on_wait=events.waiting,
            )
        finally:
            if events.text_ended is not None:
                events.text_ended()
        return outcome


def generate(
    worker: Worker,
    prompt: str,
    n: int,
    temperature: float,
    seed: int,
    on_text: Callable[[str], None] | None,
    *,
    on_wait: Callable[[float], None] | None = None,
) -> Done:
    """Stream a completion from the worker (each piece to `on_text` as it comes, the seconds of a silence
    to `on_wait` every few seconds); a signal ends it."""
    events = worker.complete(prompt, max_tokens=n, temperature=temperature, seed=seed, on_wait=on_wait)
    for event in events:
        signals.raise_if_interrupted()
        if isinstance(event, Done):
            return event
        if on_text is not None:
            on_text(event.text)
    raise AssertionError("the worker's stream ended without its Done")
