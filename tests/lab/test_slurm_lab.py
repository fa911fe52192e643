"""Slurm as an inventory source against a real Slurm 22.05 (Debian's slurm-wlm and munge) on the lab: a
slurmctld and a slurmd per node, each in its node's namespaces (tests/plugins/slurm.py). A job allocated with
`salloc --no-shell` becomes the inventory (`--slurm-job`, `-i slurm:JOBID`, an overlay file); `ping` reaches
its nodes over SSH; a batch job runs rpcfleet inside its allocation (`-i slurm:`, $SLURM_JOB_NODELIST); a
job that has ended, or never was, is an error with exit status 2."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.cli import main
from orchestrator.lab.state import Lab
from tests.plugins.lab import own_lab
from tests.plugins.slurm import SlurmCluster, slurm_cluster

pytestmark = pytest.mark.lab
ROOT = Path(__file__).parents[2]


def overlay_of(lab: Lab, path: Path) -> str:
    """A Slurm overlay with the lab's variables: its SSH settings for every node, each node's address."""
    written = yaml.safe_load(lab.inventory.read_text())
    document = {
        "slurm": None,
        "vars": written["vars"],
        "hosts": {node.name: {"address": node.address} for node in lab.nodes},
    }
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return str(path)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, " ".join(err.split())


def batch_inventory(slurm: SlurmCluster, directory: Path) -> list[dict[str, object]]:
    """`rpcfleet -i slurm: inventory list --json` run by sbatch inside a 2-node allocation."""
    out, err = directory / "batch.out", directory / "batch.err"
    command = f"{sys.executable} -m orchestrator -i slurm: inventory list --json"
    done = slurm.run(
        "sbatch",
        "--parsable",
        "-N",
        "2",
        f"--chdir={ROOT}",
        "-o",
        str(out),
        "-e",
        str(err),
        "--wrap",
        command,
    )
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip().split(";")[0]
    state = slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, timeout=60)
    if state != "COMPLETED":
        shown = slurm.run("scontrol", "show", "job", job).stdout + slurm.run("sinfo", "-N", "-l").stdout
        pytest.fail(f"batch job {job}: {state}\n{shown}\n{err.read_text() if err.exists() else ''}")
    hosts: list[dict[str, object]] = json.loads(out.read_text())
    return hosts


def test_a_slurm_jobs_nodes_are_the_inventory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_JOB_ID", "SLURM_JOBID"):
        monkeypatch.delenv(name, raising=False)
    with own_lab(2, "slurm") as lab, slurm_cluster(lab, tmp_path / "slurm") as slurm:
        monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
        names = [node.name for node in lab.nodes]
        job = slurm.allocate(2)
        path = overlay_of(lab, tmp_path / "slurm.yml")

        status, out, err = run(capsys, "inventory", "list", "--json", "-i", path, "--slurm-job", job)
        assert (status, err) == (0, "")
        listed = json.loads(out)
        assert [(h["name"], h["address"]) for h in listed] == [(n.name, n.address) for n in lab.nodes]

        status, out, err = run(capsys, "inventory", "list", "--json", "-i", f"slurm:{job}")  # no overlay
        assert status == 0 and [h["name"] for h in json.loads(out)] == names

        status, out, err = run(capsys, "ping", "--json", "-i", path, "--slurm-job", job)  # over SSH
        assert status == 0, err
        assert [(r["host"], r["status"]) for r in json.loads(out)] == [(name, "ok") for name in names]

        assert slurm.run("scancel", job).returncode == 0
        assert slurm.wait_state(job, {"CANCELLED"}) == "CANCELLED"
        hosts = batch_inventory(slurm, tmp_path)  # the nodes are free again: a batch job gets both
        assert [host["name"] for host in hosts] == names

        status, out, err = run(capsys, "inventory", "list", "-i", path, "--slurm-job", job)
        assert status == 2 and out == "" and "Traceback" not in err
        assert f"slurm job {job} holds no nodes (JobState=CANCELLED;" in err
        status, _, err = run(capsys, "inventory", "list", "-i", "slurm:999999")
        assert status == 2
        assert (
            "slurm job 999999: scontrol show job 999999 failed: slurm_load_jobs error: Invalid job id" in err
        )

        # a job array: each task an allocation of one node; the array's id is refused, a task's is read
        array = array_of_two(slurm)
        try:
            status, out, err = run(capsys, "inventory", "list", "-i", f"slurm:{array}")
            assert status == 2 and out == "" and "Traceback" not in err
            assert f"slurm job {array} is a job array ({array}_" in err and "RUNNING" in err, err
            assert "give one task's id, JOBID_TASK: -i slurm:" in err
            status, out, err = run(capsys, "inventory", "list", "--json", "-i", f"slurm:{array}_1")
            assert status == 0 and len(json.loads(out)) == 1, err
            # --slurm-job alone takes the overlay $RPCFLEET_INVENTORY names: the task's node, its address
            monkeypatch.setenv("RPCFLEET_INVENTORY", path)
            status, out, err = run(capsys, "inventory", "list", "--json", "--slurm-job", f"{array}_2")
            assert status == 0, err
            ((name, address),) = [(h["name"], h["address"]) for h in json.loads(out)]
            assert address == {node.name: node.address for node in lab.nodes}[name]
        finally:
            slurm.run("scancel", array)


def array_of_two(slurm: SlurmCluster) -> str:
    """`sbatch --array=1-2 -N 1`, its two tasks running (one node each): the array's id."""
    done = slurm.run(
        "sbatch", "--parsable", "--array=1-2", "-N", "1", "-o", "/dev/null", "--wrap", "sleep 300"
    )
    assert done.returncode == 0, done.stderr
    array = done.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        shown = slurm.run("scontrol", "show", "job", array).stdout
        if shown.count("JobState=RUNNING") == 2:
            return array
        time.sleep(0.3)
    slurm.run("scancel", array)
    raise AssertionError(f"array {array}: its two tasks are not running in 30 s\n{shown}")
