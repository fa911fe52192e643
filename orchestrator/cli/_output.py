"""What a command prints: the consoles (stdout, stderr; made on first use: rich costs about 50 ms), markup
escaping, errors, JSON, the --json flag and -o files."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.core.errors import RpcfleetError, UsageError

if TYPE_CHECKING:
    from rich.console import Console

    console: Console
    err_console: Console


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


def print_error(exc: RpcfleetError) -> None:
    _console("err_console").print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def write_output(path: Path, data: str) -> None:
    """Write an -o file atomically; a path that cannot be written is the user's to fix (exit status 2)."""
    from orchestrator.core.files import write_atomic

    try:
        write_atomic(path, data)
    except RpcfleetError as exc:
        raise UsageError(exc.message) from None
