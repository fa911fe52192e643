"""Every planning and probe flag of every command, and every flag of `rpcfleet serve`, is made from its one
declaration (`orchestrator.workflows.options`, `orchestrator.workflows.serve_options`, by
`cli/_planning.py: add_options`): none is added by hand, each keeps the declared spellings, help, default
and choices (but the few commands that change one on purpose). serve's defaults are one number each."""

from __future__ import annotations

import argparse
import dataclasses

from orchestrator.cli import build_parser, command_parsers
from orchestrator.cli._planning import add_options, declaration_of
from orchestrator.workflows.options import OPTIONS, PLAN_OPTIONS, PROBE_OPTIONS, TIMEOUT
from orchestrator.workflows.serve_options import (
    EXCLUSIVE,
    LIMITS,
    OBSERVE_INTERVAL,
    OWN_OPTIONS,
    SERVE_OPTIONS,
    SERVE_PARALLEL,
    serve_config,
)

# What a command changes of a declared option, on purpose.
CHANGED = {
    ("rpcfleet export lws", "parallel"): {"default", "help"},  # llama-server's slots: 4, as serve
    ("rpcfleet export lws", "replicas"): {"help"},  # groups of pods, each with its NetworkPolicy
    ("rpcfleet model info", "ctx"): {"default", "help"},  # optional: also show the KV cache at it
    ("rpcfleet report", "ctx"): {"default", "help"},  # several contexts, comma-separated or repeated
    ("rpcfleet exporter", "timeout"): {"help"},  # the exporter's rounds read over SSH more than facts
    ("rpcfleet plan", "replicas"): {"default", "help"},  # serve's --replicas: no formations unless asked
    ("rpcfleet report", "replicas"): {"default", "help"},
    # None when not given: a models file's entries then take serve's default, the other reports the plan's
    ("rpcfleet report", "parallel"): {"default"},
    ("rpcfleet report", "models"): {"help"},  # serve's models file, reported together as serve forms them
}
PLANNING_COMMANDS = ("plan", "run", "serve", "report", "cache warm", "cache prune")
# The flags of `rpcfleet serve` that no declaration of its own makes: every command's.
SERVE_BY_HAND = ["help", "inventory", "slurm_job", "limit", "forks", "verbose", "log_format"]


def _flags() -> dict[str, str]:
    return {flag: option.name for option in OPTIONS.values() for flag in option.flags}


def _made(parser: argparse.ArgumentParser) -> tuple[set[tuple[str, str]], list[str]]:
    """(command, option) for every flag made from a declaration, and what is wrong with the others: a
    planning or probe flag added by hand, a made one that differs from its declaration."""
    flags, made, wrong = _flags(), set(), []
    for command in command_parsers(parser):
        for action in command._actions:
            option = declaration_of(action)
            where = f"{command.prog} {'/'.join(action.option_strings)}"
            if option is None:
                if {f for f in action.option_strings if f in flags} or action.dest in OPTIONS:
                    wrong.append(f"{where}: added by hand, not from its declaration")
                continue
            changed = CHANGED.get((command.prog, option.name), set())
            if tuple(action.option_strings) != option.flags or action.dest != option.name:
                wrong.append(f"{where}: spelled other than {option.flags} ({option.name})")
            if "help" not in changed and action.help != option.help:
                wrong.append(f"{where}: help {action.help!r} is not the declared one")
            if "default" not in changed and command.get_default(option.name) != option.default:
                wrong.append(f"{where}: default {command.get_default(option.name)!r} != {option.default!r}")
            if option.choices and tuple(action.choices or ()) != option.choices:
                wrong.append(f"{where}: choices {action.choices} != {option.choices}")
            if option.metavar is not None and action.metavar != option.metavar:
                wrong.append(f"{where}: metavar {action.metavar!r} != {option.metavar!r}")
            made.add((command.prog, option.name))
    return made, wrong


def test_every_option_is_declared_once() -> None:
    declared = [*PLAN_OPTIONS, *PROBE_OPTIONS]
    names = [option.name for option in declared]
    flags = [flag for option in declared for flag in option.flags]
    assert len(set(names)) == len(names) == len(OPTIONS)
    assert len(set(flags)) == len(flags)
    serve_names = [option.name for option in SERVE_OPTIONS]
    serve_flags = [flag for option in SERVE_OPTIONS for flag in option.flags]
    assert len(set(serve_names)) == len(serve_names) and len(set(serve_flags)) == len(serve_flags)
    assert not {option.name for option in OWN_OPTIONS} & set(OPTIONS)  # serve's own are its own
    assert {name for group in EXCLUSIVE for name in group} <= set(serve_names)


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


def test_every_serve_flag_comes_from_its_declaration() -> None:
    """serve's flags are its declaration, in its order, with its exclusions; none added by hand but the
    inventory's and the logging's (every command's)."""
    (serve,) = [p for p in command_parsers(build_parser()) if p.prog == "rpcfleet serve"]
    made = [declaration_of(action) for action in serve._actions]
    assert [option for option in made if option is not None] == list(SERVE_OPTIONS)
    assert [a.dest for a, option in zip(serve._actions, made, strict=True) if option is None] == SERVE_BY_HAND
    groups = [tuple(a.dest for a in group._group_actions) for group in serve._mutually_exclusive_groups]
    assert groups == list(EXCLUSIVE)
    assert serve.get_default("parallel") == SERVE_PARALLEL.default == 4


def test_serve_defaults_are_one_number_each() -> None:
    """The flags' defaults are the serving limits' (`ServeConfig`), the engine's slots and the request's."""
    from orchestrator.serve.engine import DEFAULT_PARALLEL
    from orchestrator.serve.states import ServeConfig
    from orchestrator.workflows.serve import ServeRequest

    config = ServeConfig()
    assert {field: getattr(config, field) for field in LIMITS} == {f: o.default for f, o in LIMITS.items()}
    assert serve_config({}) == config and serve_config({"queue": 3, "seed": None}).queue_size == 3
    assert config.parallel == DEFAULT_PARALLEL == SERVE_PARALLEL.default
    (observe,) = [f for f in dataclasses.fields(ServeRequest) if f.name == OBSERVE_INTERVAL.name]
    assert observe.default == OBSERVE_INTERVAL.default
