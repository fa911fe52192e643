"""Tier 2: untrusted memory and a cut link on a deployed lab (network namespaces, real sshd and servers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from orchestrator.artifacts.manifest import Artifact
from orchestrator.cli import main
from orchestrator.engine.executor import Session
from orchestrator.inventory.model import Host
from orchestrator.lab.state import Lab
from orchestrator.operations.install.ensure import ArtifactChooser
from orchestrator.operations.server.steps import make_deploy_step
from tests.plugins.lab import lab_hosts_of, own_lab

pytestmark = [pytest.mark.lab, pytest.mark.llama]


@pytest.fixture(scope="module")
def worker_lab() -> Iterator[Lab]:
    with own_lab(3, "wk") as made:
        yield made


@pytest.fixture
async def deployed(worker_lab: Lab, cpu_artifact: Artifact) -> AsyncIterator[list[Host]]:
    hosts = lab_hosts_of(worker_lab)
    async with Session() as session:
        run = await session.run(hosts, make_deploy_step(ArtifactChooser(cpu_artifact.id)), name="deploy")
        assert run.ok, [str(r.error) for r in run.failed]
    yield hosts
    worker_lab.heal()


def test_a_node_whose_memory_cannot_be_measured_is_refused_unless_trusted(
    worker_lab: Lab, deployed: list[Host], tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blind = deployed[1]
    worker_lab.kill_sshd(blind.name)
    plan = ["plan", "-i", str(worker_lab.inventory), "-m", str(tiny_model), "--ctx", "512", "--json"]
    assert main(plan) == 1
    err = capsys.readouterr().err
    assert f"{blind.name} ({blind.endpoint}: CPU memory not measured (no host facts)" in err
    assert "--trust-rpc-memory" in err and "Traceback" not in err
    # Trusted on request: that node is planned on its server's figure, the machine's total RAM.
    assert main([*plan, "--trust-rpc-memory"]) == 0
    usable = {d["endpoint"]: d["memory"]["usable"] for d in json.loads(capsys.readouterr().out)["devices"]}
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # lab nodes share this machine's RAM
    assert abs(usable[blind.endpoint] - (ram - blind.memory_reserve)) < ram // 100
    assert all(u < ram // 2 for ep, u in usable.items() if ep != blind.endpoint)  # MemAvailable / 2 or 3
    # The report leaves it out and says why.
    report = ["report", "-i", str(worker_lab.inventory), "-m", str(tiny_model), "--format", "json"]
    assert main(report) == 0
    text = capsys.readouterr().out
    assert f"{blind.name} ({blind.endpoint}): CPU memory not measured" in text
    assert blind.endpoint not in json.dumps(json.loads(text)["cases"])


def test_the_dropin_example_plans_remote_cpu_servers_with_the_inventorys_facts(
    worker_lab: Lab,
    deployed: list[Host],
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/python.md's example, with the lab's endpoints: the inventory rpcfleet's commands would
    use measures the nodes, as `rpcfleet plan` does; without one they are refused as not measured."""
    from orchestrator.core.errors import PlanError
    from orchestrator.workflows.dropin import Llama

    monkeypatch.chdir(tmp_path)  # no ./inventory.yml here
    monkeypatch.setenv("RPCFLEET_HOME", str(tmp_path / "home"))  # and no default lab
    monkeypatch.delenv("RPCFLEET_INVENTORY", raising=False)
    endpoints = [h.endpoint for h in deployed]
    with pytest.raises(PlanError, match="was not measured"):
        Llama(model_path=str(tiny_model), rpc_servers=endpoints, n_gpu_layers=-1, n_ctx=256, verbose=False)
    monkeypatch.setenv("RPCFLEET_INVENTORY", str(worker_lab.inventory))
    llm = Llama(model_path=str(tiny_model), rpc_servers=endpoints, n_gpu_layers=-1, n_ctx=256, verbose=False)
    try:
        usable = [d.memory.usable for d in llm.rpcfleet_plan.devices]
        available = int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) * 1024
        # Three CPU servers of one machine share its MemAvailable (each about a third), not its RAM each.
        assert all(abs(u - available / 3) < available / 10 for u in usable), (usable, available)
        assert llm("Hello", max_tokens=4)["choices"][0]["text"] is not None
    finally:
        llm.close()


def test_a_cut_link_during_run_is_a_bounded_clean_error_naming_the_node(
    worker_lab: Lab, deployed: list[Host], tiny_model: Path, tmp_path: Path
) -> None:
    argv = [sys.executable, "-m", "orchestrator", "run", "-i", str(worker_lab.inventory)]
    argv += ["-m", str(tiny_model), "-p", "hello world", "-n", "4000", "--ctx", "4096"]
    env = {**os.environ, "RPCFLEET_HOME": str(tmp_path), "COLUMNS": "200"}
    run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert run.stdout is not None
    assert run.stdout.read(1), run.communicate(timeout=30)  # generating
    cut = deployed[2]
    worker_lab.cut_link(cut.name)
    started = time.monotonic()
    _, err_bytes = run.communicate(timeout=90)
    took = time.monotonic() - started
    err = err_bytes.decode()
    assert run.returncode == 1, err
    assert f"lost {cut.endpoint} (timeout) while generating" in err
    assert all(h.endpoint not in err.split("hint")[0] for h in deployed[:2])
    assert "Traceback" not in err
    assert took < 60, took  # the worker's link timeout (10 s) plus the probe (headroom), not TCP's minutes
