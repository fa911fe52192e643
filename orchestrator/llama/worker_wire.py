"""The worker's wire format: one JSON object per line, both ways (pure; no llama_cpp).

Parent → child (stdin): `{"op": "complete" | "chat" | "close", ...}`.
Child → parent (its protocol pipe): `{"event": "loaded" | "token" | "done" | "error", ...}`.

The `Placement` of a load crosses as JSON; `placement_from_json` checks every field, so a malformed
answer is a `ValueError` naming the field, never a half-built record.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from orchestrator.llama.placement import DevicePlacement, HostPlacement, MemoryBytes, Placement

T = TypeVar("T")


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
