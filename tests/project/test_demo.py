"""`make demo`: the whole pipeline on a lab of this machine, as a user runs it, with Gemma 3 270M."""

from __future__ import annotations

import re

import pytest

from orchestrator.cli import main
from orchestrator.lab.lifecycle import list_labs
from tests.plugins.lab import require_lab_privileges, session_lab_name

pytestmark = [pytest.mark.lab, pytest.mark.llama]


def test_demo_runs_the_pipeline_and_leaves_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    require_lab_privileges()
    name = session_lab_name("demo")
    assert main(["demo", "--nodes", "3", "--lab-name", name]) == 0
    out = capsys.readouterr().out
    for step in ("ping:", "deploy:", "probe:", "plan:", "run:", "lab down"):
        assert step in out
    assert out.count("changed") >= 3  # every node got the server installed and started
    assert "fits" in out and "placement (MiB)" in out
    placement = out[out.index("placement (MiB)") :]
    plan_rows = re.findall(r"plan\s+([\d.]+)\s+([\d.]+)", placement)
    actual_rows = re.findall(r"actual\s+([\d.]+)\s+([\d.]+)", placement)
    assert len(plan_rows) == len(actual_rows) == 4  # three RPC devices and the host
    # Weights and KV predicted exactly (0.01 MiB log precision); compute buffers are an estimate, short
    # for Gemma 3's sliding-window graph (tests/planning/test_gemma.py measures it), so not compared here.
    assert plan_rows == actual_rows
    assert " Paris" in out[out.index("run:") : out.index("placement (MiB)")]  # the real model's words
    speed = re.search(r"(\d+) tokens generated, decoding at ([\d.]+) tokens/s", out)
    assert speed is not None and int(speed.group(1)) == 24 and float(speed.group(2)) > 0
    assert name not in list_labs()
