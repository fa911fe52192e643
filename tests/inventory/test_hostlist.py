"""Slurm's hostlist syntax in Python, tested as data: every case of tests/data/slurm/hostnames.json is what
Slurm 22.05's `scontrol show hostnames` answered (recorded in the lab); where scontrol is installed, the
same inputs are asked of it again, live, and both readings must agree."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from orchestrator.inventory.hostlist import MAX_HOSTLIST_HOSTS, HostlistError, expand_hostlist

DATA = Path(__file__).parents[1] / "data" / "slurm" / "hostnames.json"
RECORDED: dict[str, Any] = json.loads(DATA.read_text())
CASES = RECORDED["cases"]


def python_reading(text: str) -> list[str] | None:
    """The names, or None where the list is refused (as scontrol refuses it: "Invalid hostlist")."""
    try:
        return expand_hostlist(text)
    except HostlistError:
        return None


@pytest.mark.parametrize("case", CASES, ids=[case["input"] for case in CASES])
def test_the_python_reading_is_slurms(case: dict[str, Any]) -> None:
    assert python_reading(case["input"]) == case["names"]


def test_the_recording_holds_both_kinds() -> None:
    """The data can fail the reader both ways: lists Slurm expands and lists it refuses."""
    assert RECORDED["recorded_with"].startswith("slurm-wlm 22.05")
    assert sum(case["names"] is None for case in CASES) >= 5
    assert sum(case["names"] is not None and len(case["names"]) > 3 for case in CASES) >= 5


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("node[1-3", "'[' is never closed"),
        ("node[1-[2]]", "a bracket inside a bracket"),
        ("node]1", "']' without '['"),
        ("n[5-2]", "range '5-2' in 'n[5-2]' ends before it starts"),
        ("n[1-2]-ib", "text '-ib' after the last bracket"),
        ("n[x]", "[x] in 'n[x]' is not numbers"),
        (f"n[0-{MAX_HOSTLIST_HOSTS}]", f"names {MAX_HOSTLIST_HOSTS + 1} hosts"),
        ("a[0-999]b[0-999]", "names 1000000 hosts"),
    ],
)
def test_a_bad_list_is_refused_naming_it(text: str, says: str) -> None:
    with pytest.raises(HostlistError, match="node list") as caught:
        expand_hostlist(text)
    assert says in str(caught.value)
    assert repr(text) in str(caught.value)


def test_order_padding_and_repeats() -> None:
    assert expand_hostlist("b[2,1],a[09-10] c") == ["b2", "b1", "a09", "a10", "c"]
    assert expand_hostlist("n[1-2,1]") == ["n1", "n2", "n1"]  # Slurm keeps repeats; the inventory drops them
    assert expand_hostlist("") == []


def scontrol_with_config(tmp_path: Path) -> dict[str, str] | None:
    """The environment for a `scontrol show hostnames` that needs no daemon (a minimal slurm.conf)."""
    if shutil.which("scontrol") is None:
        if os.environ.get("CI"):
            pytest.fail("scripts/setup.sh installs slurm-wlm: scontrol must be on PATH in CI")
        return None
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=rpcfleet\nSlurmctldHost=localhost\n")
    return {**os.environ, "SLURM_CONF": str(conf)}


def test_the_live_scontrol_agrees_with_the_python_reading(tmp_path: Path) -> None:
    env = scontrol_with_config(tmp_path)
    if env is None:
        pytest.skip("scontrol is not installed (Debian: slurm-wlm); the recorded answers were checked above")
    inputs = [case["input"] for case in CASES] + ["x[1-3]y[7-8],z", "n[0001-0003,0010]"]
    for text in inputs:
        command = ["scontrol", "show", "hostnames", text]
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        refused = "Invalid hostlist" in done.stdout + done.stderr
        assert done.returncode == 0, done.stderr
        assert python_reading(text) == (None if refused else done.stdout.split()), text
