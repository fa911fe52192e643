"""`rpcfleet run`: probe the fleet, plan, load the model over RPC, generate, and show where it went.

The placement table sets the plan's prediction beside what llama.cpp allocated (its load log, 0.01 MiB
precision) for every device and for the host, then generation speed. The model runs in a worker process
(`orchestrator.llama.worker`): a node lost mid-inference is an error naming it (exit status 1), never a
native abort of this process; llama.cpp's log goes to the worker's log file (or stderr with
`--llama-verbose`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.cli import _common, _planning
from orchestrator.cli._common import escape
from orchestrator.core import signals
from orchestrator.core.errors import UsageError
from orchestrator.core.units import format_size

if TYPE_CHECKING:  # imported lazily: planning pulls in numpy
    from collections.abc import Callable

    from orchestrator.engine.executor import RunResult
    from orchestrator.inventory.model import Host
    from orchestrator.llama.cache_prep import CachePrep
    from orchestrator.llama.placement import Placement
    from orchestrator.planning.plan import Plan, PlanDevice
    from orchestrator.planning.profile import ModelProfile


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="plan from a fresh probe, load a model over RPC, generate, and show the placement",
        description=(
            "Probe the selected servers (inventory, or --endpoint for servers outside it), plan the "
            "model's placement, load it through llama-cpp-python with an explicit device list, generate "
            "and print predicted versus actual memory per device and tokens per second."
        ),
    )
    parser.add_argument("--model", "-m", type=Path, required=True, help="the GGUF model (first shard)")
    parser.add_argument("-p", "--prompt", required=True, help="the prompt")
    parser.add_argument("-n", "--n-predict", type=int, default=32, help="tokens to generate (default: 32)")
    _planning.add_plan_option_args(parser)
    parser.add_argument(
        "--endpoint",
        action="append",
        default=[],
        type=_endpoint,
        metavar="HOST:PORT",
        help="a server to use (repeatable); without it, the inventory's hosts",
    )
    parser.add_argument("--plan", type=Path, default=None, help="load this plan (JSON) instead of planning")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--temp", type=float, default=0.0, help="temperature (default: 0, greedy)")
    parser.add_argument(
        "--llama-verbose",
        action="store_true",
        help="show llama.cpp's own log here (default: the worker's log file, named on failure)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="load even when the plan does not fit (a CPU server may then be killed for lack of memory)",
    )
    parser.add_argument(
        "--warm",
        choices=["auto", "always", "never"],  # cache_prep.WarmChoice (not imported: start-up time)
        default="auto",
        help="put the tensors the nodes' caches lack into them over SSH first, all nodes in parallel "
        "(rpc_cache hosts; auto: when two nodes or more lack some)",
    )
    parser.add_argument(
        "--verify-cache",
        action="store_true",
        help="re-hash on each node the cache files the load will read (default: their sizes are checked)",
    )
    _common.add_inventory_args(parser)
    _common.add_json_arg(parser)
    parser.set_defaults(handler=handle)


def _endpoint(text: str) -> str:
    """--endpoint's value, checked as it is parsed (a bad one is a usage error naming it)."""
    from orchestrator.rpc.protocol import EndpointError, parse_endpoint

    try:
        parse_endpoint(text)
    except EndpointError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    return text


def endpoint_hosts(endpoints: list[str]) -> list[Host]:
    """Inventory-less hosts for `--endpoint` values. Loopback servers run on this machine, so they get
    a local connection (facts such as MemAvailable are read here); others are probed over RPC only."""
    from orchestrator.inventory.model import Host
    from orchestrator.rpc.protocol import parse_endpoint

    hosts = []
    for text in endpoints:
        ep = parse_endpoint(text)
        hosts.append(
            Host(name=str(ep), address=ep.host, connection="local", rpc_host=ep.host, rpc_port=ep.port)
        )
    return hosts


def make_run_plan(
    args: argparse.Namespace,
    phases: dict[str, float] | None = None,
    read: ModelProfile | Plan | None = None,
    local_gpus: Callable[[], list[PlanDevice]] | None = None,
) -> Plan:
    """The plan of this run (probed and planned, or `--plan`'s); `phases` gets the probe's and the
    plan's seconds. `read`: the model's profile, or the saved plan, when it was already read.
    `local_gpus`: this machine's GPUs (the worker's listing; default: a child started to list them)."""
    from orchestrator.inventory.model import is_loopback
    from orchestrator.planning.plan import Plan
    from orchestrator.planning.profile import ModelProfile, profile_model
    from orchestrator.planning.strategy import make_plan

    times = phases if phases is not None else {}
    started = time.monotonic()
    if args.plan is not None:
        plan = read if isinstance(read, Plan) else Plan.from_path(args.plan)
        times["plan"] = time.monotonic() - started
        return plan
    options = _planning.plan_options(args)
    hosts = None
    if args.endpoint:
        hosts = endpoint_hosts(args.endpoint)
        # Facts are read on this machine for loopback servers; others are probed over RPC only.
        args.no_facts = args.no_facts or any(not is_loopback(h.address) for h in hosts)
    # A load lets go of an inventory server held by a client proven gone (never an --endpoint's).
    devices = _planning.probe_devices(args, hosts, release=hosts is None, local_gpus=local_gpus)
    times["probe"] = time.monotonic() - started
    started = time.monotonic()
    profile = read if isinstance(read, ModelProfile) else profile_model(args.model)
    plan = make_plan(devices, profile, options)
    times["plan"] = time.monotonic() - started
    return plan


def check_fit(plan: Plan, *, force: bool, json: bool = False) -> None:
    """Refuse a plan that does not fit (PlanError) unless `force`, then only warn.

    Refusing matters most on CPU servers: with memory overcommit the allocation succeeds and the
    kernel's OOM killer kills the rpc-server later, in the middle of the load or of a generation.
    """
    from orchestrator.core.errors import PlanError

    if plan.fit.fits:
        return
    short = plan.devices[plan.fit.binding_device or 0].label if plan.devices else "the host"
    message = f"the plan does not fit: {short} is short by {format_size(plan.fit.shortfall)}"
    if not force:
        largest = plan.fit.largest_n_ctx
        ctx = f"a smaller --ctx (the largest that fits: {largest})" if largest else "a smaller --ctx"
        raise PlanError(message, hint=f"use {ctx}, more nodes, or --force to load it anyway")
    if not json:
        _common.err_console.print(f"[yellow]warning:[/yellow] {escape(message)} (--force)", highlight=False)


def inventory_hosts(args: argparse.Namespace) -> list[Host]:
    """The selected inventory hosts (their caches, their names); none with --endpoint, or with a saved
    --plan and no inventory (nothing to check against)."""
    from orchestrator.core.errors import InputError, LabError

    if args.endpoint:
        return []
    try:
        _, hosts = _common.load_hosts(args)
    except (InputError, LabError):
        if args.plan is not None:
            return []
        raise
    return list(hosts)


def handle(args: argparse.Namespace) -> int:
    from orchestrator.cli._progress import LoadBars
    from orchestrator.llama.worker import Worker

    if args.n_predict < 1:
        raise UsageError(f"-n must be at least 1, got {args.n_predict}")
    _common.require_model(args.model)
    # a file that is no model, or no plan, fails before the worker starts and the fleet is probed
    from orchestrator.planning.plan import Plan
    from orchestrator.planning.profile import profile_model

    read = profile_model(args.model) if args.plan is None else Plan.from_path(args.plan)
    # llama.cpp runs in a worker process: a node lost mid-inference aborts the worker, not this
    # process; the worker's log (llama.cpp's own) is named in the error. Spawned first, so its imports
    # overlap with the probe and the plan.
    phases: dict[str, float] = {}
    with Worker.spawn(log_to_stderr=args.llama_verbose) as worker:
        plan = make_run_plan(args, phases, read, worker.local_gpus)
        check_fit(plan, force=args.force, json=args.json)
        hosts = inventory_hosts(args)
        cache, cache_phases = prepare_cache(args, plan, hosts)
        phases |= cache_phases
        signals.raise_if_interrupted()  # one swallowed during the probe or the plan: no load follows
        if _common.err_console.is_terminal and not args.json:  # a phase line while the weights travel
            where = f"{len(plan.devices)} device(s)" if plan.devices else "this machine's CPU"
            _common.err_console.print(
                f"[dim]loading {escape(str(args.model))} on {where}, n_ctx {plan.n_ctx}...[/dim]",
                highlight=False,
            )
        dial = _planning.dial_map(args, plan.endpoints)
        started = time.monotonic()
        names = {h.endpoint: h.name for h in hosts if h.endpoint in plan.endpoints}
        bars = LoadBars(_common.err_console.is_terminal and not args.json, names=names)
        with bars:
            placement = worker.load(
                plan,
                args.model,
                {"seed": args.seed},
                dial=dial,
                on_progress=bars,
                cache_hits=cache.hit_bytes if cache is not None else None,
            )
        phases["load"] = time.monotonic() - started
        text, stats = generate(worker, args.prompt, args.n_predict, args.temp, args.seed, echo=not args.json)
    if args.json:
        _common.print_json(
            {
                "text": text,
                **stats,
                "placement": _placement_json(placement),
                "plan": {"tensor_split": plan.tensor_split, "n_ctx": plan.n_ctx, "fits": plan.fit.fits},
                "log": str(worker.log_path) if worker.log_path else None,
                "phases": {k: round(v, 3) for k, v in phases.items()},
                "cache": cache.as_json() if cache is not None else None,
            }
        )
        return 0
    _common.console.print()
    _print_placement(placement)
    n = stats["completion_tokens"]
    speed = (
        f", decoding at [bold]{stats['tokens_per_second']:.1f} tokens/s[/bold]"
        if stats["decode_seconds"] > 0
        else " (from the prompt's evaluation: no decoding step)"
    )
    _common.console.print(
        " · ".join(f"{k} {v:.2f} s" for k, v in phases.items()) + " · ready", highlight=False
    )
    _common.console.print(
        # llama.cpp's own load time, inside the load phase above (which adds the worker's round trip):
        # two figures both called "load" read as a contradiction
        f"llama.cpp's load {placement.load_seconds:.2f} s · prompt {stats['prompt_tokens']} tokens in "
        f"{stats['prompt_seconds']:.3f} s · {n} token{'s' if n != 1 else ''} generated{speed}",
        highlight=False,
    )
    return 0


def prepare_cache(
    args: argparse.Namespace, plan: Plan, hosts: list[Host]
) -> tuple[CachePrep | None, dict[str, float]]:
    """Before a load through the inventory's `rpc_cache` hosts: count each node's hits and misses, refuse
    (LoaderError) when a file the load would read back is truncated (or, with --verify-cache, corrupt),
    and warm the misses first when `--warm` says so (all nodes in parallel). Returns what the load will
    find and the phases' times."""
    from orchestrator.llama.cache_prep import prepare_caches

    phases: dict[str, float] = {}
    if not hosts:
        return None, phases
    started = time.monotonic()

    def checked(prep: CachePrep) -> None:
        phases["cache check"] = time.monotonic() - started
        if not args.json:
            _common.err_console.print(
                f"[dim]tensor cache: {prep.hits} hits, {prep.misses} misses "
                f"({format_size(prep.miss_bytes)} to send)[/dim]",
                highlight=False,
            )

    async def go() -> tuple[CachePrep | None, RunResult[Any] | None, bool]:
        async with _common.fleet_session(args) as session:  # one session: one connection per node
            prep, run = await prepare_caches(
                session, hosts, plan, args.model, full=args.verify_cache, warm=args.warm, on_checked=checked
            )
            return prep, run, session.interrupted is not None

    prep, run, interrupted = _common.run_async(go())
    if run is not None:
        phases["warm"] = time.monotonic() - started - phases["cache check"]
        for r in run.results:
            if not r.succeeded:  # to stderr even with --json: the load goes on, sending those tensors
                _common.err_console.print(
                    f"[yellow]warning:[/yellow] {escape(r.host.name)}: warming failed "
                    f"({escape(str(r.error))}); the load sends its tensors itself",
                    highlight=False,
                )
        if run.interrupted:
            _common.print_interrupted([run])
    if interrupted:  # Ctrl-C during the check or the warm: no load
        raise SystemExit(_common.INTERRUPTED_EXIT)
    if run is not None and prep is not None and not args.json:
        _common.err_console.print(
            f"[dim]warmed {len(run.results)} node(s) in parallel in {phases['warm']:.2f} s; "
            f"{prep.misses} misses left[/dim]",
            highlight=False,
        )
    return prep, phases


def generate(
    worker: Any, prompt: str, n: int, temp: float, seed: int, *, echo: bool
) -> tuple[str, dict[str, Any]]:
    """Stream a completion from the worker (echoed as it comes); the counts are the tokens the model
    produced and llama.cpp's own timings."""
    from orchestrator.llama.worker import Done

    done: Done | None = None
    try:
        for event in worker.complete(prompt, max_tokens=n, temperature=temp, seed=seed):
            signals.raise_if_interrupted()
            if isinstance(event, Done):
                done = event
            elif echo:
                sys.stdout.write(event.text)
                sys.stdout.flush()
    finally:
        if echo:
            sys.stdout.write("\n")
            sys.stdout.flush()
    assert done is not None
    return done.text, {
        "prompt_tokens": done.prompt_tokens,
        "prompt_seconds": round(done.prompt_seconds, 4),
        "completion_tokens": done.completion_tokens,
        "finish_reason": done.finish_reason,
        "decode_seconds": round(done.decode_seconds, 4),
        "tokens_per_second": round(done.tokens_per_second, 2),
    }


def _print_placement(placement: Placement) -> None:
    """Two rows per device: the plan's prediction, then what llama.cpp allocated (red: other layers)."""
    from rich import box
    from rich.table import Table

    from orchestrator.llama.placement import PLACEMENT_COLUMNS

    table = Table(
        title="placement (MiB)", title_justify="left", box=box.SIMPLE_HEAD, highlight=False, pad_edge=False
    )
    for i, column in enumerate(PLACEMENT_COLUMNS):
        table.add_column(column, justify="right" if i >= 4 else "left", no_wrap=True)
    moved = {d.label for d in placement.devices if d.actual_layers != d.planned_layers}
    label = ""
    for row in placement.rows():
        label = row[0] or label
        cells = [escape(cell) for cell in row]
        if row[3] == "actual" and label in moved:
            cells[2] = f"[red]{cells[2]}[/red]"
        table.add_row(*cells)
    _common.console.print(table)


def _placement_json(placement: Placement) -> dict[str, Any]:
    data = dataclasses.asdict(placement)
    data.pop("log", None)
    return data
