"""The report's what-if fleets (issue 46, part 4): `--add` nodes plan exactly as probed nodes of that backend
would, `--remove` as the fleet without that host, every format marks what is assumed, and bad values
exit 2 naming themselves."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cli import main
from orchestrator.core.errors import UsageError
from orchestrator.planning.devices import to_plan_devices
from orchestrator.planning.profile import ModelProfile, profile_model
from orchestrator.probe.capacity import DeviceCapacity
from orchestrator.probe.fleet import FleetProbe, NodeProbe
from orchestrator.report.build import Report, ReportOptions, build_report
from orchestrator.report.data import render_json, report_to_dict
from orchestrator.report.html import render_html
from orchestrator.report.text import render_markdown, render_text
from orchestrator.report.what_if import WhatIf, parse_addition, parse_what_if
from orchestrator.rpc.records import DeviceMemory, Outcome, ProbeResult, ProtocolVersion
from tests.plugins.fleets import down_node, fleet_of, ok_node
from tests.plugins.servers import free_port, write_local_inventory

GiB = 1024**3
SCHEMA_DOC = Path(__file__).parents[2] / "docs" / "report-schema.md"
OPTIONS = ReportOptions(recommend=False)


@pytest.fixture(scope="module")
def profile_70b(sparse_70b: Path) -> ModelProfile:
    return profile_model(sparse_70b)


def base_fleet() -> FleetProbe:
    return fleet_of(
        ok_node("epyc-a", "10.0.0.1:50052", [32 * GiB]),
        ok_node("epyc-b", "10.0.0.2:50052", [16 * GiB]),
        down_node("epyc-c", "10.0.0.3:50052"),
    )


def cuda_node(host: str, sizes: list[int]) -> NodeProbe:
    """A CUDA rpc-server as the probe records one (by hand, not through the what-if code)."""
    endpoint = f"{host}:50052"
    devices = tuple(
        DeviceCapacity(
            host=host,
            endpoint=endpoint,
            index=i,
            name=f"{endpoint}#{i}",
            description="NVIDIA GeForce RTX 4090",
            backend="cuda",
            kind="gpu",
            total=s,
            free=s,
            reserve=0,
            limit=None,
            usable=s,
            source_of_free="rpc",
        )
        for i, s in enumerate(sizes)
    )
    memory = tuple(DeviceMemory(d.index, d.free, d.total) for d in devices)
    rpc = ProbeResult(endpoint, Outcome.OK, ProtocolVersion(7, 0, 0), memory, "ok", 0.004)
    return NodeProbe(host, endpoint, rpc, None, devices, "ok")


def without_descriptions(value: Any) -> Any:
    """The JSON less device descriptions (an assumed device says "assumed 24 GiB cuda", a real one its
    GPU's name): everything the planner decided is compared."""
    if isinstance(value, dict):
        return {k: without_descriptions(v) for k, v in value.items() if k != "description"}
    if isinstance(value, list):
        return [without_descriptions(v) for v in value]
    return value


def planned(report: Report) -> dict[str, Any]:
    doc = without_descriptions(report_to_dict(report))
    return {k: doc[k] for k in ("cases", "summary")}


def test_an_added_cuda_node_plans_as_a_real_one(profile_70b: ModelProfile) -> None:
    models = [("llama-70b.gguf", profile_70b)]
    contexts = [4096, 32768]
    real = fleet_of(*base_fleet().nodes, cuda_node("gpu-a", [24 * GiB, 24 * GiB]))
    expected = build_report(real, models, contexts, OPTIONS)
    what_if = parse_what_if(["gpu-a=2x24GiB:cuda"], [])
    got = build_report(base_fleet(), models, contexts, OPTIONS, what_if=what_if)
    assert planned(got) == planned(expected)
    without = build_report(base_fleet(), models, contexts, OPTIONS)
    assert planned(got) != planned(without)  # the node changes the answer (32k is short without it)
    assert [c.fits for c in without.cases] == [True, False]
    assert [c.fits for c in got.cases] == [True, True]
    # CUDA's rules apply to it: 128-byte alignment, and the plan's note that cuda is unverified
    cuda = [d for d in to_plan_devices(got.fleet, failed="skip") if d.backend == "cuda"]
    assert [d.alignment for d in cuda] == [128, 128]
    assert any(n.startswith("unverified on cuda") for c in got.cases if c.plan for n in c.plan.notes)
    # N-1 loses both of its GPUs at once (one server)
    loss_endpoints = [x.endpoint for x in got.cases[0].losses]
    assert loss_endpoints == ["10.0.0.1:50052", "10.0.0.2:50052", "gpu-a:50052"]


def test_removing_a_host_is_the_fleet_without_it(profile_70b: ModelProfile) -> None:
    models = [("llama-70b.gguf", profile_70b)]
    a, _, c = base_fleet().nodes
    expected = report_to_dict(build_report(fleet_of(a, c), models, [4096], OPTIONS))
    for name in ("epyc-b", "10.0.0.2:50052"):  # by host name or endpoint
        got = report_to_dict(
            build_report(base_fleet(), models, [4096], OPTIONS, what_if=WhatIf(removed=(name,)))
        )
        assert got.pop("what_if") == {"added": [], "removed": [name]}
        assert got == expected
    assert expected["fleet"]["totals"]["usable"] == 32 * GiB


def test_every_format_marks_what_is_assumed(profile_70b: ModelProfile) -> None:
    models = [("llama-70b.gguf", profile_70b)]
    what_if = parse_what_if(["gpu-a=2x24GiB:cuda", "4GiB"], ["epyc-b"])
    report = build_report(base_fleet(), models, [4096], OPTIONS, what_if=what_if)
    text, md, page = render_text(report), render_markdown(report), render_html(report)
    doc = json.loads(render_json(report))
    said = "what-if: gpu-a (gpu-a:50052) is assumed, not probed: 2 x 24.00 GiB cuda"
    for out in (text, md, page):
        assert said in out
        assert "what-if: epyc-b is left out of the fleet (--remove)" in out
        assert "what-if-2 (what-if-2:50052) is assumed" in out  # an unnamed one gets a name
        assert "assumed 24.00 GiB cuda; unverified on cuda" in out  # its fleet rows
        assert "assumed 4.00 GiB cpu;" not in out  # llama was measured on cpu
    rows = [line.split() for line in text.splitlines() if line.strip().startswith("gpu-a ")]
    assert len(rows) == 2 and all(r[2] == "assumed" for r in rows)  # the state column
    assert "epyc-b" not in text.split("Fleet\n")[1].split("\n\n")[0]
    assert "<td>assumed</td>" in page
    assert doc["schema_version"] == 2  # an optional key: schema 2 carries it
    assert doc["what_if"] == {
        "added": [
            {
                "host": "gpu-a",
                "endpoint": "gpu-a:50052",
                "backend": "cuda",
                "devices": 2,
                "size": 24 * GiB,
                "unverified": True,
            },
            {
                "host": "what-if-2",
                "endpoint": "what-if-2:50052",
                "backend": "cpu",
                "devices": 1,
                "size": 4 * GiB,
                "unverified": False,
            },
        ],
        "removed": ["epyc-b"],
    }
    documented = set(re.findall(r"`([a-z_]+)`", SCHEMA_DOC.read_text()))
    keys = {"what_if", *doc["what_if"], *doc["what_if"]["added"][0]}
    assert keys <= documented, keys - documented
    plain = json.loads(render_json(build_report(base_fleet(), models, [4096], OPTIONS)))
    assert "what_if" not in plain  # a plain report is unchanged


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("2x24XB:cuda", "24XB"),
        ("0x24GiB", "device count"),
        ("24GiB:tpu", "unknown backend tpu"),
        ("", "not a node"),
        ("a=b=1GiB", "a=b=1GiB"),
    ],
)
def test_bad_additions_name_the_value(value: str, why: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_addition(value)
    assert caught.value.message.startswith(f"--add {value}:")
    assert why in caught.value.message


def test_an_addition_parses() -> None:
    node = parse_addition("2x24GiB:CUDA", 3)
    assert (node.name, node.count, node.size, node.backend) == ("what-if-3", 2, 24 * GiB, "cuda")
    with pytest.raises(UsageError, match="two nodes are named n"):
        parse_what_if(["n=1GiB", "n=2GiB"], [])


def test_cli_what_if(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """End to end with no server: the only host is down (a free loopback port), the report is made on the
    assumed nodes; formations (--replicas) form on them too. Bad values: exit 2, the value named."""
    inventory = write_local_inventory(
        tmp_path / "inventory.yml", {"gone": {"rpc_port": free_port()}, "other": {"rpc_port": free_port()}}
    )
    base = ["report", "-i", str(inventory), "-m", str(tiny_model), "--margin", "0", "--timeout", "2"]
    out = tmp_path / "r.json"
    argv = [*base, "--add", "gpu=2x1GiB:cuda", "--remove", "other", "--replicas", "1", "--format", "json"]
    assert main([*argv, "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [n["host"] for n in doc["fleet"]["nodes"]] == ["gone", "gpu"]
    assert doc["cases"][0]["fits"] and doc["cases"][0]["nodes"] == ["gpu:50052"]
    assert [f["endpoints"] for f in doc["formations"]] == [["gpu:50052"]]
    capsys.readouterr()
    for flag, value in (("--add", "24GiB:tpu"), ("--add", "gone=1GiB"), ("--remove", "nowhere")):
        assert main([*base, flag, value]) == 2
        err = capsys.readouterr().err
        assert value in err and "Traceback" not in err
