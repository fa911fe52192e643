"""The argument parser every command uses: usage errors as exit status 2 through one path, "did you
mean" for a mistyped command, choice or flag, and field parsers (`orchestrator.core.fields`) as flag types."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

from orchestrator.cli import _output
from orchestrator.cli._output import escape

T = TypeVar("T")


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
        _output.err_console.print(f"[red]error:[/red] {escape(message)}", highlight=False)
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
