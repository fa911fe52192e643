"""Helpers shared by the command modules: consoles, common flags, loading the inventory, async."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from orchestrator.core import fields
from orchestrator.core.errors import RpcfleetError, UsageError

if TYPE_CHECKING:  # imported lazily below: `rpcfleet artifact build` must start fast without asyncssh
    from orchestrator.engine.executor import Recap, RunResult, Session
    from orchestrator.inventory.model import Host, Inventory
    from orchestrator.operations.layer import OperationOptions

T = TypeVar("T")

# Piped output (logs, CI, `| less`) gets room for wide tables instead of rich's 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)

DEFAULT_INVENTORY_ENV = "RPCFLEET_INVENTORY"


class UsageExit(Exception):
    def __init__(self, status: int) -> None:
        self.status = status


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports usage errors as exit status 2 without a traceback, through one path."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        err_console.print(f"[red]error:[/red] {message}", highlight=False)
        raise UsageExit(2)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise UsageExit(status)


def flag(parse: Callable[[Any], T]) -> Callable[[str], T]:
    """A field parser (`orchestrator.core.fields`) as an argparse `type=`: the flag means what the same
    value means in an inventory or a playbook, and its message becomes the usage error (exit status 2)."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def print_error(exc: RpcfleetError) -> None:
    err_console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)


def add_inventory_args(parser: argparse.ArgumentParser, *, limit: bool = True) -> None:
    parser.add_argument(
        "-i",
        "--inventory",
        type=Path,
        default=None,
        help=f"inventory file (default: ${DEFAULT_INVENTORY_ENV}, else ./inventory.yml, else the lab's)",
    )
    if limit:
        parser.add_argument(
            "-l", "--limit", default=None, help="host pattern: names, groups, globs, !exclude, &intersect"
        )
    parser.add_argument(
        "-f",
        "--forks",
        type=flag(fields.integer(minimum=1)),
        default=16,
        help="hosts worked on at once (default: 16)",
    )


def add_probe_args(parser: argparse.ArgumentParser) -> None:
    """--timeout and --no-facts, for every command that probes the fleet."""
    from orchestrator.probe.host import DEFAULT_TIMEOUT

    parser.add_argument(
        "--timeout",
        type=flag(fields.seconds),
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help=f"seconds per host for the RPC probe and the facts (default: {DEFAULT_TIMEOUT:g})",
    )
    parser.add_argument(
        "--no-facts",
        action="store_true",
        help="RPC only: no SSH (CPU devices then show the server's free figure, which is total RAM)",
    )


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def inventory_path(args: argparse.Namespace) -> Path:
    """The inventory to use: -i, then $RPCFLEET_INVENTORY, then ./inventory.yml, then the running lab's."""
    if args.inventory is not None:
        return Path(args.inventory)
    if os.environ.get(DEFAULT_INVENTORY_ENV):
        return Path(os.environ[DEFAULT_INVENTORY_ENV])
    if Path("inventory.yml").exists():
        return Path("inventory.yml")
    from orchestrator.lab.lifecycle import default_lab_inventory

    path: Path = default_lab_inventory()
    return path


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


INTERRUPTED_EXIT = 130
LOCKED_EXIT = 3  # operations.lock.LOCKED_EXIT: a host is being changed by another operator


def add_operation_args(parser: argparse.ArgumentParser, *, force_help: str | None = None) -> None:
    """The flags of every command that changes nodes (the operations layer's options)."""
    parser.add_argument(
        "--force",
        action="store_true",
        help=force_help or "stop a server even while a client is connected (its model is cut off)",
    )
    parser.add_argument(
        "--wait-lock",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait this long for another operator's lock on a host (default: fail at once, exit 3)",
    )


def operation_options(args: argparse.Namespace) -> OperationOptions:
    from orchestrator.operations.layer import OperationOptions

    wait = float(getattr(args, "wait_lock", 0.0) or 0.0)
    if wait < 0:
        raise UsageError(f"--wait-lock must be 0 or more seconds, got {wait:g}")
    return OperationOptions(
        check=bool(getattr(args, "check", False)), force=bool(getattr(args, "force", False)), wait_lock=wait
    )


def _on_interrupt(why: str, count: int) -> None:
    if count == 1:
        err_console.print(
            f"[yellow]{why}: finishing the hosts already being changed; no new host is started[/yellow]",
            highlight=False,
        )
    else:
        err_console.print("[yellow]still finishing the hosts in flight (each step has a timeout)[/yellow]")


def fleet_session(args: argparse.Namespace) -> Session:
    """The executor session of a command: its forks, and Ctrl-C / SIGTERM stop it between hosts."""
    from orchestrator.engine.executor import Session

    return Session(forks=args.forks, interruptible=True, on_interrupt=_on_interrupt)


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
    """130 when interrupted, 3 when a host was locked by another operator, 1 on any failure, else 0."""
    from orchestrator.operations.lock import HostLockedError

    if any(run.interrupted for run in runs):
        return INTERRUPTED_EXIT
    if any(isinstance(r.error, HostLockedError) for run in runs for r in run.results):
        return LOCKED_EXIT
    return 0 if all(run.ok for run in runs) else 1


def print_interrupted(runs: Sequence[RunResult[Any]]) -> None:
    """After an interrupted run: what was done, what was not, and the command that finishes the job."""
    if not any(run.interrupted for run in runs):
        return
    done = sorted({r.host.name for run in runs for r in run.results if r.status in ("ok", "changed")})
    pending = sorted({r.host.name for run in runs for r in run.results if r.status == "skipped"})
    err_console.print(
        f"[yellow]interrupted[/yellow]: done on {', '.join(done) or 'no host'}; "
        f"not started on {', '.join(pending)}",
        highlight=False,
    )
    err_console.print(f"finish with: {escape(finish_command(pending))}", highlight=False)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def load_inventory(args: argparse.Namespace) -> Inventory:
    """The inventory named by the flags; its warnings are printed."""
    from orchestrator.inventory.load import load_inventory as load

    inventory = load(inventory_path(args))
    for warning in inventory.warnings:
        err_console.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False)
    return inventory


def load_hosts(args: argparse.Namespace) -> tuple[Inventory, list[Host]]:
    """The inventory named by the flags and the hosts selected by --limit (all when absent)."""
    from orchestrator.inventory.model import select_hosts

    inventory = load_inventory(args)
    pattern = getattr(args, "limit", None)
    hosts = select_hosts(inventory, pattern) if pattern else list(inventory.hosts)
    return inventory, hosts


_STATUS_STYLE = {
    "ok": "green",
    "changed": "yellow",
    "failed": "red",
    "unreachable": "red",
    "skipped": "cyan",
}


def print_recap(recap: Recap) -> None:
    """The end-of-run summary, one line per host (Ansible's PLAY RECAP)."""
    from orchestrator.engine.executor import STATUSES

    table = Table(title="recap", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("host")
    for status in STATUSES:
        table.add_column(status, justify="right")
    for host, counts in recap.counts.items():
        cells = [f"[{_STATUS_STYLE[s]}]{n}[/{_STATUS_STYLE[s]}]" if n else "0" for s, n in counts.items()]
        table.add_row(host, *cells)
    console.print(table)
    for host, errors in recap.errors.items():
        for error in errors:
            err_console.print(f"[red]{escape(host)}[/red]: {escape(error)}", highlight=False)
