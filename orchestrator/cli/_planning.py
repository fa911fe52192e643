"""Planning flags shared by `plan`, `run` and `report`, and the probe → devices step behind them."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from orchestrator.cli import _common
from orchestrator.core import fields
from orchestrator.core.errors import UsageError

if TYPE_CHECKING:  # numpy and the probe are imported lazily: `rpcfleet --help` stays fast
    from collections.abc import Callable, Sequence

    from orchestrator.inventory.model import Host
    from orchestrator.planning.plan import PlanDevice, PlanOptions
    from orchestrator.probe.fleet import FleetProbe


# orchestrator.planning.profile.KV_CACHE_TYPES, without importing gguf (tests/test_cli.py checks they agree)
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


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
            type=_common.flag(fields.context),
            default=4096,
            help="context size: 8192, 8k, 128k (default: 4096; 0 = the model's training context)",
        )
    parser.add_argument(
        "--margin",
        type=_common.flag(fields.size),
        default=None,
        help="headroom kept free per device (default: 256MiB)",
    )
    add_kv_type_args(parser)
    parser.add_argument("--flash-attn", action="store_true", help="plan with flash attention")
    parser.add_argument(
        "--swa-full",
        action="store_true",
        help="full-context cache for sliding-window layers, as llama.cpp's C default (default: the small "
        "SWA cache, as llama-server)",
    )
    parser.add_argument(
        "--parallel",
        "-np",
        type=_common.flag(fields.integer(minimum=1, maximum=256)),  # LLAMA_MAX_SEQ
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
        type=_common.flag(fields.integer(minimum=0)),
        default=0,
        metavar="N",
        help="keep the expert (MoE) weights of the first N layers on this machine's CPU (default: 0)",
    )
    parser.add_argument(
        "--ubatch", type=_common.flag(fields.integer(minimum=1)), default=512, help="n_ubatch (default: 512)"
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
    _common.add_probe_args(parser)


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
        type=_common.flag(replicas),
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
) -> tuple[list[Any], list[Host]]:
    """The formations serve would choose for `models` ((path, name, profile)) with --replicas on the probed
    `devices`; a model that gets none: PlanError."""
    from orchestrator.core.errors import PlanError
    from orchestrator.serve.formations import FormationError
    from orchestrator.serve.forming import ServedModel, form

    replicas = args.replicas if isinstance(args.replicas, int) else None
    served = [ServedModel(path, name, profile, options, replicas) for path, name, profile in models]
    rpc = [d for d in devices if d.ok and d.endpoint is not None]
    local = [d for d in devices if d.endpoint is None]
    try:
        selection = local_device_selection(args) if hasattr(args, "local_devices") else []
        return form(served, hosts, rpc, local, selection)
    except FormationError as exc:
        raise PlanError(f"no formations: {exc}") from None


def formations_lines(formed: Sequence[Any], spares: Sequence[Host], replicas: Any) -> list[str]:
    """The formations as text: one line each (nodes, fit, headroom), then the spares."""
    from orchestrator.core.units import format_size
    from orchestrator.planning.plan import largest_ctx_text

    lines = [f"formations (--replicas {replicas}): {len(formed)}"]
    for one in formed:
        plan = one.plan
        headroom = min((d.memory.headroom for d in plan.devices), default=0)
        lines.append(
            f"  {one.choice.name}: {len(one.choice.endpoints)} node(s) {', '.join(one.choice.endpoints)} · "
            f"n_ctx {plan.n_ctx} x {plan.options.parallel} sequence(s) · headroom {format_size(headroom)} · "
            f"{largest_ctx_text(plan.fit)}"
        )
    lines.append(f"spares: {', '.join(h.endpoint for h in spares) or 'none'}")
    return lines


def formations_json(formed: Sequence[Any], spares: Sequence[Host]) -> dict[str, Any]:
    return {
        "formations": [
            {
                "name": one.choice.name,
                "model": one.model.name,
                "endpoints": list(one.choice.endpoints),
                "plan": one.plan.to_json(),
            }
            for one in formed
        ],
        "spares": [h.endpoint for h in spares],
    }


def plan_options(args: argparse.Namespace, *, n_ctx: int | None = None) -> PlanOptions:
    """PlanOptions from the flags; `n_ctx` overrides --ctx (the report plans several contexts)."""
    from orchestrator.planning.plan import DEFAULT_MARGIN, PlanOptions

    return PlanOptions(
        n_ctx=args.ctx if n_ctx is None else n_ctx,
        type_k=args.type_k,
        type_v=args.type_v,
        n_ubatch=args.ubatch,
        flash_attn=args.flash_attn,
        swa_full=args.swa_full,
        parallel=args.parallel,
        kv_unified=args.kv_unified,
        n_cpu_moe=args.n_cpu_moe,
        margin=args.margin if args.margin is not None else DEFAULT_MARGIN,
        strategy=args.strategy,
    )


def local_device_selection(args: argparse.Namespace) -> list[str] | None:
    text = args.local_devices
    if text is None:
        return None
    return [name.strip() for name in text.split(",") if name.strip()]


def dial_map(args: argparse.Namespace, endpoints: tuple[str, ...]) -> dict[str, str]:
    """Plan endpoint -> the endpoint to dial, for the inventory's `rpc_transport: ssh` hosts among
    `endpoints` (their SSH forwards, opened now or reused from the probe); empty without an inventory."""
    from orchestrator.connectors.tunnel import default_tunnels
    from orchestrator.core.errors import RpcfleetError

    if getattr(args, "endpoint", None):
        return {}
    hosts = getattr(args, "selected_hosts", None)
    if hosts is None:  # a saved plan (--plan): its hosts are the inventory's, when there is one
        try:
            _, hosts = _common.load_hosts(args)
        except RpcfleetError:  # none (or none readable): a saved plan runs as before, on its endpoints
            return {}
    return default_tunnels().mapping(h for h in hosts if h.endpoint in endpoints)


def probe(args: argparse.Namespace, hosts: list[Host] | None = None, *, release: bool = False) -> FleetProbe:
    """Probe the selected hosts (or `hosts`) with the planning flags (timeout, facts, forks, trust);
    `release`: a busy server whose client is proven gone is let go (`operations.stale`), then probed
    again (for a load, not for the read-only commands)."""
    from orchestrator.probe.fleet import probe_fleet

    if hosts is None:
        _, hosts = _common.load_hosts(args)
        args.selected_hosts = hosts
    if not hosts:
        raise UsageError("no hosts selected")
    selected = hosts

    def go() -> FleetProbe:
        return _common.run_async(
            probe_fleet(
                selected,
                timeout=_common.probe_timeout(args),
                facts=not args.no_facts,
                forks=args.forks,
                trust_rpc_memory=args.trust_rpc_memory,
            )
        )

    fleet = go()
    busy = [h for h in hosts if any(n.host == h.name and n.state == "busy" for n in fleet.nodes)]
    if release and busy:
        from orchestrator.operations.stale import release_stale_on

        if _common.run_async(release_stale_on(busy, forks=args.forks)):
            fleet = go()
    return fleet


def probe_devices(
    args: argparse.Namespace,
    hosts: list[Host] | None = None,
    *,
    release: bool = False,
    local_gpus: Callable[[], list[PlanDevice]] | None = None,
) -> list[PlanDevice]:
    """Probe the selected hosts and order their devices for the planner: every RPC device of each
    endpoint in inventory order, then the selected local GPUs of this machine (`release`: see `probe`).
    The local GPUs come from `local_gpus` (`run`: its worker's), by default from a worker child started
    to list them: this process never loads libllama."""
    from orchestrator.llama.worker import list_local_gpus
    from orchestrator.planning.devices import to_plan_devices
    from orchestrator.planning.placement import order_devices

    fleet = probe(args, hosts, release=release)
    selection = local_device_selection(args)
    gpus = [] if selection == [] else (local_gpus or list_local_gpus)()  # none wanted: no child
    return list(order_devices(to_plan_devices(fleet), gpus, selection))
