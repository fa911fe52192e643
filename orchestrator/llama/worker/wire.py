"""What crosses the worker's pipes, and what the parent makes of it (pure; no llama_cpp).

One JSON object per line, both ways. Parent → child (stdin): `{"op": "load" | "complete" | "chat" |
"cancel" | "close", ...}`. Child → parent (its protocol pipe): `{"event": "ready" | "progress" | "loaded" |
"token" | "done" | "error", ...}`; they become `Token`/`Done` events and `WorkerError`s here. `ready`
carries this machine's GPUs as llama.cpp lists them (`local_gpus`): the parent plans with them and never
loads libllama itself.

The `Placement` of a load crosses as JSON; `placement_from_json` checks every field, so a malformed
answer is a `ValueError` naming the field, never a half-built record.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, TypeVar

from orchestrator.core import errors as core_errors
from orchestrator.core.errors import LoaderError, RpcfleetError
from orchestrator.core.target import Target
from orchestrator.llama import errors as llama_errors
from orchestrator.llama.observed_placement import DevicePlacement, HostPlacement, Placement
from orchestrator.planning.plan import MemoryBytes, PlanDevice
from orchestrator.rpc.errors import EndpointProbeError
from orchestrator.rpc.records import Outcome, ProbeResult

T = TypeVar("T")


class WorkerError(LoaderError):
    """The worker process failed, was refused a request, or could not be started; `log_path`: the
    worker's log (`with_log` names it in the hint)."""

    log_path: Path | None = None

    def with_log(self, log_path: Path | None) -> Self:
        """A copy that keeps `log_path` and says in its hint where the log is."""
        if log_path is None:
            return self.replaced(log_path=None)
        where = f"the worker's log: {log_path}"
        return self.replaced(log_path=log_path, _hint=f"{self.hint}; {where}" if self.hint else where)


class NodeLostError(WorkerError):
    """A node of the plan stopped answering while the worker used it (`endpoints`: the lost ones, with
    `probes`: what probing every node found)."""

    def __init__(
        self,
        message: str,
        *,
        probes: tuple[ProbeResult, ...] = (),
        endpoints: tuple[str, ...] = (),
        **kw: Any,
    ) -> None:
        self.endpoints = endpoints
        self.probes = probes
        super().__init__(message, **kw)


class WorkerCrashedError(WorkerError):
    """The worker died, but every node still answers (a bug, memory, a signal from outside)."""


class WorkerTimeoutError(WorkerError):
    """The worker did not answer within its timeout (it was killed) and every node still answers."""


@dataclass(frozen=True)
class Token:
    """A piece of generated text, as it streams."""

    text: str


@dataclass(frozen=True)
class Done:
    """The end of a request: the whole text and llama.cpp's counts and timings (seconds)."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    prompt_seconds: float  # llama.cpp's prompt evaluation time
    decode_seconds: float  # llama.cpp's generation time
    decode_tokens: int  # the tokens llama.cpp evaluated one by one in that time
    first_token_seconds: float  # from the request to the first piece of text, in the child
    seconds: float  # the whole request, in the child

    @property
    def tokens_per_second(self) -> float:
        """Decoding speed, llama.cpp's own: tokens evaluated one by one over the time it took."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


Event = Token | Done


def encode(message: Mapping[str, Any]) -> bytes:
    """One message as a line (no newline inside: json.dumps escapes them)."""
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    """A line back to its message; ValueError when it is not a JSON object."""
    try:
        value = json.loads(line.decode("utf-8", "replace"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"a message must be an object, got {type(value).__name__}")
    return value


def typed(data: Mapping[str, Any], key: str, kind: type[T]) -> T:
    """`data[key]`, which must be a `kind` (an int field takes no bool, a float field takes an int)."""
    value = data.get(key)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # type: ignore[return-value]
    if not isinstance(value, kind) or (kind in (int, float) and isinstance(value, bool)):
        raise ValueError(f"{key} must be {kind.__name__}, got {value!r}")
    return value


def int_tuple(data: Mapping[str, Any], key: str) -> tuple[int, ...]:
    value = data.get(key)
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise ValueError(f"{key} must be a list of integers, got {value!r}")
    return tuple(value)


def int_fields(data: Mapping[str, Any], key: str, keys: Sequence[str]) -> dict[str, int]:
    value = data.get(key)
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be an object with integers {', '.join(keys)}, got {value!r}")
    try:
        return {k: typed(value, k, int) for k in keys}
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


def placement_to_json(placement: Placement) -> dict[str, Any]:
    data = dataclasses.asdict(placement)
    data["log"] = list(placement.log)
    return data


_MEMORY = ("weights", "kv", "compute")
_HOST = tuple(f.name for f in dataclasses.fields(HostPlacement))


def _device_from_json(data: Any) -> DevicePlacement:
    if not isinstance(data, dict):
        raise ValueError(f"a device must be an object, got {type(data).__name__}")
    endpoint = data.get("endpoint")
    if endpoint is not None and not isinstance(endpoint, str):
        raise ValueError(f"endpoint must be a string or null, got {endpoint!r}")
    return DevicePlacement(
        label=typed(data, "label", str),
        name=typed(data, "name", str),
        endpoint=endpoint,
        index=typed(data, "index", int),
        planned_layers=int_tuple(data, "planned_layers"),
        actual_layers=int_tuple(data, "actual_layers"),
        predicted=MemoryBytes(**int_fields(data, "predicted", _MEMORY)),
        actual=MemoryBytes(**int_fields(data, "actual", _MEMORY)),
    )


def placement_from_json(data: Any) -> Placement:
    """The child's placement; ValueError naming the first field that is missing or of the wrong type."""
    if not isinstance(data, dict):
        raise ValueError(f"the placement must be an object, got {type(data).__name__}")
    devices = data.get("devices")
    if not isinstance(devices, list):
        raise ValueError("devices must be a list")
    used = data.get("used_devices")
    if not isinstance(used, list) or not all(
        isinstance(u, list) and len(u) == 2 and all(isinstance(s, str) for s in u) for u in used
    ):
        raise ValueError(f"used_devices must be a list of [name, description], got {used!r}")
    log = data.get("log")
    if not isinstance(log, list) or not all(isinstance(line, str) for line in log):
        raise ValueError("log must be a list of strings")
    return Placement(
        devices=tuple(_device_from_json(d) for d in devices),
        host=HostPlacement(**int_fields(data, "host", _HOST)),
        used_devices=tuple((u[0], u[1]) for u in used),
        load_seconds=typed(data, "load_seconds", float),
        log=tuple(log),
    )


def devices_to_json(devices: Sequence[PlanDevice]) -> dict[str, Any]:
    """The local GPUs as JSON: an object, as every `*to_json` gives (`devices_from_json` reads it)."""
    return {"devices": [dataclasses.asdict(d) for d in devices]}


_DEVICE_FIELDS = {f.name: f for f in dataclasses.fields(PlanDevice)}


def devices_from_json(data: Any) -> list[PlanDevice]:
    """The child's local GPUs; ValueError naming the first field that is missing or of the wrong type."""
    if not isinstance(data, dict) or not isinstance(data.get("devices"), list):
        raise ValueError(f"local_gpus must be an object with a list of devices, got {data!r:.80}")
    devices = []
    for item in data["devices"]:
        if not isinstance(item, dict) or set(item) != set(_DEVICE_FIELDS):
            raise ValueError(f"a local GPU must be an object with the fields {sorted(_DEVICE_FIELDS)}")
        endpoint, host = item["endpoint"], item["host"]
        if endpoint is not None or (host is not None and not isinstance(host, str)):
            raise ValueError(
                f"a local GPU has no endpoint and a string or null host, got {endpoint!r}, {host!r}"
            )
        devices.append(
            PlanDevice(
                endpoint=None,
                index=typed(item, "index", int),
                name=typed(item, "name", str),
                description=typed(item, "description", str),
                total=typed(item, "total", int),
                free=typed(item, "free", int),
                usable=typed(item, "usable", int),
                alignment=typed(item, "alignment", int),
                ok=typed(item, "ok", bool),
                state=typed(item, "state", str),
                host=host,
            )
        )
    return devices


def error_from_child(message: Mapping[str, Any], log_path: Path | None) -> RpcfleetError:
    """The child's error event as the error class it names (loader refusals keep their type)."""
    name = str(message.get("type", ""))
    cls = getattr(llama_errors, name, None) or getattr(core_errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, RpcfleetError)) or issubclass(
        cls, core_errors.InputError
    ):
        cls = WorkerError
    text = str(message.get("message", "the worker failed"))
    if cls is WorkerError and name not in ("", "WorkerError"):
        text = f"{name}: {text}"
    host, found = message.get("host"), message.get("dial")
    dial = found if isinstance(found, str) else None
    if issubclass(cls, EndpointProbeError):
        try:
            outcome = Outcome(str(message.get("outcome")))
        except ValueError:
            outcome = Outcome.REFUSED
        result = ProbeResult(
            str(host or ""), outcome, None, (), text, 0.0, dial=dial if isinstance(dial, str) else None
        )
        return cls(result, text, hint=message.get("hint"))
    where = Target(host, dial) if isinstance(host, str) and dial else host
    err = cls(text, host=where, hint=message.get("hint"), stderr=message.get("stderr"))
    return err.replaced(log_path=log_path) if isinstance(err, WorkerError) else err


def done_from_json(answer: Mapping[str, Any]) -> Done:
    def number(key: str) -> float:
        value = answer.get(key, 0)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0

    finish = answer.get("finish_reason")
    return Done(
        text=str(answer.get("text", "")),
        finish_reason=finish if isinstance(finish, str) else None,
        prompt_tokens=int(number("prompt_tokens")),
        completion_tokens=int(number("completion_tokens")),
        prompt_seconds=number("prompt_seconds"),
        decode_seconds=number("decode_seconds"),
        decode_tokens=int(number("decode_tokens")),
        first_token_seconds=number("first_token_seconds"),
        seconds=number("seconds"),
    )
