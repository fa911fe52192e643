"""The capacity report: pure building (fit verdicts, the smallest change re-planned), each renderer, the
golden JSON, the HTML chart measured in a headless-Chromium screenshot, and `rpcfleet report` end to end
against real loopback rpc-servers."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import zlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader

from orchestrator.cli import main
from orchestrator.cli.report import parse_contexts
from orchestrator.core.errors import PlanError, UsageError
from orchestrator.models.synth import write_tiny_llama
from orchestrator.planning.plan import Plan, PlanDevice, PlanOptions
from orchestrator.planning.profile import ModelProfile, profile_model
from orchestrator.planning.strategy import make_plan
from orchestrator.probe.fleet import FleetProbe
from orchestrator.report.build import (
    NEW_NODE_ENDPOINT,
    SCHEMA_VERSION,
    Report,
    ReportOptions,
    build_report,
    size_up,
    smallest_addition,
)
from orchestrator.report.data import render_json
from orchestrator.report.html import (
    BAR_WIDTH,
    MIN_SEGMENT,
    SEGMENT_COLOURS,
    bar_segments,
    render_html,
)
from orchestrator.report.render import render
from orchestrator.report.text import render_markdown, render_text
from orchestrator.rpc.records import Outcome
from orchestrator.serve.settings import DEFAULT_PARALLEL
from tests.plugins.browser import chromium
from tests.plugins.fleets import down_node, fleet_of, ok_node
from tests.plugins.servers import LocalServer, free_port, write_local_inventory

GiB = 1024**3
MiB = 1024**2
DATA = Path(__file__).parents[1] / "data" / "report"
DOCS = Path(__file__).parents[2] / "docs" / "report-schema.md"
CHROMIUM = Path("/usr/bin/chromium")


# --------------------------------------------------------------------------------------------------
# fleets made of the probe's own records (tests/plugins/fleets.py)


@pytest.fixture(scope="module")
def profile_70b(sparse_70b: Path) -> ModelProfile:
    return profile_model(sparse_70b)


@pytest.fixture(scope="module")
def tiny_profile(tiny_model: Path) -> ModelProfile:
    return profile_model(tiny_model)


def two_node_fleet() -> FleetProbe:
    return fleet_of(
        ok_node("epyc-a", "10.0.0.1:50052", [32 * GiB]),
        ok_node("epyc-b", "10.0.0.2:50052", [16 * GiB]),
        down_node("epyc-c", "10.0.0.3:50052"),
    )


@pytest.fixture(scope="module")
def report_70b(profile_70b: ModelProfile) -> Report:
    return build_report(
        two_node_fleet(),
        [("models/llama-70b-q4_K.gguf", profile_70b)],
        [4096, 32768],
        ReportOptions(generated_at="2025-01-01T00:00:00+00:00", inventory="inventory.yml"),
    )


def replan_fits(devices: Sequence[PlanDevice], profile: ModelProfile, n_ctx: int) -> bool:
    try:
        return make_plan(devices, profile, PlanOptions(n_ctx=n_ctx)).fit.fits
    except PlanError:
        return False


def grown(devices: Sequence[PlanDevice], label: str, extra: int) -> list[PlanDevice]:
    return [replace(d, usable=d.usable + extra) if d.label == label else d for d in devices]


def new_node(usable: int) -> PlanDevice:
    return PlanDevice(NEW_NODE_ENDPOINT, 0, f"{NEW_NODE_ENDPOINT}#0", usable=usable)


# --------------------------------------------------------------------------------------------------
# building


def test_fitting_and_not_fitting_cases(report_70b: Report, sparse_70b: Path) -> None:
    r = report_70b
    assert [d.label for d in r.devices] == ["10.0.0.1:50052#0", "10.0.0.2:50052#0"]  # epyc-c is down
    assert any("epyc-c" in n and "refused" in n for n in r.notes)
    fits, short = r.cases
    assert (fits.model, fits.n_ctx, short.n_ctx) == ("models/llama-70b-q4_K.gguf", 4096, 32768)
    # Numbers known without the planner: Llama-2-70B keeps 320 KiB of f16 KV per token (80 layers of
    # 8 KV heads x 128 x K and V x 2 bytes), and the weights on the devices are the file's tensors but
    # token_embd (llama.cpp keeps the input layer on the CPU), read here with gguf's own reader.
    reader = GGUFReader(sparse_70b)
    on_devices = sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight")
    layer_kv = {4096: 16 * MiB, 32768: 128 * MiB}  # n_ctx x 8 x 128 x 2 x 2 bytes
    splits = {4096: (56, 25), 32768: (54, 27)}  # whole layers, the larger node first (pinned)
    for case in r.cases:
        plan = case.plan
        assert plan is not None and case.binding is not None
        assert sum(d.memory.kv for d in plan.devices) == 80 * layer_kv[case.n_ctx] == 80 * case.n_ctx * 4096
        assert sum(d.memory.weights for d in plan.devices) == on_devices == 44_388_302_848
        layers = [i for d in plan.devices for i in d.layers]
        assert layers == list(range(81)) and plan.devices[-1].has_output  # in order, output last
        for d in plan.devices:
            repeating = d.n_layers - (1 if d.has_output else 0)
            assert d.memory.kv == repeating * layer_kv[case.n_ctx], d.label
        assert plan.tensor_split == splits[case.n_ctx]
        assert case.binding.memory.headroom == min(d.memory.headroom for d in plan.devices)
        for d in plan.devices:
            assert d.memory.total == d.memory.weights + d.memory.kv + d.memory.compute > 0
    assert fits.fits and fits.recommendation is None and fits.plan is not None
    assert fits.plan.fit.shortfall == 0 and fits.plan.fit.largest_n_ctx >= 4096
    assert not short.fits and short.plan is not None and short.recommendation is not None
    assert short.plan.fit.shortfall == -short.binding.memory.headroom > GiB  # type: ignore[union-attr]
    assert short.plan.fit.largest_n_ctx < 32768


def test_smallest_change_is_a_tight_boundary(report_70b: Report, profile_70b: ModelProfile) -> None:
    case = report_70b.cases[1]
    rec = case.recommendation
    assert rec is not None and rec.smallest is not None
    devices = list(report_70b.devices)
    assert [c.device for c in rec.devices] == [d.label for d in devices]
    assert [c.host for c in rec.devices] == ["epyc-a", "epyc-b"]
    for change in rec.devices:
        assert change.add is not None and change.add % MiB == 0
        # the recommended memory added to that device alone fits; 1 MiB less does not
        assert replan_fits(grown(devices, change.device, change.add), profile_70b, case.n_ctx)
        assert not replan_fits(grown(devices, change.device, change.add - MiB), profile_70b, case.n_ctx)
    assert rec.smallest.add == min(c.add for c in rec.devices if c.add is not None)
    # and adding a node with the recommended usable memory fits; 1 MiB less does not
    assert rec.new_node is not None
    assert replan_fits([*devices, new_node(rec.new_node)], profile_70b, case.n_ctx)
    assert not replan_fits([*devices, new_node(rec.new_node - MiB)], profile_70b, case.n_ctx)


def test_no_ok_device_leaves_only_a_new_node(tiny_profile: ModelProfile) -> None:
    fleet = fleet_of(down_node("a", "10.0.0.1:50052"), down_node("b", "10.0.0.2:50052", Outcome.BUSY))
    report = build_report(fleet, [("tiny.gguf", tiny_profile)], [4096])
    (case,) = report.cases
    assert case.plan is None and case.error is not None and "no devices" in case.error
    rec = case.recommendation
    assert rec is not None and rec.devices == () and rec.smallest is None and rec.new_node is not None
    assert replan_fits([new_node(rec.new_node)], tiny_profile, 4096)
    assert not replan_fits([new_node(rec.new_node - MiB)], tiny_profile, 4096)
    assert "cannot plan" in render_text(report) and "add a node with" in render_text(report)


def test_fleet_at_the_device_limit_has_no_new_node_option(tiny_profile: ModelProfile) -> None:
    nodes = [ok_node(f"n{i}", f"10.0.1.{i}:50052", [64 * MiB]) for i in range(15)]
    report = build_report(fleet_of(*nodes), [("tiny.gguf", tiny_profile)], [32768])
    rec = report.cases[0].recommendation
    assert rec is not None and rec.new_node is None and rec.new_node_note and "15" in rec.new_node_note


def test_recommend_off_and_bad_contexts(tiny_profile: ModelProfile) -> None:
    fleet = fleet_of(ok_node("a", "10.0.0.1:50052", [64 * MiB]))
    report = build_report(fleet, [("t.gguf", tiny_profile)], [65536], ReportOptions(recommend=False))
    assert not report.cases[0].fits and report.cases[0].recommendation is None
    with pytest.raises(PlanError):
        build_report(fleet, [("t.gguf", tiny_profile)], [])
    with pytest.raises(PlanError):
        build_report(fleet, [("t.gguf", tiny_profile)], [-1])


@pytest.mark.parametrize("threshold", [1, MiB - 1, MiB, MiB + 1, 37 * MiB + 5, 3 * GiB])
@pytest.mark.parametrize("start", [0, MiB, 64 * GiB])
def test_smallest_addition_finds_the_threshold(threshold: int, start: int) -> None:
    calls: list[int] = []

    def fits(x: int) -> bool:
        calls.append(x)
        return x >= threshold

    found = smallest_addition(fits, start=start, resolution=MiB)
    assert found == -(-threshold // MiB) * MiB
    assert len(calls) < 80
    assert smallest_addition(fits, start=start, resolution=MiB, limit=found) == found
    assert smallest_addition(fits, start=start, resolution=MiB, limit=found - 1) is None


def test_size_up_never_rounds_down() -> None:
    assert size_up(int(1.001 * GiB)) == "1.01 GiB"
    assert size_up(GiB) == "1.00 GiB" and size_up(512) == "512 B" and size_up(None) == "-"


# --------------------------------------------------------------------------------------------------
# renderers


def test_text(report_70b: Report) -> None:
    text = render_text(report_70b)
    _, short = report_70b.cases
    rec = short.recommendation
    assert rec is not None and rec.smallest is not None and rec.new_node is not None
    assert "epyc-c" in text and "refused" in text and "1/3" not in text and "2/3 endpoints ok" in text
    assert "ctx 4096: fits" in text and "ctx 32768: does not fit" in text
    assert f"short {size_up(short.plan.fit.shortfall)}" in text  # type: ignore[union-attr]
    assert (
        f"smallest change: add {size_up(rec.smallest.add)} usable memory to {rec.smallest.host} "
        f"({rec.smallest.device})" in text
    )
    assert f"or add a node with {size_up(rec.new_node)} usable memory" in text
    assert f"largest context that fits: {short.plan.fit.largest_n_ctx}" in text  # type: ignore[union-attr]
    assert text.count("10.0.0.1:50052#0") >= 2 and "32.00 GiB" in text


def _md_tables(text: str) -> list[list[list[str]]]:
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            assert line.endswith("|"), line
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line[1:-1])]
            current.append(cells)
        elif current:
            tables.append(current)
            current = []
    return tables


def test_markdown_table_structure(report_70b: Report) -> None:
    md = render_markdown(report_70b)
    tables = _md_tables(md)
    # the summary matrix and the curve's table first, then the fleet, then one table per case
    assert len(tables) == 3 + len(report_70b.cases)
    for table in tables:
        width = len(table[0])
        assert all(len(row) == width for row in table), table
        assert all(set(c) == {"-"} for c in table[1])
    matrix, curve, fleet = tables[:3]
    assert matrix[0] == ["model", "ctx 4096", "ctx 32768", "largest context"]
    assert matrix[2][1] == "fits · 2 nodes · N-1 breaks" and matrix[2][2].startswith("short ")
    assert curve[0][0] == "context" and curve[-1] == ["fleet usable", "48.00 GiB"]
    assert fleet[0][:5] == ["host", "endpoint", "state", "protocol", "device"]
    assert [row[0] for row in fleet[2:]] == ["epyc-a", "epyc-b", "epyc-c", "total"]
    assert fleet[4][2] == "refused" and fleet[2][-1] == "32.00 GiB"
    for table, case in zip(tables[3:], report_70b.cases, strict=True):
        assert table[0][:6] == ["device", "host", "layers", "weights", "KV", "compute"]
        # one row per device, then the host (CPU) row that `rpcfleet plan` shows too
        assert case.plan is not None and len(table) - 2 == len(case.plan.devices) + 1
        assert table[-1][:3] == ["host (CPU)", "-", ""]
        _assert_layer_column(table[2:-1], case.plan)
    assert md.startswith("# rpcfleet capacity report") and "### ctx 32768" in md
    assert "- smallest change: add" in md


def _assert_layer_column(rows: list[list[str]], plan: Plan) -> None:
    """The layers column adds up to the model's layers: `N + output` counts the output layer apart."""
    blocks, outputs = 0, 0
    for row in rows:
        n, _, rest = row[2].partition(" + ")
        blocks += int(n)
        outputs += rest == "output"
    assert outputs <= 1 and blocks <= plan.n_layer
    assert blocks + outputs == plan.n_gpu_layers == sum(d.n_layers for d in plan.devices)


def test_report_html_has_the_host_row_and_exact_layers(report_70b: Report) -> None:
    html = render_html(report_70b)
    plan = report_70b.cases[0].plan
    assert plan is not None
    assert html.count("<td>host (CPU)</td>") == sum(1 for c in report_70b.cases if c.plan and c.plan.devices)
    with_output = next(d for d in plan.devices if d.has_output)
    assert f">{with_output.n_layers - 1} + output</td>" in html and "+out<" not in html


def test_markdown_escapes_pipes(tiny_profile: ModelProfile) -> None:
    report = build_report(
        fleet_of(ok_node("a|b", "10.0.0.1:50052", [GiB])), [("x|y.gguf", tiny_profile)], [512]
    )
    for table in _md_tables(render_markdown(report)):
        assert all(len(row) == len(table[0]) for row in table)


def test_json_shape_and_values(report_70b: Report) -> None:
    doc = json.loads(render_json(report_70b))
    assert doc["schema_version"] == SCHEMA_VERSION == 2
    assert doc["fleet"]["totals"]["usable"] == 48 * GiB and doc["fleet"]["totals"]["ok_endpoints"] == 2
    assert [n["state"] for n in doc["fleet"]["nodes"]] == ["ok", "ok", "refused"]
    fits, short = doc["cases"]
    assert fits["fits"] is True and fits["recommendation"] is None and fits["shortfall"] == 0
    assert (fits["status"], short["status"]) == ("fits", "short")
    assert fits["nodes"] == ["10.0.0.1:50052", "10.0.0.2:50052"]
    assert short["fits"] is False and short["binding_host"] in ("epyc-a", "epyc-b")
    rec = report_70b.cases[1].recommendation
    assert rec is not None and rec.smallest is not None
    assert short["recommendation"]["smallest"] == {
        "device": rec.smallest.device,
        "host": rec.smallest.host,
        "add": rec.smallest.add,
    }
    assert short["recommendation"]["new_node"] == {"usable": rec.new_node}
    for dev in short["devices"]:
        assert dev["predicted"] == dev["weights"] + dev["kv"] + dev["compute"]
        assert dev["headroom"] == dev["usable"] - dev["margin"] - dev["predicted"]
    assert sum(d["layers"] for d in short["devices"]) == 81


def _golden_report(models_dir: Path, sparse_70b: Path) -> Report:
    fleet = fleet_of(
        ok_node("gpu-a", "10.0.0.1:50052", [24 * GiB, 24 * GiB], reserve=2 * GiB),
        ok_node("epyc-b", "10.0.0.2:50052", [48 * GiB]),
        down_node("epyc-c", "10.0.0.3:50052", Outcome.VERSION_MISMATCH),
    )
    tiny = write_tiny_llama(models_dir / "golden" / "tiny.gguf", n_layer=6, n_head=8, n_head_kv=2)
    return build_report(
        fleet,
        [
            ("models/tiny.gguf", profile_model(tiny)),
            ("models/llama-70b-q4_K.gguf", profile_model(sparse_70b)),
        ],
        [4096, 65536],
        ReportOptions(generated_at="2025-01-01T00:00:00+00:00", inventory="inventory.yml"),
    )


def _golden_devices() -> list[PlanDevice]:
    """The golden fleet's ok devices as the planner takes them, written out by hand (not by the report's
    or the probe's code): gpu-a's two 24 GiB devices (2 GiB reserve), then epyc-b's 48 GiB one."""
    rows = [("10.0.0.1:50052", 0, 24, 2), ("10.0.0.1:50052", 1, 24, 2), ("10.0.0.2:50052", 0, 48, 1)]
    return [
        PlanDevice(
            endpoint=ep,
            index=i,
            name=f"{ep}#{i}",
            description="AMD EPYC 9654",
            total=(usable + reserve + 2) * GiB,
            free=(usable + reserve) * GiB,
            usable=usable * GiB,
        )
        for ep, i, usable, reserve in rows
    ]


def _check_golden_against_its_inputs(doc: dict[str, Any], models_dir: Path, sparse_70b: Path) -> None:
    """What the golden document must say whatever was written to it: the fleet's sums from the fleet's
    figures, the models from their GGUF files, and every case from the planner itself."""
    fleet = doc["fleet"]
    devices = [d for node in fleet["nodes"] for d in node["devices"]]
    assert [(n["host"], n["state"], len(n["devices"])) for n in fleet["nodes"]] == [
        ("gpu-a", "ok", 2),
        ("epyc-b", "ok", 1),
        ("epyc-c", "version_mismatch", 0),
    ]
    assert fleet["ok"] is False and fleet["totals"] == {
        "endpoints": 3,
        "ok_endpoints": 2,
        "devices": 3,
        "total": (28 + 28 + 51) * GiB,  # usable + reserve + 2 GiB the host keeps
        "free": (26 + 26 + 49) * GiB,  # usable + reserve
        "reserve": 5 * GiB,
        "usable": 96 * GiB,
    }
    assert sum(d["usable"] for d in devices) == fleet["totals"]["usable"]
    assert doc["notes"] == ["epyc-c (10.0.0.3:50052) is version_mismatch: its devices are not in the plans"]
    paths = {
        "models/tiny.gguf": models_dir / "golden" / "tiny.gguf",
        "models/llama-70b-q4_K.gguf": sparse_70b,
    }
    for model in doc["models"]:
        reader = GGUFReader(paths[model["path"]])
        block = reader.fields["llama.block_count"]
        assert model["n_layer"] == int(block.parts[block.data[0]][0])
        assert model["weights"] == sum(int(t.n_bytes) for t in reader.tensors)
    assert doc["contexts"] == [4096, 65536]
    assert [(c["model"], c["n_ctx"]) for c in doc["cases"]] == [(m, n) for m in paths for n in (4096, 65536)]
    for case in doc["cases"]:
        plan = make_plan(
            _golden_devices(), profile_model(paths[case["model"]]), PlanOptions(n_ctx=case["n_ctx"])
        )
        got = case["devices"]
        assert case["fits"] == plan.fit.fits and case["n_gpu_layers"] == plan.n_gpu_layers
        assert [d["device"] for d in got] == [d.label for d in plan.devices]
        assert [d["layers"] for d in got] == [d.n_layers for d in plan.devices]
        assert case["tensor_split"] == [float(d["layers"]) for d in got]
        for dev, planned in zip(got, plan.devices, strict=True):
            memory = planned.memory
            assert (dev["weights"], dev["kv"], dev["compute"]) == (memory.weights, memory.kv, memory.compute)
            assert dev["predicted"] == dev["weights"] + dev["kv"] + dev["compute"]
            assert dev["headroom"] == dev["usable"] - dev["margin"] - dev["predicted"]
            assert dev["last_layer"] - dev["first_layer"] + 1 == dev["layers"]
        # the layers run in order over the devices, the output layer on the last
        assert [d["first_layer"] for d in got] == [0, *[d["last_layer"] + 1 for d in got[:-1]]]
        assert got[-1]["last_layer"] == plan.n_layer and [d["has_output"] for d in got][-1]
        # past the training context read from the GGUF itself, a fit is never a plain "fits"
        train = _gguf_ctx_train(paths[case["model"]])
        assert case["beyond_training"] == (case["n_ctx"] > train)
        want = "short" if not plan.fit.fits else ("beyond_training" if case["n_ctx"] > train else "fits")
        assert case["status"] == want
        assert case["nodes"] == list(dict.fromkeys(d["endpoint"] for d in got if d["layers"]))
        # N-1: each node's loss as a plan made on the other hand-written devices says
        n1 = case["n_minus_one"]
        assert (n1 is None) == (not plan.fit.fits)
        for loss in n1["losses"] if n1 else []:
            left = [d for d in _golden_devices() if d.endpoint != loss["endpoint"]]
            without = make_plan(left, profile_model(paths[case["model"]]), PlanOptions(n_ctx=case["n_ctx"]))
            assert loss["fits"] == without.fit.fits
            assert loss["headroom"] == min(d.memory.headroom for d in without.devices)
    summary = doc["summary"]
    assert summary["capacity"] == fleet["totals"]["usable"] == 96 * GiB
    assert [m["path"] for m in summary["models"]] == list(paths)
    for model in summary["models"]:
        profile = profile_model(paths[model["path"]])
        train = _gguf_ctx_train(paths[model["path"]])
        cases = [c for c in doc["cases"] if c["model"] == model["path"]]
        assert model["statuses"] == [c["status"] for c in cases]
        assert model["largest_n_ctx"] == max(c["largest_n_ctx"] for c in cases)
        top = max(65536, train)
        powers = [1 << k for k in range(10, 40) if 1 << k <= top]
        assert [p["n_ctx"] for p in model["curve"]] == sorted({*powers, 4096, 65536, train})
        for point in model["curve"]:
            plan = make_plan(_golden_devices(), profile, PlanOptions(n_ctx=point["n_ctx"]))
            assert point["predicted"] == sum(d.memory.total for d in plan.devices)
            assert point["fits"] == plan.fit.fits


def _gguf_ctx_train(path: Path) -> int:
    field = GGUFReader(path).fields["llama.context_length"]
    return int(field.parts[field.data[0]][0])


def test_golden_json(models_dir: Path, sparse_70b: Path) -> None:
    """The JSON is stable: byte for byte the checked-in document, which must also agree with its inputs
    as checked independently (RPCFLEET_UPDATE_GOLDEN=1 rewrites it, never in CI; the independent checks
    run on what it writes)."""
    text = render_json(_golden_report(models_dir, sparse_70b))
    golden = DATA / "golden.json"
    if os.environ.get("RPCFLEET_UPDATE_GOLDEN"):
        assert not os.environ.get("CI"), "RPCFLEET_UPDATE_GOLDEN rewrites the golden file: not in CI"
        golden.write_text(text)
    _check_golden_against_its_inputs(json.loads(golden.read_text()), models_dir, sparse_70b)
    assert text == golden.read_text()
    assert render_json(_golden_report(models_dir, sparse_70b)) == text  # deterministic
    doc = json.loads(text)
    # 70b at 65536 fits since the default split weighs the compute buffers: 18/18/45 layers, not 20/20/41
    # (which left gpu-a's devices 157.5 MiB short, with 3.66 GiB as the smallest change).
    assert [c["fits"] for c in doc["cases"]] == [True, True, True, True]


def _keys(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


def test_schema_document_lists_every_key() -> None:
    doc = json.loads((DATA / "golden.json").read_text())
    documented = set(re.findall(r"`([a-z_]+)`", DOCS.read_text()))
    assert _keys(doc) - documented == set()
    assert f"schema_version` | integer | {SCHEMA_VERSION}" in DOCS.read_text()


def test_render_dispatch(report_70b: Report) -> None:
    assert render(report_70b, "md") == render_markdown(report_70b)
    assert render(report_70b, "json") == render_json(report_70b)
    with pytest.raises(ValueError, match="unknown report format"):
        render(report_70b, "pdf")


# --------------------------------------------------------------------------------------------------
# HTML, looked at in a real browser


def read_png(path: Path) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A minimal PNG decoder (8-bit RGB/RGBA, not interlaced): chunks, zlib, the five row filters."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        chunk = data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat.append(chunk)
        elif kind == b"IEND":
            break
    assert header is not None
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    bpp = 3 if colour == 2 else 4
    raw = zlib.decompress(b"".join(idat))
    stride = width * bpp
    out = np.zeros((height, stride), np.uint8)
    prev = np.zeros(stride, np.int64)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int64)
        if kind == 0:
            cur = line
        elif kind == 1:  # Sub: a running sum per channel
            cur = (np.cumsum(line.reshape(width, bpp), axis=0) & 255).reshape(-1)
        elif kind == 2:  # Up
            cur = (line + prev) & 255
        else:  # Average, Paeth: each byte depends on the one to its left
            c, p, r = line.tolist(), prev.tolist(), [0] * stride
            for i in range(stride):
                a = r[i - bpp] if i >= bpp else 0
                if kind == 3:
                    r[i] = (c[i] + ((a + p[i]) >> 1)) & 255
                else:
                    b, ul = p[i], (p[i - bpp] if i >= bpp else 0)
                    pa, pb, pc = abs(b - ul), abs(a - ul), abs(a + b - 2 * ul)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else ul)
                    r[i] = (c[i] + pred) & 255
            cur = np.array(r, np.int64)
        out[y] = cur
        prev = cur
    return out.reshape(height, width, bpp)[:, :, :3]


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    return int(hex_colour[1:3], 16), int(hex_colour[3:5], 16), int(hex_colour[5:7], 16)


def measure_bars(img: np.ndarray[Any, np.dtype[np.uint8]]) -> list[dict[str, int]]:
    """Every bar in the screenshot, top to bottom: the pixel width of each segment colour along its middle
    row, walking right from the bar's first pixel until a pixel of no segment colour."""
    colours = {k: np.array(_rgb(v)) for k, v in SEGMENT_COLOURS.items()}

    def kind_of(px: np.ndarray[Any, Any]) -> str | None:
        for k, c in colours.items():
            if np.abs(px.astype(int) - c).max() <= 3:
                return k
        return None

    weights = np.all(np.abs(img.astype(int) - colours["weights"]) <= 3, axis=2)
    rows = np.flatnonzero(weights.sum(axis=1) >= 3)
    bands: list[tuple[int, int]] = []
    for y in rows:
        if bands and y == bands[-1][1] + 1:
            bands[-1] = (bands[-1][0], int(y))
        else:
            bands.append((int(y), int(y)))
    bars = []
    for top, bottom in bands:
        if bottom - top + 1 < 16:  # legend swatches are 10 px high, bars 22
            continue
        mid = (top + bottom) // 2
        x = int(np.flatnonzero(weights[mid])[0])
        widths: dict[str, int] = {}
        while x < img.shape[1] and (k := kind_of(img[mid, x])) is not None:
            widths[k] = widths.get(k, 0) + 1
            x += 1
        bars.append(widths)
    return bars


def screenshot(html_path: Path, png: Path, profile_dir: Path) -> None:
    cmd = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        f"--user-data-dir={profile_dir}",
        f"--screenshot={png}",
        "--window-size=1400,2800",  # the whole page: the summary first, then the bars
        html_path.as_uri(),
    ]
    done = subprocess.run(cmd, capture_output=True, timeout=120, check=False)
    assert png.exists(), done.stderr.decode(errors="replace")[-2000:]


def test_html_is_self_contained(report_70b: Report) -> None:
    page = render_html(report_70b)
    lowered = page.lower()
    for banned in ("<script", "http://", "https://", "url(", "@import", "<link", "@font-face", "src="):
        assert banned not in lowered, banned
    assert page.count("<svg") == len(report_70b.cases) + 1  # the bars of each case, the curves
    for colour in SEGMENT_COLOURS.values():
        assert colour in page


def test_every_format_prints_the_fleets_warnings(tiny_profile: ModelProfile) -> None:
    """The warnings under the fleet table (memory shared among the CPU servers of one machine, a node's
    own) are in the HTML and Markdown reports as in the text one."""
    shared = "MemAvailable (20.00 GiB) is shared among the 2 CPU servers of this machine: 10.00 GiB each"
    a = ok_node("a", "10.0.0.1:50052", [8 * GiB])
    a = replace(a, devices=(replace(a.devices[0], warnings=(shared,)),), warnings=("facts were slow",))
    report = build_report(fleet_of(a, down_node("c", "10.0.0.3:50052")), [("m.gguf", tiny_profile)], [4096])
    lines = [f"a #0: warning: {shared}", "a: warning: facts were slow", "c: refused: connection refused"]
    for fmt in ("text", "md", "html"):
        page = render(report, fmt)
        assert all(line in page for line in lines), fmt
    assert f'<p class="meta">a #0: warning: {shared}</p>' in render_html(report)


def test_html_chart_in_chromium(report_70b: Report, profile_70b: ModelProfile, tmp_path: Path) -> None:
    """The stacked bars, as Chromium draws them, have the widths the data gives (within 2 px)."""
    fleet = fleet_of(
        ok_node("a", "10.0.0.1:50052", [32 * GiB]),
        ok_node("b", "10.0.0.2:50052", [20 * GiB]),
        ok_node("c", "10.0.0.3:50052", [12 * GiB]),
    )
    report = build_report(fleet, [("m.gguf", profile_70b)], [8192, 49152])
    assert [c.fits for c in report.cases] == [True, False]
    page = tmp_path / "report.html"
    page.write_text(render_html(report))
    png = tmp_path / "shot.png"
    screenshot(page, png, tmp_path / "chromium-profile")
    bars = measure_bars(read_png(png))
    expected: list[dict[str, float]] = []
    for case in report.cases:
        assert case.plan is not None
        # no device has more free memory than predicted: nothing is cut, the scale is the largest usable
        assert all(d.memory.usable <= 2 * d.memory.total for d in case.plan.devices)
        scale = BAR_WIDTH / max(max(d.memory.usable, d.memory.total) for d in case.plan.devices)
        for d in case.plan.devices:
            m = d.memory
            parts = {
                "weights": m.weights,
                "kv": m.kv,
                "compute": m.compute,
                "free": max(0, m.usable - m.total),
            }
            expected.append({k: v * scale for k, v in parts.items()})
    assert len(bars) == len(expected) == 6, bars
    for got, want in zip(bars, expected, strict=True):
        for kind, px in want.items():
            assert abs(got.get(kind, 0) - px) <= 2, (kind, got, want)
        assert want["weights"] > 100 and want["kv"] > 5 and want["compute"] > 5  # all visible
    # the over-full case draws no free segment, the fitting one does
    assert all(b.get("free", 0) > 10 for b in bars[:3]) and all("free" not in b for b in bars[3:])


def test_beyond_training_is_never_a_plain_fit(tiny_profile: ModelProfile) -> None:
    """A context past the model's training context that fits is marked as such in every format."""
    train = tiny_profile.n_ctx_train
    assert train and train < 131072
    fleet = fleet_of(ok_node("big", "10.0.0.1:50052", [64 * GiB]))
    report = build_report(fleet, [("t.gguf", tiny_profile)], [train, 131072])
    inside, past = report.cases
    assert inside.fits and past.fits
    assert (inside.status, past.status) == ("fits", "beyond_training")
    text = render_text(report)
    assert f"ctx {train}: fits (" in text and "ctx 131072: fits (" not in text
    assert "ctx 131072: fits BEYOND TRAINING" in text
    assert "beyond training" in render_markdown(report)
    page = render_html(report)
    assert '<td class="st-beyond_training"' in page and '<p class="beyond">fits BEYOND' in page
    doc = json.loads(render_json(report))
    assert [c["status"] for c in doc["cases"]] == ["fits", "beyond_training"]
    assert doc["summary"]["models"][0]["statuses"] == ["fits", "beyond_training"]


# What the page must be, measured in Chromium's DOM: the document no wider than a 1400 px window, every
# element's box inside its parent's (nothing clipped or spilling), every bar segment that holds bytes a
# few pixels wide, every colour drawn (bars, ticks, curves, matrix cells) in a legend swatch, and the
# summary matrix naming every model and context.
_DOM_CHECKS = """(() => {
  const rgb = (c) => { const d = document.createElement('i'); d.style.color = c; document.body.appendChild(d);
    const v = getComputedStyle(d).color; d.remove(); return v; };
  const out = {scrollWidth: document.documentElement.scrollWidth, outside: [], segments: [], drawn: [],
    legend: [], matrixHead: [], matrixRows: []};
  for (const el of document.body.querySelectorAll('*')) {
    const r = el.getBoundingClientRect(); const p = el.parentElement.getBoundingClientRect();
    if (r.width === 0 && r.height === 0) continue;
    if (['title'].includes(el.tagName)) continue;
    if (r.left < p.left - 1 || r.right > p.right + 1 || r.top < p.top - 1 || r.bottom > p.bottom + 1)
      out.outside.push(`${el.tagName}.${el.getAttribute('class')} ${el.textContent.slice(0, 40)}`);
  }
  for (const el of document.querySelectorAll('svg.bars rect[class^=seg-]'))
    out.segments.push(el.getBoundingClientRect().width);
  // per chart, per bar (its segments share a y): the drawn width and the coloured (predicted) part's
  out.bars = [...document.querySelectorAll('svg.bars')].map(svg => {
    const rows = {};
    for (const el of svg.querySelectorAll('rect[class^=seg-]')) {
      const row = rows[el.getAttribute('y')] ??= {used: 0, drawn: 0};
      const w = el.getBoundingClientRect().width;
      row.drawn += w; if (!el.classList.contains('seg-free')) row.used += w;
    }
    return Object.values(rows);
  });
  for (const el of document.querySelectorAll('svg rect, svg path, svg circle, svg line')) {
    if (el.classList.contains('axis')) continue;  // axes are the text's colour, no data
    for (const a of ['fill', 'stroke']) {
      const v = el.getAttribute(a); if (v && v !== 'none') out.drawn.push(rgb(v));
    }
  }
  for (const el of document.querySelectorAll('table.matrix td[class^=st-]'))
    out.drawn.push(getComputedStyle(el).backgroundColor);
  for (const el of document.querySelectorAll('.legend i'))
    out.legend.push(getComputedStyle(el).backgroundColor);
  out.matrixHead = [...document.querySelectorAll('table.matrix thead th')].map(e => e.textContent);
  out.matrixRows = [...document.querySelectorAll('table.matrix tbody tr')].map(
    tr => [...tr.children].map(e => e.textContent));
  return out;
})()"""


def test_a_models_file_entry_is_planned_with_its_own_options(tiny_profile: ModelProfile) -> None:
    """`own_options` (report --models' entries): the entry's rows use its parallel at every context, its
    own context joins the report's, and a note names it; a model without them keeps the report's."""
    fleet = fleet_of(ok_node("a", "10.0.0.1:50052", [8 * GiB]))
    own = {"e.gguf": PlanOptions(n_ctx=2048, parallel=3)}
    models = [("m.gguf", tiny_profile), ("e.gguf", tiny_profile)]
    report = build_report(fleet, models, [4096], ReportOptions(), own_options=own)
    assert report.contexts == (4096, 2048)
    got = {(c.model, c.n_ctx): c.plan for c in report.cases}
    assert len(got) == 4 and all(p is not None for p in got.values())
    assert {k: (p.options.parallel, p.options.n_ctx) for k, p in got.items() if p is not None} == {
        ("m.gguf", 4096): (1, 4096),
        ("m.gguf", 2048): (1, 2048),
        ("e.gguf", 4096): (3, 4096),
        ("e.gguf", 2048): (3, 2048),
    }
    assert report.notes == (
        "e.gguf: planned with its models-file options (parallel 3); serve runs it at ctx 2048, the other "
        "contexts are for comparison",
    )
    assert "note: e.gguf: planned with its models-file options" in render_text(report)


def test_a_small_models_bars_are_scaled_to_its_prediction_not_to_usable_memory(
    tiny_profile: ModelProfile,
) -> None:
    """A 90 MB model on 24 GiB devices: free memory past `FREE_SHOWN` times the largest prediction is
    cut, so the coloured part of that device's bar is about half its drawn width (at least 40%), not
    three 3 px segments as at the usable scale."""
    fleet = fleet_of(ok_node("big", "10.0.0.1:50052", [24 * GiB, 24 * GiB]))
    (case,) = build_report(fleet, [("t.gguf", tiny_profile)], [4096]).cases
    assert case.plan is not None
    largest = max(d.memory.total for d in case.plan.devices)
    assert largest * 100 < case.plan.devices[0].memory.usable  # a sliver at the usable scale
    for d, segments in zip(case.plan.devices, bar_segments(case.plan), strict=True):
        drawn = sum(w for _, _, w in segments)
        used = sum(w for kind, _, w in segments if kind != "free")
        assert drawn == BAR_WIDTH  # the free part drawn up to the cut
        if d.memory.total == largest:
            assert used / drawn >= 0.4, segments  # FREE_SHOWN 1.0: half


def test_html_page_in_chromium_dom(
    profile_70b: ModelProfile, tiny_profile: ModelProfile, tmp_path: Path
) -> None:
    """A small model beside a large one, a node down, a context past training, long host names: the page
    read from Chromium's DOM in a 1400 px window."""
    fleet = fleet_of(
        ok_node(
            "gpu-a-with-a-rather-long-host-name.example.internal", "10.0.0.1:50052", [24 * GiB, 24 * GiB]
        ),
        ok_node("epyc-b", "10.0.0.2:50052", [10 * GiB]),
        down_node("epyc-c", "10.0.0.3:50052"),
    )
    models = [("models/tiny.gguf", tiny_profile), ("models/llama-70b-q4_K.gguf", profile_70b)]
    report = build_report(fleet, models, [4096, 32768, 131072])
    page = tmp_path / "report.html"
    page.write_text(render_html(report))
    with chromium(tmp_path / "profile", width=1400, height=1000) as browser:
        browser.open(page.as_uri())
        browser.wait_for("document.readyState === 'complete' && document.querySelector('table.matrix')", 30)
        got = browser.evaluate(_DOM_CHECKS)
    assert got["scrollWidth"] <= 1400, got["scrollWidth"]
    assert got["outside"] == []
    assert got["segments"] and min(got["segments"]) >= MIN_SEGMENT
    assert set(got["drawn"]) - set(got["legend"]) == set(), (got["drawn"], got["legend"])
    assert got["matrixHead"] == ["model", "ctx 4096", "ctx 32768", "ctx 131072", "largest context"]
    assert [row[0] for row in got["matrixRows"]] == [p.name for _, p in models]
    assert all(len(row) == 5 for row in got["matrixRows"])
    # the tiny model's compute and KV are a sliver of 24 GiB: drawn, all the same
    assert sum(1 for w in got["segments"] if w < 10) > 0
    # ...and visible: its free memory is cut (FREE_SHOWN), so the bar of its largest prediction is at
    # least 40% coloured; scaled to the 24 GiB usable it would be the 3 px segments' 9 px of 720
    tiny_charts = got["bars"][: len(report.contexts)]  # the cases in order: the tiny model's first
    for chart in tiny_charts:
        assert max(row["used"] / row["drawn"] for row in chart) >= 0.4, chart


def test_n_minus_one_matches_plans_made_without_each_node(profile_70b: ModelProfile) -> None:
    """Each loss is what a report made on the fleet without that node says, and the worst is the one
    that breaks the fit (epyc-a holds most of the 70B)."""
    nodes = [
        ok_node("epyc-a", "10.0.0.1:50052", [40 * GiB]),
        ok_node("epyc-b", "10.0.0.2:50052", [20 * GiB]),
        ok_node("epyc-c", "10.0.0.3:50052", [20 * GiB]),
    ]
    report = build_report(fleet_of(*nodes), [("m.gguf", profile_70b)], [4096])
    (case,) = report.cases
    assert case.fits and [loss.host for loss in case.losses] == ["epyc-a", "epyc-b", "epyc-c"]
    for loss, node in zip(case.losses, nodes, strict=True):
        without = build_report(
            fleet_of(*(n for n in nodes if n is not node)), [("m.gguf", profile_70b)], [4096], ReportOptions()
        ).cases[0]
        assert without.plan is not None and loss.fits == without.fits, loss
        assert without.binding is not None and loss.headroom == without.binding.memory.headroom
    assert [loss.fits for loss in case.losses] == [False, True, True]
    worst = case.worst_loss
    assert worst is not None and worst.host == "epyc-a" and worst.headroom < 0
    assert "N-1: does not survive losing epyc-a (worst: without epyc-a, short" in render_text(report)
    doc = json.loads(render_json(report))["cases"][0]["n_minus_one"]
    assert doc["survives"] is False and doc["worst"] == "10.0.0.1:50052"
    assert [x["fits"] for x in doc["losses"]] == [False, True, True]


def test_formations_n_minus_one_replans_with_spares_as_recovery_does(profile_70b: ModelProfile) -> None:
    """The 70B needs two 32 GiB nodes: one formation on n0+n1, n2 spare. Losing n0 or n1, its recovery
    re-plans on the node left, which does not hold it, then takes the spare: the plan is the one made on
    the fleet of those two nodes. Losing the spare changes nothing."""
    from orchestrator.inventory.model import Host
    from orchestrator.planning.devices import to_plan_devices
    from orchestrator.planning.formations import ServedModel
    from orchestrator.workflows.plan import plan_formations

    eps = ["10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052"]
    nodes = [ok_node(f"n{i}", ep, [32 * GiB]) for i, ep in enumerate(eps)]
    hosts = [Host(name=f"n{i}", address=ep.split(":")[0], rpc_port=50052) for i, ep in enumerate(eps)]
    fleet = fleet_of(*nodes)
    devices = to_plan_devices(fleet, failed="skip")
    served = [ServedModel("m.gguf", "m", profile_70b, PlanOptions(n_ctx=4096), replicas=1)]
    formations = plan_formations(served, hosts, devices, "1")
    assert [f.choice.endpoints for f in formations.formed] == [tuple(eps[:2])]
    assert [h.endpoint for h in formations.spares] == [eps[2]]
    report = build_report(fleet, [("m.gguf", profile_70b)], [4096], formations=formations)
    losses = {loss.endpoint: loss for loss in report.formation_losses}
    assert losses[eps[2]].formation is None and losses[eps[2]].fits
    for lost, kept in ((eps[0], eps[1]), (eps[1], eps[0])):
        loss = losses[lost]
        assert loss.formation == "m#0" and loss.fits and loss.borrowed == (eps[2],)
        pair = sorted([kept, eps[2]])
        alone = make_plan(
            to_plan_devices(fleet_of(nodes[eps.index(kept)]), failed="skip"),
            profile_70b,
            PlanOptions(n_ctx=4096),
        )
        assert not alone.fit.fits  # so the spare had to join
        assert list(loss.endpoints) == pair
    text = render_text(report)
    assert "N-1: every formation still serves after losing any one node" in text
    assert f"lose {eps[0]}: m#0 re-plans on {eps[1]}, {eps[2]} with spare {eps[2]}" in text
    doc = json.loads(render_json(report))["formations_n_minus_one"]
    assert doc["survives"] is True and [x["borrowed"] for x in doc["losses"]] == [[eps[2]], [eps[2]], []]


# --------------------------------------------------------------------------------------------------
# CLI


def test_parse_contexts() -> None:
    assert parse_contexts(None) == [4096]
    assert parse_contexts(["4096,32k", "8192", "4096"]) == [4096, 32768, 8192]
    with pytest.raises(UsageError):
        parse_contexts(["4k,big"])


def _inventory(tmp_path: Path, servers: Sequence[LocalServer], limits: Sequence[str], dead_port: int) -> Path:
    hosts: dict[str, dict[str, object]] = {
        f"node{i}": {"rpc_port": server.port, "memory_limit": limit}
        for i, (server, limit) in enumerate(zip(servers, limits, strict=True))
    }
    hosts["gone"] = {"rpc_port": dead_port}
    return write_local_inventory(tmp_path / "inventory.yml", hosts)


@pytest.mark.llama
def test_cli_end_to_end(
    start_rpc_server: Callable[..., LocalServer],
    tiny_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    servers = [start_rpc_server(), start_rpc_server()]
    inventory = _inventory(tmp_path, servers, ["160MiB", "120MiB"], free_port())
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    base = ["report", "-i", str(inventory), "--model", str(tiny_model), "--ctx", "4096,32k", "--margin", "0"]

    assert main([*base, "--format", "json", "-o", str(out_dir / "r.json")]) == 0
    assert sorted(p.name for p in out_dir.iterdir()) == ["r.json"]  # no temporary file left behind
    doc = json.loads((out_dir / "r.json").read_text())
    nodes = {n["host"]: n for n in doc["fleet"]["nodes"]}
    assert nodes["gone"]["state"] == "refused" and nodes["gone"]["devices"] == []
    assert [nodes[f"node{i}"]["state"] for i in range(2)] == ["ok", "ok"]
    assert [nodes[f"node{i}"]["protocol"] for i in range(2)] == ["7.0.0", "7.0.0"]
    assert [nodes[f"node{i}"]["devices"][0]["usable"] for i in range(2)] == [160 * MiB, 120 * MiB]
    assert doc["fleet"]["totals"]["usable"] == 280 * MiB and doc["contexts"] == [4096, 32768]
    small, large = doc["cases"]
    assert small["fits"] is True and {d["host"] for d in small["devices"]} == {"node0", "node1"}
    assert large["fits"] is False and large["recommendation"]["smallest"]["add"] > 0

    # The recommendation holds on the probed devices: add it, re-plan, it fits; 1 MiB less does not.
    profile = profile_model(tiny_model)
    devices = [
        PlanDevice(
            f"{s.host}:{s.port}", 0, f"{s.host}:{s.port}#0", usable=nodes[f"node{i}"]["devices"][0]["usable"]
        )
        for i, s in enumerate(servers)
    ]
    smallest = large["recommendation"]["smallest"]
    opts = PlanOptions(n_ctx=32768, margin=0, flash_attn=True)  # the CLI's default (-fa auto)
    assert make_plan(grown(devices, smallest["device"], smallest["add"]), profile, opts).fit.fits
    assert not make_plan(grown(devices, smallest["device"], smallest["add"] - MiB), profile, opts).fit.fits

    assert main([*base, "--format", "html", "-o", str(out_dir / "r.html")]) == 0
    assert "<svg" in (out_dir / "r.html").read_text()
    capsys.readouterr()
    assert main([*base, "--format", "md"]) == 0
    md = capsys.readouterr().out
    assert "| node0 |" in md and "| gone |" in md and "### ctx 32768" in md
    assert main([*base]) == 0
    text = capsys.readouterr().out
    assert "ctx 4096: fits" in text and "smallest change: add" in text
    for server in servers:
        assert server.alive()  # probing twice per run, four runs, no SIGPIPE deaths

    assert main([*base, "--format", "json", "--limit", "node1", "-o", str(out_dir / "one.json")]) == 0
    one = json.loads((out_dir / "one.json").read_text())
    assert [n["host"] for n in one["fleet"]["nodes"]] == ["node1"] and one["notes"] == []
    assert one["cases"][0]["devices"][0]["usable"] == 120 * MiB

    assert main(["report", "-i", str(inventory), "--ctx", "4k,x"]) == 2
    capsys.readouterr()
    # a missing model is bad input, said as plan, run and serve say it
    assert main(["report", "-i", str(inventory), "--model", str(tmp_path / "nope.gguf")]) == 2
    assert f"error: model {tmp_path / 'nope.gguf'} does not exist" in capsys.readouterr().err


def test_plan_report_and_run_show_the_same_host_row_that_adds_up(
    gemma_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue: `plan` showed the host's weights, KV and compute but a total with the 512 MiB output
    buffer hidden in it, and `run` another total. Now the three show the same columns, output included,
    and each total is the sum of the columns shown."""
    from orchestrator.cli.plan import print_plan
    from orchestrator.core.units import format_size
    from orchestrator.llama.observed_placement import build_placement

    profile = profile_model(gemma_model)
    report = build_report(two_node_fleet(), [("gemma.gguf", profile)], [4096], ReportOptions(recommend=False))
    plan = report.cases[0].plan
    assert plan is not None
    h = plan.host
    assert h.output == 262144 * 4  # one row of logits (output_reserve(n_seq_max)), not vocab x n_batch
    assert h.total == h.weights + h.kv + h.compute + h.output
    sizes = [format_size(x) for x in (h.weights, h.kv, h.compute, h.output, h.total)]
    # plan's table
    print_plan(plan)
    host_line = next(line for line in capsys.readouterr().out.splitlines() if "host (CPU)" in line)
    assert host_line.split("host (CPU)")[1].split() == " ".join(sizes).split()
    # the report's table (text, markdown and HTML share its rows)
    text_row = render_text(report).split("host (CPU)")[1].split("\n")[0]
    assert text_row.split() == ["-", *" ".join(sizes).split()]
    # run's placement table, before the load's actual rows
    placement = build_placement(plan, [f"RPC{i}" for i in range(len(plan.devices))], [])
    host_row = next(row for row in placement.rows() if row[0] == "host")
    assert host_row[4:] == tuple(f"{x / MiB:.2f}" for x in (h.weights, h.kv, h.compute, h.output, h.total))


def test_report_shows_the_architecture_as_model_info_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Family, sliding window, experts, recurrent state and KV per token: the report's text, Markdown, HTML
    and JSON carry what `model info` prints for the same model and cache types (issue 22, item 6)."""
    from orchestrator.models.synth_arch import write_arch_model

    archs = ("gemma3", "qwen3moe", "mamba2")
    paths = {arch: write_arch_model(tmp_path / f"{arch}.gguf", arch) for arch in archs}
    opts = ReportOptions(plan=PlanOptions(type_k="q8_0", type_v="q8_0"), recommend=False)
    report = build_report(
        two_node_fleet(), [(str(p), profile_model(p)) for p in paths.values()], [1024], opts
    )
    text, md, page = render_text(report), render_markdown(report), render_html(report)
    doc = json.loads(render_json(report))
    for (arch, path), model in zip(paths.items(), doc["models"], strict=True):
        assert main(["model", "info", str(path), "--type-k", "q8_0", "--type-v", "q8_0"]) == 0
        info_text = capsys.readouterr().out
        assert main(["model", "info", str(path), "--type-k", "q8_0", "--type-v", "q8_0", "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        rows = [line.strip() for line in info_text.splitlines() if ":" in line]
        wanted = {
            "gemma3": ("sliding window", "KV per token", "SWA cache"),
            "qwen3moe": ("experts", "KV per token"),
            "mamba2": ("recurrent state",),
        }[arch]
        for label in ("family", *wanted):
            line = next(r for r in rows if r.startswith(f"{label}:"))
            value = " ".join(line.partition(":")[2].split())
            assert f"  {label}: {value}\n" in text, (arch, label)
            assert f"- {label}: {value}\n" in md, (arch, label)
            assert f"<li>{label}: {value}</li>" in page.replace("&#x27;", "'"), (arch, label)
        assert "q8_0/q8_0" in text
        assert model["architecture_info"] == {k: info[k] for k in model["architecture_info"]}


@pytest.mark.llama
def test_cli_models_file_reports_the_formations_together(
    start_rpc_server: Callable[..., LocalServer],
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """`report --models` reads serve's models file (per-model context, parallel, replicas): the
    formations, their headroom per node and the set's N-1, over real rpc-servers."""
    servers = [start_rpc_server() for _ in range(3)]
    inventory = _inventory(tmp_path, servers, ["160MiB", "160MiB", "160MiB"], free_port())
    a, b = tiny_model_factory(), tiny_model_factory(n_layer=6)
    models = tmp_path / "models.yml"
    models.write_text(
        f"models:\n  - model: {a}\n    name: a\n    context: 2k\n    replicas: 1\n"
        f"  - model: {b}\n    name: b\n    context: 4k\n    parallel: 2\n    replicas: 1\n"
    )
    out = tmp_path / "r.json"
    argv = [
        "report",
        "-i",
        str(inventory),
        "--models",
        str(models),
        "--margin",
        "0",
        "--format",
        "json",
        "-o",
        str(out),
    ]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    formed = {f["model"]: f for f in doc["formations"]}
    assert sorted(formed) == ["a", "b"]  # the API names of the models file
    plans = {f["name"]: f["plan"] for f in doc["formations"]}
    assert [p["options"]["n_ctx"] for p in plans.values()] == [2048, 4096]
    # `a` gives no parallel: serve's default, as serve would form it (not the plan's 1)
    assert [p["options"]["parallel"] for p in plans.values()] == [DEFAULT_PARALLEL, 2]
    used = [ep for f in doc["formations"] for ep in f["endpoints"]]
    assert len(used) == len(set(used))  # formations never share a server
    assert len(doc["spares"]) == 4 - len(used)  # the silent host "gone" too: a spare if it answers
    assert all(set(f["headroom"]) == set(f["endpoints"]) for f in doc["formations"])
    # each node's headroom: the probe's usable bytes (the fleet section) less the plan's per-device
    # weights, KV and compute (--margin 0), the least of the node's devices
    usable = {(n["endpoint"], d["index"]): d["usable"] for n in doc["fleet"]["nodes"] for d in n["devices"]}
    for f in doc["formations"]:
        want: dict[str, int] = {}
        for d in f["plan"]["devices"]:
            m = d["memory"]
            left = usable[(d["endpoint"], d["index"])] - (m["weights"] + m["kv"] + m["compute"])
            want[d["endpoint"]] = min(want.get(d["endpoint"], left), left)
        assert f["headroom"] == want and all(0 < h < 160 * MiB for h in want.values()), (f["name"], want)
    assert {x["endpoint"] for x in doc["formations_n_minus_one"]["losses"]} == {
        f"{s.host}:{s.port}" for s in servers
    }
    # the matrix's rows: each entry at its own context too (a's 2k joins --ctx's default), with a note
    assert doc["contexts"] == [4096, 2048]
    notes = " ".join(doc["notes"])
    assert (
        f"{a}: planned with its models-file options (parallel {DEFAULT_PARALLEL}); serve runs it at ctx 2048"
        in notes
    )
    assert f"{b}: planned with its models-file options (parallel 2); serve runs it at ctx 4096" in notes
    assert main([*argv, "--parallel", "1"]) == 0  # a flag given is the entries' default, as serve's is
    plans = {f["name"]: f["plan"] for f in json.loads(out.read_text())["formations"]}
    assert [p["options"]["parallel"] for p in plans.values()] == [1, 2]
    bad = tmp_path / "bad.yml"
    bad.write_text(f"models:\n  - model: {a}\n    contxt: 2k\n")
    assert main(["report", "-i", str(inventory), "--models", str(bad)]) == 2
