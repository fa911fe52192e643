"""Planning flags shared by `plan`, `run`, `report`, `cache`, `serve`, `probe`, `model info` and `exporter`,
made from their one declaration (`orchestrator.workflows.options`: `add_options`) and parsed once into the
typed options of `orchestrator.workflows` (`planning_args`): the workflows do the probing and the planning."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from orchestrator.cli import _parser
from orchestrator.workflows.options import CTX, LOCAL_DEVICES, PLAN_OPTIONS, PROBE_OPTIONS, Option
from orchestrator.workflows.serve_options import REPLICAS, REPLICAS_HELP

if TYPE_CHECKING:  # numpy and the probe are imported lazily: `rpcfleet --help` stays fast
    from collections.abc import Sequence
    from pathlib import Path

    from orchestrator.inventory.model import Host, Inventory
    from orchestrator.planning.formations import Formations, ServedModel
    from orchestrator.planning.plan import PlanDevice, PlanOptions
    from orchestrator.planning.profile import ModelProfile
    from orchestrator.probe.fleet import FleetProbe
    from orchestrator.serve.models_file import ModelEntry
    from orchestrator.workflows.options import ProbeSettings


_MADE: WeakKeyDictionary[argparse.Action, Option] = WeakKeyDictionary()


def add_options(
    parser: argparse.ArgumentParser,
    options: Iterable[Option],
    *,
    defaults: Mapping[str, Any] | None = None,
    helps: Mapping[str, str] | None = None,
    repeated: Iterable[str] = (),
    exclusive: Iterable[Iterable[str]] = (),
) -> None:
    """The flags of declared options, in the given order: a switch is a flag without a value, an option
    with choices takes one of them (argparse lists them and suggests the closest), any other its parser's
    value (`_parser.flag`); a `repeat` option's values are collected in a list. `defaults` and `helps`
    change an option's default or help for this command (`model info --ctx` is optional); an option in
    `repeated` may be given several times (its values, strings, are collected in a list: `report --ctx
    4k,32k --ctx 8k`). Each group of names in `exclusive` takes one of its flags at most (argparse's
    mutually exclusive group: `serve --api-key | --api-key-file`)."""
    defaults, helps, repeated = defaults or {}, helps or {}, set(repeated)
    group_of = {name: tuple(group) for group in map(tuple, exclusive) for name in group}
    groups: dict[tuple[str, ...], Any] = {}
    for option in options:
        kwargs: dict[str, Any] = {"dest": option.name, "help": helps.get(option.name, option.help)}
        if option.switch:
            kwargs["action"] = "store_false" if option.default else "store_true"
        elif option.name in repeated:
            kwargs.update(action="append", default=defaults.get(option.name))
        else:
            kwargs["default"] = defaults.get(option.name, option.default)
            if option.choices:
                kwargs["choices"] = option.choices
            else:
                kwargs["type"] = _parser.flag(option.parse)
            if option.repeat:
                kwargs["action"] = "append"
            if option.metavar is not None:
                kwargs["metavar"] = option.metavar
            if option.bare is not None:
                kwargs.update(nargs="?", const=option.bare)
        where: Any = parser
        group = group_of.get(option.name)
        if group is not None:
            if group not in groups:
                groups[group] = parser.add_mutually_exclusive_group()
            where = groups[group]
        _MADE[where.add_argument(*option.flags, **kwargs)] = option


def declaration_of(action: argparse.Action) -> Option | None:
    """The declared option `add_options` made `action` from (None: a flag declared elsewhere)."""
    return _MADE.get(action)


def add_plan_option_args(parser: argparse.ArgumentParser, *, ctx: bool = True, local: bool = True) -> None:
    """The plan's options and the probe's (`report` takes --ctx its own way, and plans no local GPUs)."""
    leave_out = {CTX.name} if not ctx else set()
    if not local:
        leave_out.add(LOCAL_DEVICES.name)
    add_options(parser, [o for o in (*PLAN_OPTIONS, *PROBE_OPTIONS) if o.name not in leave_out])


def add_replicas_arg(parser: argparse.ArgumentParser) -> None:
    """`plan` and `report` take serve's --replicas (`workflows/serve_options.py`) without a default: with
    it they print the formations serve would choose."""
    help_text = f"{REPLICAS_HELP}; prints the formations serve would choose"
    add_options(parser, [REPLICAS], defaults={REPLICAS.name: None}, helps={REPLICAS.name: help_text})


def formations(
    args: argparse.Namespace,
    hosts: Sequence[Host],
    devices: Sequence[PlanDevice],
    models: Sequence[tuple[str, str, Any]],
    options: PlanOptions,
    entries: Sequence[tuple[ModelEntry, ModelProfile]] = (),
    inventory: Inventory | None = None,
    *,
    entry_parallel: int | None = None,
) -> Formations:
    """The formations serve would choose for `models` ((path, name, profile)) with --replicas, and for a
    models file's `entries` by serve's own rule (`workflows.serve.entry_model`: each model's context,
    parallel, replicas and hosts; `loaded_at_start`), on the probed `devices`
    (workflows.plan.plan_formations); a model that gets none: PlanError."""
    from orchestrator.planning.formations import ServedModel
    from orchestrator.workflows.plan import plan_formations
    from orchestrator.workflows.serve import loaded_at_start

    flag = str(args.replicas) if args.replicas is not None else "auto"
    replicas = args.replicas if isinstance(args.replicas, int) else None
    served = [ServedModel(path, name, profile, options, replicas) for path, name, profile in models]
    if entries:
        assert inventory is not None
        served += entry_models(args, hosts, entries, options, inventory, entry_parallel=entry_parallel)
        served = loaded_at_start(served)
    selection = args.local_devices if hasattr(args, "local_devices") else []
    return plan_formations(served, hosts, devices, flag, local_devices=selection)


def entry_models(
    args: argparse.Namespace,
    hosts: Sequence[Host],
    entries: Sequence[tuple[ModelEntry, ModelProfile]],
    options: PlanOptions,
    inventory: Inventory,
    *,
    entry_parallel: int | None = None,
) -> list[ServedModel]:
    """A models file's entries as serve makes them (`workflows.serve.entry_model`: each one's context,
    parallel slots, replicas and hosts over the flags'); UsageError naming the file and line."""
    from orchestrator.workflows.serve import entry_model

    flag = str(args.replicas) if args.replicas is not None else "auto"
    # the entries' flags as serve's: its --parallel default is not the plan's (`entry_parallel`)
    entry_options = (
        options if entry_parallel is None else dataclasses.replace(options, parallel=entry_parallel)
    )
    models_file = getattr(args, "models", None)
    return [entry_model(e, p, inventory, list(hosts), entry_options, flag, models_file) for e, p in entries]


def read_models_file(path: Path) -> list[ModelEntry]:
    """serve's models file, read as serve reads it (errors name the file and line, exit 2)."""
    from orchestrator.core.errors import UsageError
    from orchestrator.serve.models_file import parse_models_file

    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"--models {path}: {exc.strerror}") from None
    return parse_models_file(path, text)


def entry_profile(models_file: Path | None, entry: ModelEntry) -> ModelProfile:
    """A models-file entry's GGUF profile; a file that is no model: exit 2 naming the file and line."""
    from orchestrator.core.errors import UsageError
    from orchestrator.planning.profile import profile_model

    where = f"{models_file}:{entry.line}: " if entry.line is not None else ""
    if not entry.model.is_file():
        what = "does not exist" if not entry.model.exists() else "is not a file"
        raise UsageError(f"{where}model {entry.model} {what}")
    try:
        return profile_model(entry.model)
    except UsageError as exc:
        raise UsageError(f"{where}{exc.message}") from None


@dataclass(frozen=True)
class PlanningArgs:
    """The planning flags, parsed once: the plan's options, the probe's settings and the local GPUs
    wanted (None: all, []: none)."""

    options: PlanOptions
    probe: ProbeSettings
    local_devices: list[str] | None


def planning_args(args: argparse.Namespace, *, n_ctx: int | None = None, facts: bool = True) -> PlanningArgs:
    """`args`' planning flags as `PlanningArgs`; `n_ctx` overrides --ctx (the report plans several
    contexts); `facts=False` reads no host facts whatever --no-facts says (`run --endpoint` with remote
    servers)."""
    from orchestrator.workflows.options import plan_options, probe_settings

    # serve's engine and the llama-cli format's reader are llama-server; run loads llama-cpp-python
    llama_server = args.command == "serve" or getattr(args, "format", None) == "llama-cli"
    return PlanningArgs(
        plan_options(vars(args), n_ctx=n_ctx, llama_server=llama_server),
        probe_settings(vars(args), forks=args.forks, facts=facts),
        getattr(args, "local_devices", None),
    )


def probe(args: argparse.Namespace, hosts: list[Host]) -> FleetProbe:
    """Probe `hosts` with the planning flags (timeout, facts, forks, trust), read-only."""
    from orchestrator.engine.runtime import run_once
    from orchestrator.workflows.plan import probe_hosts

    return run_once(probe_hosts(hosts, planning_args(args).probe))


def probe_devices(args: argparse.Namespace, hosts: list[Host]) -> list[PlanDevice]:
    """Probe `hosts` (read-only) and order their devices for the planner, local GPUs as selected."""
    from orchestrator.engine.runtime import run_once
    from orchestrator.workflows.plan import ordered_devices, probe_hosts

    request = planning_args(args)
    fleet = run_once(probe_hosts(hosts, request.probe))
    return list(ordered_devices(fleet, local_devices=request.local_devices))
