"""The command line: the only place that prints for the user and exits.

Each module in this package (not starting with "_") contributes commands through
`register(subparsers, common)`; they are discovered, so adding a command never touches this file.
A command handler takes the parsed `argparse.Namespace` and returns an exit status.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from orchestrator import __version__
from orchestrator.cli import _common
from orchestrator.core.errors import InputError, RpcfleetError
from orchestrator.core.log import configure_logging


def build_parser() -> argparse.ArgumentParser:
    parser = _common.ArgumentParser(
        prog="rpcfleet",
        description="Orchestrate fleets of llama.cpp ggml-rpc-server nodes.",
    )
    parser.add_argument("--version", action="version", version=f"rpcfleet {__version__}")
    parser.add_argument(
        "--log-format", choices=["text", "json"], default="text", help="format of log lines on stderr"
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log output (-v info, -vv debug)"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _common.UsageExit as exc:
        return exc.status
    level = ["WARNING", "INFO", "DEBUG"][min(args.verbose, 2)]
    configure_logging(args.log_format, level)
    try:
        status: int = args.handler(args)
        return status
    except InputError as exc:
        _common.print_error(exc)
        return 2
    except RpcfleetError as exc:
        _common.print_error(exc)
        return 1
    except KeyboardInterrupt:
        _common.err_console.print("[yellow]interrupted[/yellow]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
