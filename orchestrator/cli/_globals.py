"""The options a user may put before the command or after it (`rpcfleet -i inv.yml ping`), and those every
command takes (-v, --log-format)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.cli._parser import ArgumentParser, flag
from orchestrator.core import fields


@dataclass(frozen=True)
class GlobalOption:
    """An option a user may put before the command (`rpcfleet -i inv.yml ping`) or after it."""

    flags: tuple[str, ...]
    dest: str
    kwargs: dict[str, Any]
    every_command: bool = False  # -v and --log-format: every command takes them


GLOBAL_OPTIONS = (
    GlobalOption(("-i", "--inventory"), "inventory", {"type": Path, "metavar": "INVENTORY"}),
    GlobalOption(("--slurm-job",), "slurm_job", {"metavar": "JOBID"}),
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
