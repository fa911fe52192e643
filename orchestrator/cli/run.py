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

from orchestrator.cli import _inputs, _output, _planning, _running
from orchestrator.cli._output import escape
from orchestrator.core.errors import UsageError
from orchestrator.core.units import format_size

if TYPE_CHECKING:  # imported lazily: planning pulls in numpy
    from collections.abc import Sequence

    from orchestrator.caches.prep import CachePrep
    from orchestrator.engine.executor import RunResult
    from orchestrator.inventory.model import Host
    from orchestrator.llama.observed_placement import Placement
    from orchestrator.llama.worker.wire import Done
    from orchestrator.planning.plan import Plan
    from orchestrator.workflows.load import FleetLoad
    from orchestrator.workflows.run import RunEvents


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
    _inputs.add_inventory_args(parser)
    _output.add_json_arg(parser)
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
        _, hosts = _inputs.load_hosts(args)
    except (InputError, LabError):
        if args.plan is not None:
            return [], []
        raise
    return list(hosts), list(hosts)


def handle(args: argparse.Namespace) -> int:
    from orchestrator.inventory.model import is_loopback
    from orchestrator.rpc.records import parse_endpoint
    from orchestrator.workflows.run import RunRequest, run_on_fleet

    if args.n_predict < 1:
        raise UsageError(f"-n must be at least 1, got {args.n_predict}")
    _inputs.require_model(args.model)
    # Facts are read on this machine for loopback --endpoint servers; others are probed over RPC only.
    remote = any(not is_loopback(parse_endpoint(text).host) for text in args.endpoint)
    planning = _planning.planning_args(args, facts=not remote)
    request = RunRequest(
        model=args.model,
        saved_plan=args.plan,
        hosts=lambda: run_hosts(args),
        options=planning.options,
        probe=planning.probe,
        local_devices=planning.local_devices,
        prompt=args.prompt,
        n_predict=args.n_predict,
        temperature=args.temp,
        seed=args.seed,
        force=args.force,
        verify_cache=args.verify_cache,
        warm=args.warm,
        llama_log_to_stderr=args.llama_verbose,
    )
    outcome = run_on_fleet(request, RunScreen(args).events(), forks=args.forks)
    placement, done = outcome.placement, outcome.done
    if outcome.load.interrupted or placement is None or done is None:  # Ctrl-C during the caches' check
        sys.stderr.write("interrupted\n")  # the last line, as for a signal anywhere else (cli.main)
        return _running.INTERRUPTED_EXIT
    plan, phases = outcome.plan, outcome.phases
    stats = _generation_stats(done)
    if args.json:
        _output.print_json(
            {
                "text": done.text,
                **stats,
                "placement": _placement_json(placement),
                "plan": {"tensor_split": plan.tensor_split, "n_ctx": plan.n_ctx, "fits": plan.fit.fits},
                "log": str(outcome.log_path) if outcome.log_path else None,
                "phases": {k: round(v, 3) for k, v in phases.items()},
                "cache": (
                    {
                        **outcome.load.cache.as_json(),
                        "load_beside_warm": outcome.load.overlapped,
                        "warm": _warm_json(outcome.load.warm),
                    }
                    if outcome.load.cache is not None
                    else None
                ),
            }
        )
        return 0
    _output.console.print()
    _print_placement(placement)
    n = stats["completion_tokens"]
    speed = (
        f", decoding at [bold]{stats['tokens_per_second']:.1f} tokens/s[/bold]"
        if stats["decode_seconds"] > 0
        else " (from the prompt's evaluation: no decoding step)"
    )
    _output.console.print(
        " · ".join(f"{k} {v:.2f} s" for k, v in phases.items()) + " · ready", highlight=False
    )
    _output.console.print(
        # llama.cpp's own load time, inside the load phase above (which adds the worker's round trip):
        # two figures both called "load" read as a contradiction
        f"llama.cpp's load {placement.load_seconds:.2f} s · prompt {stats['prompt_tokens']} tokens in "
        f"{stats['prompt_seconds']:.3f} s · {n} token{'s' if n != 1 else ''} generated{speed}",
        highlight=False,
    )
    return 0


WAIT_LINE_S = 10.0  # seconds between two lines of a wait for the first token


class RunScreen:
    """What `run` shows as it goes (stderr, none of it with --json but the warm's failures): the fit
    warning, the caches' counts, the load's phase line and bars, then the text as it comes (stdout)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from orchestrator.cli._progress import LoadBars

        self.args = args
        self.echo = not args.json
        self.bars = LoadBars(False, names={})
        self.shown = contextlib.ExitStack()
        self.vulkan = False  # a Vulkan device in the plan: its server may compile shaders first
        self.texted = False
        self.told_at = 0.0  # the silence (seconds) last reported

    def events(self) -> RunEvents:
        from orchestrator.workflows.run import RunEvents

        return RunEvents(
            interrupt=_running.on_interrupt,
            fit_warning=self.fit_warning,
            planned=self.planned,
            checked=self.checked,
            prepared=lambda done: report_cache(self.args, done),
            loading=self.loading,
            progress=lambda progress: self.bars(progress),
            warmed=lambda done: report_cache(self.args, done),
            load_ended=self.shown.close,
            text=self.text,
            text_ended=lambda: self.text("\n"),
            waiting=self.waiting,
        )

    def fit_warning(self, warning: str) -> None:
        if self.echo:
            _output.err_console.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False)

    def planned(self, plan: Plan, cache_hosts: Sequence[Host]) -> None:
        from orchestrator.cli._progress import LoadBars

        names = {h.endpoint: h.name for h in cache_hosts if h.endpoint in plan.endpoints}
        self.bars = LoadBars(_output.err_console.is_terminal and self.echo, names=names)
        # the name a Vulkan server gives its device (Vulkan0), or the inventory's backend
        self.vulkan = any(device.name.startswith("Vulkan") for device in plan.devices) or any(
            h.rpc_backend == "vulkan" for h in cache_hosts if h.endpoint in plan.endpoints
        )

    def checked(self, prep: CachePrep) -> None:
        if self.echo:
            _output.err_console.print(
                f"[dim]tensor cache: {prep.hits} hits, {prep.misses} misses "
                f"({format_size(prep.miss_bytes)} to send)[/dim]",
                highlight=False,
            )

    def loading(self, plan: Plan) -> None:
        if _output.err_console.is_terminal and self.echo:  # a phase line while the weights travel
            where = f"{len(plan.devices)} device(s)" if plan.devices else "this machine's CPU"
            _output.err_console.print(
                f"[dim]loading {escape(str(self.args.model))} on {where}, n_ctx {plan.n_ctx}...[/dim]",
                highlight=False,
            )
        self.shown.enter_context(self.bars)

    def waiting(self, seconds: float) -> None:
        """Before the first token, a line every WAIT_LINE_S, terminal or not: a fresh Vulkan server
        compiles its shaders on its first graph (two minutes for Gemma on llvmpipe), and a silent
        command that long reads as a hung one."""
        self.told_at = min(self.told_at, seconds)  # a new silence (after an answer) counts afresh
        if not self.echo or self.texted or seconds - self.told_at < WAIT_LINE_S:
            return
        self.told_at = seconds
        why = " (the Vulkan servers compile their shaders on their first graph, once)" if self.vulkan else ""
        _output.err_console.print(
            f"waiting for the first token: {seconds:.0f} s{why}", highlight=False, markup=False
        )

    def text(self, piece: str) -> None:
        self.texted = True
        if self.echo:
            sys.stdout.write(piece)
            sys.stdout.flush()


def report_cache(args: argparse.Namespace, done: FleetLoad) -> None:
    """After the caches' check and warm: the warm's failures (the load sends those tensors itself), an
    interrupt (no load follows: exit 130), the warm's summary; for a load beside the warm, at its start
    that the warm goes on, and these at its end."""
    run, prep = done.warm, done.cache
    if done.overlapped and run is None:
        if not args.json:
            _output.err_console.print(
                "[dim]warming the misses of every node in parallel; the load reads each file as it "
                "lands[/dim]",
                highlight=False,
            )
        return
    if run is not None:
        from orchestrator.cli.cache import print_warnings

        print_warnings(run)
        for r in run.results:
            if not r.succeeded:  # to stderr even with --json: the load goes on, sending those tensors
                _output.err_console.print(
                    f"[yellow]warning:[/yellow] {escape(r.host.name)}: warming failed "
                    f"({escape(str(r.error))}); the load sends its tensors itself",
                    highlight=False,
                )
        if run.interrupted:
            _running.print_interrupted([run])
    if done.interrupted:  # Ctrl-C during the check or the warm: no load
        return
    if run is not None and prep is not None and not args.json:
        vias = ", ".join(f"{host}: {w['via']}" for host, w in _warm_json(run).items() if w["via"])
        _output.err_console.print(
            f"[dim]warmed {len(run.results)} node(s) in parallel in {done.phases['warm']:.2f} s"
            f"{f' ({escape(vias)})' if vias else ''}; {prep.misses} misses left[/dim]",
            highlight=False,
        )


def _warm_json(run: RunResult[Any] | None) -> dict[str, Any]:
    """Per warmed host: where its files came from (`via`), the bytes this machine sent and those the
    node copied from its own copy of the model."""
    from orchestrator.operations.cache import CacheChange

    return {
        r.host.name: {
            "via": r.value.via,
            "bytes_sent": r.value.bytes_sent,
            "bytes_local": r.value.bytes_local,
        }
        for r in (run.results if run is not None else ())
        if isinstance(r.value, CacheChange)
    }


def _generation_stats(done: Done) -> dict[str, Any]:
    """The counts of the tokens the model produced and llama.cpp's own timings."""
    return {
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
    _output.console.print(table)


def _placement_json(placement: Placement) -> dict[str, Any]:
    data = dataclasses.asdict(placement)
    data.pop("log", None)
    return data
