"""`rpcfleet run-playbook`: playbooks through the executor.

`rpcfleet restart --rolling` (registered with the other service commands) comes here through
`add_rolling_args` and `handle_rolling_restart`: the `restart` step of a one-step playbook with
`serial`, the same path as `run-playbook playbooks/rolling-restart.yml`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.cli import _inputs, _output, _running
from orchestrator.cli._output import escape

if TYPE_CHECKING:
    from orchestrator.playbooks.model import Playbook, PlaybookResult, StepRun

_STYLE = {"ok": "green", "changed": "yellow", "failed": "red", "unreachable": "red", "skipped": "cyan"}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run-playbook",
        help="run a playbook (YAML steps over a host selection, in batches)",
        description="Run a playbook: its steps over its hosts (narrowed by --limit), in batches of its "
        "`serial`, stopping at its failure threshold. Ends with the per-host recap.",
    )
    parser.add_argument("playbook", type=Path, help="the playbook file (see playbooks/)")
    _inputs.add_inventory_args(parser)
    parser.add_argument("--check", action="store_true", help="print every change it would make, make none")
    parser.add_argument(
        "-e",
        "--extra-vars",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a playbook variable (repeatable; wins over the playbook's vars)",
    )
    _output.add_json_arg(parser)
    _running.add_wait_lock_arg(parser)
    parser.set_defaults(handler=handle_run_playbook)


def _serial_value(text: str | None) -> int | str:
    if text is None:
        return 1
    text = str(text).strip()
    return int(text) if text.isdigit() else text


def handle_rolling_restart(args: argparse.Namespace) -> int:
    from orchestrator.playbooks.reader import rolling_restart_playbook

    max_fail = getattr(args, "max_fail_percentage", None)
    playbook = rolling_restart_playbook(
        serial=_serial_value(getattr(args, "serial", None)),
        max_fail_percentage=0.0 if max_fail is None else max_fail,
        force=bool(getattr(args, "force", False)),
    )
    return _running.with_diff(args, [], lambda: _run(args, playbook))


def handle_run_playbook(args: argparse.Namespace) -> int:
    from orchestrator.playbooks.reader import load_playbook, parse_extra_vars

    playbook = load_playbook(args.playbook, parse_extra_vars(args.extra_vars))
    return _run(args, playbook)


def _run(args: argparse.Namespace, playbook: Playbook) -> int:
    from orchestrator.playbooks.runner import play_hosts, run_playbook
    from orchestrator.workflows.change import fleet_session

    inventory = _inputs.load_inventory(args)
    hosts = play_hosts(playbook, inventory, getattr(args, "limit", None))
    check = bool(getattr(args, "check", False))
    mode = " [yellow](check mode: nothing is changed)[/yellow]" if check else ""
    if not getattr(args, "json", False):
        _output.console.print(
            f"[bold]PLAY {escape(playbook.name)}[/bold] on {len(hosts)} host(s){mode}", highlight=False
        )

    wait_lock = _running.operation_options(args).wait_lock
    as_json = bool(getattr(args, "json", False))

    from orchestrator.cli._progress import PlayProgress

    shown = PlayProgress(
        playbook.name,
        len(playbook.steps),
        len(hosts),
        enabled=not as_json and _output.err_console.is_terminal,
    )

    def step_done(step_run: StepRun) -> None:
        shown.step_done(step_run.step.label)
        if not as_json:
            _print_step(step_run)

    async def go() -> PlaybookResult:
        async with fleet_session(_running.batches(args)) as session:
            return await run_playbook(
                playbook,
                hosts,
                session=session,
                check=check,
                wait_lock=wait_lock,
                on_step=step_done,
                on_result=shown.host_done,
            )

    with shown.progress:
        result = _running.run_async(go())
    runs = [step_run.run for step_run in result.steps]
    if as_json:
        _output.print_json(result.to_json())
    else:
        _finish(result)
        _running.print_interrupted(runs)
    status = _running.exit_status(runs)
    return status if status else (0 if result.ok else 1)


def _print_step(step_run: StepRun) -> None:
    from rich import box
    from rich.table import Table

    run = step_run.run
    table = Table(box=box.SIMPLE_HEAD, title=escape(step_run.step.label), title_justify="left")
    for column in ("host", "status", "what"):
        table.add_column(column)
    for r in run.results:
        style = _STYLE[r.status]
        table.add_row(r.host.name, f"[{style}]{r.status}[/{style}]", escape(r.message))
    _output.console.print(table, highlight=False)
    for r in run.results:
        for warning in getattr(r.value, "warnings", ()) or ():
            _output.err_console.print(f"[yellow]warning:[/yellow] {escape(r.host.name)}: {escape(warning)}")


def _finish(result: PlaybookResult) -> None:
    for document in result.documents:
        if document.path is not None:
            _output.console.print(f"{document.kind} written to {escape(document.path)}", highlight=False)
        elif document.kind == "report" or result.check:
            _output.console.rule(f"{document.kind} ({document.step})")
            _output.console.print(document.text.rstrip("\n"), highlight=False, markup=False)
    if result.aborted:
        _output.err_console.print("[red]the failure threshold was reached: the play stopped[/red]")
    elif len(result.steps) < len(result.playbook.steps):
        _output.err_console.print("[red]no hosts left in play: the remaining steps did not run[/red]")
    _running.print_recap(result.recap)
