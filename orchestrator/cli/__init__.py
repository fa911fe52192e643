"""The command line: the only place that prints for the user and exits.

Each module in this package (not starting with "_") contributes commands through
`register(subparsers)`; they are discovered, so adding a command never touches this file. A command
handler takes the parsed `argparse.Namespace` and returns an exit status. Registering must stay cheap
(the modules import their stages inside the handlers): every command parses the whole tree.

Ctrl-C or SIGTERM at any moment, from the first import to the last line printed, ends the process
with "interrupted" and exit status 130, never a traceback. An error no stage expected (a bug) is one line
and the log that holds its traceback, exit status 1 (`report_unexpected`).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, NoReturn

from orchestrator.core import signals

if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    import importlib
    import pkgutil

    from orchestrator import __version__
    from orchestrator.cli import _globals, _parser

    parser = _parser.ArgumentParser(
        prog="rpcfleet",
        description="Orchestrate fleets of llama.cpp ggml-rpc-server nodes.",
        epilog="-i/-l/-f/--json/-v/--log-format may also come before the command "
        "(`rpcfleet -i inv.yml ping`). `rpcfleet COMMAND --help` shows a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"rpcfleet {__version__}")
    _globals.add_global_options(parser)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        module.register(subparsers)
    for command in command_parsers(parser):
        _globals.add_every_command_options(command)
    return parser


def command_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every parser of the tree that runs a command (the leaves: they set a handler)."""
    import argparse

    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                found += command_parsers(sub)
    if parser.get_default("handler") is not None:
        found.append(parser)
    return found


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line as a namespace; usage errors raise `_parser.UsageExit` (after printing)."""
    from orchestrator.cli import _globals, _parser

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    command: _parser.ArgumentParser = args._parser
    if extra:
        command.unknown_arguments(extra)
    _globals.merge_global_options(args, command)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command line; returns its exit status (0 ok, 1 failed, 2 bad input, 130 interrupted)."""
    try:
        return _main(argv)
    except (KeyboardInterrupt, Exception) as exc:
        if signals.interrupted_by(exc):
            sys.stderr.write("interrupted\n")
            return INTERRUPTED
        if not isinstance(exc, Exception):
            raise
        return report_unexpected(exc)


def report_unexpected(exc: Exception) -> int:
    """A bug (an error no stage turned into an `RpcfleetError`): one line naming its type and where it
    was raised, and the log that holds its traceback; exit status 1. Never its text: that may hold an
    object's repr (`list.index` quoted 34 KB of a served model's, issue 42)."""
    import traceback
    from pathlib import Path

    from orchestrator.cli import _output
    from orchestrator.cli._output import escape

    frames = traceback.extract_tb(exc.__traceback__)
    package = Path(__file__).resolve().parents[1]
    ours = [f for f in frames if Path(f.filename).resolve().is_relative_to(package)] or frames
    where = ""
    if ours:
        file = Path(ours[-1].filename).resolve()
        shown = file.relative_to(package.parent) if file.is_relative_to(package.parent) else file
        where = f" at {shown}:{ours[-1].lineno}"
    try:
        from orchestrator.engine.children import child_log_path

        log = child_log_path("error")
        log.write_text("".join(traceback.format_exception(exc)))
        told = f"its traceback is in {log}"
    except OSError as err:  # a full disk or a read-only home: the line still says what happened
        told = f"its traceback could not be written ({err.strerror})"
    _output.err_console.print(
        f"[red]error:[/red] unexpected {type(exc).__name__}{where} (a bug in rpcfleet): {escape(told)}",
        highlight=False,
        soft_wrap=True,  # one line, however long the path
    )
    return 1


def _main(argv: Sequence[str] | None) -> int:
    from orchestrator.cli import _output, _parser
    from orchestrator.core.errors import InputError, RpcfleetError
    from orchestrator.core.log import configure_logging

    signals.forget()

    try:
        args = parse_args(argv)
    except _parser.UsageExit as exc:
        return exc.status
    level = ["WARNING", "INFO", "DEBUG"][min(args.verbose, 2)]
    configure_logging(args.log_format, level)
    try:
        status: int = args.handler(args)
        return status
    except InputError as exc:
        _output.print_error(exc)
        return 2
    except RpcfleetError as exc:
        _output.print_error(exc)
        return 1
    finally:
        # SSH forwards (rpc_transport: ssh) live as long as the command; imported only if one was used
        tunnels = sys.modules.get("orchestrator.connectors.tunnel")
        if tunnels is not None:
            tunnels.close_default_tunnels()


def run() -> NoReturn:
    """The `rpcfleet` program: `main()` with SIGTERM treated as Ctrl-C, and no signal heard while the
    process exits (a late one would otherwise print a traceback from the interpreter's shutdown)."""
    try:
        signals.install()  # SIGTERM ends the run as Ctrl-C does
        signals.quiet_after_interrupt()
        status = main()
    except KeyboardInterrupt:  # a second signal while the first was being reported
        status = INTERRUPTED
    signals.ignore_interrupts()
    # CPython remembers a KeyboardInterrupt that ended any string exec() (dataclasses and others make
    # code that way) even once it was caught, and under `python -m` then kills the process with SIGINT
    # at exit instead of exiting with `status`. A string exec that ends normally clears that flag.
    exec("None")
    sys.exit(status)


if __name__ == "__main__":
    run()
