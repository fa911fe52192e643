"""Progress of a model load over RPC: what the worker measures, and the rates and ETA made of it (pure).

The worker child reports, a few times a second, llama.cpp's own fraction (bytes of tensors loaded, from
its progress callback) and, per endpoint, the bytes the servers have acknowledged on the child's TCP
connections to them (`TCP_INFO`'s `tcpi_bytes_acked`): bytes that really crossed the link, so a cache
hit (a hash instead of the tensor) shows as no bytes. With `rpc_transport: ssh` the child's connection
ends at the local SSH forward, so the count runs ahead of the link by what ssh buffers (its window).
The parent turns those samples into `LoadProgress` records: per node the bytes sent, the share of the
plan's weights it holds, and the current rate; for the load, the ETA from the fraction.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from orchestrator.planning.plan import Plan

RATE_WINDOW = 1.0  # seconds of samples behind a node's current rate
LOG_INTERVAL = 1.0  # seconds between two `load_progress` log events


@dataclass(frozen=True)
class NodeProgress:
    endpoint: str
    sent: int  # bytes acknowledged by the server since the load began
    planned: int  # bytes of weights the plan puts on this endpoint's devices
    to_send: int  # of those, the bytes that cross the link: all but the cache hits
    bytes_per_second: float  # over the last RATE_WINDOW seconds

    def as_dict(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "to_send": self.to_send,
            "planned": self.planned,
            "mb_per_s": round(self.bytes_per_second / 1e6, 1),
        }


@dataclass(frozen=True)
class LoadProgress:
    fraction: float  # llama.cpp's: bytes of tensors loaded over all (0..1)
    seconds: float  # since the load began, in the worker
    nodes: tuple[NodeProgress, ...]

    @property
    def eta_seconds(self) -> float | None:
        """Seconds left at the average pace so far (None before the first tensor)."""
        if self.fraction <= 0.0:
            return None
        return max(0.0, self.seconds * (1.0 - self.fraction) / self.fraction)

    @property
    def sent(self) -> int:
        return sum(n.sent for n in self.nodes)

    def as_log(self) -> dict[str, Any]:
        """The fields of a `load_progress` log event."""
        eta = self.eta_seconds
        return {
            "percent": round(100 * self.fraction, 1),
            "seconds": round(self.seconds, 2),
            "eta_s": None if eta is None else round(eta, 1),
            "sent": self.sent,
            "nodes": {n.endpoint: n.as_dict() for n in self.nodes},
        }


def planned_bytes(plan: Plan) -> dict[str, int]:
    """Per endpoint of the plan, the bytes of weights its devices will hold."""
    planned = dict.fromkeys(plan.endpoints, 0)
    for device in plan.devices:
        if device.endpoint is not None:
            planned[device.endpoint] += device.memory.weights
    return planned


@dataclass
class ProgressTracker:
    """Turns the worker's samples into `LoadProgress`, keeping a short history per node for its rate.

    Samples name the plan's endpoints (the child counts a forward's bytes under its endpoint);
    `skipped` gives per endpoint the bytes of cache hits (sent as hashes only)."""

    planned: Mapping[str, int]
    skipped: Mapping[str, int] = field(default_factory=dict)
    _history: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    _logged: LoadProgress | None = None

    def due_for_log(self, progress: LoadProgress) -> bool:
        """Whether `progress` goes to the log: the first, then one per LOG_INTERVAL, and the one that
        reaches 100%."""
        last = self._logged
        if (
            last is None
            or progress.seconds - last.seconds >= LOG_INTERVAL
            or progress.fraction >= 1.0 > last.fraction
        ):
            self._logged = progress
            return True
        return False

    def update(self, fraction: float, seconds: float, sent: Mapping[str, int]) -> LoadProgress:
        nodes = []
        for endpoint, planned in self.planned.items():
            now = sent.get(endpoint, 0)
            history = self._history.setdefault(endpoint, [(0.0, 0)])  # the load's start
            history.append((seconds, now))
            while len(history) > 2 and seconds - history[1][0] >= RATE_WINDOW:
                history.pop(0)
            then, before = history[0]
            rate = (now - before) / (seconds - then) if seconds > then else 0.0
            to_send = max(0, planned - self.skipped.get(endpoint, 0))
            nodes.append(NodeProgress(endpoint, now, planned, to_send, max(0.0, rate)))
        return LoadProgress(min(1.0, max(0.0, fraction)), seconds, tuple(nodes))


def progress_sample(message: Mapping[str, Any]) -> tuple[float, float, dict[str, int]]:
    """A `progress` event's fraction, seconds and bytes per endpoint; ValueError naming a bad field."""
    fraction, seconds = message.get("fraction"), message.get("seconds")
    for key, value in (("fraction", fraction), ("seconds", seconds)):
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ValueError(f"{key} must be a number, got {value!r}")
    sent = message.get("sent")
    if not isinstance(sent, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in sent.items()
    ):
        raise ValueError(f"sent must map endpoints to integers, got {sent!r}")
    return float(fraction), float(seconds), dict(sent)  # type: ignore[arg-type]
