"""Planning flags shared by `plan`, `run`, `report`, `cache` and `serve`, parsed once into the typed
options of `orchestrator.workflows` (`planning_args`): the workflows do the probing and the planning."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrator.cli import _parser
from orchestrator.core import fields

if TYPE_CHECKING:  # numpy and the probe are imported lazily: `rpcfleet --help` stays fast
    from collections.abc import Sequence

    from orchestrator.inventory.model import Host
    from orchestrator.planning.formations import Formations
    from orchestrator.planning.plan import PlanDevice, PlanOptions
    from orchestrator.probe.fleet import FleetProbe
    from orchestrator.workflows.options import ProbeSettings


# orchestrator.planning.profile.KV_CACHE_TYPES, without importing gguf
# (tests/cli/test_cli.py checks they agree)
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
FLASH_ATTN = ("on", "off", "auto")  # llama.cpp's -fa values


def add_kv_type_args(parser: argparse.ArgumentParser) -> None:
    for which in ("k", "v"):
        parser.add_argument(
            f"--type-{which}",
            choices=KV_TYPES,
            default="f16",
            metavar="TYPE",
            help=f"KV cache type of {which.upper()}: {', '.join(KV_TYPES)} (default: f16)",
        )


def add_plan_option_args(parser: argparse.ArgumentParser, *, ctx: bool = True, local: bool = True) -> None:
    if ctx:
        parser.add_argument(
            "--ctx",
            type=_parser.flag(fields.context),
            default=4096,
            help="context size: 8192, 8k, 128k (default: 4096; 0 = the model's training context)",
        )
    parser.add_argument(
        "--margin",
        type=_parser.flag(fields.size),
        default=None,
        help="headroom kept free per device (default: 256MiB)",
    )
    add_kv_type_args(parser)
    parser.add_argument(
        "--flash-attn",
        "-fa",
        nargs="?",
        const="on",
        default="auto",
        choices=FLASH_ATTN,
        metavar="on|off|auto",
        help="flash attention, llama.cpp's -fa (default: auto, llama-server's: on where the devices run "
        "it; the plan assumes on and passes -fa on, so that what is planned is what runs)",
    )
    parser.add_argument(
        "--swa-full",
        action="store_true",
        help="full-context cache for sliding-window layers, as llama.cpp's C default (default: the small "
        "SWA cache, as llama-server)",
    )
    parser.add_argument(
        "--parallel",
        "-np",
        type=_parser.flag(fields.integer(minimum=1, maximum=256)),  # LLAMA_MAX_SEQ
        default=1,
        metavar="N",
        help="parallel sequences (n_seq_max; serve: llama-server's slots, served at once and batched "
        "together): each gets --ctx/N unless --kv-unified (default: 1; serve: 4)",
    )
    parser.add_argument(
        "--kv-unified",
        action="store_true",
        help="one KV cache shared by all sequences (each may use the whole context)",
    )
    parser.add_argument(
        "--n-cpu-moe",
        type=_parser.flag(fields.integer(minimum=0)),
        default=0,
        metavar="N",
        help="keep the expert (MoE) weights of the first N layers on this machine's CPU (default: 0)",
    )
    parser.add_argument(
        "--ubatch", type=_parser.flag(fields.integer(minimum=1)), default=512, help="n_ubatch (default: 512)"
    )
    parser.add_argument(
        "--strategy",
        choices=["proportional", "fewest"],
        default="proportional",
        help="layers proportional to usable memory (default), or on the fewest devices",
    )
    parser.add_argument(
        "--trust-rpc-memory",
        action="store_true",
        help="plan on a CPU server's own memory figure (total RAM) when its host facts cannot be read "
        "(default: such a node is refused)",
    )
    if local:
        parser.add_argument(
            "--local-devices",
            default=None,
            metavar="NAMES",
            help="local GPUs after the RPC devices: absent = all, '' = none, 'CUDA0,CUDA1' = those in order",
        )
    add_probe_args(parser)


def add_probe_args(parser: argparse.ArgumentParser) -> None:
    """--timeout and --no-facts, for every command that probes the fleet."""
    parser.add_argument(
        "--timeout",
        type=_parser.flag(fields.seconds),
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


def replicas(value: str) -> int | str:
    """--replicas: auto or a number of formations."""
    if value.strip().lower() == "auto":
        return "auto"
    return fields.integer(minimum=1, maximum=1024)(value)


def add_replicas_args(parser: argparse.ArgumentParser, *, serve: bool = True) -> None:
    """--replicas auto|N and (serve) --split: how many formations (engines, each with a copy of the model
    on its own servers). `plan` and `report` take --replicas alone: with it they print the formations
    serve would choose."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--replicas",
        type=_parser.flag(replicas),
        default="auto" if serve else None,
        metavar="auto|N",
        help="formations of the model, each on its own nodes: auto = the fewest nodes it fits on, as "
        "many such groups as the nodes hold; N = N such groups"
        + (" (default: auto)" if serve else "; prints the formations serve would choose"),
    )
    if serve:
        group.add_argument(
            "--split",
            action="store_true",
            help="one formation over every selected node (the model split across all of them)",
        )


def formations(
    args: argparse.Namespace,
    hosts: Sequence[Host],
    devices: Sequence[PlanDevice],
    models: Sequence[tuple[str, str, Any]],
    options: PlanOptions,
) -> Formations:
    """The formations serve would choose for `models` ((path, name, profile)) with --replicas on the probed
    `devices` (workflows.plan.plan_formations); a model that gets none: PlanError."""
    from orchestrator.planning.formations import ServedModel
    from orchestrator.workflows.options import local_device_selection
    from orchestrator.workflows.plan import plan_formations

    replicas = args.replicas if isinstance(args.replicas, int) else None
    served = [ServedModel(path, name, profile, options, replicas) for path, name, profile in models]
    selection = local_device_selection(args.local_devices) if hasattr(args, "local_devices") else []
    return plan_formations(served, hosts, devices, str(args.replicas), local_devices=selection)


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
    from orchestrator.workflows.options import ProbeSettings, local_device_selection, plan_options

    probe = ProbeSettings(
        timeout=probe_timeout(args),
        facts=facts and not args.no_facts,
        forks=args.forks,
        trust_rpc_memory=args.trust_rpc_memory,
    )
    return PlanningArgs(
        plan_options(vars(args), n_ctx=n_ctx),
        probe,
        local_device_selection(getattr(args, "local_devices", None)),
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
