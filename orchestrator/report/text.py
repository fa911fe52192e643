"""The capacity report as text and Markdown tables."""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.core.units import format_size
from orchestrator.planning.memory import architecture_rows
from orchestrator.planning.plan import (
    Plan,
    largest_ctx_text,
)
from orchestrator.probe.fleet import FleetProbe, NodeProbe
from orchestrator.report.build import Case, DeviceChange, MiB, Recommendation, Report, ReportModel, size_up
from orchestrator.report.formations import formation_loss_lines, formations_lines
from orchestrator.report.what_if import unverified_on


def size(n: int | None) -> str:
    return format_size(n)


def ctx_label(n_ctx: int) -> str:
    return "n_ctx_train" if n_ctx == 0 else str(n_ctx)


def node_rows(report: Report, node: NodeProbe) -> list[list[str]]:
    protocol = str(node.rpc.version) if node.rpc.version is not None else "-"
    assumed = report.assumed(node.endpoint)  # a hypothetical node (--add): never probed
    base = [node.host, node.endpoint, "assumed" if assumed else node.state, protocol]
    if not node.devices:
        return [[*base, "-", "-", "-", "-", "-", "-", "-"]]
    return [
        [
            *base,
            f"#{d.index}",
            d.description + (unverified_mark(report, d.backend) if assumed else ""),
            size(d.total),
            size(d.free),
            size(d.reserve),
            size(d.limit) if d.limit is not None else "-",
            size(d.usable),
        ]
        for d in node.devices
    ]


def unverified_mark(report: Report, backend: str) -> str:
    """'; unverified on cuda' for an assumed device of a backend the report's models were never measured
    on (planning.architectures.VERIFIED_ON): its plan is the planner's rules, not a check on such a GPU."""
    architectures = [m.profile.architecture for m in report.models]
    return f"; unverified on {backend}" if unverified_on(backend, architectures) else ""


FLEET_HEADERS = [
    "host",
    "endpoint",
    "state",
    "protocol",
    "device",
    "description",
    "total",
    "free",
    "reserve",
    "limit",
    "usable",
]


DEVICE_HEADERS = [
    "device",
    "host",
    "layers",
    "weights",
    "KV",
    "compute",
    "output",
    "predicted",
    "usable",
    "headroom",
]


def reserve_total(fleet: FleetProbe) -> int:
    return sum(d.reserve for d in fleet.devices)


def totals_row(fleet: FleetProbe) -> list[str]:
    t = fleet.totals
    return [
        "total",
        f"{t.ok_endpoints}/{t.endpoints} endpoints ok",
        "",
        "",
        f"{t.devices} devices",
        "",
        size(t.total),
        size(t.free),
        size(reserve_total(fleet)),
        "",
        size(t.usable),
    ]


def device_rows(report: Report, plan: Plan) -> list[list[str]]:
    rows = []
    for d in plan.devices:
        m = d.memory
        rows.append(
            [
                d.label,
                (report.host_of(d.endpoint) or "-") + (" (assumed)" if report.assumed(d.endpoint) else ""),
                d.layers_label,
                size(m.weights),
                size(m.kv),
                size(m.compute),
                "-",
                size(m.total),
                size(m.usable),
                size(m.headroom),
            ]
        )
    h = plan.host  # what stays on this machine's CPU, as `rpcfleet plan` shows it
    host = (h.weights, h.kv, h.compute, h.output, h.total)  # the total is the sum of the columns shown
    rows.append(["host (CPU)", "-", "", *(size(x) for x in host), "", ""])
    return rows


def verdict(report: Report, case: Case) -> str:
    plan = case.plan
    if plan is None:
        return f"cannot plan: {case.error}"
    fit = plan.fit
    largest = largest_ctx_text(fit)
    binding = case.binding
    where = ""
    if binding is not None:
        host = report.host_of(binding.endpoint)
        where = f"{host} ({binding.label})" if host else binding.label
    if fit.fits:
        head = binding.memory.headroom if binding is not None else 0
        word = "fits" if not case.beyond_training else f"fits BEYOND TRAINING ({beyond_text(case)})"
        return f"{word} (n_ctx {plan.n_ctx}); binding device {where}, headroom {size(head)}; {largest}"
    return f"does not fit (n_ctx {plan.n_ctx}): short {size_up(fit.shortfall)} on {where}; {largest}"


def beyond_text(case: Case) -> str:
    return f"the model was trained on {case.n_ctx_train}; its answers past that are untested"


STATUS_WORDS = {
    "fits": "fits",
    "beyond_training": "beyond training",
    "short": "does not fit",
    "cannot_plan": "cannot plan",
}


def matrix_cell(case: Case) -> str:
    """One cell of the models × contexts matrix: the verdict, the nodes it needs or what it lacks."""
    if case.plan is None:
        return "cannot plan"
    n = len(case.nodes)
    if case.status == "short":
        return f"short {size_up(case.plan.fit.shortfall)}" + (
            " (beyond training)" if case.beyond_training else ""
        )
    nodes = f"{n} node{'s' if n != 1 else ''}"
    n1 = ""
    if case.losses:
        n1 = " · N-1 ok" if all(loss.fits for loss in case.losses) else " · N-1 breaks"
    if case.status == "beyond_training":
        return f"beyond training ({case.n_ctx_train}) · {nodes}{n1}"
    return f"fits · {nodes}{n1}"


def loss_line(case: Case) -> str | None:
    """N-1 in words: whether the case still fits after losing any one node, and the worst loss."""
    worst = case.worst_loss
    if worst is None:
        return None
    broken = [loss.host or loss.endpoint for loss in case.losses if not loss.fits]
    name = worst.host or worst.endpoint
    if not broken:
        head = size(worst.headroom)
        return f"N-1: still fits after losing any one node (worst: without {name}, headroom {head})"
    why = worst.error if worst.error is not None else f"short {size_up(-worst.headroom)}"
    return f"N-1: does not survive losing {', '.join(broken)} (worst: without {name}, {why})"


def formations_section(report: Report) -> list[str]:
    if report.formations is None:
        return []
    return [*formations_lines(report.formations), *formation_loss_lines(report.formation_losses)]


def largest_cell(report: Report, model: str) -> str:
    largest, capped = report.largest_ctx(model)
    if not largest:
        return "none"
    train = next((m.profile.n_ctx_train for m in report.models if m.path == model), 0)
    beyond = f" (beyond training {train})" if train and largest > train else ""
    return f"{largest}{'+' if capped else ''}{beyond}"


def matrix_table(report: Report) -> tuple[list[str], list[list[str]]]:
    """The models × contexts matrix: per model its verdict at each context and its largest context."""
    headers = ["model", *(f"ctx {ctx_label(c)}" for c in report.contexts), "largest context"]
    rows = []
    for model in report.models:
        cells = {c.n_ctx: matrix_cell(c) for c in report.cases if c.model == model.path}
        rows.append(
            [
                model_title(model),
                *(cells[c] for c in report.contexts),
                largest_cell(report, model.path),
            ]
        )
    return headers, rows


def model_title(model: ReportModel) -> str:
    return model.profile.name or model.path


def curve_table(report: Report) -> tuple[list[str], list[list[str]]]:
    """Each model's predicted memory (on the fleet's devices) against context, and the fleet's usable."""
    contexts = sorted({p.n_ctx for curve in report.curves for p in curve.points})
    by_model = {curve.model: {p.n_ctx: p for p in curve.points} for curve in report.curves}
    headers = ["context", *(model_title(m) for m in report.models)]
    rows = []
    for n_ctx in contexts:
        row = [str(n_ctx)]
        for model in report.models:
            point = by_model.get(model.path, {}).get(n_ctx)
            if point is None:
                row.append("")
            elif point.predicted is None:
                row.append("cannot plan")
            else:
                mark = "" if point.fits else " (short)"
                train = model.profile.n_ctx_train
                mark += " (beyond training)" if train and n_ctx > train else ""
                row.append(size(point.predicted) + mark)
        rows.append(row)
    rows.append(["fleet usable", *(size(report.capacity) for _ in report.models)])
    return headers, rows


def summary_legend() -> str:
    return (
        "fits: fits within the training context · beyond training: fits, past the context the model "
        "was trained on · does not fit: short on the binding device · +: the search stopped at the "
        "training context"
    )


def _change_where(change: DeviceChange) -> str:
    return f"{change.host} ({change.device})" if change.host else change.device


def recommendation_lines(rec: Recommendation, shortfall: int) -> list[str]:
    lines: list[str] = []
    if rec.smallest is not None:
        lines.append(
            f"smallest change: add {size_up(rec.smallest.add)} usable memory to {_change_where(rec.smallest)}"
        )
        if (rec.smallest.add or 0) > shortfall + MiB:
            lines.append(
                "(more than the shortfall: re-planned, the split moves layers onto the grown device, "
                "and their weights, KV and compute come with them)"
            )
    else:
        lines.append("no memory added to a single existing device makes it fit")
    if rec.new_node is not None:
        lines.append(f"or add a node with {size_up(rec.new_node)} usable memory")
    elif rec.new_node_note:
        lines.append(f"no new node helps: {rec.new_node_note}")
    if len(rec.devices) > 1:
        per = ", ".join(
            f"{_change_where(c)} +{size_up(c.add)}" if c.add is not None else f"{_change_where(c)} (none)"
            for c in rec.devices
        )
        lines.append(f"per device: {per}")
    return lines


def case_shortfall(case: Case) -> int:
    return case.plan.fit.shortfall if case.plan is not None else 0


def header_lines(report: Report) -> list[str]:
    lines = []
    if report.options.generated_at:
        lines.append(f"generated: {report.options.generated_at}")
    if report.options.inventory:
        lines.append(f"inventory: {report.options.inventory}")
    o = report.options.plan
    lines.append(
        f"plan options: KV {o.type_k}/{o.type_v}, ubatch {o.n_ubatch}, flash attention "
        f"{'on' if o.flash_attn else 'off'}, margin {size(o.margin)} per device, strategy {o.strategy}, "
        f"{'full-size' if o.swa_full else 'small'} SWA cache, parallel {o.parallel}"
        f"{' (unified KV)' if o.kv_unified else ''}"
        f"{f', --n-cpu-moe {o.n_cpu_moe}' if o.n_cpu_moe else ''}"
    )
    lines.append(f"controller protocol: {report.fleet.protocol}")
    return [*lines, *report.what_if.lines()]


def _text_table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return (indent + "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True))).rstrip()

    return [line(headers), indent + "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def fleet_lines(report: Report) -> list[tuple[str, str]]:
    """What every format prints under the fleet table, as (kind, text), kind "failed", "warning" or
    "note": the nodes that are not ok, the warnings of nodes and devices (memory shared among the
    servers of one machine, GPU figures that disagree...), the report's notes."""
    out: list[tuple[str, str]] = []
    for node in report.fleet.nodes:
        if not node.ok:
            out.append(("failed", f"{node.host}: {node.state}: {node.rpc.message}"))
        out += [("warning", f"{node.host}: warning: {w}") for w in node.warnings]
        out += [
            ("warning", f"{node.host} #{d.index}: warning: {w}") for d in node.devices for w in d.warnings
        ]
    out += [("note", f"note: {note}") for note in report.notes]
    return out


def model_architecture(report: Report, model: ReportModel) -> list[tuple[str, str]]:
    """The architecture rows `model info` prints (family, sliding window, experts, recurrent state, KV
    per token), at the report's KV cache types: the same numbers in both."""
    o = report.options.plan
    return architecture_rows(model.profile, o.type_k, o.type_v)


def render_text(report: Report) -> str:
    out = ["rpcfleet capacity report", *header_lines(report), "", "Summary"]
    out += _text_table(*matrix_table(report), "  ")
    out += [f"  {summary_legend()}", "", "Memory against context (predicted on the fleet's devices)"]
    out += _text_table(*curve_table(report), "  ")
    out += ["", "Fleet"]
    rows = [row for node in report.fleet.nodes for row in node_rows(report, node)]
    out += _text_table(FLEET_HEADERS, [*rows, totals_row(report.fleet)], "  ")
    out += [f"  {text}" for _, text in fleet_lines(report)]
    for model in report.models:
        p = model.profile
        out += [
            "",
            f"Model {p.name or model.path} ({model.path}): {p.n_layer} layers, "
            f"weights {size(p.total_bytes)}, n_ctx_train {p.n_ctx_train}",
            *(f"  {label}: {value}" for label, value in model_architecture(report, model)),
        ]
        for case in (c for c in report.cases if c.model == model.path):
            out.append(f"  ctx {ctx_label(case.n_ctx)}: {verdict(report, case)}")
            if (n1 := loss_line(case)) is not None:
                out.append(f"    {n1}")
            if case.plan is not None and case.plan.devices:
                out += _text_table(DEVICE_HEADERS, device_rows(report, case.plan), "    ")
            if case.plan is not None:
                out += [f"    note: {n}" for n in case.plan.notes]
            if case.recommendation is not None:
                out += [
                    "    " + line for line in recommendation_lines(case.recommendation, case_shortfall(case))
                ]
    if report.formations is not None:
        out += ["", *formations_section(report)]
    return "\n".join(out) + "\n"


def _md_cell(text: str) -> str:
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(_md_cell(c) for c in cells) + " |"

    return [line(headers), "|" + "|".join("---" for _ in headers) + "|", *(line(r) for r in rows)]


def render_markdown(report: Report) -> str:
    out = ["# rpcfleet capacity report", ""]
    out += [f"- {_md_cell(line)}" for line in header_lines(report)]
    out += ["", "## Summary", "", *_md_table(*matrix_table(report)), "", _md_cell(summary_legend())]
    out += ["", "## Memory against context", "", *_md_table(*curve_table(report))]
    out += ["", "## Fleet", ""]
    rows = [row for node in report.fleet.nodes for row in node_rows(report, node)]
    out += _md_table(FLEET_HEADERS, [*rows, totals_row(report.fleet)])
    extra = [f"- {text}" for _, text in fleet_lines(report)]
    if extra:
        out += ["", *(_md_cell(e) for e in extra)]
    for model in report.models:
        p = model.profile
        out += [
            "",
            f"## Model {_md_cell(p.name or model.path)}",
            "",
            f"`{model.path}`: {p.n_layer} layers, weights {size(p.total_bytes)}, n_ctx_train {p.n_ctx_train}",
            "",
            *(f"- {label}: {_md_cell(value)}" for label, value in model_architecture(report, model)),
        ]
        for case in (c for c in report.cases if c.model == model.path):
            out += ["", f"### ctx {ctx_label(case.n_ctx)}", "", f"**{_md_cell(verdict(report, case))}**"]
            if (n1 := loss_line(case)) is not None:
                out += ["", _md_cell(n1)]
            if case.plan is not None and case.plan.devices:
                out += ["", *_md_table(DEVICE_HEADERS, device_rows(report, case.plan))]
            if case.plan is not None and case.plan.notes:
                out += ["", *(f"- note: {_md_cell(n)}" for n in case.plan.notes)]
            if case.recommendation is not None:
                out += [
                    "",
                    *(
                        f"- {_md_cell(line)}"
                        for line in recommendation_lines(case.recommendation, case_shortfall(case))
                    ),
                ]
    if report.formations is not None:
        out += ["", "## Formations", "", "```", *formations_section(report), "```"]
    return "\n".join(out) + "\n"
