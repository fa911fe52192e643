"""`plan_for_fleet`: probe the hosts, release the servers held by a client proven gone, order the devices
(every RPC device, then this machine's GPUs as the worker lists them), plan, and judge the fit: one
`PlanRound`, the same for `rpcfleet plan` and `run`, the playbooks' `plan` step and serve."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from orchestrator.core.errors import PlanError, ProbeError, RpcfleetError, UsageError
from orchestrator.engine.executor import Session
from orchestrator.engine.runtime import run_once
from orchestrator.inventory.model import Host
from orchestrator.planning.devices import to_plan_devices
from orchestrator.planning.draft import DraftModel
from orchestrator.planning.formations import FormationError, Formations, ServedModel, form
from orchestrator.planning.layer_assignment import order_devices
from orchestrator.planning.plan import Plan, PlanDevice, PlanOptions
from orchestrator.planning.profile import ModelProfile, profile_model
from orchestrator.planning.strategy import make_plan
from orchestrator.probe.fleet import FleetProbe, probe_fleet
from orchestrator.workflows.fit import CLI_WORDS, FitWords, misfit_error
from orchestrator.workflows.options import ModelPlanning, ProbeSettings

LocalGpus = Callable[[], list[PlanDevice]]


def states_of(fleet: FleetProbe) -> dict[str, str]:
    """Endpoint -> probe state; an answering node whose memory is not measured is `unmeasured`."""
    return {n.endpoint: ("unmeasured" if n.ok and n.untrusted else n.state) for n in fleet.nodes}


@dataclass(frozen=True)
class PlanRound:
    """One probe and plan. `plan`: the plan made (also one that does not fit; None when none could be
    made: `error` says why); `misfit`: the fit policy's refusal of it (None: it fits); `reason`: why
    there is no plan to load, in a line (empty when `fitting`)."""

    plan: Plan | None
    states: dict[str, str]  # endpoint -> probe state ("ok", "refused", "timeout", ...)
    probe_seconds: float
    plan_seconds: float
    reason: str = ""
    fleet: FleetProbe | None = None
    devices: tuple[PlanDevice, ...] = ()  # the devices planned on, in the planner's order
    error: RpcfleetError | None = None  # why no plan could be made
    misfit: PlanError | None = field(default=None)

    @property
    def fitting(self) -> Plan | None:
        """The plan when it fits (serve loads only such a one)."""
        return self.plan if self.plan is not None and self.misfit is None else None


async def probe_hosts(
    hosts: Sequence[Host],
    probe: ProbeSettings,
    *,
    session: Session | None = None,
) -> FleetProbe:
    """Probe `hosts` with `probe`'s settings."""
    if not hosts:
        raise UsageError("no hosts selected")
    return await probe_fleet(
        hosts,
        timeout=probe.timeout,
        facts=probe.facts,
        forks=probe.forks,
        session=session,
        trust_rpc_memory=probe.trust_rpc_memory,
    )


def ordered_devices(
    fleet: FleetProbe,
    *,
    failed: Literal["raise", "skip"] = "raise",
    local_devices: Sequence[str] | None = None,
    local_gpus: LocalGpus | None = None,
) -> tuple[PlanDevice, ...]:
    """The planner's devices: every RPC device of each endpoint in inventory order, then the selected
    local GPUs (`local_devices`: None = all, [] = none). They come from `local_gpus` (`run`: its worker's;
    serve: its listing, made once), by default from a worker child started to list them: this process
    never loads libllama."""
    from orchestrator.llama.worker.parent import list_local_gpus

    rpc = to_plan_devices(fleet, failed=failed)
    if failed == "skip" and not rpc:
        return ()
    selection = None if local_devices is None else list(local_devices)
    gpus = [] if selection == [] else (local_gpus or list_local_gpus)()  # none wanted: no child
    return order_devices(rpc, gpus, selection)


async def plan_for_fleet(
    hosts: Sequence[Host],
    profile: ModelProfile,
    options: PlanOptions,
    *,
    probe: ProbeSettings,
    session: Session | None = None,
    local_devices: Sequence[str] | None = None,
    local_gpus: LocalGpus | None = None,
    failed: Literal["raise", "skip"] = "raise",
    fleet: FleetProbe | None = None,
    words: FitWords = CLI_WORDS,
    draft: DraftModel | None = None,
) -> PlanRound:
    """Probe `hosts` (or take `fleet`, a probe already made), plan `profile` on their devices, and judge
    the fit (`fit.misfit_error` in the front end's `words`).

    `failed="raise"` (the CLI, the playbooks): a node that is down or unmeasured, and a plan that cannot
    be made, raise their ProbeError / PlanError. `failed="skip"` (serve): such nodes are left out, and no
    plan is an answer, not an error: `plan` None with the `reason` ("no node answers", the planner's
    refusal)."""
    started = time.monotonic()
    if fleet is None:
        fleet = await probe_hosts(hosts, probe, session=session)
    probed = time.monotonic()
    states = states_of(fleet)
    try:
        devices = ordered_devices(fleet, failed=failed, local_devices=local_devices, local_gpus=local_gpus)
        if failed == "skip" and not devices:
            return PlanRound(None, states, probed - started, 0.0, "no node answers", fleet)
        plan = make_plan(devices, profile, options, draft)
    except (PlanError, ProbeError) as exc:
        if failed == "raise":
            raise
        return PlanRound(
            None, states, probed - started, time.monotonic() - probed, exc.message, fleet, error=exc
        )
    misfit = misfit_error(plan, words)
    reason = "" if misfit is None else misfit.message
    return PlanRound(
        plan, states, probed - started, time.monotonic() - probed, reason, fleet, tuple(devices), None, misfit
    )


def plan_model(
    planning: ModelPlanning, hosts: Callable[[], Sequence[Host]]
) -> tuple[ModelProfile, PlanRound]:
    """Read the model, then the hosts (so a file that is no model is named before a bad inventory), and
    plan it on them (`plan_for_fleet`, failed="raise"): its profile and the round."""
    profile = profile_model(planning.model)
    selected = hosts()
    round_ = run_once(
        plan_for_fleet(
            selected, profile, planning.options, probe=planning.probe, local_devices=planning.local_devices
        )
    )
    return profile, round_


def plan_formations(
    models: Sequence[ServedModel],
    hosts: Sequence[Host],
    devices: Sequence[PlanDevice],
    replicas: str,
    *,
    local_devices: Sequence[str] | None = None,
) -> Formations:
    """The formations of `models` on the probed `devices` (this machine's GPUs among them join the first
    formation), as `plan`, `report` and `serve` show them. A model that gets none: PlanError."""
    rpc = [d for d in devices if d.ok and d.endpoint is not None]
    local = [d for d in devices if d.endpoint is None]
    try:
        formed, spares = form(models, hosts, rpc, local, local_devices)
    except FormationError as exc:
        raise PlanError(f"no formations: {exc}") from None
    return Formations(tuple(formed), tuple(spares), replicas)
