"""The `load_check` step: a real load of the plan in a child process, compared to the prediction."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.core.errors import (
    LoaderError,
    RpcfleetError,
)

if TYPE_CHECKING:  # imported lazily at run time: planning pulls in numpy
    from orchestrator.planning.plan import MemoryBytes, Plan
from orchestrator.playbooks.model import T

_LOAD_CHECK_TIMEOUT = 300.0
_ROOT = str(Path(__file__).resolve().parents[2])  # the checkout, on the load-check child's path


@dataclass(frozen=True)
class DeviceCheck:
    """One device of a load check: the layers the plan put there and those llama.cpp placed there, and
    the memory predicted and allocated (bytes)."""

    label: str
    endpoint: str | None
    index: int
    planned_layers: tuple[int, ...]
    actual_layers: tuple[int, ...]
    predicted: MemoryBytes
    actual: MemoryBytes

    @property
    def as_planned(self) -> bool:
        return self.planned_layers == self.actual_layers

    @classmethod
    def from_json(cls, data: Any) -> DeviceCheck:
        """From the child's JSON; ValueError when a field is missing or of the wrong type."""
        from orchestrator.planning.plan import MemoryBytes

        if not isinstance(data, dict):
            raise ValueError(f"a device must be an object, got {type(data).__name__}")
        endpoint = data.get("endpoint")
        if endpoint is not None and not isinstance(endpoint, str):
            raise ValueError(f"endpoint must be a string or null, got {endpoint!r}")
        return cls(
            label=_typed(data, "label", str),
            endpoint=endpoint,
            index=_typed(data, "index", int),
            planned_layers=_int_tuple(data, "planned_layers"),
            actual_layers=_int_tuple(data, "actual_layers"),
            predicted=MemoryBytes(**_int_mapping(data, "predicted", ("weights", "kv", "compute"))),
            actual=MemoryBytes(**_int_mapping(data, "actual", ("weights", "kv", "compute"))),
        )


@dataclass(frozen=True)
class LoadCheckResult:
    """What `load_check` found: whether every device got the layers the plan gave it, how long the load
    took, and each device."""

    layers_as_planned: bool
    load_seconds: float
    devices: tuple[DeviceCheck, ...]

    @classmethod
    def from_json(cls, data: Any) -> LoadCheckResult:
        """From the child's JSON; ValueError when it is not the expected shape."""
        if not isinstance(data, dict):
            raise ValueError(f"the answer must be an object, got {type(data).__name__}")
        devices = data.get("devices")
        if not isinstance(devices, list):
            raise ValueError("devices must be a list")
        seconds = data.get("load_seconds")
        if not isinstance(seconds, int | float) or isinstance(seconds, bool):
            raise ValueError(f"load_seconds must be a number, got {seconds!r}")
        return cls(
            layers_as_planned=_typed(data, "layers_as_planned", bool),
            load_seconds=float(seconds),
            devices=tuple(DeviceCheck.from_json(d) for d in devices),
        )


def _typed(data: Mapping[str, Any], key: str, kind: type[T]) -> T:
    value = data.get(key)
    # bool is an int: an int field must not take true/false (and a bool field takes only those).
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{key} must be {kind.__name__}, got {value!r}")
    return value


def _int_tuple(data: Mapping[str, Any], key: str) -> tuple[int, ...]:
    value = data.get(key)
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise ValueError(f"{key} must be a list of integers, got {value!r}")
    return tuple(value)


def _int_mapping(data: Mapping[str, Any], key: str, keys: Sequence[str]) -> dict[str, int]:
    value = data.get(key)
    if not isinstance(value, dict) or not all(
        isinstance(value.get(k), int) and not isinstance(value.get(k), bool) for k in keys
    ):
        raise ValueError(f"{key} must be an object with integers {', '.join(keys)}, got {value!r}")
    return {k: value[k] for k in keys}


async def load_check(
    plan: Plan, model: str | Path, *, limit_s: float = _LOAD_CHECK_TIMEOUT
) -> LoadCheckResult:
    """Load `model` through `plan` in a child Python process and return where its layers went.

    A child, because a loaded model holds its servers for the life of the process that loaded it (one
    client per server) and the native client aborts its process when a server misbehaves. The child
    never outlives this call: on a timeout, a cancellation (Ctrl-C, an outer timeout) or any other
    error it is killed and reaped, so the servers are free again.
    """
    request = json.dumps({"plan": plan.to_json(), "model": str(model)}).encode()
    env = {
        **os.environ,
        "GGML_NO_BACKTRACE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")])),
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "from orchestrator.playbooks.load_check import _load_check_child; _load_check_child()",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(request), limit_s)
    except TimeoutError:
        await _kill(process)
        raise LoaderError(f"loading {model} did not finish within {limit_s:g} s") from None
    except BaseException:
        await _kill(process)
        raise
    text = stderr.decode(errors="replace")
    try:
        answer = json.loads(stdout.decode(errors="replace").strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise LoaderError(
            f"the load check of {model} died (exit status {process.returncode})", stderr=text
        ) from None
    if isinstance(answer, dict) and "error" in answer:
        raise LoaderError(f"loading {model} failed: {answer['error']}", hint=answer.get("hint"), stderr=text)
    try:
        return LoadCheckResult.from_json(answer)
    except ValueError as exc:
        raise LoaderError(f"the load check of {model} answered malformed JSON: {exc}", stderr=text) from None


async def _kill(process: asyncio.subprocess.Process) -> None:
    """Kill `process` and reap it, even when the caller is being cancelled."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    # Shielded: a second cancellation must not leave a zombie (or a live child) behind.
    await asyncio.shield(process.wait())


def _load_check_child() -> None:
    """The child of `load_check`: a plan and a model path as JSON on stdin, one JSON line on stdout."""
    from orchestrator.llama.loader import load_llama
    from orchestrator.llama.placement import placement_of
    from orchestrator.planning.plan import Plan

    request = json.loads(sys.stdin.read())
    try:
        plan = Plan.from_json(request["plan"])
        llm = load_llama(plan, request["model"])
    except RpcfleetError as exc:
        print(json.dumps({"error": exc.message, "hint": exc.hint}), flush=True)
        return
    placement = placement_of(llm)
    devices = [
        {
            "label": d.label,
            "endpoint": d.endpoint,
            "index": d.index,
            "planned_layers": list(d.planned_layers),
            "actual_layers": list(d.actual_layers),
            "predicted": dataclasses.asdict(d.predicted),
            "actual": dataclasses.asdict(d.actual),
        }
        for d in placement.devices
    ]
    llm.close()
    answer = {
        "layers_as_planned": placement.layers_as_planned,
        "load_seconds": placement.load_seconds,
        "devices": devices,
    }
    print(json.dumps(answer), flush=True)
