"""Capacity-planning report (pure): a probed fleet + model profiles + contexts → `Report` → text, Markdown,
JSON or a self-contained HTML page.

For every model × context the planner (`planner.make_plan`) is run on the fleet's usable devices and the
report keeps its verdict: predicted bytes per device (weights, KV, compute), the binding device, the
shortfall, the largest context that fits. When a model does not fit, the report finds the smallest change
that makes it fit, by re-planning:

* per device: the least usable memory that, added to that device alone, makes the planner's verdict
  "fits" (the re-plan may move layers onto the grown device). Found by a doubling search for an amount
  that fits, then a binary search between the last amount that does not and the first that does, at
  `ReportOptions.resolution` (1 MiB): the amount found fits and one resolution step less does not.
* a new node: the least usable memory of one device added at the end of the device list (a new
  rpc-server), searched the same way.

The smallest per-device amount is "the smallest change"; the new node is the alternative. Amounts are
*usable* bytes: on a node, free memory must grow by that much (reserve and limit stay as they are).

Nothing here does I/O: the CLI (`orchestrator/cli/report.py`) probes, profiles and writes the file.
The JSON document is described in `docs/report-schema.md` (`SCHEMA_VERSION`).
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from orchestrator.errors import PlanError
from orchestrator.model import ModelProfile
from orchestrator.planner import (
    CTX_PAD,
    MAX_DEVICES,
    MAX_RPC_DEVICES,
    Plan,
    PlanDevice,
    PlannedDevice,
    PlanOptions,
    make_plan,
)
from orchestrator.probe import FleetProbe, NodeProbe, to_plan_devices
from orchestrator.units import format_size

__all__ = [
    "BAR_WIDTH",
    "FORMATS",
    "NEW_NODE_ENDPOINT",
    "SCHEMA_VERSION",
    "SEGMENT_COLOURS",
    "Case",
    "DeviceChange",
    "Recommendation",
    "Report",
    "ReportModel",
    "ReportOptions",
    "build_report",
    "render",
    "render_html",
    "render_json",
    "render_markdown",
    "render_text",
    "report_to_dict",
    "smallest_addition",
]

SCHEMA_VERSION = 1
MiB = 1024 * 1024
DEFAULT_SEARCH_LIMIT = 1 << 50  # 1 PiB: no single device or node is searched beyond this
NEW_NODE_ENDPOINT = "new-node:50052"  # the placeholder endpoint of the "add a node" re-plan

Format = Literal["text", "md", "json", "html"]
FORMATS: tuple[str, ...] = ("text", "md", "json", "html")

# --------------------------------------------------------------------------------------------------
# data


@dataclass(frozen=True)
class ReportOptions:
    """How plans are made (`plan`; its n_ctx is replaced by each context) and how changes are searched."""

    plan: PlanOptions = field(default_factory=PlanOptions)
    recommend: bool = True
    resolution: int = MiB  # granularity of the smallest-change search, bytes
    search_limit: int = DEFAULT_SEARCH_LIMIT
    generated_at: str | None = None  # a timestamp the caller supplies (the report itself has no clock)
    inventory: str | None = None  # where the fleet came from, for the reader


@dataclass(frozen=True)
class ReportModel:
    path: str  # as the user named it
    profile: ModelProfile


@dataclass(frozen=True)
class DeviceChange:
    """Usable bytes to add to one device (alone) so the plan fits; `add` None: no amount up to the limit."""

    device: str  # the device's label, `host:port#index`
    host: str | None
    add: int | None


@dataclass(frozen=True)
class Recommendation:
    devices: tuple[DeviceChange, ...]  # one per device the fleet could plan with, in device order
    smallest: DeviceChange | None  # the least `add` among `devices` (first on ties); None: none helps
    new_node: int | None  # usable bytes of one added node that make the plan fit; None: none does
    new_node_note: str | None = None  # why there is no new-node option, when there is none


@dataclass(frozen=True)
class Case:
    """One model at one context: the plan (None when the planner refused) and what would make it fit."""

    model: str  # ReportModel.path
    n_ctx: int  # as requested (0 = the model's n_ctx_train)
    plan: Plan | None
    error: str | None
    recommendation: Recommendation | None

    @property
    def fits(self) -> bool:
        return self.plan is not None and self.plan.fit.fits

    @property
    def binding(self) -> PlannedDevice | None:
        if self.plan is None or self.plan.fit.binding_device is None:
            return None
        return self.plan.devices[self.plan.fit.binding_device]


@dataclass(frozen=True)
class Report:
    schema_version: int
    fleet: FleetProbe
    devices: tuple[PlanDevice, ...]  # what the plans could use: ok nodes' devices, each endpoint once
    models: tuple[ReportModel, ...]
    contexts: tuple[int, ...]
    cases: tuple[Case, ...]  # models × contexts, model-major
    options: ReportOptions
    notes: tuple[str, ...] = ()

    def host_of(self, endpoint: str | None) -> str | None:
        for dev in self.devices:
            if dev.endpoint == endpoint:
                return dev.host
        return None


# --------------------------------------------------------------------------------------------------
# building


def smallest_addition(
    fits: Callable[[int], bool], *, start: int, resolution: int = MiB, limit: int = DEFAULT_SEARCH_LIMIT
) -> int | None:
    """The least multiple of `resolution` for which `fits(amount)` holds, given that `fits(0)` does not.

    Doubling from `start` (rounded up) finds an amount that fits; a binary search then narrows the gap to
    one step: the result fits and the result minus `resolution` does not. None when nothing up to `limit`
    fits. (If `fits` is not monotone the result is still a boundary of that kind, found from below.)
    """
    if resolution <= 0:
        raise ValueError("resolution must be positive")
    max_units = limit // resolution  # amounts above `limit` are never tried
    if max_units == 0:
        return None
    hi = min(max(1, -(-start // resolution)), max_units)
    lo = 0  # known not to fit
    while not fits(hi * resolution):
        if hi >= max_units:
            return None
        lo = hi
        hi = min(hi * 2, max_units)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * resolution):
            hi = mid
        else:
            lo = mid
    return hi * resolution


def _plan_fits(devices: Sequence[PlanDevice], profile: ModelProfile, opts: PlanOptions) -> bool:
    try:
        return make_plan(devices, profile, opts).fit.fits
    except PlanError:
        return False


def _grow(device: PlanDevice, extra: int) -> PlanDevice:
    return replace(device, usable=device.usable + extra, free=device.free + extra, total=device.total + extra)


def _recommend(
    devices: tuple[PlanDevice, ...],
    profile: ModelProfile,
    opts: PlanOptions,
    plan: Plan | None,
    ro: ReportOptions,
) -> Recommendation:
    # The verdict does not depend on the largest-context search: cap it so each re-plan stays cheap.
    quick = replace(opts, n_ctx_cap=CTX_PAD)
    shortfall = plan.fit.shortfall if plan is not None else 0
    changes: list[DeviceChange] = []
    for i, dev in enumerate(devices):

        def fits_with(extra: int, i: int = i) -> bool:
            grown = (*devices[:i], _grow(devices[i], extra), *devices[i + 1 :])
            return _plan_fits(grown, profile, quick)

        add = smallest_addition(fits_with, start=shortfall, resolution=ro.resolution, limit=ro.search_limit)
        changes.append(DeviceChange(device=dev.label, host=dev.host, add=add))
    helpful = [c for c in changes if c.add is not None]
    smallest = min(helpful, key=lambda c: c.add or 0) if helpful else None

    note: str | None = None
    new_node: int | None = None
    n_rpc = sum(1 for d in devices if d.is_rpc)
    if len(devices) >= MAX_DEVICES or n_rpc >= MAX_RPC_DEVICES:
        note = f"the fleet already has {len(devices)} devices; llama.cpp takes at most {MAX_RPC_DEVICES}"
    else:
        template = PlanDevice(
            endpoint=NEW_NODE_ENDPOINT, index=0, name=f"{NEW_NODE_ENDPOINT}#0", description="a new node"
        )

        def node_fits(extra: int) -> bool:
            return _plan_fits((*devices, _grow(template, extra)), profile, quick)

        # A new device only helps past the margin: start the search there.
        new_node = smallest_addition(
            node_fits, start=shortfall + opts.margin, resolution=ro.resolution, limit=ro.search_limit
        )
        if new_node is None:
            note = f"no node of up to {format_size(ro.search_limit)} makes it fit"
    return Recommendation(tuple(changes), smallest, new_node, note)


def build_report(
    fleet: FleetProbe,
    models: Sequence[tuple[str, ModelProfile]],
    contexts: Sequence[int],
    options: ReportOptions | None = None,
) -> Report:
    """Plan every model at every context on the fleet's ok devices; find the smallest change where a plan
    does not fit. Pure: no I/O, no clock."""
    ro = options or ReportOptions()
    if not contexts:
        raise PlanError("no context sizes to report on")
    if any(c < 0 for c in contexts):
        raise PlanError(
            f"context sizes must be >= 0 (0 = the model's training context), got {list(contexts)}"
        )
    devices = tuple(to_plan_devices(fleet, failed="skip"))
    notes: list[str] = []
    for node in fleet.failed:
        notes.append(f"{node.host} ({node.endpoint}) is {node.state}: its devices are not in the plans")
    cases: list[Case] = []
    for path, profile in models:
        for n_ctx in contexts:
            opts = replace(ro.plan, n_ctx=n_ctx)
            plan: Plan | None = None
            error: str | None = None
            try:
                plan = make_plan(devices, profile, opts)
            except PlanError as exc:
                error = exc.message
            rec = None
            if ro.recommend and (plan is None or not plan.fit.fits):
                rec = _recommend(devices, profile, opts, plan, ro)
            cases.append(Case(path, n_ctx, plan, error, rec))
    return Report(
        schema_version=SCHEMA_VERSION,
        fleet=fleet,
        devices=devices,
        models=tuple(ReportModel(p, m) for p, m in models),
        contexts=tuple(contexts),
        cases=tuple(cases),
        options=ro,
        notes=tuple(notes),
    )


# --------------------------------------------------------------------------------------------------
# shared helpers for the renderers


def size_up(n: int | None) -> str:
    """Like `format_size`, but never shows less than `n` (a recommended amount must not be rounded down)."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{n} B"
            return f"{math.ceil(value * 100 - 1e-9) / 100:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _size(n: int | None) -> str:
    return format_size(n)


def _ctx_label(n_ctx: int) -> str:
    return "n_ctx_train" if n_ctx == 0 else str(n_ctx)


def _node_rows(node: NodeProbe) -> list[list[str]]:
    protocol = str(node.rpc.version) if node.rpc.version is not None else "-"
    base = [node.host, node.endpoint, node.state, protocol]
    if not node.devices:
        return [[*base, "-", "-", "-", "-", "-", "-", "-"]]
    return [
        [
            *base,
            f"#{d.index}",
            d.description,
            _size(d.total),
            _size(d.free),
            _size(d.reserve),
            _size(d.limit) if d.limit is not None else "-",
            _size(d.usable),
        ]
        for d in node.devices
    ]


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
DEVICE_HEADERS = ["device", "host", "layers", "weights", "KV", "compute", "predicted", "usable", "headroom"]


def _reserve_total(fleet: FleetProbe) -> int:
    return sum(d.reserve for d in fleet.devices)


def _totals_row(fleet: FleetProbe) -> list[str]:
    t = fleet.totals
    return [
        "total",
        f"{t.ok_endpoints}/{t.endpoints} endpoints ok",
        "",
        "",
        f"{t.devices} devices",
        "",
        _size(t.total),
        _size(t.free),
        _size(_reserve_total(fleet)),
        "",
        _size(t.usable),
    ]


def _device_rows(report: Report, plan: Plan) -> list[list[str]]:
    rows = []
    for d in plan.devices:
        m = d.memory
        rows.append(
            [
                d.label,
                report.host_of(d.endpoint) or "-",
                str(d.n_layers) + (" +out" if d.has_output else ""),
                _size(m.weights),
                _size(m.kv),
                _size(m.compute),
                _size(m.total),
                _size(m.usable),
                _size(m.headroom),
            ]
        )
    return rows


def _verdict(report: Report, case: Case) -> str:
    plan = case.plan
    if plan is None:
        return f"cannot plan: {case.error}"
    fit = plan.fit
    largest = f"largest context that fits: {fit.largest_n_ctx}" if fit.largest_n_ctx else "no context fits"
    binding = case.binding
    where = ""
    if binding is not None:
        host = report.host_of(binding.endpoint)
        where = f"{host} ({binding.label})" if host else binding.label
    if fit.fits:
        head = binding.memory.headroom if binding is not None else 0
        return f"fits (n_ctx {plan.n_ctx}); binding device {where}, headroom {_size(head)}; {largest}"
    return f"does not fit (n_ctx {plan.n_ctx}): short {size_up(fit.shortfall)} on {where}; {largest}"


def _change_where(change: DeviceChange) -> str:
    return f"{change.host} ({change.device})" if change.host else change.device


def _recommendation_lines(rec: Recommendation, shortfall: int) -> list[str]:
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


def _shortfall(case: Case) -> int:
    return case.plan.fit.shortfall if case.plan is not None else 0


def _header_lines(report: Report) -> list[str]:
    lines = []
    if report.options.generated_at:
        lines.append(f"generated: {report.options.generated_at}")
    if report.options.inventory:
        lines.append(f"inventory: {report.options.inventory}")
    o = report.options.plan
    lines.append(
        f"plan options: KV {o.type_k}/{o.type_v}, ubatch {o.n_ubatch}, flash attention "
        f"{'on' if o.flash_attn else 'off'}, margin {_size(o.margin)} per device, strategy {o.strategy}"
    )
    lines.append(f"controller protocol: {report.fleet.protocol}")
    return lines


# --------------------------------------------------------------------------------------------------
# text


def _text_table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return (indent + "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True))).rstrip()

    return [line(headers), indent + "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def render_text(report: Report) -> str:
    out = ["rpcfleet capacity report", *_header_lines(report), "", "Fleet"]
    rows = [row for node in report.fleet.nodes for row in _node_rows(node)]
    out += _text_table(FLEET_HEADERS, [*rows, _totals_row(report.fleet)], "  ")
    for node in report.fleet.nodes:
        if not node.ok:
            out.append(f"  {node.host}: {node.state}: {node.rpc.message}")
        out += [f"  {node.host}: warning: {w}" for w in node.warnings]
        out += [f"  {node.host} #{d.index}: warning: {w}" for d in node.devices for w in d.warnings]
    for note in report.notes:
        out.append(f"  note: {note}")
    for model in report.models:
        p = model.profile
        out += [
            "",
            f"Model {p.name or model.path} ({model.path}): {p.n_layer} layers, "
            f"weights {_size(p.total_bytes)}, n_ctx_train {p.n_ctx_train}",
        ]
        for case in (c for c in report.cases if c.model == model.path):
            out.append(f"  ctx {_ctx_label(case.n_ctx)}: {_verdict(report, case)}")
            if case.plan is not None and case.plan.devices:
                out += _text_table(DEVICE_HEADERS, _device_rows(report, case.plan), "    ")
            if case.plan is not None:
                out += [f"    note: {n}" for n in case.plan.notes]
            if case.recommendation is not None:
                out += [
                    "    " + line for line in _recommendation_lines(case.recommendation, _shortfall(case))
                ]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------------
# Markdown


def _md_cell(text: str) -> str:
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(_md_cell(c) for c in cells) + " |"

    return [line(headers), "|" + "|".join("---" for _ in headers) + "|", *(line(r) for r in rows)]


def render_markdown(report: Report) -> str:
    out = ["# rpcfleet capacity report", ""]
    out += [f"- {_md_cell(line)}" for line in _header_lines(report)]
    out += ["", "## Fleet", ""]
    rows = [row for node in report.fleet.nodes for row in _node_rows(node)]
    out += _md_table(FLEET_HEADERS, [*rows, _totals_row(report.fleet)])
    extra = [f"- {node.host}: {node.state}: {node.rpc.message}" for node in report.fleet.nodes if not node.ok]
    extra += [f"- note: {n}" for n in report.notes]
    if extra:
        out += ["", *(_md_cell(e) for e in extra)]
    for model in report.models:
        p = model.profile
        out += [
            "",
            f"## Model {_md_cell(p.name or model.path)}",
            "",
            f"`{model.path}`: {p.n_layer} layers, weights {_size(p.total_bytes)}, "
            f"n_ctx_train {p.n_ctx_train}",
        ]
        for case in (c for c in report.cases if c.model == model.path):
            out += ["", f"### ctx {_ctx_label(case.n_ctx)}", "", f"**{_md_cell(_verdict(report, case))}**"]
            if case.plan is not None and case.plan.devices:
                out += ["", *_md_table(DEVICE_HEADERS, _device_rows(report, case.plan))]
            if case.recommendation is not None:
                out += [
                    "",
                    *(
                        f"- {_md_cell(line)}"
                        for line in _recommendation_lines(case.recommendation, _shortfall(case))
                    ),
                ]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------------
# JSON


def _plan_device_json(report: Report, d: PlannedDevice) -> dict[str, Any]:
    m = d.memory
    return {
        "device": d.label,
        "host": report.host_of(d.endpoint),
        "endpoint": d.endpoint,
        "index": d.index,
        "description": d.description,
        "layers": d.n_layers,
        "first_layer": d.layers[0] if d.layers else None,
        "last_layer": d.layers[-1] if d.layers else None,
        "has_output": d.has_output,
        "weights": m.weights,
        "kv": m.kv,
        "compute": m.compute,
        "predicted": m.total,
        "usable": m.usable,
        "margin": m.margin,
        "headroom": m.headroom,
    }


def _case_json(report: Report, case: Case) -> dict[str, Any]:
    plan = case.plan
    binding = case.binding
    out: dict[str, Any] = {
        "model": case.model,
        "n_ctx": case.n_ctx,
        "n_ctx_padded": plan.n_ctx if plan is not None else None,
        "fits": plan.fit.fits if plan is not None else False,
        "error": case.error,
        "binding_device": binding.label if binding is not None else None,
        "binding_host": report.host_of(binding.endpoint) if binding is not None else None,
        "shortfall": plan.fit.shortfall if plan is not None else None,
        "largest_n_ctx": plan.fit.largest_n_ctx if plan is not None else None,
        "n_gpu_layers": plan.n_gpu_layers if plan is not None else None,
        "tensor_split": list(plan.tensor_split) if plan is not None else None,
        "pipeline_parallel": plan.pipeline_parallel if plan is not None else None,
        "devices": [_plan_device_json(report, d) for d in plan.devices] if plan is not None else [],
        "host_memory": (
            {
                "weights": plan.host.weights,
                "kv": plan.host.kv,
                "compute": plan.host.compute,
                "output": plan.host.output,
                "total": plan.host.total,
            }
            if plan is not None
            else None
        ),
        "notes": list(plan.notes) if plan is not None else [],
        "recommendation": None,
    }
    rec = case.recommendation
    if rec is not None:

        def change(c: DeviceChange) -> dict[str, Any]:
            return {"device": c.device, "host": c.host, "add": c.add}

        out["recommendation"] = {
            "smallest": change(rec.smallest) if rec.smallest is not None else None,
            "new_node": {"usable": rec.new_node} if rec.new_node is not None else None,
            "new_node_note": rec.new_node_note,
            "devices": [change(c) for c in rec.devices],
        }
    return out


def report_to_dict(report: Report) -> dict[str, Any]:
    """The JSON document (docs/report-schema.md) as plain data."""
    fleet = report.fleet
    t = fleet.totals
    o = report.options.plan
    return {
        "schema_version": report.schema_version,
        "generated_at": report.options.generated_at,
        "inventory": report.options.inventory,
        "options": {
            "type_k": o.type_k,
            "type_v": o.type_v,
            "n_ubatch": o.n_ubatch,
            "n_batch": o.n_batch,
            "flash_attn": o.flash_attn,
            "n_gpu_layers": o.n_gpu_layers,
            "margin": o.margin,
            "strategy": o.strategy,
            "resolution": report.options.resolution,
        },
        "fleet": {
            "protocol": fleet.protocol,
            "ok": fleet.ok,
            "totals": {
                "endpoints": t.endpoints,
                "ok_endpoints": t.ok_endpoints,
                "devices": t.devices,
                "total": t.total,
                "free": t.free,
                "reserve": _reserve_total(fleet),
                "usable": t.usable,
            },
            "nodes": [
                {
                    "host": n.host,
                    "endpoint": n.endpoint,
                    "state": n.state,
                    "ok": n.ok,
                    "protocol": str(n.rpc.version) if n.rpc.version is not None else None,
                    "message": n.rpc.message,
                    "duplicate_of": n.duplicate_of,
                    "warnings": list(n.warnings),
                    "devices": [
                        {
                            "device": d.name,
                            "index": d.index,
                            "description": d.description,
                            "backend": d.backend,
                            "kind": d.kind,
                            "total": d.total,
                            "free": d.free,
                            "reserve": d.reserve,
                            "limit": d.limit,
                            "usable": d.usable,
                            "source_of_free": d.source_of_free,
                            "warnings": list(d.warnings),
                        }
                        for d in n.devices
                    ],
                }
                for n in fleet.nodes
            ],
        },
        "notes": list(report.notes),
        "models": [
            {
                "path": m.path,
                "name": m.profile.name,
                "architecture": m.profile.architecture,
                "n_layer": m.profile.n_layer,
                "n_ctx_train": m.profile.n_ctx_train,
                "weights": m.profile.total_bytes,
            }
            for m in report.models
        ],
        "contexts": list(report.contexts),
        "cases": [_case_json(report, c) for c in report.cases],
    }


def render_json(report: Report) -> str:
    return json.dumps(report_to_dict(report), indent=2) + "\n"


# --------------------------------------------------------------------------------------------------
# HTML (one self-contained file: inline CSS and SVG, no scripts, nothing fetched)

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
                f'fill="{SEGMENT_COLOURS[kind]}"><title>{_e(kind)}: {_e(_size(_segment_bytes(d, kind)))}'
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
        parts.append(f'<text x="{end}" y="{y + 15}">{_e(_size(m.total))} / {_e(_size(m.usable))}</text>')
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
        *(f'<p class="meta">{_e(line)}</p>' for line in _header_lines(report)),
        "<h2>Fleet</h2>",
    ]
    rows = [row for node in report.fleet.nodes for row in _node_rows(node)]
    b.append(_html_table(FLEET_HEADERS, [*rows, _totals_row(report.fleet)], numeric_from=6))
    for node in report.fleet.nodes:
        if not node.ok:
            b.append(f'<p class="meta nofit">{_e(node.host)}: {_e(node.state)}: {_e(node.rpc.message)}</p>')
    b += [f'<p class="meta">note: {_e(n)}</p>' for n in report.notes]
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
            f"{_e(_size(p.total_bytes))}, n_ctx_train {p.n_ctx_train}</p>"
        )
        for case in (c for c in report.cases if c.model == model.path):
            cls = "fits" if case.fits else "nofit"
            b.append(f'<section class="case"><h3>ctx {_e(_ctx_label(case.n_ctx))}</h3>')
            b.append(f'<p class="{cls}">{_e(_verdict(report, case))}</p>')
            if case.plan is not None and case.plan.devices:
                b.append(_svg_chart(report, case.plan))
                b.append(_html_table(DEVICE_HEADERS, _device_rows(report, case.plan), numeric_from=2))
            if case.recommendation is not None:
                b += [
                    f'<p class="rec">{_e(line)}</p>'
                    for line in _recommendation_lines(case.recommendation, _shortfall(case))
                ]
            b.append("</section>")
    b.append("</body></html>")
    return "\n".join(b) + "\n"


_RENDERERS: dict[str, Callable[[Report], str]] = {
    "text": render_text,
    "md": render_markdown,
    "json": render_json,
    "html": render_html,
}


def render(report: Report, fmt: str) -> str:
    try:
        return _RENDERERS[fmt](report)
    except KeyError:
        raise ValueError(f"unknown report format {fmt!r}; expected one of {', '.join(FORMATS)}") from None
