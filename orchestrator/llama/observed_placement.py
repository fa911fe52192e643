"""Where a load put each layer and how many bytes, observed after it, against the plan's prediction
(`placement_of`; the assignment llama.cpp makes, ported, is planning/layer_assignment.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.core.errors import LoaderError
from orchestrator.llama.logs import MiB, parse_load_log
from orchestrator.planning.plan import MemoryBytes, Plan


def _mib_of(n: int) -> str:
    return f"{n / MiB:.2f}"


def exact_memory(logged: MemoryBytes, sizes: Sequence[int]) -> MemoryBytes:
    """Pair a device's logged buffers (0.01 MiB precision) with the sizes its server allocated, in order
    (weights, KV, compute), to get exact bytes. Raises ValueError when they do not correspond."""
    out: dict[str, int] = {}
    pos = 0
    for kind in ("weights", "kv", "compute"):
        target = getattr(logged, kind)
        if target == 0:
            out[kind] = 0
            continue
        while pos < len(sizes) and _mib_of(sizes[pos]) != _mib_of(target):
            pos += 1
        if pos == len(sizes):
            raise ValueError(f"no allocation of {_mib_of(target)} MiB for {kind} in {list(sizes)}")
        out[kind] = sizes[pos]
        pos += 1
    return MemoryBytes(**out)


@dataclass(frozen=True)
class DevicePlacement:
    """One device of a loaded model: what the plan predicted beside what llama.cpp allocated.

    `actual` comes from the load log, so it is exact only to 0.01 MiB (`exact_memory` refines it with
    a server's allocation log)."""

    label: str  # host:port#index, or the local device's name
    name: str  # the device name in this process: RPC<k> (a process-wide counter) or CUDA0...
    endpoint: str | None
    index: int
    planned_layers: tuple[int, ...]
    actual_layers: tuple[int, ...]
    predicted: MemoryBytes
    actual: MemoryBytes


@dataclass(frozen=True)
class HostPlacement:
    predicted_weights: int
    predicted_kv: int
    predicted_compute: int
    predicted_output: int
    actual_weights: int
    actual_kv: int
    actual_compute: int
    actual_output: int


@dataclass(frozen=True)
class Placement:
    devices: tuple[DevicePlacement, ...]
    host: HostPlacement
    used_devices: tuple[tuple[str, str], ...]  # (name, description) llama.cpp reported using, in order
    load_seconds: float
    log: tuple[str, ...] = field(repr=False)

    @property
    def layers_as_planned(self) -> bool:
        return all(d.planned_layers == d.actual_layers for d in self.devices)

    def rows(self) -> list[tuple[str, ...]]:
        """The placement as table rows (MiB): per device a `plan` row, then an `actual` row; then the host.
        Columns: PLACEMENT_COLUMNS."""
        out: list[tuple[str, ...]] = []
        for d in self.devices:
            p, a = d.predicted, d.actual
            mib = [_mib_of(x) for x in (p.weights, p.kv, p.compute)]
            out.append((d.label, d.name, layer_range(d.planned_layers), "plan", *mib, "-", _mib_of(p.total)))
            mib = [_mib_of(x) for x in (a.weights, a.kv, a.compute)]
            out.append(("", "", layer_range(d.actual_layers), "actual", *mib, "-", _mib_of(a.total)))
        h = self.host
        # the host's total is the sum of the columns shown, its output (logits) buffer included
        for kind, parts in (
            ("plan", (h.predicted_weights, h.predicted_kv, h.predicted_compute, h.predicted_output)),
            ("actual", (h.actual_weights, h.actual_kv, h.actual_compute, h.actual_output)),
        ):
            first = ("host", "CPU") if kind == "plan" else ("", "")
            out.append((*first, "", kind, *(_mib_of(x) for x in (*parts, sum(parts)))))
        return out

    def render(self) -> str:
        """A plain-text table of `rows()` (what `print(placement_of(llm))` shows)."""
        rows = [PLACEMENT_COLUMNS, *self.rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(PLACEMENT_COLUMNS))]

        def line(row: tuple[str, ...]) -> str:
            cells = zip(row, widths, strict=True)
            return "  ".join(c.rjust(w) if i >= 4 else c.ljust(w) for i, (c, w) in enumerate(cells)).rstrip()

        return "\n".join(["placement (MiB)", *map(line, rows)])

    __str__ = render


PLACEMENT_COLUMNS = ("device", "name", "layers", "", "weights", "KV", "compute", "output", "total")


def layer_range(layers: Sequence[int]) -> str:
    """`0-4` for a run of layers, `0,2` otherwise, `-` for none."""
    if not layers:
        return "-"
    if list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
    return ",".join(map(str, layers))


def build_placement(
    plan: Plan,
    names: Sequence[str],
    lines: Sequence[str],
    load_seconds: float = 0.0,
) -> Placement:
    """Predicted (from the plan) beside actual (from the load log) per device. `names` are the devices'
    names in this process, in plan order. Pure."""
    parsed = parse_load_log(lines)
    devices: list[DevicePlacement] = []
    for dev, name in zip(plan.devices, names, strict=True):
        sizes = {"weights": 0, "kv": 0, "compute": 0}
        for buf in parsed.buffers:
            mine = (
                buf.endpoint == dev.endpoint and buf.index == dev.index
                if dev.endpoint is not None
                else buf.buffer == dev.name
            )
            if mine and buf.kind in sizes:
                sizes[buf.kind] += buf.approx_bytes
        actual_layers = tuple(sorted(il for il, d in parsed.layers.items() if d == name))
        m = dev.memory
        devices.append(
            DevicePlacement(
                label=dev.label,
                name=name,
                endpoint=dev.endpoint,
                index=dev.index,
                planned_layers=dev.layers,
                actual_layers=actual_layers,
                predicted=MemoryBytes(m.weights, m.kv, m.compute),
                actual=MemoryBytes(**sizes),
            )
        )
    device_buffers = {(d.endpoint, d.index) for d in plan.devices if d.endpoint is not None}
    local_names = {d.name for d in plan.devices if d.endpoint is None}
    host = {"weights": 0, "kv": 0, "compute": 0, "output": 0}
    for buf in parsed.buffers:
        on_device = (buf.endpoint, buf.index) in device_buffers if buf.endpoint else buf.buffer in local_names
        if not on_device:
            host[buf.kind] += buf.approx_bytes
    h = plan.host
    return Placement(
        devices=tuple(devices),
        host=HostPlacement(
            h.weights, h.kv, h.compute, h.output, host["weights"], host["kv"], host["compute"], host["output"]
        ),
        used_devices=parsed.devices,
        load_seconds=load_seconds,
        log=tuple(lines),
    )


def placement_of(llm: Any) -> Placement:
    """The `Placement` of a model loaded by `load_llama`."""
    placement = getattr(llm, "rpcfleet_placement", None)
    if not isinstance(placement, Placement):
        raise LoaderError("this model was not loaded by rpcfleet's load_llama")
    return placement
