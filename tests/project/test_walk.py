"""A newcomer's walk of `run` and of `deploy` (issue 19's "done when"): the front end reads its input (the
flags, the inventory), hands the whole job to one use case of `workflows/`, and goes on only to print what
came back. No stage below the use cases is reached before them. Traced in-process
(`tests/plugins/walk.py`) over a real rpc-server, a real model load and a real deploy on this machine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.artifacts.manifest import Artifact
from orchestrator.cli import main
from tests.plugins.servers import LocalServer, free_port, write_local_inventory
from tests.plugins.walk import Walk, trace

INPUT = {"core", "inventory"}  # the flags and the inventory, read by the front end before it hands over


def handed_over(walk: Walk) -> None:
    """The walk reaches `workflows` before any stage below it but the input's, and the front end's own
    calls before the use case are the input's alone (what it called instead is named on failure)."""
    reached = walk.reached
    assert "workflows" in reached, reached
    early = [s for s in reached[1 : reached.index("workflows")] if s not in INPUT]
    assert not early, {s: walk.first_calls(s) for s in early}
    front = walk.front_end
    wrong = [s for s in front[: front.index("workflows")] if s not in INPUT]
    assert not wrong, {s: walk.first_calls(s) for s in wrong}


def test_the_check_names_a_front_end_that_skips_the_use_case() -> None:
    """The checks above can fail: a front end that reads the model and starts the worker itself (as `run`
    did) before it calls its use case."""
    walk = Walk(
        calls=[
            ("cli", "core", "core.errors.__init__", True),
            ("cli", "planning", "planning.profile.profile_model", True),
            ("cli", "llama", "llama.worker.parent.spawn", True),
            ("cli", "workflows", "workflows.plan.plan_for_fleet", True),
            ("workflows", "probe", "probe.fleet.probe_fleet", False),
            ("engine", "workflows", "workflows.plan.once", False),  # a callback reaches nothing
        ]
    )
    assert walk.reached == ["cli", "core", "planning", "llama", "workflows", "probe"]
    assert walk.front_end == ["core", "planning", "llama", "workflows"]
    with pytest.raises(AssertionError, match="profile_model"):
        handed_over(walk)


@pytest.mark.llama
def test_run_hands_over_to_its_use_case(
    start_rpc_server: Callable[..., LocalServer],
    tiny_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = start_rpc_server()
    inventory = write_local_inventory(tmp_path / "inv.yml", {"n1": {"rpc_port": server.port}})
    argv = ["run", "-i", str(inventory), "-m", str(tiny_model), "--ctx", "512", "-p", "hello", "-n", "4"]
    assert main(argv) == 0, capsys.readouterr().err  # untraced first: imports are no part of the walk
    walk, status = trace(lambda: main(argv))
    assert status == 0, capsys.readouterr().err
    handed_over(walk)
    # and on down through what a run needs: the probe over RPC, the plan, the worker's load
    assert {"workflows", "planning", "llama", "probe", "rpc", "engine"} <= set(walk.reached), walk.reached
    print("run:", " > ".join(walk.reached), f"({len(walk.modules)} modules)")


@pytest.mark.llama
def test_deploy_hands_over_to_its_use_case(
    cpu_artifact: Artifact, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def inventory(name: str) -> Path:
        port = free_port()
        fields = {"rpc_port": port, "install_dir": str(tmp_path / name), "rpc_artifact": cpu_artifact.id}
        return write_local_inventory(tmp_path / f"{name}.yml", {name: fields})

    first, second = inventory("warm"), inventory("walked")
    try:
        assert main(["deploy", "-i", str(first)]) == 0, capsys.readouterr().err  # untraced first
        walk, status = trace(lambda: main(["deploy", "-i", str(second)]))  # a whole deploy: install, start
        assert status == 0, capsys.readouterr().err
        assert "install" in capsys.readouterr().out
    finally:
        for path in (first, second):
            main(["stop", "-i", str(path), "--force"])
    handed_over(walk)
    assert {"workflows", "operations", "engine", "connectors", "rpc"} <= set(walk.reached), walk.reached
    print("deploy:", " > ".join(walk.reached), f"({len(walk.modules)} modules)")
