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
from orchestrator.llama.observed_placement import MemoryBytes
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


async def test_a_shared_error_with_its_own_constructor_reaches_callers_whole_and_copies_whole() -> None:
    original = PlaybookErrors([PlaybookError("first"), PlaybookError("second")])

    async def fail() -> None:
        raise original

    with pytest.raises(PlaybookErrors) as info:
        await SharedCall(fail).get()
    assert info.value is original  # immutable: every caller gets it as it is
    named = info.value.with_host("n1")  # a copy made without its own constructor's arguments
    assert type(named) is PlaybookErrors and named.errors == original.errors
    assert named.location == original.location and str(named) == f"n1: {original}"
    assert original.host is None


# --- the load-check worker -----------------------------------------------------------------------------


@pytest.fixture
def plan(tiny_model: Path) -> Plan:
    from orchestrator.planning.plan import PlanDevice
    from orchestrator.planning.profile import profile_model

    device = PlanDevice("127.0.0.1:1", 0, "127.0.0.1:1#0", usable=512 * MiB)
    return make_plan([device], profile_model(tiny_model), PlanOptions(n_ctx=256))


def _fake_python(tmp_path: Path, body: str) -> Path:
    """A stand-in for the worker's interpreter: a shell script that writes its pid, then runs `body`."""
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
    # The plan's endpoint refuses connections, so the silence is blamed on it.
    with pytest.raises(
        LoaderError, match=r"lost 127\.0\.0\.1:1 \(refused\) while starting: .* within 0\.3 s"
    ):
        await load_check(plan, "m.gguf", limit_s=0.3)
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _placement(**changes: object) -> dict[str, object]:
    device = {
        "label": "127.0.0.1:1#0",
        "name": "RPC0",
        "endpoint": "127.0.0.1:1",
        "index": 0,
        "planned_layers": [0, 1, 2],
        "actual_layers": [0, 1, 2],
        "predicted": {"weights": 3 * MiB, "kv": MiB, "compute": 2 * MiB},
        "actual": {"weights": 3 * MiB, "kv": MiB, "compute": 2 * MiB + 5},
    }
    host = {f"{w}_{k}": 0 for w in ("predicted", "actual") for k in ("weights", "kv", "compute", "output")}
    answer = {
        "devices": [device],
        "host": host,
        "used_devices": [["RPC0", "127.0.0.1:1"]],
        "load_seconds": 0.25,
    }
    return {**answer, "log": ["load_tensors: layer   0 assigned to device RPC0"], **changes}


def _answering(tmp_path: Path, placement: object) -> Path:
    """A fake worker that reads the load request, answers `loaded` with `placement`, then exits on close."""
    line = json.dumps({"event": "loaded", "pid": 1, "placement": placement})
    return _fake_python(tmp_path, f"read -r _; echo '{line}'; read -r _")


async def test_the_worker_answer_becomes_typed_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plan: Plan
) -> None:
    monkeypatch.setattr(sys, "executable", str(_answering(tmp_path, _placement())))
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
    assert gone(int((tmp_path / "pid").read_text()))  # closed after the check


_DEVICE = _placement()["devices"][0]  # type: ignore[index]


@pytest.mark.parametrize(
    ("placement", "message"),
    [
        ([], "must be an object"),
        (_placement(devices=None), "devices must be a list"),
        (_placement(load_seconds="fast"), "load_seconds"),
        (_placement(load_seconds=True), "load_seconds"),
        (_placement(devices=[{"label": "x"}]), "name must be|endpoint must be|index"),
        (_placement(devices=[{**_DEVICE, "index": True}]), "index must be int"),
        (_placement(devices=[{**_DEVICE, "actual_layers": [0, "1"]}]), "actual_layers"),
        (_placement(devices=[{**_DEVICE, "actual": {"weights": 1}}]), "actual: kv"),
        (_placement(used_devices=[["RPC0"]]), "used_devices"),
        (_placement(log="text"), "log must be"),
    ],
)
async def test_a_malformed_worker_answer_is_a_loader_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plan: Plan, placement: object, message: str
) -> None:
    monkeypatch.setattr(sys, "executable", str(_answering(tmp_path, placement)))
    with pytest.raises(LoaderError, match=f"malformed placement: .*({message})"):
        await load_check(plan, "m.gguf", limit_s=30)
    assert gone(int((tmp_path / "pid").read_text()))
