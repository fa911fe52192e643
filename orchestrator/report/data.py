"""The capacity report as JSON (schema in docs/report-schema.md)."""

from __future__ import annotations

import json
from typing import Any

from orchestrator.planning.memory import architecture_info
from orchestrator.planning.plan import (
    PlannedDevice,
)
from orchestrator.report.build import Case, DeviceChange, Report
from orchestrator.report.formations import formations_json
from orchestrator.report.text import reserve_total
from orchestrator.report.what_if import unverified_on


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


def _losses_json(case: Case) -> dict[str, Any] | None:
    if not case.losses:
        return None
    worst = case.worst_loss
    return {
        "survives": all(loss.fits for loss in case.losses),
        "worst": worst.endpoint if worst is not None else None,
        "losses": [
            {
                "endpoint": loss.endpoint,
                "host": loss.host,
                "fits": loss.fits,
                "headroom": loss.headroom,
                "error": loss.error,
            }
            for loss in case.losses
        ],
    }


def _case_json(report: Report, case: Case) -> dict[str, Any]:
    plan = case.plan
    binding = case.binding
    out: dict[str, Any] = {
        "model": case.model,
        "n_ctx": case.n_ctx,
        "n_ctx_padded": plan.n_ctx if plan is not None else None,
        "fits": plan.fit.fits if plan is not None else False,
        "status": case.status,
        "beyond_training": case.beyond_training,
        "nodes": list(case.nodes),
        "error": case.error,
        "binding_device": binding.label if binding is not None else None,
        "binding_host": report.host_of(binding.endpoint) if binding is not None else None,
        "shortfall": plan.fit.shortfall if plan is not None else None,
        "largest_n_ctx": plan.fit.largest_n_ctx if plan is not None else None,
        "ctx_cap": plan.fit.ctx_cap if plan is not None else None,  # 0: the search was not capped
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
        "n_minus_one": _losses_json(case),
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


def _summary_json(report: Report) -> dict[str, Any]:
    curves = {c.model: c for c in report.curves}
    models = []
    for m in report.models:
        largest, capped = report.largest_ctx(m.path)
        curve = curves.get(m.path)
        models.append(
            {
                "path": m.path,
                "statuses": [c.status for c in report.cases if c.model == m.path],  # one per context
                "largest_n_ctx": largest,
                "largest_capped": capped,
                "curve": [
                    {"n_ctx": p.n_ctx, "predicted": p.predicted, "fits": p.fits}
                    for p in (curve.points if curve is not None else ())
                ],
            }
        )
    return {"capacity": report.capacity, "models": models}


def _what_if_json(report: Report) -> dict[str, Any]:
    """The fleet's changes for this report only (`--add`, `--remove`): present only when there are some."""
    w = report.what_if
    if not w:
        return {}
    architectures = [m.profile.architecture for m in report.models]
    added = [
        {
            "host": a.name,
            "endpoint": a.endpoint,
            "backend": a.backend,
            "devices": a.count,
            "size": a.size,
            "unverified": unverified_on(a.backend, architectures),
        }
        for a in w.added
    ]
    return {"what_if": {"added": added, "removed": list(w.removed)}}


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
            "swa_full": o.swa_full,
            "parallel": o.parallel,
            "kv_unified": o.kv_unified,
            "n_cpu_moe": o.n_cpu_moe,
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
                "reserve": reserve_total(fleet),
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
        **_what_if_json(report),
        "models": [
            {
                "path": m.path,
                "name": m.profile.name,
                "architecture": m.profile.architecture,
                "n_layer": m.profile.n_layer,
                "n_ctx_train": m.profile.n_ctx_train,
                "weights": m.profile.total_bytes,
                # what `model info --json` gives, at the report's KV cache types
                "architecture_info": architecture_info(m.profile, o.type_k, o.type_v),
            }
            for m in report.models
        ],
        "contexts": list(report.contexts),
        "summary": _summary_json(report),
        "cases": [_case_json(report, c) for c in report.cases],
        **(
            formations_json(report.formations, report.formation_losses)
            if report.formations is not None
            else {}
        ),
    }


def render_json(report: Report) -> str:
    return json.dumps(report_to_dict(report), indent=2) + "\n"
