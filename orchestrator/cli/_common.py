"""Helpers shared by the command modules: consoles, common flags, loading the inventory, async.

Start-up matters (`rpcfleet --help` in a tenth of a second): this module imports nothing heavy at the
top. The consoles are made on first use (rich costs about 50 ms), the stages inside the functions.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shlex
import socket
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from orchestrator.core import fields
from orchestrator.core.errors import RpcfleetError, UsageError

if TYPE_CHECKING:  # imported lazily below: each command pays only for what it uses
    from rich.console import Console

    from orchestrator.engine.executor import Recap, RunResult
    from orchestrator.inventory.model import Host, Inventory
    from orchestrator.operations.layer import OperationOptions
    from orchestrator.workflows.change import Batches

    console: Console
    err_console: Console

T = TypeVar("T")

DEFAULT_INVENTORY_ENV = "RPCFLEET_INVENTORY"


def __getattr__(name: str) -> Any:
    """`console` (stdout) and `err_console` (stderr), made on first use."""
    if name not in ("console", "err_console"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from rich.console import Console

    stream = sys.stderr if name == "err_console" else sys.stdout
    # Piped output (logs, CI, `| less`) gets room for wide tables instead of rich's 80 columns. No emoji
    # codes: a user's "a:b:" (a bad host:port) would print as "a" and an emoji instead of what was typed.
    made = Console(stderr=name == "err_console", width=None if stream.isatty() else 160, emoji=False)
    globals()[name] = made
    return made


def _console(name: str) -> Console:
    """`console` or `err_console` from inside this module (a bare name would skip `__getattr__`)."""
    made: Console = globals().get(name) or __getattr__(name)
    return made


def escape(text: str) -> str:
    """`text` safe to print with rich markup on (a host name or message with brackets stays as is)."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


class UsageExit(Exception):
    def __init__(self, status: int) -> None:
        self.status = status


class _SubParsers(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Subcommands whose `--help` always has a description line: their one-line help, as a sentence,
    where the command gives no longer one."""

    def add_parser(self, name: str, **kwargs: Any) -> Any:
        help_text = kwargs.get("help")
        if kwargs.get("description") is None and isinstance(help_text, str) and help_text:
            kwargs["description"] = help_text[0].upper() + help_text[1:] + "."
        return super().add_parser(name, **kwargs)


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports usage errors as exit status 2 without a traceback, through one path; an
    unknown command or choice gets a "did you mean"; the parser that parsed the command is recorded
    (`args._parser`) so that errors found later print that command's usage."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _SubParsers)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        _console("err_console").print(f"[red]error:[/red] {escape(message)}", highlight=False)
        raise UsageExit(2)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise UsageExit(status)

    def parse_known_args(  # type: ignore[override]
        self, args: Any = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extra = super().parse_known_args(args, namespace)
        if not hasattr(parsed, "_parser"):  # the innermost (sub)parser finishes first
            parsed._parser = self
        return parsed, extra

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        choices = action.choices
        if choices is not None and isinstance(value, str) and value not in choices:
            names = [str(c) for c in choices]
            close = closest(value, names, n=2)
            what = "command" if isinstance(action, argparse._SubParsersAction) else "choice"
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise argparse.ArgumentError(
                action, f"unknown {what} {value!r}{hint} (choose from {', '.join(names)})"
            )
        super()._check_value(action, value)

    def unknown_arguments(self, extra: list[str]) -> NoReturn:
        """Arguments nothing took: this parser's usage, then the closest option to each mistyped flag,
        after the arguments (never between a flag and its value)."""
        known = [o for action in self._actions for o in action.option_strings]
        hints: dict[str, str] = {}
        for arg in extra:
            flag = arg.split("=", 1)[0]
            close = closest(flag, known, n=1) if flag.startswith("-") else []
            if close:
                hints[flag] = close[0]
        message = f"unrecognized arguments: {' '.join(extra)}"
        if len(hints) == 1:
            message += f"; did you mean {next(iter(hints.values()))}?"
        elif hints:
            message += "; did you mean " + ", ".join(f"{c} for {f}" for f, c in hints.items()) + "?"
        self.error(message)


def edit_distance(a: str, b: str) -> int:
    """Optimal string alignment distance: insertions, deletions, substitutions and swaps of two
    neighbours each cost 1 (the typos people make: `--forse`, `--josn`)."""
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i]
        for j, cb in enumerate(b, 1):
            cost = min(previous[j] + 1, row[j - 1] + 1, previous[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cost = min(cost, previous2[j - 2] + 1)
            row.append(cost)
        previous2, previous = previous, row
    return previous[-1]


def closest(word: str, candidates: Sequence[str], n: int = 1) -> list[str]:
    """Up to `n` candidates close to `word`, the fewest typos first. difflib decides what is close
    enough; its ratio alone ranks `--forks` above `--force` for `--forse` (a tie it breaks by name)."""
    close = difflib.get_close_matches(word, candidates, n=len(candidates) or 1)
    ranked = sorted(
        close,
        key=lambda c: (edit_distance(word, c), -difflib.SequenceMatcher(None, word, c).ratio(), c),
    )
    return ranked[:n]


def flag(parse: Callable[[Any], T]) -> Callable[[str], T]:
    """A field parser (`orchestrator.core.fields`) as an argparse `type=`: the flag means what the same
    value means in an inventory or a playbook, and its message becomes the usage error (exit status 2)."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def address(text: str) -> str:
    """A `--host` to listen on: an IPv4/IPv6 address or a hostname, read as an inventory's `address`
    is (a `host:port` there is a usage error naming it, not a failure to bind later)."""
    from orchestrator.inventory.variables import parse_address

    return flag(parse_address)(text)


# --- options accepted before or after the command -----------------------------------------------------------


@dataclass(frozen=True)
class GlobalOption:
    """An option a user may put before the command (`rpcfleet -i inv.yml ping`) or after it."""

    flags: tuple[str, ...]
    dest: str
    kwargs: dict[str, Any]
    every_command: bool = False  # -v and --log-format: every command takes them


GLOBAL_OPTIONS = (
    GlobalOption(("-i", "--inventory"), "inventory", {"type": Path, "metavar": "INVENTORY"}),
    GlobalOption(("-l", "--limit"), "limit", {"metavar": "PATTERN"}),
    GlobalOption(("-f", "--forks"), "forks", {"type": flag(fields.integer(minimum=1)), "metavar": "N"}),
    GlobalOption(("--json",), "json", {"action": "store_true"}),
    GlobalOption(("-v", "--verbose"), "verbose", {"action": "count"}, every_command=True),
    GlobalOption(("--log-format",), "log_format", {"choices": ["text", "json"]}, every_command=True),
)
_TOP = "_top_"


def add_global_options(parser: argparse.ArgumentParser) -> None:
    """The options of GLOBAL_OPTIONS on the top-level parser (before the command)."""
    group = parser.add_argument_group("options also accepted before the command")
    for option in GLOBAL_OPTIONS:
        group.add_argument(
            *option.flags,
            dest=_TOP + option.dest,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,  # each command's --help explains them; here one line lists them
            **option.kwargs,
        )
    group.description = "  ".join("/".join(o.flags) for o in GLOBAL_OPTIONS)


def add_every_command_options(parser: argparse.ArgumentParser) -> None:
    """-v and --log-format on a command's own parser."""
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log output (-v info, -vv debug)"
    )
    parser.add_argument(
        "--log-format", choices=["text", "json"], default="text", help="format of log lines on stderr"
    )


def merge_global_options(args: argparse.Namespace, command: ArgumentParser) -> None:
    """Fold the options given before the command into `args`. One given after the command wins; an
    option the command does not take is a usage error of that command."""
    taken = {action.dest for action in command._actions}
    for option in GLOBAL_OPTIONS:
        value = getattr(args, _TOP + option.dest, argparse.SUPPRESS)
        if value is argparse.SUPPRESS:
            continue
        delattr(args, _TOP + option.dest)
        if option.dest not in taken:
            command.error(f"{option.flags[0]} does not apply to `{command.prog}`")
        if option.dest == "verbose":
            args.verbose += value
        elif getattr(args, option.dest) == command.get_default(option.dest):
            setattr(args, option.dest, value)


def print_error(exc: RpcfleetError) -> None:
    _console("err_console").print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)


def add_inventory_args(
    parser: argparse.ArgumentParser, *, limit: bool = True, forks: bool = True, forks_short: bool = True
) -> None:
    """-i, -l (unless `limit` is false) and -f/--forks (for commands that work on hosts at once; only
    --forks where `-f` means something else: `logs -f` follows, as `tail -f` does)."""
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
    if not forks:
        return
    parser.add_argument(
        *(("-f", "--forks") if forks_short else ("--forks",)),
        type=flag(fields.integer(minimum=1)),
        default=16,
        help="hosts worked on at once (default: 16)",
    )


def add_probe_args(parser: argparse.ArgumentParser) -> None:
    """--timeout and --no-facts, for every command that probes the fleet."""
    parser.add_argument(
        "--timeout",
        type=flag(fields.seconds),
        default=None,
        metavar="S",
        help="seconds per host for the RPC probe and the facts (default: 3)",
    )
    parser.add_argument(
        "--no-facts",
        action="store_true",
        help="RPC only: no SSH (CPU devices then show the server's free figure, which is total RAM)",
    )


def probe_timeout(args: argparse.Namespace) -> float:
    """--timeout, or the probe's default (imported here: registering the flag stays cheap)."""
    if args.timeout is None:
        from orchestrator.probe.host import DEFAULT_TIMEOUT

        return DEFAULT_TIMEOUT
    timeout: float = args.timeout
    return timeout


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
    from orchestrator.core.errors import LabError
    from orchestrator.lab.lifecycle import default_lab_inventory

    try:
        path: Path = default_lab_inventory()
    except LabError as exc:  # no inventory named and none found: the user's to give (exit status 2)
        raise UsageError(exc.message, hint=exc.hint) from None
    return path


def write_output(path: Path, data: str) -> None:
    """Write an -o file atomically; a path that cannot be written is the user's to fix (exit status 2)."""
    from orchestrator.core.files import write_atomic

    try:
        write_atomic(path, data)
    except RpcfleetError as exc:
        raise UsageError(exc.message) from None


def listen_socket(host: str, port: int) -> socket.socket:
    """The socket `serve` and `exporter` hand to uvicorn, bound before anything is announced or loaded:
    a port another program holds is the user's to change (exit status 2), where uvicorn would log its
    own error after the announcement and exit 3 (this CLI's "locked" status)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds its own
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}", hint="choose another --host or --port"
        ) from None
    sock.set_inheritable(True)
    return sock


def require_model(path: Path) -> Path:
    """`path` when it is a file; else the usage error every command that reads a model gives."""
    if not path.exists():
        raise UsageError(f"model {path} does not exist")
    if not path.is_file():
        raise UsageError(f"model {path} is not a file")
    return path


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """A command's one async phase on a loop of its own (`engine.runtime`; 40 ms to import asyncio:
    only the commands that run a loop pay for it)."""
    from orchestrator.engine.runtime import run_once

    return run_once(coro)


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
    out = _console("err_console" if getattr(args, "json", False) else "console")
    for host in [*hosts, *(h for h in planned if h not in hosts)]:
        items = planned.get(host, [])
        out.rule(f"{host}: {len(items)} command(s) would run", characters="-")
        for item in items:
            out.print(f"# {item.name}", highlight=False, markup=False)
            out.print(item.command, highlight=False, markup=False, soft_wrap=True)
    return result


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


def on_interrupt(why: str, count: int) -> None:
    """How a session reports a signal: the hosts in flight finish, no new one starts."""
    if count == 1:
        _console("err_console").print(
            f"[yellow]{why}: finishing the hosts already being changed; no new host is started[/yellow]",
            highlight=False,
        )
    else:
        _console("err_console").print(
            "[yellow]still finishing the hosts in flight (each step has a timeout)[/yellow]"
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
    _console("err_console").print(
        f"[yellow]interrupted[/yellow]: done on {', '.join(done) or 'no host'}; "
        f"not started on {', '.join(pending)}",
        highlight=False,
    )
    _console("err_console").print(f"finish with: {escape(finish_command(pending))}", highlight=False)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def load_inventory(args: argparse.Namespace) -> Inventory:
    """The inventory named by the flags; its warnings are printed."""
    from orchestrator.inventory.load import load_inventory as load

    inventory = load(inventory_path(args))
    for warning in inventory.warnings:
        _console("err_console").print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False)
    return inventory


def load_hosts(args: argparse.Namespace, *, servers: bool = True) -> tuple[Inventory, list[Host]]:
    """The inventory named by the flags and what --limit selects (all when absent): every rpc-server
    as a host of its own (a host with `rpc_servers` is one per server, `HOST/SERVER`), or with
    `servers=False` the machines."""
    from orchestrator.inventory.model import select_servers

    inventory = load_inventory(args)
    pattern = getattr(args, "limit", None)
    if servers:
        return inventory, select_servers(inventory, pattern)
    if not pattern:
        return inventory, list(inventory.hosts)
    # `-l gpu1/second` names a server: its machine is selected (a pattern of hosts selects the same)
    machines = {server.node_name for server in select_servers(inventory, pattern)}
    return inventory, [host for host in inventory.hosts if host.name in machines]


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
    _console("console").print(table)
    for host, errors in recap.errors.items():
        for error in errors:
            _console("err_console").print(f"[red]{escape(host)}[/red]: {escape(error)}", highlight=False)
