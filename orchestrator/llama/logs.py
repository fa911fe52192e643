"""Parsers of llama.cpp's load log and of a server's GGML_RPC_DEBUG log (pure)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MiB = 1024 * 1024


# llama-model.cpp: "%s: %12s model buffer size = %8.2f MiB"; llama-kv-cache.cpp: "%s: %10s KV buffer
# size = ..."; llama-memory-recurrent.cpp: "%s: %10s RS buffer size = ..." (recurrent state);
# llama-context.cpp: "%s: %10s compute buffer size = ..." and "%s: %10s  output buffer size".
_BUFFER_RE = re.compile(
    r"^(?P<func>\w+):\s+(?P<buffer>\S+)\s+(?P<kind>model|KV|RS|compute|output) buffer size =\s*"
    r"(?P<mib>[0-9]+(?:\.[0-9]+)?) MiB\s*$"
)


# ggml-rpc.cpp: buffer types are named "RPC<device index on the server>[<endpoint>]".
_RPC_BUFFER_RE = re.compile(r"^RPC(?P<index>\d+)\[(?P<endpoint>.+)\]$")


# llama.cpp: "%s: using device %s (%s) (%s) - %zu MiB free"
_USING_RE = re.compile(
    r"^\w+: using device (?P<name>\S+) \((?P<description>.*)\) \((?P<id>.*)\) - \d+ MiB free"
)


# llama-model.cpp: "load_tensors: layer %3d assigned to device %s, is_swa = %d"
_LAYER_RE = re.compile(r"^\w+: layer\s+(?P<il>\d+) assigned to device (?P<device>[^,\s]+)")


# The recurrent state counts with the KV cache: both are the model's memory per sequence, planned per
# layer on the layer's device (the plan's `kv` column holds both).
_KINDS = {"model": "weights", "KV": "kv", "RS": "kv", "compute": "compute", "output": "output"}


@dataclass(frozen=True)
class BufferLine:
    """One `... buffer size = X MiB` line: `kind` is weights, kv, compute or output."""

    kind: str
    buffer: str  # the buffer type's name: "RPC0[127.0.0.1:50052]", "CPU_Mapped", "CUDA0", ...
    mib: float
    endpoint: str | None = None  # for RPC buffers: the server and its device index
    index: int | None = None

    @property
    def approx_bytes(self) -> int:
        """The size to the log's precision (0.01 MiB: within 5243 bytes of the real size)."""
        return round(self.mib * MiB)


@dataclass(frozen=True)
class LoadLog:
    """What llama.cpp said while loading: buffers, the devices it used (name, description) in order, and
    the device each layer went to (index n_layer is the output layer)."""

    buffers: tuple[BufferLine, ...]
    devices: tuple[tuple[str, str], ...]
    layers: Mapping[int, str]


def parse_buffer_line(line: str) -> BufferLine | None:
    m = _BUFFER_RE.match(line.strip())
    if m is None:
        return None
    buffer = m.group("buffer")
    rpc_m = _RPC_BUFFER_RE.match(buffer)
    return BufferLine(
        kind=_KINDS[m.group("kind")],
        buffer=buffer,
        mib=float(m.group("mib")),
        endpoint=rpc_m.group("endpoint") if rpc_m else None,
        index=int(rpc_m.group("index")) if rpc_m else None,
    )


def parse_load_log(lines: Iterable[str]) -> LoadLog:
    buffers: list[BufferLine] = []
    devices: list[tuple[str, str]] = []
    layers: dict[int, str] = {}
    for raw in lines:
        line = raw.strip()
        if (buf := parse_buffer_line(line)) is not None:
            buffers.append(buf)
        elif (m := _USING_RE.match(line)) is not None:
            devices.append((m.group("name"), m.group("description")))
        elif (m := _LAYER_RE.match(line)) is not None:
            layers[int(m.group("il"))] = m.group("device")
    return LoadLog(tuple(buffers), tuple(devices), layers)


def join_log_records(records: Iterable[tuple[int, str]]) -> list[str]:
    """ggml log records (level, text) → whole lines: level 5 (CONT) continues the previous record, and
    a record may hold several lines or part of one."""
    text = "".join(t for _, t in records)
    return text.splitlines()


# ggml-rpc.cpp rpc_server::alloc_buffer / free_buffer, and rpc-server.cpp's connection messages.
_ALLOC_RE = re.compile(
    r"^\[alloc_buffer\] device: (?P<device>\d+), size: (?P<size>\d+) -> "
    r"(?:remote_ptr: (?P<ptr>[0-9a-fA-F]+), remote_size: (?P<rsize>\d+)|failed)"
)


_FREE_RE = re.compile(r"^\[free_buffer\] remote_ptr: (?P<ptr>[0-9a-fA-F]+)")


@dataclass(frozen=True)
class ServerAllocation:
    """One ALLOC_BUFFER a server served: `connection` counts accepted clients from 0 in this log."""

    connection: int
    device: int
    size: int
    remote_ptr: int | None  # None: the allocation failed
    remote_size: int
    freed: bool


def parse_server_log(text: str) -> tuple[ServerAllocation, ...]:
    """Every buffer allocation in a server log (started with `GGML_RPC_DEBUG=1`), in order; a buffer is
    `freed` once FREE_BUFFER names it or its client's connection closes (the server frees them all)."""
    allocs: list[dict[str, Any]] = []
    live: dict[int, int] = {}  # remote_ptr -> index into allocs
    connection = -1
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("Accepted client connection"):
            connection += 1
        elif line.startswith("Client connection closed"):
            for i in live.values():
                allocs[i]["freed"] = True
            live.clear()
        elif (m := _ALLOC_RE.match(line)) is not None:
            ptr = int(m.group("ptr"), 16) if m.group("ptr") else None
            allocs.append(
                {
                    "connection": max(connection, 0),
                    "device": int(m.group("device")),
                    "size": int(m.group("size")),
                    "remote_ptr": ptr,
                    "remote_size": int(m.group("rsize") or 0),
                    "freed": ptr is None,
                }
            )
            if ptr is not None:
                live[ptr] = len(allocs) - 1
        elif (m := _FREE_RE.match(line)) is not None:
            index = live.pop(int(m.group("ptr"), 16), None)
            if index is not None:
                allocs[index]["freed"] = True
    return tuple(ServerAllocation(**a) for a in allocs)


def model_allocations(allocs: Sequence[ServerAllocation]) -> dict[int, list[int]]:
    """Sizes allocated per device by the last connection that allocated anything (a model's connection:
    probes and registration allocate nothing), in order: weights, KV, then compute buffers."""
    ok = [a for a in allocs if a.remote_ptr is not None]
    if not ok:
        return {}
    last = ok[-1].connection
    out: dict[int, list[int]] = {}
    for a in ok:
        if a.connection == last:
            out.setdefault(a.device, []).append(a.size)
    return out
