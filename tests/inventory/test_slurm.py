"""Slurm as an inventory source, as data: `scontrol show job` records recorded from Slurm 22.05 in the lab
(tests/data/slurm/show-job-*.txt: a running job, a pending one, a cancelled one, an unknown id), overlays
given as text, node lists from the environment. The live cluster is the Slurm lab test (tests/lab/)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from orchestrator.core.errors import InventoryError
from orchestrator.inventory.model import Inventory
from orchestrator.inventory.slurm import (
    CommandOutput,
    Scontrol,
    SlurmNodes,
    SlurmSettings,
    build_inventory,
    expand_nodelist,
    find_nodes,
    is_slurm_document,
    job_nodelist,
    job_of_spec,
    parse_job,
    read_settings,
)

DATA = Path(__file__).parents[1] / "data" / "slurm"
HOSTNAMES = {case["input"]: case for case in json.loads((DATA / "hostnames.json").read_text())["cases"]}


def recorded(name: str) -> str:
    return (DATA / name).read_text()


def replay(answers: dict[tuple[str, ...], CommandOutput]) -> Scontrol:
    """scontrol as recorded: each question answered with what Slurm answered it in the lab."""

    def scontrol(arguments: Sequence[str]) -> CommandOutput:
        return answers[tuple(arguments)]

    return scontrol


def test_a_running_jobs_nodelist_is_read_not_its_requested_one() -> None:
    text = recorded("show-job-running.txt")
    assert "ReqNodeList=(null)" in text  # the record has a field ending in NodeList= before the real one
    assert parse_job(text, "3") == "slurmtryn[1-2]"


@pytest.mark.parametrize(
    ("name", "state"), [("show-job-pending.txt", "PENDING"), ("show-job-cancelled.txt", "CANCELLED")]
)
def test_a_job_that_holds_no_nodes_is_an_error_naming_its_state(name: str, state: str) -> None:
    with pytest.raises(InventoryError, match=rf"slurm job 7 holds no nodes \(JobState={state};"):
        parse_job(recorded(name), "7")


def test_the_records_of_a_heterogeneous_job_are_joined() -> None:
    first = recorded("show-job-running.txt")
    second = first.replace("JobId=3 ", "JobId=4 ").replace("NodeList=slurmtryn[1-2]", "NodeList=gpu[01-02]")
    assert parse_job(first + "\n" + second, "3") == "slurmtryn[1-2],gpu[01-02]"
    pending = recorded("show-job-pending.txt")
    assert parse_job(first + "\n" + pending, "3") == "slurmtryn[1-2]"  # a pending component holds nothing


def test_a_job_arrays_id_is_refused_naming_a_task_to_give() -> None:
    """`scontrol show job ARRAY` prints every task of the array, each an allocation of its own: joining
    them would make one fleet of unrelated allocations. (Records made from the running one, as Slurm
    writes an array task's; the Slurm lab test asks a live slurmctld.)"""
    running = recorded("show-job-running.txt")
    task1 = running.replace("JobId=3 ", "JobId=3 ArrayJobId=3 ArrayTaskId=1 ")
    task2 = running.replace("JobId=3 ", "JobId=4 ArrayJobId=3 ArrayTaskId=2 ").replace(
        "NodeList=slurmtryn[1-2]", "NodeList=slurmtryn3"
    )
    rest = recorded("show-job-pending.txt").replace("JobId=4 ", "JobId=5 ArrayJobId=3 ArrayTaskId=3-9 ")
    with pytest.raises(
        InventoryError, match=r"slurm job 3 is a job array \(3_1 RUNNING, 3_2 RUNNING, 3_\[3-9\] PENDING\)"
    ) as err:
        parse_job("\n".join([task1, task2, rest]), "3")
    assert err.value.hint == "give one task's id, JOBID_TASK: -i slurm:3_1 or --slurm-job 3_1"
    assert parse_job(task2, "3_2") == "slurmtryn3"  # one task, by its JOBID_TASK
    assert parse_job(task2, "4") == "slurmtryn3"  # or by its own JobId
    assert parse_job(task1, "3") == "slurmtryn[1-2]"  # an array of one task is that task
    with pytest.raises(InventoryError, match="slurm job 3 is a job array"):
        parse_job(rest, "3")  # pending tasks only: still the array, not one allocation


def test_an_unknown_job_is_scontrols_error() -> None:
    answer = CommandOutput("", recorded("show-job-invalid.stderr"), 1)
    scontrol = replay({("show", "job", "999"): answer})
    with pytest.raises(
        InventoryError, match="slurm job 999: scontrol show job 999 failed: slurm_load_jobs error"
    ):
        job_nodelist("999", scontrol)
    with pytest.raises(InventoryError, match="needs Slurm's scontrol, which is not on PATH"):
        job_nodelist("999", None)


def test_a_recorded_job_becomes_its_nodes() -> None:
    scontrol = replay(
        {
            ("show", "job", "3"): CommandOutput(recorded("show-job-running.txt"), "", 0),
            ("show", "hostnames", "slurmtryn[1-2]"): CommandOutput("slurmtryn1\nslurmtryn2\n", "", 0),
        }
    )
    nodes = find_nodes(job="3", settings=SlurmSettings(nodelist="x1"), environ={}, scontrol=scontrol)
    assert nodes == SlurmNodes(("slurmtryn1", "slurmtryn2"), "slurm job 3")


def test_scontrols_refusal_is_explained_by_the_python_reading() -> None:
    case = HOSTNAMES["n[3-1]"]
    scontrol = replay(
        {("show", "hostnames", "n[3-1]"): CommandOutput(case["scontrol_stdout"], case["scontrol_stderr"], 0)}
    )
    with pytest.raises(InventoryError) as caught:
        expand_nodelist("n[3-1]", "$SLURM_JOB_NODELIST", scontrol)
    assert str(caught.value) == (
        "$SLURM_JOB_NODELIST: node list 'n[3-1]' cannot be expanded: "
        "node list 'n[3-1]': range '3-1' in 'n[3-1]' ends before it starts"
    )


def test_scontrols_garbage_is_refused() -> None:
    """22.05 answers `n]` for the unclosed `n[1-3`, with exit status 0 (seen in the lab)."""
    scontrol = replay({("show", "hostnames", "n[1-3"): CommandOutput("n]\n", "", 0)})
    with pytest.raises(InventoryError, match=r"gave 'n\]', not a host name"):
        expand_nodelist("n[1-3", "the nodelist", scontrol)


def test_an_unconfigured_scontrol_leaves_the_expansion_to_python() -> None:
    fatal = (
        "scontrol: error: fetch_config: DNS SRV lookup failed\n"
        "scontrol: fatal: Could not establish a configuration source\n"
    )
    scontrol = replay({("show", "hostnames", "g[1-2]"): CommandOutput("", fatal, 1)})
    names, warning = expand_nodelist("g[1-2]", "the nodelist", scontrol)
    assert names == ["g1", "g2"]
    assert warning == (
        "scontrol cannot expand node lists here (scontrol: fatal: Could not establish a configuration"
        " source); rpcfleet expanded 'g[1-2]' itself"
    )


def test_the_allocation_is_read_from_the_environment() -> None:
    environ = {"SLURM_JOB_NODELIST": "n[01-02]", "SLURM_JOB_ID": "41"}
    assert find_nodes(job=None, settings=SlurmSettings(), environ=environ, scontrol=None) == SlurmNodes(
        ("n01", "n02"), "$SLURM_JOB_NODELIST"
    )
    with pytest.raises(InventoryError, match=r"not inside a Slurm allocation") as caught:
        find_nodes(job=None, settings=SlurmSettings(), environ={}, scontrol=None)
    assert caught.value.hint and "-i slurm:JOBID" in caught.value.hint
    with pytest.raises(InventoryError, match=r"\$SLURM_JOB_ID: 'abc' is not a Slurm job id"):
        find_nodes(job=None, settings=SlurmSettings(), environ={"SLURM_JOB_ID": "abc"}, scontrol=None)
    with pytest.raises(
        InventoryError, match=r"\$SLURM_JOB_NODELIST: node list 'n\[1-2': '\[' is never closed"
    ):
        find_nodes(job=None, settings=SlurmSettings(), environ={"SLURM_JOB_NODELIST": "n[1-2"}, scontrol=None)


@pytest.mark.parametrize(
    ("spec", "job"),
    [("slurm:", None), ("slurm:12345", "12345"), ("slurm:12345_7", "12345_7"), ("slurm:9+1", "9+1")],
)
def test_the_spec_names_a_job_or_the_allocation(spec: str, job: str | None) -> None:
    assert job_of_spec(spec) == job


def test_a_bad_spec_is_refused() -> None:
    with pytest.raises(InventoryError, match=r"-i slurm:node01: 'node01' is not a Slurm job id"):
        job_of_spec("slurm:node01")


OVERLAY = """\
slurm:
  nodelist: gpu[01-02],cpu-[1-3]
vars:
  ssh_user: ops
  rpc_port: 50100
  address: "{{ inventory_hostname }}.ib"
hosts:
  "gpu[01-02]": {rpc_devices: [CUDA0], rpc_backend: cuda}
  "cpu-*": {rpc_threads: 8}
  cpu-2: {rpc_threads: 2, rpc_port: 50200}
  "big[1-9]": {rpc_threads: 64}
groups:
  gpu:
    hosts: "gpu*"
    vars: {memory_reserve: 1GiB, rpc_port: 50300}
    children: [fast]
  fast:
    hosts: [gpu02]
    vars: {rpc_threads: 16}
"""


def overlay_inventory(text: str = OVERLAY) -> Inventory:
    return build_inventory(
        SlurmNodes(("gpu01", "gpu02", "cpu-1", "cpu-2", "cpu-3"), "slurm job 3"), text, Path("slurm.yml")
    )


def test_the_overlay_gives_the_nodes_their_variables() -> None:
    inventory = overlay_inventory()
    assert inventory.host_names() == ("gpu01", "gpu02", "cpu-1", "cpu-2", "cpu-3")  # Slurm's order
    gpu01, gpu02 = inventory.host("gpu01"), inventory.host("gpu02")
    assert gpu01.address == "gpu01.ib" and gpu01.ssh_user == "ops"
    assert (gpu01.rpc_port, gpu01.rpc_devices, gpu01.rpc_backend, gpu01.memory_reserve) == (
        50300, ("CUDA0",), "cuda", 1 << 30
    )  # fmt: skip
    assert gpu01.var_sources["rpc_port"] == "group gpu" and gpu02.rpc_threads == 16
    assert gpu02.groups == ("gpu", "fast")
    cpu1, cpu2 = inventory.host("cpu-1"), inventory.host("cpu-2")
    assert (cpu1.rpc_port, cpu1.rpc_threads, cpu1.groups) == (50100, 8, ("ungrouped",))
    assert (cpu2.rpc_port, cpu2.rpc_threads) == (50200, 2)  # the later pattern wins
    assert str(cpu1.location) == "slurm job 3"
    assert inventory.warnings == ("slurm.yml:11:3: pattern 'big[1-9]' matches none of this job's nodes",)
    assert sorted(inventory.groups) == ["all", "fast", "gpu", "ungrouped"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("groups:", "group:"), "slurm.yml:12:1: unknown top-level key 'group' (did you mean 'groups'?)"),
        (
            ("children: [fast]", "children: [fats]"),
            "slurm.yml:16:16: group 'gpu' has undefined child group 'fats'",
        ),
        (('"cpu-*"', '"cpu-[3-1]"'), "slurm.yml:9:3: node list 'cpu-[3-1]': range '3-1'"),
        (("  fast:\n", "  all:\n"), "slurm.yml:17:3: group 'all' is implicit"),
        (("rpc_port: 50100", "rpc_port: many"), "slurm.yml:5:13: rpc_port:"),
        (("vars:\n  ssh_user", "vars: [1]\nx:\n  ssh_user"), "slurm.yml:3:7: vars must be a mapping"),
    ],
)
def test_an_overlay_error_points_into_the_file(change: tuple[str, str], message: str) -> None:
    text = OVERLAY.replace(*change, 1)
    assert text != OVERLAY
    with pytest.raises(InventoryError) as caught:
        overlay_inventory(text)
    assert message in str(caught.value)


def test_the_settings_section() -> None:
    assert read_settings(OVERLAY, Path("s.yml")).nodelist == "gpu[01-02],cpu-[1-3]"
    assert read_settings("slurm:\n  job: 12345\n", None) == SlurmSettings(job="12345")
    assert read_settings("slurm:\nvars: {}\n", None) == SlurmSettings()
    for text, message in [
        ("slurm:\n  job: 1\n  nodelist: n1\n", "s.yml:3:13: slurm: give job or nodelist, not both"),
        ("slurm:\n  jobs: 1\n", "s.yml:2:3: unknown key 'jobs' in slurm (did you mean 'job'?)"),
        ("slurm:\n  job: first\n", "s.yml:2:8: 'first' is not a Slurm job id"),
        ("slurm:\n  nodelist: [a, b]\n", "s.yml:2:13: slurm nodelist must be text, got a list"),
        ("slurm:\n  job: [1\n", "s.yml:3:1: invalid YAML"),
    ]:
        with pytest.raises(InventoryError) as caught:
            read_settings(text, Path("s.yml"))
        assert message in str(caught.value), text


@pytest.mark.parametrize(
    ("text", "slurm"),
    [
        (OVERLAY, True),
        ("slurm:\n", True),
        ("slurm:\n  job: 3\n", True),
        ("slurm:\n  hosts:\n    n1:\n", False),  # Ansible without all: a group named slurm
        ("all:\n  children:\n    slurm:\n", False),
        ("vars: {}\nhosts: {n1: }\n", False),
        ("[slurm]\nn1\n", False),
    ],
)
def test_a_slurm_overlay_is_told_from_other_inventories(text: str, slurm: bool) -> None:
    assert is_slurm_document(text) is slurm
