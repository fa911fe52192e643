"""Helpers shared by the command modules: consoles, common flags, loading the inventory, async."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from orchestrator.core import fields
from orchestrator.core.errors import RpcfleetError

if TYPE_CHECKING:  # imported lazily below: `rpcfleet artifact build` must start fast without asyncssh
    from orchestrator.engine.executor import Recap
    from orchestrator.inventory.model import Host, Inventory

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
