"""`rpcfleet run`: probe the fleet, plan, load the model over RPC, generate, and show where it went.

The placement table sets the plan's prediction beside what llama.cpp allocated (its load log, 0.01 MiB
precision) for every device and for the host, then generation speed. The model runs in a worker process
(`orchestrator.llama.worker.parent`): a node lost mid-inference is an error naming it (exit status 1), never a
native abort of this process; llama.cpp's log goes to the worker's log file (or stderr with
`--llama-verbose`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.cli import _common, _planning
from orchestrator.cli._common import escape
from orchestrator.core import signals
from orchestrator.core.errors import UsageError
from orchestrator.core.units import format_size

if TYPE_CHECKING:  # imported lazily: planning pulls in numpy
    from collections.abc import Callable

    from orchestrator.engine.runtime import Runtime
    from orchestrator.inventory.model import Host
    from orchestrator.llama.cache.prep import CachePrep
    from orchestrator.llama.observed_placement import Placement
    from orchestrator.planning.plan import Plan, PlanDevice
    from orchestrator.planning.profile import ModelProfile
    from orchestrator.workflows.load import FleetLoad


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
        choices=["auto", "always", "never"],  # cache.prep.WarmChoice (not imported: start-up time)
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
    from orchestrator.rpc.records import EndpointError, parse_endpoint

    try:
        parse_endpoint(text)
    except EndpointError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    return text


def endpoint_hosts(endpoints: list[str]) -> list[Host]:
    """Inventory-less hosts for `--endpoint` values. Loopback servers run on this machine, so they get
    a local connection (facts such as MemAvailable are read here); others are probed over RPC only."""
    from orchestrator.inventory.model import Host
    from orchestrator.rpc.records import parse_endpoint

    hosts = []
    for text in endpoints:
        ep = parse_endpoint(text)
        hosts.append(
            Host(name=str(ep), address=ep.host, connection="local", rpc_host=ep.host, rpc_port=ep.port)
        )
    return hosts


def run_hosts(args: argparse.Namespace) -> tuple[list[Host], list[Host]]:
    """The hosts to plan on, and those whose caches, tunnels and names the load uses: for `--endpoint`,
    inventory-less hosts and none; else the selected inventory hosts for both (with a saved `--plan`
    and no inventory, none: nothing to check against)."""
    from orchestrator.core.errors import InputError, LabError

    if args.endpoint:
        return endpoint_hosts(args.endpoint), []
    try:
        _, hosts = _common.load_hosts(args)
    except (InputError, LabError):
        if args.plan is not None:
            return [], []
        raise
    return list(hosts), list(hosts)


def make_run_plan(
    args: argparse.Namespace,
    runtime: Runtime,
    hosts: list[Host],
    read: ModelProfile | Plan,
    local_gpus: Callable[[], list[PlanDevice]] | None = None,
    phases: dict[str, float] | None = None,
) -> Plan:
    """The plan of this run (probed and planned on the command's session, or `--plan`'s, `read`);
    `phases` gets the probe's and the plan's seconds. `local_gpus`: this machine's GPUs (the worker's)."""
    from orchestrator.inventory.model import is_loopback
    from orchestrator.planning.plan import Plan
    from orchestrator.workflows.plan import plan_for_fleet

    times = phases if phases is not None else {}
    if isinstance(read, Plan):
        times["plan"] = 0.0
        return read
    # Facts are read on this machine for loopback --endpoint servers; others are probed over RPC only.
    facts = not (args.endpoint and any(not is_loopback(h.address) for h in hosts))
    request = _planning.planning_args(args, facts=facts)
    # A load lets go of an inventory server held by a client proven gone (never an --endpoint's).
    round_ = runtime.run(
        plan_for_fleet(
            hosts,
            read,
            request.options,
            probe=request.probe,
            session=runtime.session,
            release=not args.endpoint,
            local_devices=request.local_devices,
            local_gpus=local_gpus,
        )
    )
    times["probe"], times["plan"] = round_.probe_seconds, round_.plan_seconds
    assert round_.plan is not None  # failed="raise": no plan is an error
    return round_.plan


def handle(args: argparse.Namespace) -> int:
    from orchestrator.cli._progress import LoadBars
    from orchestrator.engine.runtime import Runtime
    from orchestrator.llama.worker.parent import Worker
    from orchestrator.workflows.fit import check_fit
    from orchestrator.workflows.load import load_on_fleet

    if args.n_predict < 1:
        raise UsageError(f"-n must be at least 1, got {args.n_predict}")
    _common.require_model(args.model)
    # a file that is no model, or no plan, fails before the worker starts and the fleet is probed
    from orchestrator.planning.plan import Plan
    from orchestrator.planning.profile import profile_model

    read = profile_model(args.model) if args.plan is None else Plan.from_path(args.plan)
    # llama.cpp runs in a worker process: a node lost mid-inference aborts the worker, not this
    # process; the worker's log (llama.cpp's own) is named in the error. Spawned first, so its imports
    # overlap with the probe and the plan. One loop and one session for the command: the probe's SSH
    # connections serve the cache check.
    phases: dict[str, float] = {}
    with (
        Worker.spawn(log_to_stderr=args.llama_verbose) as worker,
        Runtime(forks=args.forks, on_interrupt=_common.on_interrupt) as runtime,
        contextlib.ExitStack() as bars_open,
    ):
        hosts, cache_hosts = run_hosts(args)
        plan = make_run_plan(args, runtime, hosts, read, worker.local_gpus, phases)
        warning = check_fit(plan, force=args.force)
        if warning is not None and not args.json:
            _common.err_console.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False)
        names = {h.endpoint: h.name for h in cache_hosts if h.endpoint in plan.endpoints}
        bars = LoadBars(_common.err_console.is_terminal and not args.json, names=names)

        def checked(prep: CachePrep) -> None:
            if not args.json:
                _common.err_console.print(
                    f"[dim]tensor cache: {prep.hits} hits, {prep.misses} misses "
                    f"({format_size(prep.miss_bytes)} to send)[/dim]",
                    highlight=False,
                )

        def prepared(done: FleetLoad) -> None:
            report_cache(args, done)
            signals.raise_if_interrupted()  # one swallowed during the probe or the plan: no load follows
            if _common.err_console.is_terminal and not args.json:  # a phase line while the weights travel
                where = f"{len(plan.devices)} device(s)" if plan.devices else "this machine's CPU"
                _common.err_console.print(
                    f"[dim]loading {escape(str(args.model))} on {where}, n_ctx {plan.n_ctx}...[/dim]",
                    highlight=False,
                )
            bars_open.enter_context(bars)

        loaded = load_on_fleet(
            plan,
            cache_hosts,
            worker,
            args.model,
            runtime=runtime,
            interruptible=True,
            verify=args.verify_cache,
            warm=args.warm,
            llama_kwargs={"seed": args.seed},
            on_checked=checked,
            on_prepared=prepared,
            on_progress=bars,
        )
        bars_open.close()
        phases |= loaded.phases
        placement = loaded.placement
        assert placement is not None  # an interrupted check exits in `prepared`
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
                "cache": loaded.cache.as_json() if loaded.cache is not None else None,
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


def report_cache(args: argparse.Namespace, done: FleetLoad) -> None:
    """After the caches' check and warm: the warm's failures (the load sends those tensors itself), an
    interrupt (exit 130, no load), the warm's summary."""
    run, prep = done.warm, done.cache
    if run is not None:
        for r in run.results:
            if not r.succeeded:  # to stderr even with --json: the load goes on, sending those tensors
                _common.err_console.print(
                    f"[yellow]warning:[/yellow] {escape(r.host.name)}: warming failed "
                    f"({escape(str(r.error))}); the load sends its tensors itself",
                    highlight=False,
                )
        if run.interrupted:
            _common.print_interrupted([run])
    if done.interrupted:  # Ctrl-C during the check or the warm: no load
        raise SystemExit(_common.INTERRUPTED_EXIT)
    if run is not None and prep is not None and not args.json:
        _common.err_console.print(
            f"[dim]warmed {len(run.results)} node(s) in parallel in {done.phases['warm']:.2f} s; "
            f"{prep.misses} misses left[/dim]",
            highlight=False,
        )


def generate(
    worker: Any, prompt: str, n: int, temp: float, seed: int, *, echo: bool
) -> tuple[str, dict[str, Any]]:
    """Stream a completion from the worker (echoed as it comes); the counts are the tokens the model
    produced and llama.cpp's own timings."""
    from orchestrator.llama.worker.parent import Done

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

    from orchestrator.llama.observed_placement import PLACEMENT_COLUMNS

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
