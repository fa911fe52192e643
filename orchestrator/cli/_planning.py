"""Planning flags shared by `plan`, `run` and `report`, and the probe → devices step behind them."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from orchestrator.cli import _common
from orchestrator.core import fields
from orchestrator.core.errors import UsageError

if TYPE_CHECKING:  # numpy and the probe are imported lazily: `rpcfleet --help` stays fast
    from collections.abc import Callable

    from orchestrator.inventory.model import Host
    from orchestrator.planning.plan import PlanDevice, PlanOptions
    from orchestrator.probe.fleet import FleetProbe


# orchestrator.planning.profile.KV_CACHE_TYPES, without importing gguf (tests/test_cli.py checks they agree)
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
FLASH_ATTN = ("on", "off", "auto")  # llama.cpp's -fa values


def flash_attn_planned(value: str) -> bool:
    """Whether the plan assumes flash attention for `-fa VALUE`. llama.cpp's `auto` turns it on unless a
    layer's device lacks the kernel (llama_context::resolve_fused_ops); the CPU, CUDA, Metal and Vulkan
    backends, and RPC servers of them, have it, so auto plans (and runs) it on."""
    return value != "off"


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


def plan_options(args: argparse.Namespace, *, n_ctx: int | None = None) -> PlanOptions:
    """PlanOptions from the flags; `n_ctx` overrides --ctx (the report plans several contexts)."""
    from orchestrator.planning.plan import DEFAULT_MARGIN, PlanOptions

    return PlanOptions(
        n_ctx=args.ctx if n_ctx is None else n_ctx,
        type_k=args.type_k,
        type_v=args.type_v,
        n_ubatch=args.ubatch,
        flash_attn=flash_attn_planned(args.flash_attn),
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
