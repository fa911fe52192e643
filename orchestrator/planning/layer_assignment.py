"""Where llama.cpp puts each layer for a split (a port of its assignment), and device order."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from orchestrator.core.errors import PlanError
from orchestrator.planning.plan import CTX_PAD, PlanDevice


def llama_cpp_assignment(tensor_split: Sequence[float], n_layer: int, n_gpu_layers: int) -> list[int | None]:
    """Device index (or None = CPU) of each of the n_layer + 1 layers (the last is the output layer).

    A port of `llama_model::load_tensors` (llama-model.cpp, 0.3.36): split points are the float32
    cumulative sums of `tensor_split` divided by their float32 total; layer `il >= i_gpu_start` goes to
    `upper_bound(splits, float(il - i_gpu_start) / act_gpu_layers)`. An all-zero split means "by free
    memory", which needs the devices: it is refused here.
    """
    n_devices = len(tensor_split)
    n_all = n_layer
    # llama_model::n_gpu_layers(): negative means n_layer + 1 (as unsigned, then stored in an int).
    ngl = n_gpu_layers if n_gpu_layers >= 0 else n_all + 1
    i_gpu_start = max(n_all + 1 - ngl, 0)
    act_gpu_layers = 0 if n_devices == 0 else min(ngl, n_all + 1)
    splits = np.asarray(tensor_split, dtype=np.float32)
    if n_devices and act_gpu_layers and not np.any(splits != 0):
        raise PlanError("an all-zero tensor_split means 'by free memory'; pass explicit values")
    split_sum = np.float32(0.0)
    cum = np.empty(n_devices, dtype=np.float32)
    for i in range(n_devices):
        split_sum = np.float32(split_sum + splits[i])
        cum[i] = split_sum
    with np.errstate(invalid="ignore", divide="ignore"):  # 0/0 only when nothing is offloaded
        for i in range(n_devices):
            cum[i] = np.float32(cum[i] / split_sum)
    out: list[int | None] = []
    for il in range(n_all + 1):
        if il < i_gpu_start or (il - i_gpu_start) >= act_gpu_layers:
            out.append(None)
            continue
        # float(il - i_gpu_start) / act_gpu_layers: float / int → float32 division.
        value = np.float32(np.float32(il - i_gpu_start) / np.float32(act_gpu_layers))
        # std::upper_bound: first element strictly greater than value.
        k = int(np.searchsorted(cum, value, side="right"))
        if k >= n_devices:
            # devices.at(k) would throw std::out_of_range in llama.cpp
            raise PlanError(f"tensor_split {list(tensor_split)} assigns layer {il} past the last device")
        out.append(k)
    return out


def resolve_n_gpu_layers(n_gpu_layers: int, n_layer: int) -> int:
    """Layers llama.cpp will offload (`act_gpu_layers` with at least one device)."""
    return n_layer + 1 if n_gpu_layers < 0 else min(n_gpu_layers, n_layer + 1)


def pad_ctx(n_ctx: int) -> int:
    return -(-n_ctx // CTX_PAD) * CTX_PAD


def pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment if alignment > 1 else n


WEIGHT_TIE = 8 << 20  # bytes, at most 0.1% of the mean weight: what free memory moves between probes


def largest_remainder(total: int, weights: Sequence[float]) -> list[int]:
    """Split `total` whole units proportionally to `weights` (bytes; Hamilton's method). Remainders
    closer than what WEIGHT_TIE bytes of weight make (at most 0.1% of the mean weight) are a tie, which
    goes to the first devices: devices whose free memory differs only by what moves between two probes
    always get the same split."""
    wsum = float(sum(weights))
    if total == 0 or wsum <= 0:
        return [0] * len(weights)
    quotas = [total * w / wsum for w in weights]
    counts = [math.floor(q) for q in quotas]
    rest = total - sum(counts)
    if rest == 0:
        return counts
    tie = min(WEIGHT_TIE, wsum / len(weights) / 1000) * total / wsum
    remainders = [q - c for q, c in zip(quotas, counts, strict=True)]
    cut = sorted(remainders, reverse=True)[rest - 1]
    sure = [i for i, r in enumerate(remainders) if r > cut + tie]
    tied = [i for i, r in enumerate(remainders) if abs(r - cut) <= tie]
    for i in sure + tied[: rest - len(sure)]:
        counts[i] += 1
    return counts


def order_devices(
    rpc_devices: Sequence[PlanDevice],
    local_gpus: Sequence[PlanDevice],
    local_devices: Sequence[str] | None = None,
) -> tuple[PlanDevice, ...]:
    """The device order llama-cpp-python's RPC adapter uses: all devices of each RPC endpoint (endpoints in
    first-seen order, devices by index), then the selected local GPUs.

    `local_devices`: None = every local GPU in the given order, [] = none, names = those, in that order.
    """
    by_endpoint: dict[str, list[PlanDevice]] = {}
    for dev in rpc_devices:
        if dev.endpoint is None:
            raise PlanError(f"device {dev.name} is listed as an RPC device but has no endpoint")
        by_endpoint.setdefault(dev.endpoint, []).append(dev)
    ordered: list[PlanDevice] = []
    for endpoint, devs in by_endpoint.items():
        indices = [d.index for d in devs]
        if len(set(indices)) != len(indices):
            raise PlanError(f"endpoint {endpoint} lists device index {_first_dup(indices)} twice")
        ordered += sorted(devs, key=lambda d: d.index)
    names = [d.name for d in local_gpus]
    if len(set(names)) != len(names):
        raise PlanError(f"local device {_first_dup(names)} is listed twice")
    if local_devices is None:
        ordered += local_gpus
    else:
        if len(set(local_devices)) != len(local_devices):
            raise PlanError(f"local_devices names {_first_dup(list(local_devices))} twice")
        by_name = {d.name: d for d in local_gpus}
        for name in local_devices:
            if name not in by_name:
                known = ", ".join(names) or "none"
                raise PlanError(f"local device {name!r} not found (local GPUs: {known})")
            ordered.append(by_name[name])
    return tuple(ordered)


def _first_dup(items: Sequence[Any]) -> Any:
    seen: set[Any] = set()
    for x in items:
        if x in seen:
            return x
        seen.add(x)
    return None
