"""Fleet steps of playbooks: shared errors keep their type, the load-check child never outlives its call
and its answer is validated once."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from orchestrator.core.errors import LoaderError, PlaybookError, UnreachableError
from orchestrator.engine.executor import HostContext, Session, StepOutcome
from orchestrator.engine.shared import SharedCall
from orchestrator.inventory.model import Host
from orchestrator.llama.placement import MemoryBytes
from orchestrator.planning.plan import Plan, PlanOptions
from orchestrator.planning.strategy import make_plan
from orchestrator.playbooks.load_check import DeviceCheck, LoadCheckResult, load_check
from orchestrator.playbooks.model import PlaybookErrors
from tests.procs import gone

MiB = 1 << 20


async def test_a_shared_fleet_error_keeps_its_type_for_every_host() -> None:
    calls = 0

    async def fail() -> None:
        nonlocal calls
        calls += 1
        raise UnreachableError("the fleet is gone", hint="check the network")

    shared: SharedCall[None] = SharedCall(fail)

    async def step(ctx: HostContext) -> StepOutcome[None]:
        await shared.get()
        return StepOutcome(None)

    hosts = [Host(name=f"n{i}", address="127.0.0.1", connection="local") for i in range(2)]
    async with Session() as session:
        run = await session.run(hosts, step, name="fleet")
    assert calls == 1
    assert [r.status for r in run.results] == ["unreachable", "unreachable"]
    errors = [r.error for r in run.results]
    assert all(isinstance(e, UnreachableError) for e in errors)
    assert errors[0] is not errors[1]  # one copy per host: each is stamped with its own host
    assert [e.host for e in errors if e is not None] == ["n0", "n1"]
    assert all(e is not None and e.hint == "check the network" for e in errors)


async def test_a_shared_error_with_its_own_constructor_is_copied_whole() -> None:
    original = PlaybookErrors([PlaybookError("first"), PlaybookError("second")])

    async def fail() -> None:
        raise original

    with pytest.raises(PlaybookErrors) as info:
        await SharedCall(fail).get()
    assert info.value is not original
    assert info.value.errors == original.errors and str(info.value) == str(original)


# --- the load-check child ------------------------------------------------------------------------------


@pytest.fixture
def plan(tiny_model: Path) -> Plan:
    from orchestrator.planning.plan import PlanDevice
    from orchestrator.planning.profile import profile_model

    device = PlanDevice("127.0.0.1:1", 0, "127.0.0.1:1#0", usable=512 * MiB)
    return make_plan([device], profile_model(tiny_model), PlanOptions(n_ctx=256))


def _fake_python(tmp_path: Path, body: str) -> Path:
    """A stand-in for the child's interpreter: a shell script that writes its pid, then runs `body`."""
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\necho $$ > {tmp_path / 'pid'}\n{body}\n")
    script.chmod(0o755)
    return script


async def _child_pid(tmp_path: Path) -> int:
    for _ in range(500):
        text = (tmp_path / "pid").read_text() if (tmp_path / "pid").exists() else ""
        if text.endswith("\n"):
            return int(text)
        await asyncio.sleep(0.01)
    raise AssertionError("the child did not start")


async def test_a_cancelled_load_check_kills_its_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plan: Plan
) -> None:
    monkeypatch.setattr(sys, "executable", str(_fake_python(tmp_path, "exec sleep 60")))
    task = asyncio.ensure_future(load_check(plan, "m.gguf", limit_s=60))
    pid = await _child_pid(tmp_path)
    assert not gone(pid)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gone(pid)  # killed and reaped before the cancellation went on
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_a_load_check_past_its_limit_kills_its_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plan: Plan
) -> None:
    monkeypatch.setattr(sys, "executable", str(_fake_python(tmp_path, "exec sleep 60")))
    with pytest.raises(LoaderError, match=r"did not finish within 0\.3 s"):
        await load_check(plan, "m.gguf", limit_s=0.3)
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _answer(**changes: object) -> dict[str, object]:
    device = {
        "label": "127.0.0.1:1#0",
        "endpoint": "127.0.0.1:1",
        "index": 0,
        "planned_layers": [0, 1, 2],
        "actual_layers": [0, 1, 2],
        "predicted": {"weights": 3 * MiB, "kv": MiB, "compute": 2 * MiB},
        "actual": {"weights": 3 * MiB, "kv": MiB, "compute": 2 * MiB + 5},
    }
    return {"layers_as_planned": True, "load_seconds": 0.25, "devices": [device], **changes}


async def test_the_child_answer_becomes_typed_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plan: Plan
) -> None:
    line = json.dumps(_answer())
    monkeypatch.setattr(sys, "executable", str(_fake_python(tmp_path, f"cat >/dev/null; echo '{line}'")))
    result = await load_check(plan, "m.gguf", limit_s=30)
    assert result == LoadCheckResult(
        layers_as_planned=True,
        load_seconds=0.25,
        devices=(
            DeviceCheck(
                label="127.0.0.1:1#0",
                endpoint="127.0.0.1:1",
                index=0,
                planned_layers=(0, 1, 2),
                actual_layers=(0, 1, 2),
                predicted=MemoryBytes(3 * MiB, MiB, 2 * MiB),
                actual=MemoryBytes(3 * MiB, MiB, 2 * MiB + 5),
            ),
        ),
    )
    assert result.devices[0].as_planned


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ([], "must be an object"),
        (_answer(devices=None), "devices must be a list"),
        (_answer(load_seconds="fast"), "load_seconds"),
        (_answer(layers_as_planned=1), "layers_as_planned"),
        (_answer(devices=[{"label": "x"}]), "endpoint must be|index"),
        (_answer(devices=[{**_answer()["devices"][0], "actual_layers": [0, "1"]}]), "actual_layers"),  # type: ignore[index]
        (_answer(devices=[{**_answer()["devices"][0], "actual": {"weights": 1}}]), "actual must be"),  # type: ignore[index]
    ],
)
async def test_a_malformed_child_answer_is_a_loader_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plan: Plan, answer: object, message: str
) -> None:
    line = json.dumps(answer)
    monkeypatch.setattr(sys, "executable", str(_fake_python(tmp_path, f"cat >/dev/null; echo '{line}'")))
    with pytest.raises(LoaderError, match=f"malformed JSON: .*({message})"):
        await load_check(plan, "m.gguf", limit_s=30)


def test_device_check_refuses_booleans_for_numbers() -> None:
    device = dict(_answer()["devices"][0])  # type: ignore[index]
    with pytest.raises(ValueError, match="index"):
        DeviceCheck.from_json({**device, "index": True})
    assert DeviceCheck.from_json(device).predicted.total == 6 * MiB
