"""The server lifecycle: `rpcfleet deploy | start | stop | restart | status | logs | rollback`.

`deploy` installs the pinned artifact (when it is not already current), starts the server (or restarts
it on the new version) and waits for a HELLO. `--check` prints what would change and changes nothing.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from orchestrator.cli import _follow, _inputs, _output, _parser, _running
from orchestrator.core import fields

if TYPE_CHECKING:  # the stages are imported by the handlers: registering stays cheap
    from orchestrator.engine.executor import RunResult
    from orchestrator.inventory.model import Host, Inventory
    from orchestrator.operations.undeclared import LiveServer


def register(subparsers: Any) -> None:
    deploy = subparsers.add_parser(
        "deploy",
        help="install the pinned rpc-server on every host, start it (or restart it when its version or "
        "launch line changed) and wait until it answers",
        description="Install the pinned rpc-server on every selected host (uploaded once, checked on the "
        "node, switched in atomically), start it, or restart it when its version or launch line changed, "
        "and wait until it answers HELLO. An unchanged host is left alone; --check prints what would change.",
    )
    _add_run_args(deploy, check=True)
    deploy.add_argument(
        "--artifact", default=None, help="artifact id or spec file (default: each host's rpc_artifact)"
    )
    deploy.add_argument("--reinstall", action="store_true", help="upload and unpack even when installed")
    _running.add_operation_args(deploy)
    deploy.set_defaults(handler=handle_deploy)

    for name, help_text, description, force_help in (
        (
            "start",
            "start the installed rpc-server where it is not running",
            "Start the installed rpc-server on every selected host where it is not running, and wait "
            "until it answers HELLO. A server running another version or launch line than the "
            "inventory's, or an orphan holding the port, is restarted.",
            "restart a server that must be restarted (new version, changed launch line, orphan) even "
            "while a client is connected (its model is cut off)",
        ),
        (
            "stop",
            "stop the rpc-server (refused while a client is connected, unless --force)",
            "Stop the rpc-server on every selected host. A server with a client connected (a loaded "
            "model) is refused unless --force.",
            None,
        ),
        (
            "restart",
            "restart the rpc-server, waiting for HELLO (--rolling: one batch at a time)",
            "Restart the rpc-server on every selected host and wait until it answers HELLO; --rolling "
            "restarts one batch at a time and stops at the first failure. Busy servers are refused "
            "unless --force.",
            None,
        ),
    ):
        parser = subparsers.add_parser(name, help=help_text, description=description)
        _add_run_args(parser, check=True)
        _running.add_operation_args(parser, force_help=force_help)
        if name == "stop":
            parser.add_argument(
                "--undeclared",
                action="store_true",
                help="stop the servers of the selected hosts' installs that the inventory no longer "
                "declares (a name dropped from rpc_servers), and nothing else",
            )
        if name == "restart":
            parser.add_argument(
                "--rolling",
                action="store_true",
                help="one batch at a time (default --serial 1), stopping at the first failure",
            )
        parser.set_defaults(handler=handle_service, action=name)

    status = subparsers.add_parser(
        "status",
        help="state of every rpc-server: running, busy, crashed...",
        description="Show each selected host's rpc-server: running, busy, stopped, crashed, unhealthy or "
        "orphan, its supervisor, pid, version and protocol, and the servers of its install that the "
        "inventory no longer declares (undeclared). Read-only: no lock, nothing changed.",
    )
    _add_run_args(status, check=False, batches=False)
    status.set_defaults(handler=handle_status)

    logs = subparsers.add_parser(
        "logs",
        help="the end of each rpc-server's log",
        description="Print the last lines of each selected host's rpc-server log (its journal under "
        "systemd), without the lines every probe's connection writes (--noise keeps them); "
        "-f/--follow then prints new lines as they come.",
    )
    _inputs.add_inventory_args(logs, forks_short=False)  # -f is --follow here, as in tail and journalctl
    logs.add_argument(
        "-n",
        "--lines",
        type=_parser.flag(fields.integer(minimum=1)),
        default=40,
        help="lines per host, after leaving out probe connections (default: 40)",
    )
    _follow.add_follow_args(logs)
    logs.set_defaults(handler=handle_logs)

    rollback = subparsers.add_parser(
        "rollback", help="switch back to the previously installed version and restart on it"
    )
    _add_run_args(rollback, check=True)
    rollback.add_argument("--to", default=None, help="the version id to return to (default: the previous)")
    _running.add_operation_args(rollback)
    rollback.set_defaults(handler=handle_rollback)


def _add_run_args(parser: argparse.ArgumentParser, *, check: bool, batches: bool = True) -> None:
    _inputs.add_inventory_args(parser)
    _output.add_json_arg(parser)
    if check:
        parser.add_argument("--check", action="store_true", help="print what would change, change nothing")
        parser.add_argument(
            "--diff",
            action="store_true",
            help="with --check: also print, per host, the exact node-side commands the change would run "
            "(as Ansible's --check --diff, pyinfra's --dry -vv)",
        )
    if not batches:  # batches limit the harm of a change; a read-only command has none
        return
    parser.add_argument("--serial", default=None, help="hosts per batch: a number or a percentage")
    parser.add_argument(
        "--max-fail-percentage",
        type=_parser.flag(fields.percentage),
        default=None,
        help="stop after a batch with more failures",
    )


def _warn_undeclared(found: list[tuple[Host, LiveServer]]) -> None:
    from orchestrator.operations.undeclared import describe

    for machine, live in found:
        _output.err_console.print(
            f"[yellow]warning:[/yellow] {_output.escape(describe(machine, live))}", highlight=False
        )


def _print_changes(run: RunResult[Any], check: bool) -> None:
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, title="would change" if check else None, title_justify="left")
    for column in ("host", "status", "what"):
        table.add_column(column)
    for r in run.results:
        what = r.message if r.error is None else str(r.error.message)
        table.add_row(r.host.name, r.status, what)
    _output.console.print(table, highlight=False)
    for r in run.results:
        value = r.value
        warnings = getattr(value, "warnings", ())
        for warning in warnings:
            _output.err_console.print(f"[yellow]warning:[/yellow] {r.host.name}: {warning}", highlight=False)


def _json_value(value: Any) -> Any:
    from orchestrator.operations.install.plan import InstallChange
    from orchestrator.operations.restart import RestartReport
    from orchestrator.operations.server.state import ServerStatus
    from orchestrator.operations.server.steps import DeployResult, ServiceChange

    if isinstance(value, DeployResult | ServiceChange | ServerStatus | InstallChange | RestartReport):
        return value.to_json()
    return value


def _print_json(run: RunResult[Any]) -> None:
    _output.print_json(
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
    from orchestrator.engine.executor import Recap

    if args.json:
        _print_json(run)
    else:
        _print_changes(run, getattr(args, "check", False))
        _running.print_recap(Recap().add(run))
        _running.print_interrupted([run])
    return _running.exit_status([run])


def handle_deploy(args: argparse.Namespace) -> int:
    from orchestrator.cli._progress import Uploads
    from orchestrator.workflows.change import deploy_fleet

    inventory, hosts = _inputs.load_hosts(args)
    options, batches = _running.operation_options(args), _running.batches(args)
    uploads = Uploads(enabled=not args.json and not args.check)
    with uploads.progress:
        change = _running.with_diff(
            args,
            [h.name for h in hosts],
            lambda: deploy_fleet(
                inventory,
                hosts,
                options,
                batches,
                artifact=args.artifact,
                reinstall=args.reinstall,
                progress=uploads,
                build_log=uploads.build_log,
            ),
        )
    status = _finish(args, change.run)
    _warn_undeclared(change.undeclared)
    return status


def handle_service(args: argparse.Namespace) -> int:
    if args.action == "restart" and args.rolling:
        from orchestrator.cli.playbook import handle_rolling_restart

        return handle_rolling_restart(args)
    from orchestrator.workflows.change import service_fleet

    inventory, hosts = _inputs.load_hosts(args)
    options = _running.operation_options(args)
    if args.action == "stop" and args.undeclared:
        return _stop_undeclared(args, inventory, hosts)
    names = [h.name for h in hosts]
    change = _running.with_diff(
        args, names, lambda: service_fleet(hosts, args.action, options, _running.batches(args))
    )
    return _finish(args, change.run)


def _stop_undeclared(args: argparse.Namespace, inventory: Inventory, hosts: list[Host]) -> int:
    """Stop exactly the undeclared servers of the selected hosts' installs, each as its own server's
    view through the same stop as any server (lock, busy check, its supervisor loop first)."""
    from orchestrator.operations.undeclared import server_view
    from orchestrator.workflows.change import find_undeclared, service_fleet

    found, interrupted = find_undeclared(inventory, hosts, _running.batches(args))
    if interrupted:
        _output.err_console.print("[yellow]interrupted[/yellow]: nothing stopped", highlight=False)
        return _running.INTERRUPTED_EXIT
    views = [server_view(machine, live) for machine, live in found]
    if not views:
        _output.err_console.print("no undeclared server runs on the selected hosts", highlight=False)
        return 0
    options = _running.operation_options(args)
    names = [h.name for h in views]
    change = _running.with_diff(
        args, names, lambda: service_fleet(views, "stop", options, _running.batches(args))
    )
    return _finish(args, change.run)


def handle_rollback(args: argparse.Namespace) -> int:
    from orchestrator.workflows.change import rollback_fleet

    _, hosts = _inputs.load_hosts(args)
    options = _running.operation_options(args)
    names = [h.name for h in hosts]
    change = _running.with_diff(
        args, names, lambda: rollback_fleet(hosts, options, _running.batches(args), to=args.to)
    )
    return _finish(args, change.run)


_STATE_STYLE = {
    "running": "green",
    "busy": "cyan",
    "stale": "yellow",
    "stopped": "yellow",
    "crashed": "red",
    "crash-looping": "red",
    "unhealthy": "red",
    "orphan": "red",
}


def handle_status(args: argparse.Namespace) -> int:
    from rich import box
    from rich.table import Table

    from orchestrator.operations.server.state import ServerStatus
    from orchestrator.operations.undeclared import server_view
    from orchestrator.workflows.change import status_fleet

    inventory, hosts = _inputs.load_hosts(args)
    change = status_fleet(inventory, hosts, _running.batches(args))
    run, found = change.run, change.undeclared
    # A running server whose port no REJECT closes is open to everyone: a failure, as a host's error is.
    exposed = any(isinstance(r.value, ServerStatus) and r.value.exposed for r in run.results)
    if args.json:
        _print_json(run)
        _warn_undeclared(found)
        return 0 if run.ok and not exposed else 1
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
        supervisor: str = s.supervisor + (f" as {s.user}" if s.user else "")
        if s.restarts is not None:
            supervisor += f" ({s.restarts} restarts" + (f", last: {s.last_exit}" if s.last_exit else "") + ")"
        table.add_row(
            s.host,
            f"{s.endpoint} ({s.transport})",
            f"[{style}]{s.state}[/{style}]",
            supervisor,
            str(s.pid or "-"),
            version,
            s.protocol or "-",
            s.message,
        )
    for machine, live in found:
        view = server_view(machine, live)
        port = f"{view.address}:{live.port}" if live.port is not None else "-"
        table.add_row(
            view.name,
            port,
            "[red]undeclared[/red]",
            "-",
            str(live.pid or "-"),
            "-",
            "-",
            "not in the inventory (rpc_servers)",
        )
    _output.console.print(table, highlight=False)
    _warn_undeclared(found)
    for r in run.results:
        if r.error is not None:
            error = _output.escape(r.error.describe(with_host=False))
            _output.err_console.print(f"[red]{_output.escape(r.host.name)}[/red]: {error}", highlight=False)
    return 0 if run.ok and not exposed else 1


def handle_logs(args: argparse.Namespace) -> int:
    from orchestrator.workflows.change import logs_fleet

    _, hosts = _inputs.load_hosts(args)
    run = logs_fleet(hosts, args.lines, _running.batches(args), noise=args.noise).run
    for r in run.results:
        _output.console.rule(f"{r.host.name} ({r.status})")
        if isinstance(r.value, str):
            _output.console.print(r.value.rstrip("\n"), highlight=False, markup=False)
        elif r.error is not None:
            _output.err_console.print(str(r.error), highlight=False, markup=False)
    if args.follow:
        return _follow.follow(args, hosts)
    return 0 if run.ok else 1
