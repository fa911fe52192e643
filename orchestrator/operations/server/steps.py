"""Service operations: ensure a server's state, deploy, rollback, and their executor steps."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from orchestrator.connectors.base import Connection
from orchestrator.connectors.nodescript import NodeScript, Planned, run_script, would_run
from orchestrator.core.errors import ServiceError, ServiceScriptError
from orchestrator.engine.executor import HostContext, Step, StepOutcome
from orchestrator.facts.server import (
    LogTailFact,
)
from orchestrator.inventory.model import Host
from orchestrator.operations import BUSY_GRACE
from orchestrator.operations.firewall import apply_firewall, planned_firewall
from orchestrator.operations.follow import NOISE_PATTERN
from orchestrator.operations.install.apply import apply_install, planned_install
from orchestrator.operations.install.ensure import (
    ArtifactChooser,
    BuildLogFactory,
    ProgressFactory,
    ensure_installed,
)
from orchestrator.operations.install.plan import (
    InstallChange,
    InstallState,
    plan_rollback,
    read_install_state,
)
from orchestrator.operations.layer import DEFAULT_OPTIONS, OperationOptions, first_of_install, node_operation
from orchestrator.operations.server.process import (
    launch_drift,
    planned_start,
    refuse_if_busy,
    run_as_warning,
    start_server,
    stop_node_script,
    stop_server,
    unit_text,
    wait_ready,
)
from orchestrator.operations.server.state import (
    NodeState,
    ServerStatus,
    bind_policy,
    classify,
    node_path,
    probe_server,
    read_node_state,
    server_files,
    server_status,
)
from orchestrator.operations.systemd import journal_command, plan_unit, remove_unit_script

ServiceAction = Literal["none", "start", "restart", "stop"]
Want = Literal["running", "stopped", "restarted"]
_PAST = {"start": "started", "restart": "restarted", "stop": "stopped"}


@dataclass(frozen=True)
class ServiceChange:
    """What an operation did to one server: the action, why, and the status before and after it."""

    host: str
    action: ServiceAction
    reason: str = ""
    status: ServerStatus | None = None  # before the change
    warnings: tuple[str, ...] = ()
    after: ServerStatus | None = None  # after the change (None: nothing changed, or --check)
    check: bool = False

    @property
    def changed(self) -> bool:
        return self.action != "none"

    def describe(self) -> str:
        """The result, not the previous state: `started: running pid 1234, version X (stopped)`."""
        if self.action == "none":
            return self.reason or "nothing to do"
        if self.check or self.after is None:
            return f"would {self.action}: {self.reason}" if self.reason else f"would {self.action}"
        why = f" ({self.reason})" if self.reason else ""
        if self.after.state == "stopped" and self.action == "stop":
            return f"stopped{why}"  # "stopped: stopped" says nothing more
        return f"{_PAST[self.action]}: {describe_status(self.after)}{why}"

    def to_json(self) -> dict[str, object]:
        return {
            "action": self.action,
            "reason": self.reason,
            "warnings": list(self.warnings),
            "check": self.check,
            "after": self.after.to_json() if self.after else None,
        }


def describe_status(status: ServerStatus) -> str:
    """`running pid 1234, version X` / `stopped` / `busy pid 1234, version X`."""
    if status.state in ("stopped", "crashed", "crash-looping", "orphan") or status.pid is None:
        return f"{status.state}" + (
            f": {status.message}" if status.message and status.state != "stopped" else ""
        )
    version = status.running_version or status.version
    return f"{status.state} pid {status.pid}" + (f", version {version}" if version else "")


def plan_service(
    status: ServerStatus, want: Want, *, current: str | None, drift: tuple[str, ...] = ()
) -> ServiceChange:
    """Pure: what brings the server to `want`, given its status, the installed version `current` and how
    its launch line differs from the inventory's (`drift`)."""
    host = status.host
    if want == "stopped":
        if status.state == "stopped":
            return ServiceChange(host, "none", "stopped", status)
        if status.state in ("crashed", "crash-looping"):
            return ServiceChange(
                host, "stop", f"remove the stale pid file of a {status.state} server", status
            )
        if status.state == "orphan":
            return ServiceChange(host, "stop", status.message, status)
        return ServiceChange(host, "stop", f"was {status.state} pid {status.pid}", status)
    if want == "restarted":
        running = status.pid is not None and status.state not in ("stopped", "crashed", "crash-looping")
        if status.state == "orphan":
            return ServiceChange(host, "restart", "replace the orphan", status)
        return ServiceChange(host, "restart" if running else "start", "restart requested", status)
    if status.state in ("stopped", "crashed", "crash-looping"):
        return ServiceChange(host, "start", f"was {status.state}", status)
    if status.state == "orphan":
        return ServiceChange(host, "restart", status.message, status)
    if status.running_version != current:
        reason = f"was running {status.running_version}, installed {current}"
        return ServiceChange(host, "restart", reason, status)
    if drift:
        return ServiceChange(host, "restart", f"launch line: {', '.join(drift)}", status)
    if status.state == "unhealthy":
        return ServiceChange(host, "restart", f"was unhealthy: {status.message}", status)
    return ServiceChange(host, "none", describe_status(status), status)


async def ensure_state(
    conn: Connection,
    host: Host,
    want: Want,
    *,
    check: bool = False,
    force: bool = False,
    busy_grace: float = BUSY_GRACE,
    state: NodeState | None = None,
) -> ServiceChange:
    """Read (unless given), plan, and (unless `check`) apply: start, stop or restart the server, then read
    the state it left. A busy server is never stopped without `force` (checked again on the node)."""
    warnings: list[str] = []
    if want != "stopped":
        warning = bind_policy(host)
        if warning:
            warnings.append(warning)
    state = state or await read_node_state(conn, host)
    root = run_as_warning(host, state) if want != "stopped" else None
    if root:
        warnings.append(root)
    status = classify(host, state, await probe_server(host, state))
    change = plan_service(status, want, current=state.install.current, drift=launch_drift(host, state))
    change = dataclasses.replace(change, warnings=tuple(warnings), check=check)
    stops = change.action in ("stop", "restart") and status.pid is not None
    if check and stops and not force:
        await refuse_if_busy(conn, host, change.action, busy_grace=busy_grace)  # what the stop would say
    if check and change.action in ("start", "restart"):
        change = dataclasses.replace(
            change, reason="; ".join(filter(None, [change.reason, _unit_plan(host, state)]))
        )
    install_dir = state.install.install_dir
    if check:
        would_run(host.name, planned_service(host, state, change, want, force=force, busy_grace=busy_grace))
    if not change.changed or check:
        if not check:  # rpc_allow_from follows the inventory even when the server is left as it is
            await apply_firewall(conn, host, install_dir, install=want != "stopped")
        return change
    if change.action in ("stop", "restart"):
        await stop_server(conn, host, state, force=force, busy_grace=busy_grace, action=change.action)
        if change.action == "stop":  # the rules go with the server
            await apply_firewall(conn, host, install_dir, install=False)
    if change.action in ("start", "restart"):
        pid = await start_server(conn, host, state)  # rpc_allow_from's rules first
        await wait_ready(conn, host, state, pid)
    return dataclasses.replace(change, after=await server_status(conn, host))


def planned_service(
    host: Host,
    state: NodeState,
    change: ServiceChange,
    want: Want,
    *,
    force: bool = False,
    busy_grace: float = BUSY_GRACE,
) -> list[NodeScript | Planned]:
    """Check mode: the node scripts `ensure_state` would run for `change`, in its order."""
    install_dir = state.install.install_dir
    if not change.changed:
        return [*planned_firewall(host, install_dir, install=want != "stopped")]
    planned: list[NodeScript | Planned] = []
    if change.action in ("stop", "restart"):
        planned.append(stop_node_script(host, state, force=force, busy_grace=busy_grace))
        if change.action == "stop":
            planned += planned_firewall(host, install_dir, install=False)
    if change.action in ("start", "restart"):
        planned += planned_start(host, state)
    return planned


def _unit_plan(host: Host, state: NodeState) -> str:
    """What starting under systemd would do to the unit (`--check` shows it; "" when nothing)."""
    text = unit_text(host, state)
    if text is None or state.unit is None or state.systemd is None:
        return ""
    plan = plan_unit(state.unit, text, state.systemd)
    return plan.describe() if plan.changed else ""


def make_service_step(want: Want, options: OperationOptions) -> Step[ServiceChange]:
    """`rpcfleet start | stop | restart` on one host, through the operations layer."""

    async def body(ctx: HostContext, conn: Connection) -> StepOutcome[ServiceChange]:
        change = await ensure_state(
            conn, ctx.host, want, check=options.check, force=options.force, busy_grace=options.busy_grace
        )
        return StepOutcome(change, change.changed, change.describe())

    name = {"running": "start", "stopped": "stop", "restarted": "restart"}[want]
    return node_operation(name, body, options)


def make_status_step() -> Callable[[HostContext], Awaitable[StepOutcome[ServerStatus]]]:
    async def status(ctx: HostContext) -> StepOutcome[ServerStatus]:
        result = await server_status(await ctx.connection(), ctx.host)
        return StepOutcome(
            result, False, f"{result.state}: {result.message}" if result.message else result.state
        )

    return status


def make_logs_step(
    lines: int = 50, *, noise: bool = False
) -> Callable[[HostContext], Awaitable[StepOutcome[str]]]:
    """The last `lines` lines of the server's log (its unit's journal under systemd); without the
    connection lines of probes (`follow.NOISE_PATTERN`) unless `noise`, left out before the last
    `lines` are taken."""
    drop = "" if noise else NOISE_PATTERN

    async def logs(ctx: HostContext) -> StepOutcome[str]:
        conn = await ctx.connection()
        state = await read_node_state(conn, ctx.host)
        if state.supervisor == "systemd" and state.unit is not None:
            command = journal_command(state.unit.name, lines, user=state.unit.user, drop=drop)
            journal = (await conn.run(command, timeout=15)).stdout
            return StepOutcome(
                journal, False, f"{len(journal.splitlines())} lines (journal of {state.unit.name})"
            )
        fact = LogTailFact(node_path(ctx.host.install_dir, server_files(ctx.host.server).log), lines, drop)
        result = await conn.run(fact.command(), timeout=15)
        text = fact.parse(result.stdout, result.stderr, result.exit_status)
        if text is None:
            raise ServiceError("no rpc-server log yet", host=ctx.host.name, stderr=result.stderr)
        return StepOutcome(text, False, f"{len(text.splitlines())} lines")

    return logs


async def remove_unit(
    conn: Connection, host: Host, *, check: bool = False, force: bool = False, busy_grace: float = BUSY_GRACE
) -> str:
    """Stop the server (a busy one only with `force`) and remove its systemd unit (and, with the last one,
    the dedicated user). Nothing to do where the install has no unit. Returns what was (or would be) done."""
    state = await read_node_state(conn, host)
    unit = state.unit
    if unit is None or not unit.installed:
        return "no unit"
    if check:
        if state.service.ours and not force:
            await refuse_if_busy(conn, host, "stop", busy_grace=busy_grace)
        would_run(host.name, [remove_unit_node_script(unit.name, user=unit.user)])
        return f"would stop and remove {unit.name}"
    await ensure_state(conn, host, "stopped", force=force, busy_grace=busy_grace, state=state)
    # A failure keeps the unit file: the unit may still be enabled or running.
    result = await run_script(conn, remove_unit_node_script(unit.name, user=unit.user))
    return f"removed {unit.name}" + (", and user rpcfleet" if "userdel" in result else "")


def remove_unit_node_script(name: str, *, user: bool) -> NodeScript:
    return NodeScript(
        "remove-unit",
        remove_unit_script(name, user=user),
        60,
        f"could not remove {name}",
        ServiceScriptError,
        hint="the unit file was kept; see systemctl's message, fix it and remove the unit again",
    )


def make_remove_unit_step(options: OperationOptions = DEFAULT_OPTIONS) -> Step[str]:
    """The teardown's `remove_unit`, through the operations layer (lock, busy check, check mode)."""

    async def body(ctx: HostContext, conn: Connection) -> StepOutcome[str]:
        done = await remove_unit(
            conn, ctx.host, check=options.check, force=options.force, busy_grace=options.busy_grace
        )
        return StepOutcome(done, done.startswith("removed"), done)

    return node_operation("remove_unit", body, options)


@dataclass(frozen=True)
class DeployResult:
    """One host's deploy: the install change, the server change, and the server's status after."""

    install: InstallChange
    service: ServiceChange
    status: ServerStatus | None = None
    warnings: tuple[str, ...] = field(default=())

    @property
    def changed(self) -> bool:
        return self.install.changed or self.service.changed

    def describe(self) -> str:
        parts = []
        if self.install.changed:
            parts.append(self.install.describe())
        if self.service.changed or not self.install.changed:
            parts.append(self.service.describe())
        return "; ".join(parts)

    def to_json(self) -> dict[str, object]:
        return {
            "install": self.install.to_json(),
            "service": self.service.to_json(),
            "warnings": list(self.warnings),
        }


async def deploy(
    conn: Connection,
    host: Host,
    choose: ArtifactChooser,
    *,
    check: bool = False,
    force: bool = False,
    reinstall: bool = False,
    progress: ProgressFactory | None = None,
    build_log: BuildLogFactory | None = None,
) -> DeployResult:
    """Install the pinned artifact and have it serve with the inventory's launch line: one state read,
    then only the needed changes.

    A failed install (or on-node build) raises before the server is touched: the running version keeps
    serving. A busy server is refused (unless `force`) before anything is installed.
    """
    warning = bind_policy(host)  # refuse a bad bind before changing anything
    state = await read_node_state(conn, host)
    if state.service.clients and state.service.ours and not force:
        # Refuse before switching versions: a switch that cannot be followed by a restart is half a deploy.
        source = await choose(host, state.install)
        would = plan_service(
            classify(host, state, None),
            "running",
            current=source.id,
            drift=launch_drift(host, state),
        )
        if would.changed:
            await refuse_if_busy(conn, host, "deploy to")
    if host.server and not force and not check:
        await _refuse_busy_siblings(conn, host, choose, state.install)
    change = await ensure_installed(
        conn,
        host,
        choose,
        state=state.install,
        check=check,
        force=reinstall,
        progress=progress,
        build_log=build_log,
    )
    if change.changed and change.manifest is None and not check:
        # A switch to a version built on the node: only the node has its manifest.
        state = dataclasses.replace(state, install=await read_install_state(conn, host))
    elif change.changed:
        # What the install made (or, with --check, would make) current: no second read needed.
        installed = sorted({*state.install.versions, change.version} - set(change.prune))
        manifest = change.manifest or state.install.manifest
        install = dataclasses.replace(
            state.install, current=change.version, versions=tuple(installed), manifest=manifest, problems=()
        )
        state = dataclasses.replace(state, install=install)
    service = await ensure_state(conn, host, "running", check=check, force=force, state=state)
    # The server's warnings (root) too; the bind's only once.
    warnings = tuple(dict.fromkeys([*((warning,) if warning else ()), *service.warnings]))
    return DeployResult(change, service, service.after or service.status, warnings)


async def _refuse_busy_siblings(
    conn: Connection, host: Host, choose: ArtifactChooser, install: InstallState
) -> None:
    """One of several servers (`rpc_servers`): a new version switched in for this one is the version
    every server of the install restarts on, so a busy one among them refuses the switch before it is
    made, as this server's own client would."""
    source = await choose(host, install)
    if source.id == install.current:
        return
    for server in host.rpc_servers:
        if server.name != host.server:
            sibling = dataclasses.replace(host, rpc_port=server.port, name=f"{host.node_name}/{server.name}")
            await refuse_if_busy(conn, sibling, f"switch the install of {host.node_name} under")


def make_deploy_step(
    choose: ArtifactChooser,
    options: OperationOptions = DEFAULT_OPTIONS,
    *,
    reinstall: bool = False,
    progress: ProgressFactory | None = None,
    build_log: BuildLogFactory | None = None,
) -> Step[DeployResult]:
    async def body(ctx: HostContext, conn: Connection) -> StepOutcome[DeployResult]:
        result = await deploy(
            conn,
            ctx.host,
            choose,
            check=options.check,
            force=options.force,
            # One install serves every server of a host: the run's first reinstalls, the others find it.
            reinstall=reinstall and first_of_install(ctx),
            progress=progress,
            build_log=build_log,
        )
        if ctx.host.rpc_cache and not options.check:
            result = await _verify_cache(conn, ctx.host, result)
        return StepOutcome(result, result.changed, result.describe())

    return node_operation("deploy", body, options)


async def _verify_cache(conn: Connection, host: Host, result: DeployResult) -> DeployResult:
    """On deploy, the tensor cache is re-hashed and truncated or corrupt files removed (they would be loaded
    as weights unchecked), then pruned to `rpc_cache_max`; what was removed becomes a warning."""
    from orchestrator.operations.cache import prune, verify

    checked = await verify(conn, host)
    pruned = await prune(conn, host)
    notes = []
    if checked.corrupt:
        notes.append(f"tensor cache: removed {len(checked.corrupt)} truncated or corrupt file(s)")
    if pruned.removed:
        notes.append(
            f"tensor cache: pruned {len(pruned.removed)} least recently used file(s) (rpc_cache_max)"
        )
    return dataclasses.replace(result, warnings=(*result.warnings, *notes)) if notes else result


async def rollback(
    conn: Connection,
    host: Host,
    *,
    to: str | None = None,
    check: bool = False,
    force: bool = False,
    switch: bool = True,
) -> DeployResult:
    """Switch `current` back to the previous version (or `to`) and have that version serve.

    `switch=False`: another server of this install switched it back in this run (one install, several
    servers): this one only has to run the version that is current now."""
    state = await read_node_state(conn, host)
    change = plan_rollback(state.install, to=to if switch else state.install.current)
    if change.changed and state.service.clients and state.service.ours and not force:
        await refuse_if_busy(conn, host, "roll back")
    if change.changed and not check:
        await apply_install(conn, change)
        state = await read_node_state(conn, host)
    elif change.changed:
        would_run(host.name, planned_install(change))
        state = dataclasses.replace(state, install=dataclasses.replace(state.install, current=change.version))
    service = await ensure_state(conn, host, "running", check=check, force=force, state=state)
    return DeployResult(change, service, service.after or service.status)


def make_rollback_step(
    options: OperationOptions = DEFAULT_OPTIONS, *, to: str | None = None
) -> Step[DeployResult]:
    async def body(ctx: HostContext, conn: Connection) -> StepOutcome[DeployResult]:
        result = await rollback(
            conn, ctx.host, to=to, check=options.check, force=options.force, switch=first_of_install(ctx)
        )
        return StepOutcome(result, result.changed, result.describe())

    return node_operation("rollback", body, options)
