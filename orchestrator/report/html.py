"""The capacity report as one self-contained HTML page with SVG bars."""

from __future__ import annotations

import html
from collections.abc import Sequence

from orchestrator.planning.plan import (
    Plan,
    PlannedDevice,
)
from orchestrator.report.build import Report, size_up
from orchestrator.report.formations import formations_lines
from orchestrator.report.text import (
    DEVICE_HEADERS,
    FLEET_HEADERS,
    case_shortfall,
    ctx_label,
    device_rows,
    fleet_lines,
    header_lines,
    model_architecture,
    node_rows,
    recommendation_lines,
    size,
    totals_row,
    verdict,
)

BAR_WIDTH = 720  # CSS pixels of the longest bar in a chart


BAR_HEIGHT = 22


_BAR_X = 220  # left edge of the bars (labels to the left)


_ROW = 44  # vertical pitch of the bars


# Distinct fills (one per segment kind) so a screenshot can be measured against the data.
SEGMENT_COLOURS: dict[str, str] = {
    "weights": "#1f5fbf",
    "kv": "#e07b00",
    "compute": "#2e9e44",
    "free": "#c8c8c8",
}


_OVER_COLOUR = "#d62728"


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:22px;margin:0 0 8px}h2{font-size:18px;margin:28px 0 8px}h3{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
th,td{border-bottom:1px solid #ddd;padding:3px 8px;text-align:left;white-space:nowrap}
td.n,th.n{text-align:right}th{background:#f4f4f4}
.meta{color:#555;font-size:13px;margin:2px 0}.fits{color:#1b7a2f}.nofit{color:#b00020}
.legend span{display:inline-block;margin-right:16px;font-size:13px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:5px;vertical-align:middle}
.rec{font-size:13px;margin:4px 0 0 0}svg text{font-size:12px;fill:#222}
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _html_table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int) -> str:
    head = "".join(
        f'<th class="n">{_e(h)}</th>' if i >= numeric_from else f"<th>{_e(h)}</th>"
        for i, h in enumerate(headers)
    )
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="n">{_e(c)}</td>' if i >= numeric_from else f"<td>{_e(c)}</td>"
            for i, c in enumerate(r)
        )
        + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def bar_segments(plan: Plan) -> list[list[tuple[str, int, int]]]:
    """Per device: (kind, x, width) in CSS pixels, x from the bar's left edge; integer edges (cumulative
    rounding) so the drawn widths add up exactly. The scale is shared by all bars of the chart."""
    scale_bytes = max((max(d.memory.usable, d.memory.total) for d in plan.devices), default=0) or 1
    out = []
    for d in plan.devices:
        m = d.memory
        parts = [("weights", m.weights), ("kv", m.kv), ("compute", m.compute)]
        parts.append(("free", max(0, m.usable - m.total)))
        edges, cum = [0], 0
        for _, n in parts:
            cum += n
            edges.append(round(cum * BAR_WIDTH / scale_bytes))
        out.append(
            [
                (kind, edges[k], edges[k + 1] - edges[k])
                for k, (kind, _) in enumerate(parts)
                if edges[k + 1] > edges[k]
            ]
        )
    return out


def _svg_chart(report: Report, plan: Plan) -> str:
    scale_bytes = max((max(d.memory.usable, d.memory.total) for d in plan.devices), default=0) or 1
    height = _ROW * len(plan.devices) + 10
    width = _BAR_X + BAR_WIDTH + 140
    parts = [
        f'<svg width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" shape-rendering="crispEdges" role="img">'
    ]
    for row, (d, segments) in enumerate(zip(plan.devices, bar_segments(plan), strict=True)):
        y = 10 + row * _ROW
        host = report.host_of(d.endpoint)
        label = f"{host} {d.label}" if host else d.label
        parts.append(f'<text x="{_BAR_X - 8}" y="{y + 15}" text-anchor="end">{_e(label[:34])}</text>')
        for kind, x, w in segments:
            parts.append(
                f'<rect class="seg-{kind}" x="{_BAR_X + x}" y="{y}" width="{w}" height="{BAR_HEIGHT}" '
                f'fill="{SEGMENT_COLOURS[kind]}"><title>{_e(kind)}: {_e(size(_segment_bytes(d, kind)))}'
                "</title></rect>"
            )
        m = d.memory
        # Markers sit above and below the bar, never across it: the bar's middle row shows only data.
        for at, colour in ((m.usable, "#000"), (m.usable - m.margin, "#777")):
            xu = _BAR_X + round(max(at, 0) * BAR_WIDTH / scale_bytes)
            parts.append(f'<rect x="{xu - 1}" y="{y - 5}" width="2" height="5" fill="{colour}"/>')
            parts.append(f'<rect x="{xu - 1}" y="{y + BAR_HEIGHT}" width="2" height="5" fill="{colour}"/>')
        if m.total > m.usable:
            x0 = _BAR_X + round(m.usable * BAR_WIDTH / scale_bytes)
            x1 = _BAR_X + round(m.total * BAR_WIDTH / scale_bytes)
            parts.append(
                f'<rect x="{x0}" y="{y + BAR_HEIGHT + 1}" width="{max(x1 - x0, 1)}" height="4" '
                f'fill="{_OVER_COLOUR}"><title>over by {_e(size_up(m.total - m.usable))}</title></rect>'
            )
        end = _BAR_X + round(max(m.usable, m.total) * BAR_WIDTH / scale_bytes) + 8
        parts.append(f'<text x="{end}" y="{y + 15}">{_e(size(m.total))} / {_e(size(m.usable))}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _segment_bytes(d: PlannedDevice, kind: str) -> int:
    m = d.memory
    return {"weights": m.weights, "kv": m.kv, "compute": m.compute, "free": max(0, m.usable - m.total)}[kind]


def render_html(report: Report) -> str:
    b: list[str] = [
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
        "<title>rpcfleet capacity report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>rpcfleet capacity report</h1>",
        *(f'<p class="meta">{_e(line)}</p>' for line in header_lines(report)),
        "<h2>Fleet</h2>",
    ]
    rows = [row for node in report.fleet.nodes for row in node_rows(node)]
    b.append(_html_table(FLEET_HEADERS, [*rows, totals_row(report.fleet)], numeric_from=6))
    for kind, text in fleet_lines(report):  # the same lines as the text report's
        b.append(f'<p class="meta{" nofit" if kind == "failed" else ""}">{_e(text)}</p>')
    legend = "".join(
        f'<span><i style="background:{colour}"></i>{_e(kind)}</span>'
        for kind, colour in SEGMENT_COLOURS.items()
    )
    b.append(
        f'<p class="legend">{legend}<span>▮ black tick: usable, grey tick: usable − margin, '
        "red line: predicted beyond usable</span></p>"
    )
    for model in report.models:
        p = model.profile
        b.append(f"<h2>Model {_e(p.name or model.path)}</h2>")
        b.append(
            f'<p class="meta"><code>{_e(model.path)}</code>: {p.n_layer} layers, weights '
            f"{_e(size(p.total_bytes))}, n_ctx_train {p.n_ctx_train}</p>"
        )
        items = "".join(
            f"<li>{_e(label)}: {_e(value)}</li>" for label, value in model_architecture(report, model)
        )
        b.append(f'<ul class="arch">{items}</ul>')
        for case in (c for c in report.cases if c.model == model.path):
            cls = "fits" if case.fits else "nofit"
            b.append(f'<section class="case"><h3>ctx {_e(ctx_label(case.n_ctx))}</h3>')
            b.append(f'<p class="{cls}">{_e(verdict(report, case))}</p>')
            if case.plan is not None and case.plan.devices:
                b.append(_svg_chart(report, case.plan))
                b.append(_html_table(DEVICE_HEADERS, device_rows(report, case.plan), numeric_from=2))
            if case.plan is not None:
                b += [f'<p class="meta">note: {_e(n)}</p>' for n in case.plan.notes]
            if case.recommendation is not None:
                b += [
                    f'<p class="rec">{_e(line)}</p>'
                    for line in recommendation_lines(case.recommendation, case_shortfall(case))
                ]
            b.append("</section>")
    if report.formations is not None:
        lines = "\n".join(formations_lines(report.formations))
        b += ["<h2>Formations</h2>", f"<pre>{_e(lines)}</pre>"]
    b.append("</body></html>")
    return "\n".join(b) + "\n"
