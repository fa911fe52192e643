"""`run` says why the first token is late, terminal or not (issue 43: a first run of Gemma on llvmpipe
spent two minutes compiling shaders with nothing printed when stdout was not a terminal)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from orchestrator.cli import _output
from orchestrator.cli.run import WAIT_LINE_S, RunScreen


def screen(*, json: bool = False, vulkan: bool = True) -> RunScreen:
    shown = RunScreen(argparse.Namespace(json=json, model=Path("gemma.gguf")))
    shown.vulkan = vulkan  # what `planned` finds in a plan with a Vulkan device
    return shown


def test_a_line_every_few_seconds_until_the_first_token(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_output.err_console, "_width", 300)
    assert not _output.err_console.is_terminal  # a pipe: the bars are off, these lines are not
    run = screen()
    for seconds in (5.0, WAIT_LINE_S, WAIT_LINE_S + 5, 2 * WAIT_LINE_S):
        run.waiting(seconds)
    why = "(the Vulkan servers compile their shaders on their first graph, once)"
    assert capsys.readouterr().err.splitlines() == [
        f"waiting for the first token: {WAIT_LINE_S:.0f} s {why}",
        f"waiting for the first token: {2 * WAIT_LINE_S:.0f} s {why}",
    ]
    run.text("Paris")
    run.waiting(3 * WAIT_LINE_S)  # the text has begun: stderr stays out of it
    assert capsys.readouterr().err == ""


def test_without_vulkan_the_wait_is_told_without_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    screen(vulkan=False).waiting(WAIT_LINE_S)
    assert capsys.readouterr().err == f"waiting for the first token: {WAIT_LINE_S:.0f} s\n"
    screen(json=True).waiting(WAIT_LINE_S)
    assert capsys.readouterr().err == ""


def test_a_plan_on_a_vulkan_device_is_known_as_one() -> None:
    from types import SimpleNamespace

    from orchestrator.inventory.model import Host

    def plan(*names: str) -> SimpleNamespace:
        devices = [SimpleNamespace(name=name) for name in names]
        return SimpleNamespace(devices=devices, endpoints=["10.0.0.1:50052"])

    cpu = Host(name="n1", address="10.0.0.1", rpc_port=50052)
    for devices, hosts, vulkan in [
        (("Vulkan0",), [cpu], True),
        (("RPC0",), [Host(name="n1", address="10.0.0.1", rpc_port=50052, rpc_backend="vulkan")], True),
        (("CPU",), [cpu], False),
    ]:
        run = screen(vulkan=False)
        run.planned(plan(*devices), hosts)  # type: ignore[arg-type]
        assert run.vulkan is vulkan, devices
