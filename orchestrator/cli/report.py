"""`rpcfleet report`: probe the fleet, plan each model at each context, write a capacity report.

The report itself is pure (`orchestrator.report`); this module probes, reads the models, and writes the
result to stdout or, with `-o`, atomically to a file (a temporary file in the same folder, then a rename,
so a reader never sees half a report).
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from orchestrator.cli import _inputs, _output, _planning
from orchestrator.core import fields
from orchestrator.core.errors import UsageError
from orchestrator.workflows.options import CTX
from orchestrator.workflows.serve_options import MODELS


def parse_contexts(values: list[str] | None) -> list[int]:
    """'4096,32k' (repeatable) -> [4096, 32768]; k means 1024. Duplicates are dropped, order kept."""
    try:
        parsed = [n for value in values or [str(CTX.default)] for n in _CONTEXTS(value)]
    except ValueError as exc:
        raise UsageError(f"--ctx: {exc}") from None
    return list(dict.fromkeys(parsed))


_CONTEXTS = fields.list_of(CTX.parse)


FORMATS = ("text", "md", "json", "html")  # orchestrator.report.render.FORMATS (tests/cli/test_cli.py checks)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "report",
        help="capacity report: the fleet's memory and, per model and context, whether and where it fits",
        description="Probe the selected servers, then plan each model (-m, repeatable) at each context "
        "(--ctx 4k,32k): the fleet's memory per device, and per case whether it fits, where each layer "
        "goes and what to change when it does not. Text, Markdown, JSON or a self-contained HTML page.",
    )
    _inputs.add_inventory_args(parser)
    parser.add_argument(
        "-m", "--model", action="extend", nargs="+", default=[], metavar="GGUF", help="model file(s) to plan"
    )
    _planning.add_options(
        parser,
        [CTX],
        repeated=[CTX.name],
        helps={CTX.name: f"context sizes, comma-separated (default {CTX.default}; 32k = 32768)"},
    )
    parser.add_argument("--format", choices=FORMATS, default="text", help="output format (default: text)")
    _planning.add_options(
        parser,
        [MODELS],
        helps={
            MODELS.name: "serve's models file: its models reported together, as serve would form them "
            "(each model's context, parallel, replicas and hosts)"
        },
    )
    _planning.add_replicas_arg(parser)
    parser.add_argument(
        "--add",
        action="append",
        default=[],
        metavar="NODE",
        help="a hypothetical node, for this report only: [NAME=][COUNTx]SIZE[:BACKEND] (2x24GiB:cuda: "
        "one server of two 24 GiB CUDA GPUs; SIZE is each device's free memory; backend cpu by default); "
        "repeatable",
    )
    parser.add_argument(
        "--remove",
        action="append",
        default=[],
        metavar="HOST",
        help="leave a host (name or endpoint) out of the fleet, for this report only; repeatable",
    )
    parser.add_argument("-o", "--output", type=Path, default=None, help="write to FILE (atomically)")
    _planning.add_plan_option_args(parser, ctx=False, local=False)
    # None: --parallel not given, so a models file's entries take serve's default, as serve would
    parser.set_defaults(handler=handle, parallel=None)


def handle(args: argparse.Namespace) -> int:
    from orchestrator.planning.profile import profile_model
    from orchestrator.report.build import ReportOptions, build_report
    from orchestrator.report.render import render
    from orchestrator.report.what_if import apply_what_if, check_removals, hosts_of, parse_what_if
    from orchestrator.serve.settings import DEFAULT_PARALLEL
    from orchestrator.workflows.options import PARALLEL

    # A models file's entry without `parallel:` gets serve's --parallel (default DEFAULT_PARALLEL), and
    # the other reports the plan's (default 1): the same flag, two defaults, as the two commands have.
    entry_parallel = args.parallel if args.parallel is not None else DEFAULT_PARALLEL
    if args.parallel is None:
        args.parallel = PARALLEL.default
    contexts = parse_contexts(args.ctx)
    what_if = parse_what_if(args.add, args.remove)
    plan_options = _planning.planning_args(args, n_ctx=contexts[0]).options
    # read before probing: fail fast on a typo
    models = [(str(m), profile_model(_inputs.require_model(Path(m)))) for m in args.model]
    entries = _planning.read_models_file(args.models) if args.models is not None else []
    entry_profiles = [_planning.entry_profile(args.models, e) for e in entries]
    models += [(str(e.model), p) for e, p in zip(entries, entry_profiles, strict=True)]
    if not models:
        raise UsageError(
            "no model to report on", hint="give -m FILE (several: one per model) or --models FILE"
        )
    inventory, hosts = _inputs.load_hosts(args)
    check_removals(what_if, hosts)  # before probing: a typo costs no probe
    fleet = _planning.probe(args, hosts)
    options = ReportOptions(
        plan=plan_options,
        generated_at=datetime.now(UTC).isoformat(timespec="seconds"),
        inventory=str(_inputs.inventory_path(args)),
    )
    given = list(zip(entries, entry_profiles, strict=True))
    formed_on = hosts_of(what_if, hosts)
    # the entries' rows are planned as serve forms them (their own context and parallel), not at --ctx
    served = _planning.entry_models(
        args, formed_on, given, plan_options, inventory, entry_parallel=entry_parallel
    )
    own = {m.path: m.options for m in served}
    formations = None
    if args.replicas is not None or entries:  # the formations serve would choose
        from orchestrator.planning.devices import to_plan_devices

        named = [(path, Path(path).stem, profile) for path, profile in models[: len(args.model)]]
        devices = to_plan_devices(apply_what_if(fleet, what_if), failed="skip")
        formations = _planning.formations(
            args, formed_on, devices, named, plan_options, given, inventory, entry_parallel=entry_parallel
        )
    report = build_report(fleet, models, contexts, options, formations, what_if, own)
    text = render(report, args.format)
    if args.output is not None:
        _output.write_output(args.output, text)
        _output.err_console.print(f"report written to {args.output}", highlight=False)
    else:
        sys.stdout.write(text)
    return 0
