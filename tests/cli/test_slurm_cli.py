"""`-i slurm:`, `--slurm-job` and Slurm overlay files through the real entry point: `inventory list`,
`show` and `graph` read the nodes without connecting to them; every bad input is a message, exit status 2.

Where scontrol is installed it expands the node lists (a minimal slurm.conf: `show hostnames` needs no
daemon); elsewhere rpcfleet's own reading does. Jobs of a live slurmctld: tests/lab/test_slurm_lab.py."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from orchestrator.cli import _output, main

DATA = Path(__file__).parents[1] / "data" / "slurm"

OVERLAY = """\
slurm:
  nodelist: gpu[01-02],cpu-1
vars:
  ssh_user: ops
hosts:
  "gpu[01-02]": {rpc_devices: [CUDA0], rpc_backend: cuda}
groups:
  gpu:
    hosts: "gpu*"
    vars: {rpc_port: 50300}
"""


@pytest.fixture(autouse=True)
def slurm_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(_output.console, "_width", 200)
    monkeypatch.setattr(_output.err_console, "_width", 300)
    for name in ("SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_JOB_ID", "SLURM_JOBID", "RPCFLEET_INVENTORY"):
        monkeypatch.delenv(name, raising=False)
    if shutil.which("scontrol"):
        conf = tmp_path / "slurm.conf"
        conf.write_text("ClusterName=rpcfleet\nSlurmctldHost=localhost\n")
        monkeypatch.setenv("SLURM_CONF", str(conf))
    monkeypatch.chdir(tmp_path)  # no ./inventory.yml


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, " ".join(err.split())


def overlay(tmp_path: Path, text: str = OVERLAY) -> str:
    path = tmp_path / "slurm.yml"
    path.write_text(text)
    return str(path)


def test_an_overlay_lists_shows_and_graphs_the_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = overlay(tmp_path)
    status, out, err = run(capsys, "inventory", "list", "--json", "-i", path)
    assert (status, err) == (0, "")
    hosts = json.loads(out)
    assert [(h["name"], h["endpoint"], h["rpc_backend"], h["ssh_user"]) for h in hosts] == [
        ("gpu01", "gpu01:50300", "cuda", "ops"),
        ("gpu02", "gpu02:50300", "cuda", "ops"),
        ("cpu-1", "cpu-1:50052", "cpu", "ops"),
    ]
    status, out, err = run(capsys, "inventory", "show", "--json", "-i", path, "gpu02")
    assert (status, err) == (0, "")
    shown = json.loads(out)
    assert shown["sources"]["rpc_port"] == "group gpu" and shown["sources"]["rpc_devices"] == "host"
    assert shown["location"] == f"the nodelist at {path}:2:13"
    status, out, err = run(capsys, "-i", path, "inventory", "graph")
    assert (status, err) == (0, "")
    assert out.split() == [
        "@all:",
        "|--@gpu:",
        "|",
        "|--gpu01",
        "|",
        "|--gpu02",
        "|--@ungrouped:",
        "|",
        "|--cpu-1",
    ]


def test_the_allocations_nodes_are_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[08-10]")
    status, out, err = run(capsys, "inventory", "list", "--json", "-i", "slurm:")
    assert (status, err) == (0, "")
    assert [host["name"] for host in json.loads(out)] == ["node08", "node09", "node10"]
    monkeypatch.setenv("RPCFLEET_INVENTORY", "slurm:")  # the default inventory may be Slurm too
    status, out, _ = run(capsys, "inventory", "list", "--json")
    assert status == 0 and len(json.loads(out)) == 3


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["-i", "slurm:"], {}, "error: slurm: not inside a Slurm allocation"),
        (["-i", "slurm:"], {"SLURM_JOB_NODELIST": "n[1-"}, "error: $SLURM_JOB_NODELIST: node list 'n[1-'"),
        (["-i", "slurm:"], {"SLURM_JOB_NODELIST": "n[4-2]"}, "range '4-2' in 'n[4-2]' ends before it starts"),
        (["-i", "slurm:n01"], {}, "error: -i slurm:n01: 'n01' is not a Slurm job id"),
        (["--slurm-job", "x"], {}, "error: --slurm-job: 'x' is not a Slurm job id"),
        (["-i", "slurm:1", "--slurm-job", "2"], {}, "error: -i slurm:1 and --slurm-job 2 name two jobs"),
    ],
)
def test_bad_slurm_input_is_a_message_and_status_2(
    argv: list[str],
    env: dict[str, str],
    says: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    status, out, err = run(capsys, "inventory", "list", *argv)
    assert status == 2 and out == ""
    assert says in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (("gpu[01-02],cpu-1", "gpu[01-02"), "the nodelist at {path}:2:13: node list 'gpu[01-02'"),
        (
            ("nodelist: gpu[01-02],cpu-1", "job: 12\n  nodelist: n1"),
            "{path}:3:13: slurm: give job or nodelist",
        ),
        (('"gpu[01-02]"', '"gpu[02-01]"'), "{path}:6:3: node list 'gpu[02-01]': range '02-01'"),
        (("rpc_port: 50300", "rpc_port: -1"), "{path}:10:22: rpc_port: port -1 is out of range"),
    ],
)
def test_a_bad_overlay_names_its_file_and_line(
    change: tuple[str, str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = overlay(tmp_path, OVERLAY.replace(*change))
    status, _, err = run(capsys, "inventory", "list", "-i", path)
    assert status == 2 and "Traceback" not in err
    assert says.format(path=path) in err


def test_slurm_job_needs_a_slurm_inventory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = tmp_path / "plain.yml"
    plain.write_text("hosts:\n  n1: {address: 192.0.2.1}\n")
    status, _, err = run(capsys, "inventory", "list", "-i", str(plain), "--slurm-job", "5")
    assert status == 2 and f"--slurm-job needs a Slurm inventory, and {plain} is not one" in err


def test_the_file_reader_points_an_overlay_to_the_slurm_reader() -> None:
    """From Python, `load_inventory` reads files only: an overlay is refused, naming the reader to use."""
    from orchestrator.core.errors import InventoryError
    from orchestrator.inventory.load import load_inventory_text

    with pytest.raises(InventoryError, match=r"1:1: a `slurm:` section makes this a Slurm inventory.*"):
        load_inventory_text(OVERLAY, Path("slurm.yml"))


def fake_scontrol(monkeypatch: pytest.MonkeyPatch, jobs: dict[str, str]) -> None:
    """scontrol answering `show job JOB` with `jobs[JOB]` (the records it would print) and `show hostnames`
    with rpcfleet's own expansion: a job without a slurmctld."""
    from orchestrator.cli import _sources
    from orchestrator.inventory.hostlist import expand_hostlist
    from orchestrator.inventory.slurm import CommandOutput

    def scontrol(arguments: Sequence[str]) -> CommandOutput:
        if list(arguments[:2]) == ["show", "job"]:
            return CommandOutput(jobs[arguments[2]], "", 0)
        return CommandOutput("".join(f"{name}\n" for name in expand_hostlist(arguments[2])), "", 0)

    monkeypatch.setattr(_sources, "scontrol_runner", lambda: scontrol)


def job_record(job: str, nodelist: str, extra: str = "") -> str:
    return (
        (DATA / "show-job-running.txt")
        .read_text()
        .replace("JobId=3 ", f"JobId={job} {extra}")
        .replace("NodeList=slurmtryn[1-2]", f"NodeList={nodelist}")
    )


def test_slurm_job_takes_the_overlay_rpcfleet_inventory_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_scontrol(monkeypatch, {"5": job_record("5", "gpu[01-02]")})
    monkeypatch.setenv("RPCFLEET_INVENTORY", overlay(tmp_path))
    status, out, err = run(capsys, "inventory", "list", "--json", "--slurm-job", "5")
    assert (status, err) == (0, "")
    hosts = [(h["name"], h["endpoint"], h["ssh_user"]) for h in json.loads(out)]
    assert hosts == [("gpu01", "gpu01:50300", "ops"), ("gpu02", "gpu02:50300", "ops")]  # the job's nodes
    plain = tmp_path / "plain.yml"  # a default inventory that is no overlay gives way to the flag
    plain.write_text("hosts:\n  n1: {address: 192.0.2.1}\n")
    monkeypatch.setenv("RPCFLEET_INVENTORY", str(plain))
    status, out, err = run(capsys, "inventory", "list", "--json", "--slurm-job", "5")
    assert (status, err) == (0, "")
    assert [(h["name"], h["ssh_user"]) for h in json.loads(out)] == [("gpu01", None), ("gpu02", None)]


def test_a_job_arrays_id_is_a_message_and_status_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    first = job_record("8", "n1", "ArrayJobId=8 ArrayTaskId=1 ")
    second = job_record("9", "n2", "ArrayJobId=8 ArrayTaskId=2 ")
    fake_scontrol(monkeypatch, {"8": first + "\n" + second, "8_2": second})
    status, out, err = run(capsys, "inventory", "list", "--slurm-job", "8")
    assert status == 2 and out == "" and "Traceback" not in err
    assert "slurm job 8 is a job array (8_1 RUNNING, 8_2 RUNNING)" in err
    assert "give one task's id, JOBID_TASK: -i slurm:8_1 or --slurm-job 8_1" in err
    status, out, err = run(capsys, "inventory", "list", "--json", "-i", "slurm:8_2")
    assert status == 0 and [h["name"] for h in json.loads(out)] == ["n2"]
