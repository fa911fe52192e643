"""A newcomer's walk of `run`, `deploy` and `serve` (issue 19's and issue 32's "done when"): the front end
reads its input (the flags, the inventory), hands the whole job to its one use case in `workflows/`, and
goes on only to print what came back; below it, the stages are reached in the order docs/architecture.md
gives; a request to serve goes route > router > formation > engine (the HTTP client), never back
up. Traced in-process (`tests/plugins/walk.py`) over a real rpc-server, a real model load, a real deploy
and a real llama-server on this machine."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.artifacts.manifest import Artifact
from orchestrator.cli import main
from tests.plugins.servers import LocalServer, free_port, write_local_inventory
from tests.plugins.walk import LAYERS, PACKAGE, Walk, trace

INPUT = {"core", "inventory"}  # the flags and the inventory, read by the front end before it hands over
OPTIONS = ("workflows.options.", "workflows.serve_options.")  # the builders of typed options, at the edge


def documented_walk(command: str) -> list[str]:
    """The walk docs/architecture.md states for `command` ("`run` reaches cli > core > ...")."""
    text = " ".join((PACKAGE.parent / "docs" / "architecture.md").read_text().split())
    found = re.search(rf"`{command}` (?:reaches )?(cli(?: > \w+)+)", text)
    assert found, f"docs/architecture.md states no walk of {command}"
    return found.group(1).split(" > ")


def handed_over(walk: Walk, use_case: str) -> None:
    """The front end's own calls before its use case (`workflows.MODULE.FUNCTION`) are its input's and
    the options' builder only, and the use case is the first other thing it calls in `workflows`; no
    stage below `workflows` but the input's is reached before it (what was called instead is named)."""
    own = [(callee, name) for _, callee, name, mine in walk.calls if mine]
    names = [name for _, name in own]
    assert use_case in names, f"the front end never calls {use_case}: {list(dict.fromkeys(names))}"
    before = own[: names.index(use_case)]
    wrong = [name for callee, name in before if callee not in INPUT and not name.startswith(OPTIONS)]
    assert not wrong, f"before {use_case}, the front end itself calls {list(dict.fromkeys(wrong))}"
    reached = walk.reached
    early = [s for s in reached[1 : reached.index("workflows")] if s not in INPUT]
    assert not early, {s: walk.first_calls(s) for s in early}


def test_the_check_names_a_front_end_that_skips_the_use_case() -> None:
    """The check can fail: a front end that reads the model and starts the worker itself (as `run` did)
    before it calls its use case."""
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
    assert walk.callbacks == ["engine -> workflows.plan.once"]
    with pytest.raises(AssertionError, match="profile_model"):
        handed_over(walk, "workflows.plan.plan_for_fleet")


def test_the_trace_sees_a_front_end_that_calls_a_stage_itself(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tracer on a real command whose front end reads the model itself (`model info` has no use case)."""
    assert main(["model", "info", str(tiny_model)]) == 0
    walk, status = trace(lambda: main(["model", "info", str(tiny_model)]))
    assert status == 0, capsys.readouterr().err
    assert "planning.profile.profile_model" in walk.first_calls("planning")
    with pytest.raises(AssertionError, match="profile_model"):
        handed_over(walk, "workflows.run.run_on_fleet")


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
    capsys.readouterr()
    walk, status = trace(lambda: main(argv))
    out = capsys.readouterr().out
    assert status == 0 and "tokens generated" in out, out
    handed_over(walk, "workflows.run.run_on_fleet")
    assert walk.reached == documented_walk("run"), " > ".join(walk.reached)
    print("run:", " > ".join(walk.reached), f"({len(walk.modules)} modules)")
    print("  callbacks:", "; ".join(walk.callbacks))


@pytest.mark.llama
def test_deploy_hands_over_to_its_use_case(
    cpu_artifact: Artifact, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def inventory(name: str) -> Path:
        fields = {
            "rpc_port": free_port(),
            "install_dir": str(tmp_path / name),
            "rpc_artifact": cpu_artifact.id,
        }
        return write_local_inventory(tmp_path / f"{name}.yml", {name: fields})

    first, second = inventory("warm"), inventory("walked")
    try:
        assert main(["deploy", "-i", str(first)]) == 0, capsys.readouterr().err  # untraced first
        capsys.readouterr()
        walk, status = trace(lambda: main(["deploy", "-i", str(second)]))  # a whole deploy: install, start
        out = capsys.readouterr().out
        assert status == 0 and "walked" in out and "install" in out, out
    finally:
        for path in (first, second):
            main(["stop", "-i", str(path), "--force"])
    handed_over(walk, "workflows.change.deploy_fleet")
    assert walk.reached == documented_walk("deploy"), walk.reached
    print("deploy:", " > ".join(walk.reached), f"({len(walk.modules)} modules)")
    print("  callbacks:", "; ".join(walk.callbacks))


def _serve_ready(base: str, limit: float = 120.0) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as answer:
                if json.loads(answer.read()).get("status") == "ready":
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


REQUEST_PATH = ("serve.routes", "serve.router", "serve.formation", "serve.upstream")


def request_walk(calls: list[tuple[str, str, str]]) -> list[str]:
    """The modules of serve/ a request's calls first reach, in order (a call within a module is none)."""
    order: list[str] = []
    for _, callee, _ in calls:
        if callee in REQUEST_PATH and callee not in order:
            order.append(callee)
    return order


def test_the_request_check_names_a_call_back_up() -> None:
    """The check can fail: a request whose formation calls back into workflows/."""
    calls = [
        ("serve.app", "serve.routes", "completions"),
        ("serve.routes", "serve.router", "admit"),
        ("serve.router", "serve.formation", "admit"),
        ("serve.formation", "workflows.serving", "plan_round"),
        ("serve.routes", "serve.upstream", "request"),
    ]
    assert request_walk(calls) == list(REQUEST_PATH)
    assert _climbs(calls) == ["serve.formation -> workflows.serving.plan_round"]


def _climbs(calls: list[tuple[str, str, str]]) -> list[str]:
    """The calls from serve/ (or below) to a stage above it."""
    above = LAYERS[: LAYERS.index("serve")]
    return [
        f"{caller} -> {callee}.{name}"
        for caller, callee, name in calls
        if callee.split(".")[0] in above and caller.split(".")[0] not in above
    ]


@pytest.mark.llama
def test_serve_hands_over_to_its_use_case_and_a_request_goes_router_formation_engine(
    start_rpc_server: Callable[..., LocalServer],
    tiny_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """serve's start (read the models and hosts, probe, plan the formations, start llama-server, serve)
    and one completion, traced; SIGINT ends it, as a user's Ctrl-C (uvicorn takes it, then hands it to
    the handler from before: here the test's own, which does nothing)."""
    server = start_rpc_server()
    inventory = write_local_inventory(tmp_path / "inv.yml", {"n1": {"rpc_port": server.port}})
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = ["serve", "-i", str(inventory), "-m", str(tiny_model), "--ctx", "512", "--port", str(port)]
    argv += ["--observe-interval", "0", "--rejoin-interval", "0", "--local-devices", ""]
    window: dict[str, int] = {}
    answers: list[object] = []
    walks: list[Walk] = []

    def ask_then_stop() -> None:
        try:
            if not _serve_ready(base):
                answers.append("serve never got ready")
                return
            body = json.dumps({"prompt": "hello", "max_tokens": 4}).encode()
            request = urllib.request.Request(
                f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            window["start"] = len(walks[0].module_calls) if walks else 0
            with urllib.request.urlopen(request, timeout=60) as answer:
                answers.append(json.loads(answer.read()))
            window["end"] = len(walks[0].module_calls) if walks else 0
        finally:
            os.kill(os.getpid(), signal.SIGINT)

    def serve_once() -> int:
        asker = threading.Thread(target=ask_then_stop)
        asker.start()
        try:
            return main(argv)
        finally:
            asker.join(180)

    previous = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        assert serve_once() == 0, capsys.readouterr().err  # untraced first: imports are no part of the walk
        assert answers and isinstance(answers[-1], dict), answers
        capsys.readouterr()
        answers.clear()

        def traced() -> int:
            return serve_once()

        walk = Walk()
        walks.append(walk)
        walked, status = trace(traced, walk)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert status == 0 and answers and isinstance(answers[-1], dict), (answers, capsys.readouterr().err)
    assert answers[-1]["choices"][0]["text"] is not None  # type: ignore[index]
    handed_over(walked, "workflows.serve.serve_fleet")
    assert walked.reached == documented_walk("serve"), " > ".join(walked.reached)
    request = walked.module_calls[window["start"] : window["end"]]
    assert request_walk(request) == list(REQUEST_PATH), request_walk(request)
    assert not _climbs(request), _climbs(request)
    print("serve:", " > ".join(walked.reached), f"({len(walked.modules)} modules)")
    print("  a request:", " > ".join(request_walk(request)))
