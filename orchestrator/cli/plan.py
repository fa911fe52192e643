"""`rpcfleet plan`: probe the fleet, profile a GGUF model and show where every layer will go."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.cli import _inputs, _output, _planning
from orchestrator.cli._output import escape
from orchestrator.core.errors import UsageError
from orchestrator.core.units import format_size

if TYPE_CHECKING:
    from collections.abc import Sequence

    from orchestrator.planning.plan import Plan, PlanDevice

FORMATS = ("table", "json", "llama-cli", "python")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="plan a model's placement on the fleet: layers, tensor_split, memory per device, fit",
        description=(
            "Probe the selected servers, profile the GGUF model (metadata only) and plan the layers "
            "per device: proportional to usable memory, or on the fewest devices. The plan can be "
            "printed as a table, JSON (reloadable with `rpcfleet run --plan`), llama-cli/llama-server "
            "arguments, or a Python snippet."
        ),
    )
    parser.add_argument("--model", "-m", type=Path, required=True, help="the GGUF model (first shard)")
    _planning.add_plan_option_args(parser)
    _planning.add_replicas_arg(parser)
    parser.add_argument("--format", choices=FORMATS, default="table", help="output (default: table)")
    parser.add_argument("-o", "--output", type=Path, default=None, help="also write the plan JSON here")
    _inputs.add_inventory_args(parser)
    _output.add_json_arg(parser)
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from orchestrator.planning.formats import llama_cli_args, python_snippet
    from orchestrator.workflows.options import ModelPlanning
    from orchestrator.workflows.plan import plan_model

    fmt = "json" if args.json else args.format
    _inputs.require_model(args.model)
    request = _planning.planning_args(args)
    if args.replicas is not None:  # the formations serve would choose
        from orchestrator.planning.profile import profile_model

        return print_formations(args, profile_model(args.model), request.options, fmt)
    planning = ModelPlanning(args.model, request.options, request.probe, request.local_devices)
    _, round_ = plan_model(planning, lambda: _inputs.load_hosts(args)[1])
    plan, devices = round_.plan, round_.devices
    assert plan is not None  # failed="raise": no plan is an error
    if args.output is not None:
        _output.write_output(args.output, plan.to_text())
    if fmt == "json":
        sys.stdout.write(plan.to_text() + "\n")
    elif fmt in ("llama-cli", "python"):
        if fmt == "llama-cli":
            sys.stdout.write(shlex.join(llama_cli_args(plan, args.model)) + "\n")
        else:
            sys.stdout.write(python_snippet(plan, args.model, args.output))  # embeds the plan without -o
        # stdout is for the command or the code: why the exit status is 1, and the notes, go to stderr
        if not plan.fit.fits:
            _output.err_console.print(f"does not fit: {_shortfall(plan)}", highlight=False, markup=False)
        for note in plan.notes:
            _output.err_console.print(f"note: {note}", highlight=False, markup=False)
    else:
        print_plan(plan, devices)
    return 0 if plan.fit.fits else 1


def print_formations(args: argparse.Namespace, profile: Any, options: Any, fmt: str) -> int:
    """`plan --replicas`: each formation (its nodes, context, headroom) and the spares; JSON: each with its
    plan. Exit 1 when the model gets no formation."""
    import json

    if fmt not in ("table", "json"):  # before the probe
        raise UsageError(f"--replicas prints the formations as a table or JSON, not --format {fmt}")
    _, hosts = _inputs.load_hosts(args)
    devices = _planning.probe_devices(args, hosts)
    name = args.model.stem
    from orchestrator.report.formations import formations_json, formations_lines

    formations = _planning.formations(args, hosts, devices, [(str(args.model), name, profile)], options)
    if fmt == "json":
        sys.stdout.write(json.dumps(formations_json(formations), indent=2) + "\n")
    else:
        for line in formations_lines(formations):
            _output.console.print(escape(line), highlight=False)
    return 0


def _shortfall(plan: Plan) -> str:
    from orchestrator.planning.plan import largest_ctx_text

    binding = plan.devices[plan.fit.binding_device or 0]
    return f"{binding.label} is short by {format_size(plan.fit.shortfall)}; {largest_ctx_text(plan.fit)}"


def print_plan(plan: Plan, probed: Sequence[PlanDevice] = ()) -> None:
    """The plan as a table; a probed device the plan leaves out (no layers for it) gets a row saying so."""
    from rich import box
    from rich.table import Table

    from orchestrator.planning.plan import largest_ctx_text

    table = Table(
        box=box.SIMPLE_HEAD, highlight=False, title=f"plan: {plan.model_name}", title_justify="left"
    )
    for column in ("device", "layers", "weights", "KV", "compute", "output", "total", "usable", "headroom"):
        table.add_column(column, justify="left" if column in ("device", "layers") else "right")
    for i, d in enumerate(plan.devices):
        m = d.memory
        headroom = format_size(m.headroom)
        if m.headroom < 0:
            headroom = f"[red]{headroom}[/red]"
        elif i == plan.fit.binding_device:
            headroom = f"[yellow]{headroom}[/yellow]"
        table.add_row(
            escape(d.label),
            d.layers_label,
            *(format_size(x) for x in (m.weights, m.kv, m.compute)),
            "-",
            *(format_size(x) for x in (m.total, m.usable)),
            headroom,
        )
    planned = {d.label for d in plan.devices}
    for device in probed:
        if device.label not in planned:
            left_out = ("[yellow]left out[/yellow]", "", "", "", "", "", format_size(device.usable), "")
            table.add_row(escape(device.label), *left_out)
    h = plan.host
    host = (h.weights, h.kv, h.compute, h.output, h.total)  # the total is the sum of the columns shown
    table.add_row("host (CPU)", "", *(format_size(x) for x in host), "", "")
    _output.console.print(table)
    split = ",".join(f"{x:g}" for x in plan.tensor_split)
    _output.console.print(
        f"n_ctx {plan.n_ctx} · n_gpu_layers {plan.n_gpu_layers} · split_mode layer · tensor_split {split}",
        highlight=False,
    )
    if plan.fit.fits:
        _output.console.print(f"[green]fits[/green]; {largest_ctx_text(plan.fit)}", highlight=False)
    else:
        _output.console.print(f"[red]does not fit[/red]: {escape(_shortfall(plan))}", highlight=False)
    for note in plan.notes:
        _output.err_console.print(f"note: {escape(note)}", highlight=False)
