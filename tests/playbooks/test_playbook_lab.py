"""Tier 2: every shipped playbook against the lab (network namespaces, real OpenSSH, real servers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.artifacts.manifest import Artifact
from orchestrator.cli import main
from orchestrator.inventory.model import Host
from orchestrator.lab.state import Lab
from orchestrator.planning.plan import Plan
from orchestrator.playbooks.load_check import LoadCheckResult
from orchestrator.rpc.client import probe_endpoint
from orchestrator.rpc.records import Outcome
from tests.plugins.playbooks import PLAYBOOKS, NodeView, Play

pytestmark = pytest.mark.lab


def _cli(lab: Lab, name: str, *args: str) -> int:
    return main(["run-playbook", str(PLAYBOOKS / f"{name}.yml"), "-i", str(lab.inventory), *args])


def test_deploy_check_changes_nothing_then_deploy_then_nothing_to_do(
    lab: Lab, fresh_nodes: list[Host], cpu_artifact: Artifact, capsys: pytest.CaptureFixture[str]
) -> None:
    views = [NodeView(lab, h) for h in fresh_nodes]
    assert _cli(lab, "deploy", "--check") == 1  # its probe step fails: nothing serves yet
    out = capsys.readouterr().out
    assert "check mode" in out and f"install {cpu_artifact.id}" in out and "recap" in out
    assert not any(v.root.exists() for v in views)  # not even a folder

    assert _cli(lab, "deploy") == 0
    out = capsys.readouterr().out
    assert "recap" in out
    assert all(v.server_alive() for v in views)
    pids = [v.pid() for v in views]

    assert _cli(lab, "deploy") == 0  # a second run changes nothing
    capsys.readouterr()
    assert [v.pid() for v in views] == pids
    assert all(v.starts() == 1 for v in views)


def test_check_mode_of_rolling_restart_and_teardown_changes_nothing(
    lab: Lab, deployed: list[Host], capsys: pytest.CaptureFixture[str]
) -> None:
    views = [NodeView(lab, h) for h in deployed]
    pids, starts = [v.pid() for v in views], [v.starts() for v in views]
    assert _cli(lab, "rolling-restart", "--check") == 0
    out = capsys.readouterr().out
    assert out.count("would restart (pid") == 3
    assert _cli(lab, "teardown", "--check") == 0
    out = capsys.readouterr().out
    assert out.count("would stop: was running pid") == 3
    assert (
        main(["restart", "--rolling", "-i", str(lab.inventory), "--check", "--limit", deployed[0].name]) == 0
    )
    assert "would restart" in capsys.readouterr().out
    assert [v.pid() for v in views] == pids and [v.starts() for v in views] == starts
    assert all(v.server_alive() for v in views)


async def test_teardown_stops_every_server(lab: Lab, deployed: list[Host], play: Play) -> None:
    views = [NodeView(lab, h) for h in deployed]
    result = await play("teardown", deployed)
    assert result.ok and [r.status for r in result.steps[0].run.results] == ["changed"] * 3
    assert not any(v.server_alive() for v in views) and all(v.pid() is None for v in views)
    for host in deployed:
        assert (await probe_endpoint(host.endpoint, hello_only=True)).outcome is Outcome.REFUSED
    again = await play("teardown", deployed)
    assert [r.status for r in again.steps[0].run.results] == ["ok"] * 3


def test_capacity_report_writes_the_report(
    lab: Lab, deployed: list[Host], tiny_model: Path, tmp_path: Path
) -> None:
    output = tmp_path / "capacity.json"
    extra = [f"models={tiny_model}", "ctx=512,1k", "format=json", f"output={output}"]
    assert _cli(lab, "capacity-report", *[a for e in extra for a in ("-e", e)]) == 0
    report = json.loads(output.read_text())
    text = json.dumps(report)
    for host in deployed:
        assert host.endpoint in text
    assert "512" in text and "1024" in text


@pytest.mark.llama
async def test_preload_ends_with_a_model_placed_as_planned(
    lab: Lab, deployed: list[Host], play: Play, tiny_model_factory: object
) -> None:
    model = tiny_model_factory(n_layer=5)  # type: ignore[operator]
    views = [NodeView(lab, h) for h in deployed]
    pids = [v.pid() for v in views]
    result = await play("preload", deployed, model=str(model), ctx=512)
    assert result.ok, {h: [str(r.error) for r in rs if r.error] for h, rs in result.by_host().items()}
    assert [s.step.op for s in result.steps] == ["restart", "probe", "plan", "cache_warm", "load_check"]
    assert {r.message for r in result.steps[3].run.results} == {"rpc_cache is off here: nothing to warm"}
    assert all(v.pid() != p for v, p in zip(views, pids, strict=True))  # restarted first
    plan = Plan.from_text(next(d.text for d in result.documents if d.kind == "plan"))
    assert set(plan.endpoints) == {h.endpoint for h in deployed}  # all three nodes hold layers
    placement = result.steps[4].run.results[0].value
    assert isinstance(placement, LoadCheckResult) and placement.layers_as_planned is True
    planned = {d.endpoint: list(d.layers) for d in plan.devices}
    actual = {d.endpoint: list(d.actual_layers) for d in placement.devices}
    assert actual == planned
    assert sorted(il for layers in actual.values() for il in layers) == list(range(plan.n_layer + 1))
    # The check ran in a child process: the servers are free again.
    for host in deployed:
        assert (await probe_endpoint(host.endpoint, hello_only=True)).outcome is Outcome.OK


def test_a_rolling_restart_shows_its_progress_on_a_terminal(
    lab: Lab, deployed: list[Host], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import io

    from rich.console import Console

    from orchestrator.cli import _output, _progress

    screen = io.StringIO()
    monkeypatch.setattr(
        _output, "err_console", Console(file=screen, force_terminal=True, width=120), raising=False
    )
    seen: list[int] = []

    class Recording(_progress.PlayProgress):
        def host_done(self, result: object) -> None:
            super().host_done(result)
            self.progress.refresh()
            seen.append(int(self.progress.tasks[1].completed))

    monkeypatch.setattr(_progress, "PlayProgress", Recording)
    assert main(["restart", "--rolling", "-i", str(lab.inventory)]) == 0
    assert seen == [1, 2, 3]  # host by host, as each batch of one finishes
    shown = screen.getvalue()
    assert "rolling restart: steps" in shown and "1/3" in shown and "3/3" in shown
    capsys.readouterr()
