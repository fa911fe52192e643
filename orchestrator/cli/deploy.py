"""The server lifecycle: `rpcfleet deploy | start | stop | restart | status | logs | rollback`.

`deploy` installs the pinned artifact (when it is not already current), starts the server (or restarts
it on the new version) and waits for a HELLO. `--check` prints what would change and changes nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any

from rich import box
from rich.progress import BarColumn, DownloadColumn, Progress, Task, TextColumn, TransferSpeedColumn
from rich.table import Table
from rich.text import Text

from orchestrator.cli import _common
from orchestrator.connectors.base import Progress as ProgressCallback
from orchestrator.engine.executor import HostContext, Recap, RunResult, Session, StepOutcome
from orchestrator.inventory.model import Host
from orchestrator.operations.install import ArtifactChooser
from orchestrator.operations.install_plan import InstallChange
from orchestrator.operations.server import ServerStatus
from orchestrator.operations.service import (
    DeployResult,
    ServiceChange,
    make_deploy_step,
    make_logs_step,
    make_restart_step,
    make_rollback_step,
    make_start_step,
    make_status_step,
    make_stop_step,
)


def register(subparsers: Any) -> None:
    deploy = subparsers.add_parser(
        "deploy", help="install the pinned rpc-server on every host, start it and wait until it answers"
    )
    _add_run_args(deploy, check=True)
    deploy.add_argument(
        "--artifact", default=None, help="artifact id or spec file (default: each host's rpc_artifact)"
    )
    deploy.add_argument("--force", action="store_true", help="upload and unpack even when installed")
    deploy.set_defaults(handler=handle_deploy)

    for name, help_text in (
        ("start", "start the installed rpc-server where it is not running"),
        ("stop", "stop the rpc-server (SIGTERM, then SIGKILL)"),
        ("restart", "restart the rpc-server (--rolling: batches, busy servers refused)"),
    ):
        parser = subparsers.add_parser(name, help=help_text)
        _add_run_args(parser, check=True)
        if name == "restart":
            from orchestrator.cli.playbook import add_rolling_args

            parser.add_argument(
                "--rolling", action="store_true", help="one batch at a time; refuse busy servers"
            )
            add_rolling_args(parser, serial=False)  # adds --force
        parser.set_defaults(handler=handle_service, action=name)

    status = subparsers.add_parser("status", help="state of every rpc-server: running, busy, crashed...")
    _add_run_args(status, check=False)
    status.set_defaults(handler=handle_status)

    logs = subparsers.add_parser("logs", help="the end of each rpc-server's log")
    _common.add_inventory_args(logs)
    logs.add_argument("-n", "--lines", type=int, default=40, help="lines per host (default: 40)")
    logs.set_defaults(handler=handle_logs)

    rollback = subparsers.add_parser(
        "rollback", help="switch back to the previously installed version and restart on it"
    )
    _add_run_args(rollback, check=True)
    rollback.add_argument("--to", default=None, help="the version id to return to (default: the previous)")
    rollback.set_defaults(handler=handle_rollback)


def _add_run_args(parser: argparse.ArgumentParser, *, check: bool) -> None:
    _common.add_inventory_args(parser)
    _common.add_json_arg(parser)
    if check:
        parser.add_argument("--check", action="store_true", help="print what would change, change nothing")
    parser.add_argument("--serial", default=None, help="hosts per batch: a number or a percentage")
    parser.add_argument(
        "--max-fail-percentage", type=float, default=None, help="stop after a batch with more failures"
    )


def _serial(args: argparse.Namespace) -> int | str | None:
    value = getattr(args, "serial", None)
    if value is None:
        return None
    return int(value) if str(value).isdigit() else str(value)


def _run(
    args: argparse.Namespace,
    hosts: list[Host],
    step: Callable[[HostContext], Awaitable[StepOutcome[Any]]],
    name: str,
) -> RunResult[Any]:
    async def go() -> RunResult[Any]:
        async with Session(forks=args.forks) as session:
            return await session.run(
                hosts,
                step,
                name=name,
                serial=_serial(args),
                max_fail_percentage=getattr(args, "max_fail_percentage", None),
            )

    return _common.run_async(go())


class _TransferColumn(DownloadColumn):
    """Bytes done/total for an upload; the latest build log line for an on-node build."""

    def render(self, task: Task) -> Text:
        if "line" in task.fields:
            return Text(str(task.fields["line"])[:80], style="dim")
        return super().render(task)


class _Uploads:
    """Rich progress bars for uploads, one per host, fed by `Connection.put`'s callback; for an on-node
    build, one status line per host showing the build log's latest line."""

    def __init__(self, enabled: bool) -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            _TransferColumn(),
            TransferSpeedColumn(),
            console=_common.err_console,
            transient=True,
            disable=not enabled,
        )

    def __call__(self, host: Host, change: InstallChange) -> ProgressCallback:
        what = f"the source of {change.version}" if change.build is not None else change.version
        task = self.progress.add_task(f"{host.name}: upload {what}", total=None)

        def update(done: int, total: int) -> None:
            self.progress.update(task, completed=done, total=total)

        return update

    def build_log(self, host: Host, change: InstallChange) -> Callable[[str], None]:
        task = self.progress.add_task(f"{host.name}: build {change.version}", total=None, line="starting")

        def update(line: str) -> None:
            self.progress.update(task, line=line)

        return update


def _print_changes(run: RunResult[Any], check: bool) -> None:
    table = Table(box=box.SIMPLE_HEAD, title="would change" if check else None, title_justify="left")
    for column in ("host", "status", "what"):
        table.add_column(column)
    for r in run.results:
        what = r.message if r.error is None else str(r.error.message)
        table.add_row(r.host.name, r.status, what)
    _common.console.print(table, highlight=False)
    for r in run.results:
        value = r.value
        warnings = getattr(value, "warnings", ())
        for warning in warnings:
            _common.err_console.print(f"[yellow]warning:[/yellow] {r.host.name}: {warning}", highlight=False)


def _json_value(value: Any) -> Any:
    if isinstance(value, DeployResult | ServiceChange | ServerStatus | InstallChange):
        return value.to_json()
    return value


def _print_json(run: RunResult[Any]) -> None:
    _common.print_json(
        [
            {
                "host": r.host.name,
                "status": r.status,
                "message": r.message,
                "result": _json_value(r.value),
                "error": str(r.error) if r.error else None,
            }
            for r in run.results
        ]
    )


def _finish(args: argparse.Namespace, run: RunResult[Any]) -> int:
    if args.json:
        _print_json(run)
    else:
        _print_changes(run, getattr(args, "check", False))
        _common.print_recap(Recap().add(run))
    return 0 if run.ok else 1


def handle_deploy(args: argparse.Namespace) -> int:
    _, hosts = _common.load_hosts(args)
    uploads = _Uploads(enabled=not args.json and not args.check)
    step = make_deploy_step(
        ArtifactChooser(args.artifact),
        check=args.check,
        force=args.force,
        progress=uploads,
        build_log=uploads.build_log,
    )
    with uploads.progress:
        run = _run(args, hosts, step, "deploy")
    return _finish(args, run)


def handle_service(args: argparse.Namespace) -> int:
    if args.action == "restart" and args.rolling:
        from orchestrator.cli.playbook import handle_rolling_restart

        return handle_rolling_restart(args)
    _, hosts = _common.load_hosts(args)
    factory = {"start": make_start_step, "stop": make_stop_step, "restart": make_restart_step}[args.action]
    run = _run(args, hosts, factory(check=args.check), args.action)
    return _finish(args, run)


def handle_rollback(args: argparse.Namespace) -> int:
    _, hosts = _common.load_hosts(args)
    run = _run(args, hosts, make_rollback_step(to=args.to, check=args.check), "rollback")
    return _finish(args, run)


_STATE_STYLE = {
    "running": "green",
    "busy": "cyan",
    "stopped": "yellow",
    "crashed": "red",
    "unhealthy": "red",
}


def handle_status(args: argparse.Namespace) -> int:
    _, hosts = _common.load_hosts(args)
    run = _run(args, hosts, make_status_step(), "status")
    if args.json:
        _print_json(run)
        return 0 if run.ok else 1
    table = Table(box=box.SIMPLE_HEAD)
    for column in ("host", "endpoint", "state", "supervisor", "pid", "version", "protocol", "detail"):
        table.add_column(column)
    for r in run.results:
        s = r.value if isinstance(r.value, ServerStatus) else None
        if s is None:
            detail = r.error.message if r.error else r.message
            table.add_row(r.host.name, r.host.endpoint, f"[red]{r.status}[/red]", "-", "-", "-", "-", detail)
            continue
        style = _STATE_STYLE[s.state]
        version = s.version or "-"
        if s.running_version and s.running_version != s.version:
            version += f" (running {s.running_version})"
        supervisor: str = s.supervisor
        if s.restarts is not None:
            supervisor += f" ({s.restarts} restarts" + (f", last: {s.last_exit}" if s.last_exit else "") + ")"
        table.add_row(
            s.host,
            s.endpoint,
            f"[{style}]{s.state}[/{style}]",
            supervisor,
            str(s.pid or "-"),
            version,
            s.protocol or "-",
            s.message,
        )
    _common.console.print(table, highlight=False)
    for r in run.results:
        if r.error is not None:
            _common.err_console.print(f"[red]{r.host.name}[/red]: {r.error}", highlight=False, markup=False)
    return 0 if run.ok else 1


def handle_logs(args: argparse.Namespace) -> int:
    _, hosts = _common.load_hosts(args)
    run = _run(args, hosts, make_logs_step(args.lines), "logs")
    for r in run.results:
        _common.console.rule(f"{r.host.name} ({r.status})")
        if isinstance(r.value, str):
            _common.console.print(r.value.rstrip("\n"), highlight=False, markup=False)
        elif r.error is not None:
            _common.err_console.print(str(r.error), highlight=False, markup=False)
    return 0 if run.ok else 1
