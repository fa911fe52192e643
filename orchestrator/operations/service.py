"""Service operations: ensure a server's state, deploy, rollback, and their executor steps."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from orchestrator.connectors.base import Connection
from orchestrator.core.errors import ServiceError
from orchestrator.engine.executor import HostContext, StepOutcome
from orchestrator.facts.server import (
    LogTailFact,
)
from orchestrator.inventory.model import Host
from orchestrator.operations.install import (
    ArtifactChooser,
    BuildLogFactory,
    ProgressFactory,
    ensure_installed,
)
from orchestrator.operations.install_apply import apply_install
from orchestrator.operations.install_plan import (
    InstallChange,
    plan_rollback,
    read_install_state,
)
from orchestrator.operations.process import start_server, stop_server, supervisor_drift, wait_ready
from orchestrator.operations.server import (
    LOG_FILE,
    NodeState,
    ServerStatus,
    _node_path,
    bind_policy,
    classify,
    probe_server,
    read_node_state,
    server_status,
)
from orchestrator.operations.systemd import journal_command, remove_unit_script

ServiceAction = Literal["none", "start", "restart", "stop"]


@dataclass(frozen=True)
class ServiceChange:
    host: str
    action: ServiceAction
    reason: str = ""
    status: ServerStatus | None = None  # before the change
    warnings: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return self.action != "none"

    def describe(self) -> str:
        if self.action == "none":
            return self.reason or "nothing to do"
        return f"{self.action}: {self.reason}" if self.reason else self.action

    def to_json(self) -> dict[str, object]:
        return {"action": self.action, "reason": self.reason, "warnings": list(self.warnings)}


def plan_service(
    status: ServerStatus,
    want: Literal["running", "stopped", "restarted"],
    *,
    current: str | None,
    drift: str = "",
) -> ServiceChange:
    """Pure: what brings the server to `want`, given its status and the installed version `current`."""
    host = status.host
    if want == "stopped":
        if status.state == "stopped":
            return ServiceChange(host, "none", "already stopped", status)
        if status.state == "crashed":
            return ServiceChange(host, "stop", "remove the stale pid file of a crashed server", status)
        return ServiceChange(host, "stop", f"{status.state} (pid {status.pid})", status)
    if want == "restarted":
        return ServiceChange(host, "restart" if status.pid else "start", "restart requested", status)
    if status.state in ("stopped", "crashed"):
        return ServiceChange(host, "start", status.state, status)
    if status.running_version != current:
        reason = f"running {status.running_version}, installed {current}"
        return ServiceChange(host, "restart", reason, status)
    if status.state == "unhealthy":
        return ServiceChange(host, "restart", f"unhealthy: {status.message}", status)
    if drift:
        return ServiceChange(host, "restart", drift, status)
    return ServiceChange(host, "none", f"{status.state} (pid {status.pid})", status)


async def ensure_state(
    conn: Connection,
    host: Host,
    want: Literal["running", "stopped", "restarted"],
    *,
    check: bool = False,
    state: NodeState | None = None,
) -> ServiceChange:
    """Read (unless given), plan, and (unless `check`) apply: start, stop or restart the server."""
    warnings: list[str] = []
    if want != "stopped":
        warning = bind_policy(host)
        if warning:
            warnings.append(warning)
    state = state or await read_node_state(conn, host)
    status = classify(host, state, await probe_server(host, state))
    change = plan_service(status, want, current=state.install.current, drift=supervisor_drift(host, state))
    change = ServiceChange(change.host, change.action, change.reason, status, tuple(warnings))
    if not change.changed or check:
        return change
    install_dir = state.install.install_dir
    if change.action in ("stop", "restart"):
        await stop_server(conn, host, install_dir, state=state)
    if change.action in ("start", "restart"):
        pid = await start_server(conn, host, state)
        await wait_ready(conn, host, state, pid)
    return change


async def ensure_running(
    conn: Connection, host: Host, *, check: bool = False, state: NodeState | None = None
) -> ServiceChange:
    return await ensure_state(conn, host, "running", check=check, state=state)


async def ensure_stopped(
    conn: Connection, host: Host, *, check: bool = False, state: NodeState | None = None
) -> ServiceChange:
    return await ensure_state(conn, host, "stopped", check=check, state=state)


def _service_step(
    want: Literal["running", "stopped", "restarted"], check: bool
) -> Callable[[HostContext], Awaitable[StepOutcome[ServiceChange]]]:
    async def step(ctx: HostContext) -> StepOutcome[ServiceChange]:
        conn = await ctx.connection()
        change = await ensure_state(conn, ctx.host, want, check=check)
        return StepOutcome(change, change.changed, change.describe())

    step.__name__ = {"running": "start", "stopped": "stop", "restarted": "restart"}[want]
    return step


def make_start_step(*, check: bool = False) -> Callable[[HostContext], Awaitable[StepOutcome[ServiceChange]]]:
    return _service_step("running", check)


def make_stop_step(*, check: bool = False) -> Callable[[HostContext], Awaitable[StepOutcome[ServiceChange]]]:
    return _service_step("stopped", check)


def make_restart_step(
    *, check: bool = False
) -> Callable[[HostContext], Awaitable[StepOutcome[ServiceChange]]]:
    return _service_step("restarted", check)


def make_status_step() -> Callable[[HostContext], Awaitable[StepOutcome[ServerStatus]]]:
    async def status(ctx: HostContext) -> StepOutcome[ServerStatus]:
        result = await server_status(await ctx.connection(), ctx.host)
        return StepOutcome(
            result, False, f"{result.state}: {result.message}" if result.message else result.state
        )

    return status


def make_logs_step(lines: int = 50) -> Callable[[HostContext], Awaitable[StepOutcome[str]]]:
    async def logs(ctx: HostContext) -> StepOutcome[str]:
        conn = await ctx.connection()
        state = await read_node_state(conn, ctx.host)
        if state.supervisor == "systemd" and state.unit is not None:
            command = journal_command(state.unit.name, lines, user=state.unit.user)
            journal = (await conn.run(command, timeout=15)).stdout
            return StepOutcome(
                journal, False, f"{len(journal.splitlines())} lines (journal of {state.unit.name})"
            )
        fact = LogTailFact(_node_path(ctx.host.install_dir, LOG_FILE), lines)
        result = await conn.run(fact.command(), timeout=15)
        text = fact.parse(result.stdout, result.stderr, result.exit_status)
        if text is None:
            raise ServiceError("no rpc-server log yet", host=ctx.host.name, stderr=result.stderr)
        return StepOutcome(text, False, f"{len(text.splitlines())} lines")

    return logs


async def remove_unit(conn: Connection, host: Host, *, check: bool = False) -> str:
    """Stop the server and remove its systemd unit (and, with the last one, the dedicated user).
    Nothing to do where the install has no unit. Returns what was (or would be) done."""
    state = await read_node_state(conn, host)
    unit = state.unit
    if unit is None or not unit.installed:
        return "no unit"
    if check:
        return f"would stop and remove {unit.name}"
    await ensure_state(conn, host, "stopped", state=state)
    out = (await conn.run(remove_unit_script(unit.name, user=unit.user), timeout=60)).stdout
    return f"removed {unit.name}" + (", and user rpcfleet" if "@userdel" in out else "")


def make_remove_unit_step(*, check: bool = False) -> Callable[[HostContext], Awaitable[StepOutcome[str]]]:
    async def remove_unit_step(ctx: HostContext) -> StepOutcome[str]:
        done = await remove_unit(await ctx.connection(), ctx.host, check=check)
        return StepOutcome(done, done.startswith("removed"), done)

    remove_unit_step.__name__ = "remove_unit"
    return remove_unit_step


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
        if self.service.changed:
            parts.append(self.service.describe())
        return "; ".join(parts) or f"{self.install.version} {self.service.describe()}"

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
    progress: ProgressFactory | None = None,
    build_log: BuildLogFactory | None = None,
) -> DeployResult:
    """Install the pinned artifact and have it serve: one state read, then only the needed changes.

    A failed install (or on-node build) raises before the server is touched: the running version keeps
    serving.
    """
    warning = bind_policy(host)  # refuse a bad bind before changing anything
    state = await read_node_state(conn, host)
    change = await ensure_installed(
        conn,
        host,
        choose,
        state=state.install,
        check=check,
        force=force,
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
    service = await ensure_state(conn, host, "running", check=check, state=state)
    warnings = (warning,) if warning else ()
    return DeployResult(change, service, service.status, warnings)


def make_deploy_step(
    choose: ArtifactChooser,
    *,
    check: bool = False,
    force: bool = False,
    progress: ProgressFactory | None = None,
    build_log: BuildLogFactory | None = None,
) -> Callable[[HostContext], Awaitable[StepOutcome[DeployResult]]]:
    async def deploy_step(ctx: HostContext) -> StepOutcome[DeployResult]:
        conn = await ctx.connection()
        result = await deploy(
            conn, ctx.host, choose, check=check, force=force, progress=progress, build_log=build_log
        )
        return StepOutcome(result, result.changed, result.describe())

    deploy_step.__name__ = "deploy"
    return deploy_step


async def rollback(
    conn: Connection, host: Host, *, to: str | None = None, check: bool = False
) -> DeployResult:
    """Switch `current` back to the previous version (or `to`) and have that version serve."""
    state = await read_node_state(conn, host)
    change = plan_rollback(state.install, to=to)
    if change.changed and not check:
        await apply_install(conn, change)
        state = await read_node_state(conn, host)
    elif change.changed:
        state = dataclasses.replace(state, install=dataclasses.replace(state.install, current=change.version))
    service = await ensure_state(conn, host, "running", check=check, state=state)
    return DeployResult(change, service, service.status)


def make_rollback_step(
    *, to: str | None = None, check: bool = False
) -> Callable[[HostContext], Awaitable[StepOutcome[DeployResult]]]:
    async def rollback_step(ctx: HostContext) -> StepOutcome[DeployResult]:
        result = await rollback(await ctx.connection(), ctx.host, to=to, check=check)
        return StepOutcome(result, result.changed, result.describe())

    rollback_step.__name__ = "rollback"
    return rollback_step
