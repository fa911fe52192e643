"""The capacity report as one self-contained HTML page with SVG bars."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from orchestrator.planning.plan import (
    Plan,
    PlannedDevice,
)
from orchestrator.report.build import Report, size_up
from orchestrator.report.text import (
    DEVICE_HEADERS,
    FLEET_HEADERS,
    STATUS_WORDS,
    case_shortfall,
    ctx_label,
    device_rows,
    fleet_lines,
    formations_section,
    header_lines,
    loss_line,
    matrix_table,
    model_architecture,
    model_title,
    node_rows,
    recommendation_lines,
    size,
    totals_row,
    verdict,
)

BAR_WIDTH = 720  # CSS pixels of the longest bar in a chart


BAR_HEIGHT = 22


_ROW = 58  # vertical pitch of the bars: the device's label above its bar, markers above and below


_LABEL_X = BAR_WIDTH + 16  # the "predicted / usable" label, right of the longest bar


MIN_SEGMENT = 3  # CSS pixels: a segment that holds any bytes is never thinner (a small model stays visible)


FREE_SHOWN = 1.0  # free memory beyond this multiple of the largest prediction is cut (marked) in the bars


_CHAR = 7.5  # an upper bound of a 12 px character's width, to size an SVG so no label is clipped


# Distinct fills (one per segment kind) so a screenshot can be measured against the data.
SEGMENT_COLOURS: dict[str, str] = {
    "weights": "#1f5fbf",
    "kv": "#e07b00",
    "compute": "#2e9e44",
    "free": "#c8c8c8",
}


_OVER_COLOUR = "#d62728"


_USABLE_TICK = "#000000"


_MARGIN_TICK = "#777777"


_CUT_COLOUR = "#ffffff"  # the gap that marks free memory cut from a bar


# The matrix's cells: green only for a plain fit; amber past the training context; red short.
STATUS_COLOURS: dict[str, str] = {
    "fits": "#bfe6c8",
    "beyond_training": "#ffd98a",
    "short": "#f6b9bf",
    "cannot_plan": "#dddddd",
}


CURVE_COLOURS = ("#6a3d9a", "#b15928", "#1b9e77", "#e7298a", "#66a61e", "#a6761d", "#377eb8", "#666666")


_CAPACITY_COLOUR = "#d62728"


_AXIS = "#222222"


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#222;background:#fff;
max-width:1352px}
h1{font-size:22px;margin:0 0 8px}h2{font-size:18px;margin:28px 0 8px}h3{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
th,td{border-bottom:1px solid #ddd;padding:3px 8px;text-align:left;white-space:nowrap}
td.n,th.n{text-align:right}th{background:#f4f4f4}
.meta{color:#555;font-size:13px;margin:2px 0}.fits{color:#1b7a2f}.nofit{color:#b00020}
.beyond{color:#8a5a00;font-weight:600}
.legend{font-size:13px}.legend span{display:inline-block;margin-right:16px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:5px;vertical-align:middle;
border:1px solid #999}
.rec{font-size:13px;margin:4px 0 0 0}svg{display:block}svg text{font-size:12px;fill:#222}
pre{white-space:pre-wrap;overflow-wrap:anywhere}code{overflow-wrap:anywhere}
"""


def _key(colour: str, label: str) -> str:
    """One legend entry: a swatch of `colour` (the tests match every drawn colour to one) and its label."""
    return f'<span class="key"><i style="background:{colour}"></i>{_e(label)}</span>'


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


def bar_scale(plan: Plan) -> int:
    """The bytes the longest bar stands for: every device's prediction, and its usable memory unless free
    memory would dwarf the predictions (a small model): then free memory past `FREE_SHOWN` times the
    largest prediction is cut (`bar_segments` marks it)."""
    predicted = max((d.memory.total for d in plan.devices), default=0)
    usable = max((d.memory.usable for d in plan.devices), default=0)
    cap = int(predicted * (1 + FREE_SHOWN)) if predicted else usable
    return max(predicted, min(usable, cap)) or 1


def bar_segments(plan: Plan) -> list[list[tuple[str, int, int]]]:
    """Per device: (kind, x, width) in CSS pixels, x from the bar's left edge, on `bar_scale`; integer
    edges (cumulative rounding) so the widths add up, and a segment that holds bytes is at least
    `MIN_SEGMENT` wide. Free memory past the scale is cut: the "free" segment ends at the bar's end."""
    scale_bytes = bar_scale(plan)
    out = []
    for d in plan.devices:
        m = d.memory
        parts = [("weights", m.weights), ("kv", m.kv), ("compute", m.compute)]
        used = m.weights + m.kv + m.compute
        parts.append(("free", max(0, min(m.usable, scale_bytes) - used)))
        segments, x, cum = [], 0, 0
        for kind, n in parts:
            if n <= 0:
                continue
            cum += n
            width = max(MIN_SEGMENT, round(cum * BAR_WIDTH / scale_bytes) - x)
            segments.append((kind, x, width))
            x += width
        out.append(segments)
    return out


def _px(n: int, scale_bytes: int) -> int:
    return round(max(n, 0) * BAR_WIDTH / scale_bytes)


def _svg_chart(report: Report, plan: Plan) -> str:
    scale_bytes = bar_scale(plan)
    labels = [f"{host} {d.label}" if (host := report.host_of(d.endpoint)) else d.label for d in plan.devices]
    ends = [f"{size(d.memory.total)} / {size(d.memory.usable)}" for d in plan.devices]
    width = round(
        max(_LABEL_X + _CHAR * max(map(len, ends), default=0), _CHAR * max(map(len, labels), default=0)) + 8
    )
    height = _ROW * len(plan.devices) + 4
    parts = [
        f'<svg class="bars" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" shape-rendering="crispEdges" role="img">'
    ]
    for row, (d, segments) in enumerate(zip(plan.devices, bar_segments(plan), strict=True)):
        y = 20 + row * _ROW
        parts.append(f'<text x="0" y="{y - 8}">{_e(labels[row])}</text>')
        for kind, x, w in segments:
            parts.append(
                f'<rect class="seg-{kind}" x="{x}" y="{y}" width="{w}" height="{BAR_HEIGHT}" '
                f'fill="{SEGMENT_COLOURS[kind]}"><title>{_e(kind)}: {_e(size(_segment_bytes(d, kind)))}'
                "</title></rect>"
            )
        m = d.memory
        if m.usable > scale_bytes:  # free memory cut: a white gap, then the bar's last 6 px
            cut = BAR_WIDTH - 14
            parts.append(
                f'<rect class="cut" x="{cut}" y="{y}" width="4" height="{BAR_HEIGHT}" fill="{_CUT_COLOUR}">'
                f"<title>free memory not drawn to scale: {_e(size(m.usable - m.total))} free</title></rect>"
            )
        # Markers sit above and below the bar, never across it: the bar's middle row shows only data.
        for at, colour in ((m.usable, _USABLE_TICK), (m.usable - m.margin, _MARGIN_TICK)):
            if at > scale_bytes:
                continue
            xu = _px(at, scale_bytes)
            parts.append(f'<rect x="{max(xu - 1, 0)}" y="{y - 5}" width="2" height="5" fill="{colour}"/>')
            parts.append(
                f'<rect x="{max(xu - 1, 0)}" y="{y + BAR_HEIGHT}" width="2" height="5" fill="{colour}"/>'
            )
        if m.total > m.usable:
            x0, x1 = _px(m.usable, scale_bytes), _px(m.total, scale_bytes)
            parts.append(
                f'<rect x="{x0}" y="{y + BAR_HEIGHT + 1}" width="{max(x1 - x0, 1)}" height="4" '
                f'fill="{_OVER_COLOUR}"><title>over by {_e(size_up(m.total - m.usable))}</title></rect>'
            )
        parts.append(f'<text x="{_LABEL_X}" y="{y + 15}">{_e(ends[row])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _segment_bytes(d: PlannedDevice, kind: str) -> int:
    m = d.memory
    return {"weights": m.weights, "kv": m.kv, "compute": m.compute, "free": max(0, m.usable - m.total)}[kind]


def _bars_legend() -> str:
    keys = [_key(colour, kind) for kind, colour in SEGMENT_COLOURS.items()]
    keys += [
        _key(_USABLE_TICK, "tick: usable"),
        _key(_MARGIN_TICK, "tick: usable − margin"),
        _key(_OVER_COLOUR, "line: predicted beyond usable"),
        _key(_CUT_COLOUR, "gap: free memory cut (not to scale)"),
    ]
    return f'<p class="legend">{"".join(keys)}</p>'


def _matrix(report: Report) -> str:
    headers, rows = matrix_table(report)
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for model, row in zip(report.models, rows, strict=True):
        cases = {c.n_ctx: c for c in report.cases if c.model == model.path}
        cells = [f"<th>{_e(row[0])}</th>"]
        for n_ctx, text in zip(report.contexts, row[1:-1], strict=True):
            status = cases[n_ctx].status
            cells.append(
                f'<td class="st-{status}" style="background:{STATUS_COLOURS[status]}">{_e(text)}</td>'
            )
        cells.append(f'<td class="n">{_e(row[-1])}</td>')
        body.append(f"<tr>{''.join(cells)}</tr>")
    legend = "".join(_key(colour, STATUS_WORDS[status]) for status, colour in STATUS_COLOURS.items())
    return (
        f'<table class="matrix"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'
        f'<p class="legend">{legend}<span>largest context: the most that fits on the fleet '
        "(+: the search stopped at the training context)</span></p>"
    )


_CURVE_W, _CURVE_H = 860, 300
_CURVE_LEFT, _CURVE_BOTTOM, _CURVE_TOP, _CURVE_RIGHT = 84, 44, 12, 24


def _ctx_tick(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _size_ticks(top: int) -> list[int]:
    """About five round values from 0 to `top` (a power of two or 1.5 of one, in bytes)."""
    step = 1
    while top / step > 6:
        step *= 2
    return [i * step for i in range(int(top // step) + 1)]


def _curves(report: Report) -> str:
    """Each model's predicted memory against context (log scale), the fleet's usable capacity as a line."""
    points = [p for c in report.curves for p in c.points]
    contexts = sorted({p.n_ctx for p in points})
    if not contexts:
        return ""
    top = max([report.capacity, *(p.predicted or 0 for p in points)]) * 1.08 or 1
    lo, hi = math.log2(contexts[0]), math.log2(contexts[-1])
    plot_w = _CURVE_W - _CURVE_LEFT - _CURVE_RIGHT
    plot_h = _CURVE_H - _CURVE_TOP - _CURVE_BOTTOM

    def x_of(n: int) -> float:
        return _CURVE_LEFT + (plot_w * (math.log2(n) - lo) / (hi - lo) if hi > lo else plot_w / 2)

    def y_of(n: int) -> float:
        return _CURVE_TOP + plot_h * (1 - n / top)

    base = _CURVE_TOP + plot_h
    out = [
        f'<svg class="curves" width="{_CURVE_W}" height="{_CURVE_H}" viewBox="0 0 {_CURVE_W} {_CURVE_H}" '
        'role="img">',
        f'<line class="axis" x1="{_CURVE_LEFT}" y1="{base}" x2="{_CURVE_W - _CURVE_RIGHT}" y2="{base}" '
        f'stroke="{_AXIS}"/>',
        f'<line class="axis" x1="{_CURVE_LEFT}" y1="{_CURVE_TOP}" x2="{_CURVE_LEFT}" y2="{base}" '
        f'stroke="{_AXIS}"/>',
    ]
    ticks = [n for n in contexts if n & (n - 1) == 0] or contexts
    for n in ticks:
        x = x_of(n)
        out.append(
            f'<line class="axis" x1="{x:.1f}" y1="{base}" x2="{x:.1f}" y2="{base + 4}" stroke="{_AXIS}"/>'
        )
        out.append(f'<text x="{x:.1f}" y="{base + 17}" text-anchor="middle">{_e(_ctx_tick(n))}</text>')
    out.append(
        f'<text x="{_CURVE_LEFT + plot_w / 2:.1f}" y="{_CURVE_H - 6}" text-anchor="middle">'
        "context (tokens, log scale)</text>"
    )
    for n in _size_ticks(int(top)):
        y = y_of(n)
        out.append(
            f'<line class="axis" x1="{_CURVE_LEFT - 4}" y1="{y:.1f}" x2="{_CURVE_LEFT}" y2="{y:.1f}" '
            f'stroke="{_AXIS}"/>'
        )
        out.append(f'<text x="{_CURVE_LEFT - 7}" y="{y + 4:.1f}" text-anchor="end">{_e(size(n))}</text>')
    cap_y = y_of(report.capacity)
    out.append(
        f'<line class="capacity" x1="{_CURVE_LEFT}" y1="{cap_y:.1f}" x2="{_CURVE_W - _CURVE_RIGHT}" '
        f'y2="{cap_y:.1f}" stroke="{_CAPACITY_COLOUR}" stroke-dasharray="6 4" stroke-width="2">'
        f"<title>fleet usable: {_e(size(report.capacity))}</title></line>"
    )
    for i, curve in enumerate(report.curves):
        colour = CURVE_COLOURS[i % len(CURVE_COLOURS)]
        drawn = [(p, x_of(p.n_ctx), y_of(p.predicted)) for p in curve.points if p.predicted is not None]
        if len(drawn) > 1:
            path = " ".join(f"{'M' if k == 0 else 'L'}{x:.1f},{y:.1f}" for k, (_, x, y) in enumerate(drawn))
            out.append(f'<path d="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for p, x, y in drawn:
            fill = colour if p.fits else "#ffffff"  # hollow: does not fit there
            out.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{fill}" stroke="{colour}" '
                'stroke-width="1.5">'
                f"<title>{_e(_ctx_tick(p.n_ctx))}: {_e(size(p.predicted))}</title></circle>"
            )
        if curve.n_ctx_train and contexts[0] <= curve.n_ctx_train <= contexts[-1]:
            x = x_of(curve.n_ctx_train)
            out.append(
                f'<line x1="{x:.1f}" y1="{_CURVE_TOP}" x2="{x:.1f}" y2="{base}" stroke="{colour}" '
                f'stroke-dasharray="2 3"><title>trained on {curve.n_ctx_train}</title></line>'
            )
    out.append("</svg>")
    names = {m.path: model_title(m) for m in report.models}
    keys = [
        _key(
            CURVE_COLOURS[i % len(CURVE_COLOURS)],
            f"{names.get(c.model, c.model)} (dotted: its training context)",
        )
        for i, c in enumerate(report.curves)
    ]
    keys += [
        _key(_CAPACITY_COLOUR, f"fleet usable: {size(report.capacity)} (dashed)"),
        _key("#ffffff", "hollow point: does not fit there"),
    ]
    return "".join(out) + f'<p class="legend">{"".join(keys)}</p>'


def render_html(report: Report) -> str:
    b: list[str] = [
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
        "<title>rpcfleet capacity report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>rpcfleet capacity report</h1>",
        *(f'<p class="meta">{_e(line)}</p>' for line in header_lines(report)),
        "<h2>Summary</h2>",
        _matrix(report),
        "<h2>Memory against context</h2>",
        '<p class="meta">predicted weights, KV and compute on the fleet\'s devices, each model planned at '
        "each context</p>",
        _curves(report),
        "<h2>Fleet</h2>",
    ]
    rows = [row for node in report.fleet.nodes for row in node_rows(report, node)]
    b.append(_html_table(FLEET_HEADERS, [*rows, totals_row(report.fleet)], numeric_from=6))
    for kind, text in fleet_lines(report):  # the same lines as the text report's
        b.append(f'<p class="meta{" nofit" if kind == "failed" else ""}">{_e(text)}</p>')
    b.append("<h2>Devices per model and context</h2>")
    b.append(_bars_legend())
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
            cls = {"fits": "fits", "beyond_training": "beyond"}.get(case.status, "nofit")
            b.append(f'<section class="case"><h3>ctx {_e(ctx_label(case.n_ctx))}</h3>')
            b.append(f'<p class="{cls}">{_e(verdict(report, case))}</p>')
            if (n1 := loss_line(case)) is not None:
                ok = all(loss.fits for loss in case.losses)
                b.append(f'<p class="n1 {"fits" if ok else "nofit"}">{_e(n1)}</p>')
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
        lines = "\n".join(formations_section(report))
        b += ["<h2>Formations</h2>", f"<pre>{_e(lines)}</pre>"]
    b.append("</body></html>")
    return "\n".join(b) + "\n"
