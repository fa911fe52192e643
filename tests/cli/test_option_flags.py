"""Every planning and probe flag of every command is made from its one declaration
(`orchestrator.workflows.options`, by `cli/_planning.py: add_options`): none is added by hand, each keeps
the declared spellings, help, default and choices (but the few commands that change one on purpose)."""

from __future__ import annotations

import argparse

from orchestrator.cli import build_parser, command_parsers
from orchestrator.cli._planning import add_options, declaration_of
from orchestrator.workflows.options import OPTIONS, PLAN_OPTIONS, PROBE_OPTIONS, TIMEOUT

# What a command changes of a declared option, on purpose.
CHANGED = {
    ("rpcfleet serve", "parallel"): {"default"},  # llama-server's slots: 4
    ("rpcfleet export lws", "parallel"): {"default"},  # llama-server's slots: 4, as serve
    ("rpcfleet model info", "ctx"): {"default", "help"},  # optional: also show the KV cache at it
    ("rpcfleet report", "ctx"): {"default", "help"},  # several contexts, comma-separated or repeated
    ("rpcfleet exporter", "timeout"): {"help"},  # the exporter's rounds read over SSH more than facts
}
PLANNING_COMMANDS = ("plan", "run", "serve", "report", "cache warm", "cache prune")


def _flags() -> dict[str, str]:
    return {flag: option.name for option in OPTIONS.values() for flag in option.flags}


def _made(parser: argparse.ArgumentParser) -> tuple[set[tuple[str, str]], list[str]]:
    """(command, option) for every flag made from a declaration, and what is wrong with the others."""
    flags, made, wrong = _flags(), set(), []
    for command in command_parsers(parser):
        for action in command._actions:
            named = {flags[f] for f in action.option_strings if f in flags}
            if action.dest in OPTIONS:
                named.add(action.dest)
            if not named:
                continue
            option = declaration_of(action)
            where = f"{command.prog} {'/'.join(action.option_strings)}"
            if option is None or named != {option.name}:
                wrong.append(f"{where}: added by hand, not from its declaration")
                continue
            changed = CHANGED.get((command.prog, option.name), set())
            if tuple(action.option_strings) != option.flags:
                wrong.append(f"{where}: spelled other than {option.flags}")
            if "help" not in changed and action.help != option.help:
                wrong.append(f"{where}: help {action.help!r} is not the declared one")
            if "default" not in changed and command.get_default(option.name) != option.default:
                wrong.append(f"{where}: default {command.get_default(option.name)!r} != {option.default!r}")
            if option.choices and tuple(action.choices or ()) != option.choices:
                wrong.append(f"{where}: choices {action.choices} != {option.choices}")
            made.add((command.prog, option.name))
    return made, wrong


def test_every_option_is_declared_once() -> None:
    declared = [*PLAN_OPTIONS, *PROBE_OPTIONS]
    names = [option.name for option in declared]
    flags = [flag for option in declared for flag in option.flags]
    assert len(set(names)) == len(names) == len(OPTIONS)
    assert len(set(flags)) == len(flags)


def test_every_plan_flag_comes_from_its_declaration() -> None:
    made, wrong = _made(build_parser())
    assert not wrong, "\n".join(wrong)
    for command in PLANNING_COMMANDS:
        taken = {name for prog, name in made if prog == f"rpcfleet {command}"}
        assert {option.name for option in PLAN_OPTIONS} <= taken, command
    assert {(prog, name) for prog, name in made if name == TIMEOUT.name} >= {("rpcfleet probe", "timeout")}


def test_the_check_names_a_flag_added_by_hand() -> None:
    """The check can fail: a command that adds --type-k itself, or changes a declared option's help."""
    parser = build_parser()
    (plan,) = [p for p in command_parsers(parser) if p.prog == "rpcfleet plan"]
    plan.add_argument("--type-k-again", dest="type_k", choices=["f16"], help="by hand")
    (probe,) = [p for p in command_parsers(parser) if p.prog == "rpcfleet probe"]
    (strategy,) = [o for o in PLAN_OPTIONS if o.name == "strategy"]
    add_options(probe, [strategy], helps={"strategy": "another help"})
    _, wrong = _made(parser)
    assert wrong == [
        "rpcfleet plan --type-k-again: added by hand, not from its declaration",
        "rpcfleet probe --strategy: help 'another help' is not the declared one",
    ]
