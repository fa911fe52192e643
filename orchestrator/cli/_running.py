"""How a command runs its work: its one async phase, the flags and options of a change to nodes
(--force, --wait-lock, batches), interrupts, --diff, the exit status and the end-of-run recap."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from orchestrator.cli import _output
from orchestrator.cli._output import escape
from orchestrator.core.errors import UsageError

if TYPE_CHECKING:
    from orchestrator.engine.executor import Recap, RunResult
    from orchestrator.operations.layer import OperationOptions
    from orchestrator.workflows.change import Batches

T = TypeVar("T")


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """A command's one async phase on a loop of its own (`engine.runtime`; 40 ms to import asyncio:
    only the commands that run a loop pay for it)."""
    from orchestrator.engine.runtime import run_once

    return run_once(coro)


INTERRUPTED_EXIT = 130


LOCKED_EXIT = 3  # operations.lock.LOCKED_EXIT: a host is being changed by another operator


def add_operation_args(parser: argparse.ArgumentParser, *, force_help: str | None = None) -> None:
    """The flags of every command that changes nodes (the operations layer's options)."""
    parser.add_argument(
        "--force",
        action="store_true",
        help=force_help or "stop a server even while a client is connected (its model is cut off)",
    )
    add_wait_lock_arg(parser)


def add_wait_lock_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wait-lock",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait this long (in all) for other operators' locks on the hosts (default: fail at once, "
        "exit 3)",
    )


def operation_options(args: argparse.Namespace) -> OperationOptions:
    from orchestrator.operations.layer import OperationOptions

    wait = float(getattr(args, "wait_lock", 0.0) or 0.0)
    if wait < 0:
        raise UsageError(f"--wait-lock must be 0 or more seconds, got {wait:g}")
    return OperationOptions(
        check=bool(getattr(args, "check", False)), force=bool(getattr(args, "force", False)), wait_lock=wait
    )


def batches(args: argparse.Namespace) -> Batches:
    """How a command's change runs over its hosts: -f/--forks, --serial (a number or a percentage),
    --max-fail-percentage, and interrupts reported by `on_interrupt`."""
    from orchestrator.workflows.change import Batches

    serial = getattr(args, "serial", None)
    return Batches(
        forks=args.forks,
        serial=None if serial is None else int(serial) if str(serial).isdigit() else str(serial),
        max_fail_percentage=getattr(args, "max_fail_percentage", None),
        on_interrupt=on_interrupt,
    )


def on_interrupt(why: str, count: int) -> None:
    """How a session reports a signal: the hosts in flight finish, no new one starts."""
    if count == 1:
        _output.err_console.print(
            f"[yellow]{why}: finishing the hosts already being changed; no new host is started[/yellow]",
            highlight=False,
        )
    else:
        _output.err_console.print(
            "[yellow]still finishing the hosts in flight (each step has a timeout)[/yellow]"
        )


def with_diff(args: argparse.Namespace, hosts: Sequence[str], call: Callable[[], T]) -> T:
    """`call()`; with `--diff` (only with `--check`) noting the node-side commands the change would run,
    then printing them per host (on stderr with `--json`: stdout is the document)."""
    if not getattr(args, "diff", False):
        return call()
    if not getattr(args, "check", False):
        raise UsageError("--diff goes with --check: it prints what a check would run")
    from orchestrator.connectors.nodescript import recording

    with recording() as notes:
        result = call()
    planned = notes.by_host()
    out = _output.err_console if getattr(args, "json", False) else _output.console
    for host in [*hosts, *(h for h in planned if h not in hosts)]:
        items = planned.get(host, [])
        out.rule(f"{host}: {len(items)} command(s) would run", characters="-")
        for item in items:
            out.print(f"# {item.name}", highlight=False, markup=False)
            out.print(item.command, highlight=False, markup=False, soft_wrap=True)
    return result


def finish_command(hosts: Sequence[str]) -> str:
    """This command line again, limited to `hosts`: what finishes an interrupted run."""
    argv, out, skip = sys.argv[1:], ["rpcfleet"], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("-l", "--limit"):
            skip = True
            continue
        if arg.startswith("--limit="):
            continue
        out.append(shlex.quote(arg))
    return " ".join([*out, "-l", shlex.quote(",".join(hosts))])


def exit_status(runs: Sequence[RunResult[Any]]) -> int:
    """130 when interrupted, 3 when a host was locked by another operator, 2 when every failure is the
    inventory's (a node asked for what it cannot run), 1 on any other failure, else 0."""
    from orchestrator.core.errors import InputError
    from orchestrator.operations.lock import HostLockedError

    if any(run.interrupted for run in runs):
        return INTERRUPTED_EXIT
    if any(isinstance(r.error, HostLockedError) for run in runs for r in run.results):
        return LOCKED_EXIT
    failed = [r for run in runs for r in run.failed]
    if failed and all(isinstance(r.error, InputError) for r in failed):
        return 2
    return 0 if all(run.ok for run in runs) else 1


def print_interrupted(runs: Sequence[RunResult[Any]]) -> None:
    """After an interrupted run: what was done, what was not, and the command that finishes the job."""
    if not any(run.interrupted for run in runs):
        return
    done = sorted({r.host.name for run in runs for r in run.results if r.status in ("ok", "changed")})
    pending = sorted({r.host.name for run in runs for r in run.results if r.status == "skipped"})
    _output.err_console.print(
        f"[yellow]interrupted[/yellow]: done on {', '.join(done) or 'no host'}; "
        f"not started on {', '.join(pending)}",
        highlight=False,
    )
    _output.err_console.print(f"finish with: {escape(finish_command(pending))}", highlight=False)


_STATUS_STYLE = {
    "ok": "green",
    "changed": "yellow",
    "failed": "red",
    "unreachable": "red",
    "skipped": "cyan",
}


def print_recap(recap: Recap) -> None:
    """The end-of-run summary, one line per host (Ansible's PLAY RECAP)."""
    from rich import box
    from rich.table import Table

    from orchestrator.engine.executor import STATUSES

    table = Table(title="recap", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("host")
    for status in STATUSES:
        table.add_column(status, justify="right")
    for host, counts in recap.counts.items():
        cells = [f"[{_STATUS_STYLE[s]}]{n}[/{_STATUS_STYLE[s]}]" if n else "0" for s, n in counts.items()]
        table.add_row(escape(host), *cells)
    _output.console.print(table)
    for host, errors in recap.errors.items():
        for error in errors:
            _output.err_console.print(f"[red]{escape(host)}[/red]: {escape(error)}", highlight=False)
