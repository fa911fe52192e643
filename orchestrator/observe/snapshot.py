"""What the exporter knows about the fleet at one moment (pure data, no I/O).

A `Snapshot` is made by one probe round (`collect.Collector`) and replaced whole by the next; readers
(the scrape, the page) only ever see a complete one. Formations (a model served over some nodes) come
from whoever serves: `serve` gives one, named after its model; the exporter alone gives none.
JSON (`Snapshot.to_json`, the page's `/fleet.json`; bytes, seconds, epoch seconds; keys only added)::

    {"at": float, "interval": float, "round_seconds": float, "rounds": int,
     "nodes": [{"host", "endpoint", "up": bool, "ssh": bool, "state", "probe", "message",
                "version", "protocol", "restarts": int | null, "pid": int | null, "probed_at": float,
                "cache": {"bytes", "files"} | null,
                "devices": [{"index", "name", "description", "kind", "total", "free", "usable",
                             "held": int, "measured_at": float, "total_share": int}]}],
     "formations": [{"name", "model", "state", "nodes": [str], "slots": int, "slots_busy": int,
                     "requests": int, "completion_tokens": int, "prompt_tokens": int,
                     "recoveries": int, "reloads": int, "reason": str,
                     "devices": [{"endpoint", "index", "layers": int, "layers_label", "held"}]}],
     "events": [{"at", "kind", "host", "message"}],           # newest last
     "history": [{"at", "requests", "tokens"}]}              # one point per round: running totals
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# Every server state a node may be in (`operations.server.ServerState`, plus `unknown`: SSH unreachable).
SERVER_STATES = (
    "running",
    "busy",
    "stale",
    "stopped",
    "crashed",
    "crash-looping",
    "unhealthy",
    "orphan",
    "unknown",
)

# Up: the server runs and answers, or is held by a client (a busy server is serving someone).
UP_STATES = frozenset({"running", "busy", "stale"})

FORMATION_STATES = ("loading", "ready", "degraded", "recovering", "draining", "failed")


@dataclass(frozen=True)
class DeviceView:
    index: int
    name: str  # `<endpoint>#<index>`, as the probe names it
    description: str
    kind: str  # cpu | gpu
    total: int
    free: int
    usable: int
    held: int = 0  # bytes a loaded plan holds on it (the plan's prediction: weights + KV + compute)
    measured_at: float = 0.0  # when its memory was read (a busy server keeps its last reading)
    # `total` divided as `free` is (a CPU server's share of its machine's RAM; None: `total`): free /
    # total_share is the fraction free, like with like; free / total is not once servers share a machine.
    total_share: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "description": self.description,
            "kind": self.kind,
            "total": self.total,
            "free": self.free,
            "usable": self.usable,
            "held": self.held,
            "measured_at": round(self.measured_at, 3),
            "total_share": self.total if self.total_share is None else self.total_share,
        }


@dataclass(frozen=True)
class CacheView:
    """A tensor cache: one folder per install, shared by the servers of that install (`rpc_servers`)."""

    bytes: int
    files: int
    host: str = ""  # the machine's inventory name (not a server's `HOST/SERVER`); "": the node's
    install_dir: str = ""
    install: str = ""  # what identifies the folder on its node (`Host.install_key`); "": the node's own


@dataclass(frozen=True)
class NodeView:
    host: str
    endpoint: str
    ssh: bool  # the host's SSH connection worked this round
    state: str  # one of SERVER_STATES
    probe: str  # the RPC probe's outcome this round ("ok", "refused", ...), "skipped" when not probed
    message: str = ""
    version: str | None = None
    protocol: str | None = None
    restarts: int | None = None  # automatic restarts since the server's last start (supervisor's count)
    pid: int | None = None
    devices: tuple[DeviceView, ...] = ()
    cache: CacheView | None = None
    probed_at: float = 0.0

    @property
    def up(self) -> bool:
        if self.state == "unknown":  # no SSH: the RPC probe alone says
            return self.probe in ("ok", "busy")
        return self.state in UP_STATES

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "endpoint": self.endpoint,
            "up": self.up,
            "ssh": self.ssh,
            "state": self.state,
            "probe": self.probe,
            "message": self.message,
            "version": self.version,
            "protocol": self.protocol,
            "restarts": self.restarts,
            "pid": self.pid,
            "probed_at": round(self.probed_at, 3),
            "cache": None if self.cache is None else {"bytes": self.cache.bytes, "files": self.cache.files},
            "devices": [d.to_json() for d in self.devices],
        }


@dataclass(frozen=True)
class FormationDevice:
    endpoint: str
    index: int
    layers: int
    layers_label: str
    held: int  # bytes


@dataclass(frozen=True)
class FormationView:
    """A model served over some nodes: what `serve` reports of itself at one moment."""

    name: str
    model: str
    state: str  # one of FORMATION_STATES
    nodes: tuple[str, ...]  # endpoints the loaded plan uses
    slots: int = 1
    slots_busy: int = 0
    requests: dict[tuple[str, int], int] = field(default_factory=dict)  # (route, code) -> count
    prompt_tokens: int = 0
    completion_tokens: int = 0
    recoveries: tuple[float, ...] = ()  # each recovery's total seconds, oldest first
    reloads: int = 0
    rejoins: int = 0
    reason: str = ""
    devices: tuple[FormationDevice, ...] = ()
    # Endpoints whose RPC probes the formation makes itself (serve: its plans, recoveries, rejoins):
    # a probe of the exporter's at the same moment would make one of them see the server busy.
    probes_itself: tuple[str, ...] = ()

    @property
    def request_count(self) -> int:
        return sum(n for (route, _), n in self.requests.items() if route.startswith("/v1/"))

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.model,
            "state": self.state,
            "nodes": list(self.nodes),
            "slots": self.slots,
            "slots_busy": self.slots_busy,
            "requests": self.request_count,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "recoveries": len(self.recoveries),
            "reloads": self.reloads,
            "reason": self.reason,
            "devices": [
                {
                    "endpoint": d.endpoint,
                    "index": d.index,
                    "layers": d.layers,
                    "layers_label": d.layers_label,
                    "held": d.held,
                }
                for d in self.devices
            ],
        }


@dataclass(frozen=True)
class Event:
    at: float
    kind: str  # restart, down, up, recovery, reload, rejoin, state; serve's on-demand: load, resume,
    # loaded, load_failed, unload, swap
    host: str  # the node, or the formation's name
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"at": round(self.at, 3), "kind": self.kind, "host": self.host, "message": self.message}


@dataclass(frozen=True)
class Point:
    at: float
    requests: int
    tokens: int  # completion tokens, all formations


@dataclass(frozen=True)
class Snapshot:
    at: float  # wall clock of the round's end (0: no round yet)
    interval: float
    nodes: tuple[NodeView, ...] = ()
    formations: tuple[FormationView, ...] = ()
    events: tuple[Event, ...] = ()
    history: tuple[Point, ...] = ()
    round_seconds: float = 0.0
    rounds: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "at": round(self.at, 3),
            "interval": self.interval,
            "round_seconds": round(self.round_seconds, 4),
            "rounds": self.rounds,
            "nodes": [n.to_json() for n in self.nodes],
            "formations": [f.to_json() for f in self.formations],
            "events": [e.to_json() for e in self.events],
            "history": [
                {"at": round(p.at, 3), "requests": p.requests, "tokens": p.tokens} for p in self.history
            ],
        }


def with_held(nodes: Sequence[NodeView], formations: Sequence[FormationView]) -> tuple[NodeView, ...]:
    """The nodes with each device's `held` bytes summed over the formations' plans."""
    held: dict[tuple[str, int], int] = {}
    for f in formations:
        for d in f.devices:
            held[(d.endpoint, d.index)] = held.get((d.endpoint, d.index), 0) + d.held
    out = []
    for node in nodes:
        devices = tuple(
            DeviceView(**{**d.__dict__, "held": held.get((node.endpoint, d.index), 0)}) for d in node.devices
        )
        out.append(NodeView(**{**node.__dict__, "devices": devices}))
    return tuple(out)


def changes(before: Sequence[NodeView], after: Sequence[NodeView], at: float) -> list[Event]:
    """The events between two rounds' nodes: down, up, restart (the supervisor's count grew or the
    server's pid changed while it stayed up)."""
    old = {n.host: n for n in before}
    events = []
    for node in after:
        prev = old.get(node.host)
        if prev is None:
            continue
        if prev.up and not node.up:
            events.append(Event(at, "down", node.host, f"{node.state}: {node.message}".rstrip(": ")))
        elif node.up and not prev.up:
            events.append(Event(at, "up", node.host, node.state))
        grew = node.restarts is not None and prev.restarts is not None and node.restarts > prev.restarts
        new_pid = node.pid is not None and prev.pid is not None and node.pid != prev.pid
        if grew or new_pid:
            what = f"restarts {node.restarts}" if grew else f"pid {prev.pid} -> {node.pid}"
            events.append(Event(at, "restart", node.host, what))
    return events


def formation_changes(
    before: Sequence[FormationView], after: Sequence[FormationView], at: float
) -> list[Event]:
    """Recoveries, reloads, rejoins and state changes between two rounds' formations."""
    old = {f.name: f for f in before}
    events = []
    for f in after:
        prev = old.get(f.name)
        if prev is None:
            continue
        if len(f.recoveries) > len(prev.recoveries):
            events.append(Event(at, "recovery", f.name, f"recovered in {f.recoveries[-1]:.2f} s"))
        if f.reloads > prev.reloads:
            events.append(Event(at, "reload", f.name, f"reload {f.reloads}"))
        if f.rejoins > prev.rejoins:
            events.append(Event(at, "rejoin", f.name, f"rejoin {f.rejoins}"))
        if f.state != prev.state:
            events.append(Event(at, "state", f.name, f"{prev.state} -> {f.state}: {f.reason}".rstrip(": ")))
    return events
