"""Placement planner (pure, no I/O): devices + model profile + options → `Plan`.

The plan decides whole layers per device and passes those counts as `tensor_split`; llama.cpp then
makes exactly that assignment (`llama_cpp_assignment` is a faithful port of its arithmetic in
`llama_model::load_tensors`, and every plan is checked through it). Memory per device is predicted so it
can be compared with llama.cpp's log lines:

- weights: `<dev> model buffer size` — the sum of the device's `blk.<il>.*` tensors (each padded to the
  buffer alignment, rope_freqs duplicated per layer as llama.cpp does), plus output + output_norm (or a
  copy of token_embd when the output is tied) on the device holding the output layer. Exact.
- KV: `<dev> KV buffer size` — `n_ctx_pad` cells of K and V rows per layer, `n_ctx_pad =
  GGML_PAD(n_ctx, 256)` (llama-context.cpp); without flash attention V rows use the widest layer
  (`v_trans`). Exact.
- compute: `<dev> compute buffer size` — an estimate, see `estimate_compute`.

The default strategy ("proportional") splits the layers in proportion to the memory each device has for
layers (weights + KV): usable - margin minus the fixed costs it pays whatever its share (its compute
buffer, the output layer on the last device), re-split until the counts settle (`proportional_candidates`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .errors import PlanError
from .model import KV_CACHE_TYPES, ModelProfile, row_bytes

SCHEMA_VERSION = 1
MAX_DEVICES = 16  # llama_max_devices(): tensor_split entries
MAX_RPC_DEVICES = 15  # the scheduler takes 16 backends including the CPU
CTX_PAD = 256  # llama-context.cpp: cparams.n_ctx = GGML_PAD(cparams.n_ctx, 256)
SCHED_MAX_COPIES = 4  # GGML_SCHED_MAX_COPIES: input copies with pipeline parallelism
MiB = 1024 * 1024
# Headroom kept free on every device on top of its usable bytes: covers the compute-buffer estimate's
# error and small backend allocations. llama.cpp's own fitting (common_fit_params) keeps 1 GiB; usable
# already excludes the inventory's memory_reserve, so a smaller default is enough.
DEFAULT_MARGIN = 256 * MiB

Strategy = Literal["proportional", "fewest"]


@dataclass(frozen=True)
class PlanDevice:
    """A device a plan may use. RPC devices have an endpoint ("host:port"); local GPUs have None.

    `usable` is what the plan may fill (free memory minus the host's reserve, capped by its limit).
    `ok` is False for a device whose probe failed or whose server speaks another protocol version;
    `state` says why (as the probe reported it).
    """

    endpoint: str | None
    index: int
    name: str
    description: str = ""
    total: int = 0
    free: int = 0
    usable: int = 0
    alignment: int = 32  # buffer alignment: CPU and RPC-to-CPU 32, CUDA 128
    ok: bool = True
    state: str = "ok"
    host: str | None = None

    @property
    def is_rpc(self) -> bool:
        return self.endpoint is not None

    @property
    def label(self) -> str:
        """A name for messages: `host:port#0` for RPC devices, the backend name for local ones."""
        return f"{self.endpoint}#{self.index}" if self.endpoint is not None else self.name


@dataclass(frozen=True)
class PlanOptions:
    n_ctx: int = 4096  # 0 = the model's n_ctx_train
    type_k: str = "f16"
    type_v: str = "f16"
    n_ubatch: int = 512
    n_batch: int = 512  # llama-cpp-python's default; sizes the host output (logits) buffer
    flash_attn: bool = False
    n_gpu_layers: int = -1  # -1 = all (including the output layer)
    margin: int = DEFAULT_MARGIN
    strategy: Strategy = "proportional"
    split_mode: str = "layer"
    main_gpu: int = 0
    tensor_split: tuple[float, ...] | None = None  # user-given split: overrides the strategy
    n_ctx_cap: int | None = None  # upper bound of the largest-context search (default n_ctx_train)


@dataclass(frozen=True)
class DeviceMemory:
    """Predicted bytes on one device against what it may use."""

    weights: int
    kv: int
    compute: int
    usable: int
    margin: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute

    @property
    def headroom(self) -> int:
        """Bytes left after the prediction and the margin (negative: short by that much)."""
        return self.usable - self.margin - self.total


@dataclass(frozen=True)
class HostMemory:
    """Bytes on the machine running llama.cpp (the CPU side): never offloaded or not offloaded."""

    weights: int  # token_embd + layers kept on the CPU (+ the output layer when kept there)
    kv: int
    compute: int
    output: int  # logits buffer

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.output


@dataclass(frozen=True)
class PlannedDevice:
    endpoint: str | None
    index: int
    name: str
    description: str
    layers: tuple[int, ...]  # model layers; index n_layer is the output layer
    memory: DeviceMemory
    has_output: bool = False  # holds the output layer (output + output_norm, or token_embd's copy)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def label(self) -> str:
        return f"{self.endpoint}#{self.index}" if self.endpoint is not None else self.name


@dataclass(frozen=True)
class Fit:
    fits: bool
    binding_device: int | None  # index into plan.devices with the smallest headroom
    shortfall: int  # bytes missing on the binding device (0 when it fits)
    largest_n_ctx: int  # largest multiple of 256 that fits with this placement (0: none)


@dataclass(frozen=True)
class Plan:
    schema_version: int
    model_path: str
    model_name: str | None
    n_layer: int
    devices: tuple[PlannedDevice, ...]
    tensor_split: tuple[float, ...]
    n_gpu_layers: int  # resolved: 0..n_layer + 1
    split_mode: str
    main_gpu: int
    n_ctx: int  # as llama.cpp will use it (padded)
    pipeline_parallel: bool
    host: HostMemory
    fit: Fit
    options: PlanOptions
    notes: tuple[str, ...] = field(default=())

    @property
    def layer_counts(self) -> tuple[int, ...]:
        return tuple(d.n_layers for d in self.devices)

    @property
    def endpoints(self) -> tuple[str, ...]:
        """RPC endpoints in registration order (each once)."""
        seen: list[str] = []
        for d in self.devices:
            if d.endpoint is not None and d.endpoint not in seen:
                seen.append(d.endpoint)
        return tuple(seen)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_path(cls, path: str | Path) -> Plan:
        """The plan saved in `path`; PlanError naming the file when it is unreadable, not UTF-8 or not
        a valid plan."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise PlanError(f"cannot read plan {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise PlanError(f"plan {path} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
        try:
            return cls.from_json(text)
        except PlanError as exc:
            raise PlanError(f"{path}: {exc.message}", hint=exc.hint) from None

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise PlanError("plan JSON must be an object")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanError(
                f"unsupported plan schema version {version!r} (this rpcfleet reads version {SCHEMA_VERSION})",
                hint="re-create the plan with this version of rpcfleet",
            )
        try:
            return _plan_from_dict(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"plan JSON is malformed: {exc!r}") from exc


def _plan_from_dict(d: dict[str, Any]) -> Plan:
    opts = dict(d["options"])
    if opts.get("tensor_split") is not None:
        opts["tensor_split"] = tuple(float(x) for x in opts["tensor_split"])
    devices = tuple(
        PlannedDevice(
            endpoint=x["endpoint"],
            index=int(x["index"]),
            name=x["name"],
            description=x["description"],
            layers=tuple(int(i) for i in x["layers"]),
            memory=DeviceMemory(**x["memory"]),
            has_output=bool(x["has_output"]),
        )
        for x in d["devices"]
    )
    return Plan(
        schema_version=int(d["schema_version"]),
        model_path=d["model_path"],
        model_name=d["model_name"],
        n_layer=int(d["n_layer"]),
        devices=devices,
        tensor_split=tuple(float(x) for x in d["tensor_split"]),
        n_gpu_layers=int(d["n_gpu_layers"]),
        split_mode=d["split_mode"],
        main_gpu=int(d["main_gpu"]),
        n_ctx=int(d["n_ctx"]),
        pipeline_parallel=bool(d["pipeline_parallel"]),
        host=HostMemory(**d["host"]),
        fit=Fit(**d["fit"]),
        options=PlanOptions(**opts),
        notes=tuple(d.get("notes", ())),
    )


# --------------------------------------------------------------------------------------------------
# llama.cpp's arithmetic


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


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment if alignment > 1 else n


def largest_remainder(total: int, weights: Sequence[float]) -> list[int]:
    """Split `total` whole units proportionally to `weights` (Hamilton's method; ties go to the first)."""
    wsum = float(sum(weights))
    if total == 0 or wsum <= 0:
        return [0] * len(weights)
    quotas = [total * w / wsum for w in weights]
    counts = [math.floor(q) for q in quotas]
    rest = total - sum(counts)
    order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:rest]:
        counts[i] += 1
    return counts


# --------------------------------------------------------------------------------------------------
# device order


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


# --------------------------------------------------------------------------------------------------
# memory


def kv_layer_bytes(profile: ModelProfile, il: int, n_ctx_pad: int, opts: PlanOptions, alignment: int) -> int:
    """K and V cache tensors of layer `il` (each padded to the buffer alignment)."""
    if profile.n_head_kv[il] == 0:
        return 0
    n_v = profile.n_embd_v_gqa_max() if not opts.flash_attn else profile.n_embd_v_gqa(il)
    k = row_bytes(opts.type_k, profile.n_embd_k_gqa(il)) * n_ctx_pad
    v = row_bytes(opts.type_v, n_v) * n_ctx_pad
    return _pad(k, alignment) + _pad(v, alignment)


def estimate_compute(
    profile: ModelProfile,
    layers: Sequence[int],
    n_ctx_pad: int,
    opts: PlanOptions,
    *,
    pipeline_parallel: bool,
) -> int:
    """Estimated compute buffer of a device holding `layers` (llama.cpp's worst-case pp graph).

    The graph is reserved for n_tokens = min(n_ctx, n_ubatch) tokens against a full KV cache (n_kv =
    n_ctx_pad). ggml-alloc reuses memory, so the buffer is about the inputs plus the largest live set:
    - inputs copied onto the device: the KQ mask (n_kv × n_tokens, f32; f16 with flash attention) and
      the incoming hidden state (n_embd × n_tokens f32); with pipeline parallelism measured as 5 times
      that (GGML_SCHED_MAX_COPIES = 4 copies on top of the graph's own);
    - attention without flash attention: the KQ matrix n_head × n_kv × n_tokens f32 (soft_max in place)
      plus residual, Q, K, V and output rows; with flash attention only the rows;
    - feed-forward: 6 hidden-state rows + gate and up (n_ff wide);
    - the output layer: logits n_vocab × n_tokens f32 plus the normed hidden state.
    Calibrated against llama.cpp 0.3.36 over loopback RPC (n_embd 256-512, n_ctx 1024-4096, ubatch 512,
    f16/q8_0, with and without flash attention, one and two devices): within -3 %/+25 % of the logged
    `compute buffer size` (e.g. 79 vs 78.0 MiB, 19 vs 19.0 MiB with flash attention, 115 vs 112.0 MiB
    per device on two devices). The margin absorbs the rest.
    """
    if not layers:
        return 0
    n_tok = min(n_ctx_pad, opts.n_ubatch)
    f32 = 4
    mask = n_ctx_pad * n_tok * (2 if opts.flash_attn else 4)
    hidden = profile.n_embd * n_tok * f32
    inputs = (mask + hidden) * (SCHED_MAX_COPIES + 1 if pipeline_parallel else 1)
    repeating = [il for il in layers if il < profile.n_layer]
    peak = 0
    if repeating:
        n_head = max(profile.n_head[il] for il in repeating)
        n_kv_max = max(profile.n_embd_k_gqa(il) + profile.n_embd_v_gqa(il) for il in repeating)
        q = n_head * profile.head_dim_k * n_tok * f32
        rows = 2 * hidden + q + n_kv_max * n_tok * f32 + n_head * profile.head_dim_v * n_tok * f32
        kq = 0 if opts.flash_attn else n_head * n_ctx_pad * n_tok * f32
        n_ff = _n_ff(profile)
        ffn = 6 * hidden + 2 * n_ff * n_tok * f32
        peak = max(rows + kq, ffn)
    if profile.n_layer in layers:
        peak = max(peak, profile.n_vocab * n_tok * f32 + 2 * hidden)
    return inputs + peak


def _n_ff(profile: ModelProfile) -> int:
    widest = 0
    for t in profile.tensors:
        if t.name.endswith(".ffn_up.weight") and len(t.shape) >= 2:
            widest = max(widest, t.shape[1])
    return widest or 4 * profile.n_embd


def _host_compute(
    profile: ModelProfile, n_ctx_pad: int, opts: PlanOptions, cpu_layers: Sequence[int], pipeline: bool
) -> int:
    # Inputs live on the CPU first (token ids, positions, the mask) and the embeddings lookup runs there;
    # measured: (mask + hidden) per copy plus about 3 hidden-state rows.
    n_tok = min(n_ctx_pad, opts.n_ubatch)
    mask = n_ctx_pad * n_tok * (2 if opts.flash_attn else 4)
    hidden = profile.n_embd * n_tok * 4
    base = (mask + hidden) * (SCHED_MAX_COPIES + 1 if pipeline else 1) + 3 * hidden
    if cpu_layers:
        base += estimate_compute(profile, cpu_layers, n_ctx_pad, opts, pipeline_parallel=False)
    return base


@dataclass(frozen=True)
class _Prediction:
    memories: tuple[DeviceMemory, ...]
    host: HostMemory
    pipeline_parallel: bool


def _predict(
    profile: ModelProfile,
    devices: Sequence[PlanDevice],
    assignment: Sequence[int | None],
    n_ctx_pad: int,
    opts: PlanOptions,
    ngl: int,
) -> _Prediction:
    n_all = profile.n_layer
    pipeline_parallel = len(devices) > 1 and ngl > n_all and opts.split_mode == "layer"
    per_dev: list[list[int]] = [[] for _ in devices]
    cpu_layers: list[int] = []
    for il, where in enumerate(assignment):
        (cpu_layers if where is None else per_dev[where]).append(il)
    memories = []
    for dev, layers in zip(devices, per_dev, strict=True):
        weights = sum(profile.layer_bytes_aligned(il, dev.alignment) for il in layers if il < n_all)
        if n_all in layers:
            weights += profile.output_layer_bytes_aligned(dev.alignment)
        kv = sum(kv_layer_bytes(profile, il, n_ctx_pad, opts, dev.alignment) for il in layers if il < n_all)
        compute = estimate_compute(profile, layers, n_ctx_pad, opts, pipeline_parallel=pipeline_parallel)
        memories.append(DeviceMemory(weights, kv, compute, dev.usable, opts.margin))
    host_weights = profile.token_embd_bytes + profile.other_bytes - profile.rope_freqs_bytes
    host_weights += sum(profile.layer_bytes_aligned(il) for il in cpu_layers if il < n_all)
    if n_all in cpu_layers:
        host_weights += profile.output_layer_bytes_aligned() - (
            profile.token_embd_bytes if profile.output_tied else 0
        )
    host_kv = sum(kv_layer_bytes(profile, il, n_ctx_pad, opts, 32) for il in cpu_layers if il < n_all)
    host = HostMemory(
        weights=host_weights,
        kv=host_kv,
        compute=_host_compute(profile, n_ctx_pad, opts, cpu_layers, pipeline_parallel),
        output=profile.n_vocab * opts.n_batch * 4,
    )
    return _Prediction(tuple(memories), host, pipeline_parallel)


# --------------------------------------------------------------------------------------------------
# validation


def validate(devices: Sequence[PlanDevice], profile: ModelProfile, opts: PlanOptions) -> None:
    """Refuse inputs llama.cpp would refuse (or abort on) with a clear PlanError."""
    if opts.split_mode == "row":
        raise PlanError(
            "split mode 'row' is not supported with RPC devices "
            "(llama.cpp: 'does not support split buffers')",
            hint="use split_mode 'layer'",
        )
    if opts.split_mode != "layer":
        raise PlanError(f"unknown split mode {opts.split_mode!r}; rpcfleet plans use 'layer'")
    if opts.strategy not in ("proportional", "fewest"):
        raise PlanError(f"unknown strategy {opts.strategy!r}; expected 'proportional' or 'fewest'")
    for kind, value in (("type_k", opts.type_k), ("type_v", opts.type_v)):
        if value not in KV_CACHE_TYPES:
            raise PlanError(f"unknown KV cache {kind} {value!r}; expected one of {', '.join(KV_CACHE_TYPES)}")
    if opts.type_v not in ("f32", "f16", "bf16") and not opts.flash_attn:
        raise PlanError(
            f"a quantized V cache ({opts.type_v}) requires flash attention (llama.cpp refuses it otherwise)"
        )
    if opts.n_ctx < 0 or opts.n_ubatch <= 0 or opts.n_batch <= 0:
        raise PlanError("n_ctx must be >= 0 and n_ubatch, n_batch > 0")
    if opts.margin < 0:
        raise PlanError("margin cannot be negative")
    if not devices and opts.n_gpu_layers != 0:
        raise PlanError(
            "no devices to offload to", hint="add RPC hosts or local GPUs, or set n_gpu_layers to 0"
        )
    if len(devices) > MAX_DEVICES:
        raise PlanError(f"{len(devices)} devices: llama.cpp takes at most {MAX_DEVICES} tensor_split entries")
    n_rpc = sum(1 for d in devices if d.is_rpc)
    if n_rpc > MAX_RPC_DEVICES:
        raise PlanError(
            f"{n_rpc} RPC devices: the scheduler takes at most {MAX_RPC_DEVICES} "
            "(16 backends including the CPU)"
        )
    seen: set[tuple[str | None, int | str]] = set()
    for d in devices:
        key: tuple[str | None, int | str] = (d.endpoint, d.index) if d.is_rpc else (None, d.name)
        if key in seen:
            raise PlanError(f"device {d.label} appears twice (duplicate endpoint)")
        seen.add(key)
        if not d.ok or d.state != "ok":
            raise PlanError(
                f"device {d.label} is not usable: {d.state}",
                host=d.host,
                hint="probe the fleet and fix or exclude this host",
            )
        if d.usable < 0 or d.alignment <= 0:
            raise PlanError(f"device {d.label}: usable bytes and alignment must be positive")
    # Endpoints must be contiguous: all devices of one server, then the next (registration order).
    endpoints = [d.endpoint for d in devices if d.is_rpc]
    for i in range(1, len(endpoints)):
        if endpoints[i] != endpoints[i - 1] and endpoints[i] in endpoints[:i]:
            raise PlanError(f"endpoint {endpoints[i]} appears twice in the device list (duplicate endpoint)")
    if devices and not 0 <= opts.main_gpu < len(devices):
        raise PlanError(f"main_gpu {opts.main_gpu} is out of range (0..{len(devices) - 1})")
    if opts.tensor_split is not None:
        if len(opts.tensor_split) != len(devices):
            raise PlanError(
                f"tensor_split has {len(opts.tensor_split)} values for {len(devices)} devices "
                "(one value per device is required)"
            )
        if any(x < 0 or not math.isfinite(x) for x in opts.tensor_split):
            raise PlanError("tensor_split values must be finite and non-negative")
        if devices and opts.n_gpu_layers != 0 and not any(x > 0 for x in opts.tensor_split):
            raise PlanError("tensor_split is all zeros; give at least one device a share")


# --------------------------------------------------------------------------------------------------
# planning


def _counts_of(assignment: Sequence[int | None], n_devices: int) -> list[int]:
    counts = [0] * n_devices
    for dev in assignment:
        if dev is not None:
            counts[dev] += 1
    return counts


def _assignment_from_counts(counts: Sequence[int], n_layer: int, ngl: int) -> list[int | None]:
    start = n_layer + 1 - ngl
    out: list[int | None] = [None] * start
    for dev, c in enumerate(counts):
        out += [dev] * c
    return out


def _fewest_counts(
    profile: ModelProfile, devices: Sequence[PlanDevice], n_ctx_pad: int, opts: PlanOptions, ngl: int
) -> list[int]:
    """Fill devices in order with as many layers as fit (weights + KV + compute + margin)."""
    n_all = profile.n_layer
    start = n_all + 1 - ngl

    def fill(pipeline: bool) -> list[int]:
        counts = [0] * len(devices)
        il = start
        for di, dev in enumerate(devices):
            budget = dev.usable - opts.margin
            layers: list[int] = []
            while il <= n_all:
                trial = [*layers, il]
                w = sum(profile.layer_bytes_aligned(x, dev.alignment) for x in trial if x < n_all)
                if n_all in trial:
                    w += profile.output_layer_bytes_aligned(dev.alignment)
                kv = sum(
                    kv_layer_bytes(profile, x, n_ctx_pad, opts, dev.alignment) for x in trial if x < n_all
                )
                c = estimate_compute(profile, trial, n_ctx_pad, opts, pipeline_parallel=pipeline)
                if w + kv + c > budget:
                    break
                layers = trial
                il += 1
            counts[di] = len(layers)
            if il > n_all:
                break
        if il <= n_all:
            # Not everything fits: the rest goes to the last device so the verdict shows the shortfall.
            counts[-1] += n_all + 1 - il
        return counts

    # The compute estimate depends on pipeline parallelism, which more than one used device turns on
    # (with everything offloaded). Filling under that assumption is valid either way: if it ends up
    # on one device, pipeline parallelism is off and that device needs less.
    counts = fill(pipeline=False)
    if sum(1 for c in counts if c) > 1 and ngl > n_all:
        counts = fill(pipeline=True)
    return counts


PROPORTIONAL_ROUNDS = 4  # re-splits after today's; the counts settle after one or two in practice


@dataclass(frozen=True)
class SplitCandidate:
    """One split the proportional strategy considers: layer counts per device (0 = left out), the
    weights they are in proportion to, and the smallest headroom of the plan they make."""

    counts: tuple[int, ...]
    weights: tuple[int, ...]
    min_headroom: int


def _fixed_costs(
    profile: ModelProfile,
    devices: Sequence[PlanDevice],
    counts: Sequence[int],
    n_ctx_pad: int,
    opts: PlanOptions,
    ngl: int,
) -> tuple[int, list[int]]:
    """Predict `counts` as the plan would run them (devices without layers left out): the smallest
    headroom and, per device, its fixed costs (compute buffer + output layer; 0 for a device left out)."""
    kept = [i for i, c in enumerate(counts) if c > 0]
    devs = [devices[i] for i in kept]
    assignment = _assignment_from_counts([counts[i] for i in kept], profile.n_layer, ngl)
    pred = _predict(profile, devs, assignment, n_ctx_pad, opts, ngl)
    fixed = [0] * len(devices)
    for j, i in enumerate(kept):
        output = assignment[-1] == j  # the last entry is the output layer
        fixed[i] = pred.memories[j].compute + (
            profile.output_layer_bytes_aligned(devices[i].alignment) if output else 0
        )
    return min((m.headroom for m in pred.memories), default=0), fixed


def proportional_candidates(
    profile: ModelProfile, devices: Sequence[PlanDevice], n_ctx_pad: int, opts: PlanOptions, ngl: int
) -> list[SplitCandidate]:
    """The splits the proportional strategy considers, in order; `make_plan` takes the one with the
    largest smallest headroom (the first on ties).

    The first is today's split, by usable - margin. Each next one is in proportion to the memory each
    device has for layers (weights + KV): usable - margin minus the fixed costs the previous split's
    prediction gives it (its compute buffer and, on the last device, the output layer), which it pays
    whatever its share. A device left without layers stays out (weight 0): rejoining would cost it its
    compute buffer. Stops when the counts repeat or after PROPORTIONAL_ROUNDS re-splits.
    """
    weights = [max(d.usable - opts.margin, 0) for d in devices]
    counts = largest_remainder(ngl, weights)
    score, fixed = _fixed_costs(profile, devices, counts, n_ctx_pad, opts, ngl) if ngl else (0, [])
    out = [SplitCandidate(tuple(counts), tuple(weights), score)]
    if ngl == 0 or len(devices) < 2:
        return out
    for _ in range(PROPORTIONAL_ROUNDS):
        weights = [
            max(d.usable - opts.margin - f, 0) if c else 0
            for d, f, c in zip(devices, fixed, counts, strict=True)
        ]
        if not any(weights):
            break
        counts = largest_remainder(ngl, weights)
        if any(tuple(counts) == c.counts for c in out):
            break
        score, fixed = _fixed_costs(profile, devices, counts, n_ctx_pad, opts, ngl)
        out.append(SplitCandidate(tuple(counts), tuple(weights), score))
    return out


def _largest_ctx(
    profile: ModelProfile,
    devices: Sequence[PlanDevice],
    assignment: Sequence[int | None],
    opts: PlanOptions,
    ngl: int,
    cap: int,
) -> int:
    def fits(n_ctx_pad: int) -> bool:
        pred = _predict(profile, devices, assignment, n_ctx_pad, opts, ngl)
        return all(m.headroom >= 0 for m in pred.memories)

    lo, hi = 0, cap // CTX_PAD  # in units of 256; lo fits (0 = nothing), hi may not
    if hi == 0 or not fits(CTX_PAD):
        return 0
    lo = 1
    if fits(hi * CTX_PAD):
        return hi * CTX_PAD
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * CTX_PAD):
            lo = mid
        else:
            hi = mid
    return lo * CTX_PAD


def make_plan(
    devices: Sequence[PlanDevice], profile: ModelProfile, options: PlanOptions | None = None
) -> Plan:
    """Decide layers per device, predict memory and give a fit verdict. `devices` are already ordered
    (see `order_devices`).

    "proportional" weighs each device by usable - margin - (compute buffer + output layer), the fixed
    costs predicted for the previous split, starting from the split by usable - margin; the candidate
    with the largest smallest headroom wins. "fewest" fills devices in order; a given `tensor_split` is
    used as is."""
    opts = options or PlanOptions()
    devices = tuple(devices)
    validate(devices, profile, opts)
    for il in range(profile.n_layer):  # row_bytes raises on row widths a quantized cache cannot take
        kv_layer_bytes(profile, il, CTX_PAD, opts, 1)
    n_all = profile.n_layer
    ngl = resolve_n_gpu_layers(opts.n_gpu_layers, n_all) if devices else 0
    n_ctx = pad_ctx(opts.n_ctx or profile.n_ctx_train)
    notes: list[str] = []

    if opts.tensor_split is not None:
        split = tuple(float(x) for x in opts.tensor_split)
        if ngl == 0:
            assignment: list[int | None] = [None] * (n_all + 1)
        else:
            assignment = llama_cpp_assignment(split, n_all, ngl)
        counts = _counts_of(assignment, len(devices))
    else:
        if opts.strategy == "fewest":
            counts = _fewest_counts(profile, devices, n_ctx, opts, ngl) if devices else []
        else:
            weights = [max(d.usable - opts.margin, 0) for d in devices]
            if ngl and not any(weights):
                raise PlanError(
                    "no device has usable memory beyond the margin",
                    hint=f"lower the margin (now {opts.margin} bytes) or add devices",
                )
            candidates = proportional_candidates(profile, devices, n_ctx, opts, ngl)
            counts = list(max(candidates, key=lambda c: c.min_headroom).counts)  # first on ties
        # A device without layers still joins the model (a connection, and it turns pipeline
        # parallelism on): leave it out.
        unused = [d.label for d, c in zip(devices, counts, strict=True) if c == 0]
        if unused and ngl:
            notes.append("devices without layers left out: " + ", ".join(unused))
            kept = [i for i, c in enumerate(counts) if c > 0]
            devices = tuple(devices[i] for i in kept)
            counts = [counts[i] for i in kept]
        split = tuple(float(c) for c in counts)
        assignment = _assignment_from_counts(counts, n_all, ngl)
        if devices and ngl:
            ported = llama_cpp_assignment(split, n_all, ngl)
            if ported != assignment:
                raise PlanError(
                    f"internal error: tensor_split {list(split)} does not reproduce the intended layer "
                    f"counts {counts} in llama.cpp's arithmetic"
                )
    if not devices:
        split = ()
    main_gpu = opts.main_gpu if devices else 0

    pred = _predict(profile, devices, assignment, n_ctx, opts, ngl)
    layers_of: list[list[int]] = [[] for _ in devices]
    for il, dev in enumerate(assignment):
        if dev is not None:
            layers_of[dev].append(il)
    planned = tuple(
        PlannedDevice(
            endpoint=d.endpoint,
            index=d.index,
            name=d.name,
            description=d.description,
            layers=tuple(layers_of[i]),
            memory=pred.memories[i],
            has_output=n_all in layers_of[i],
        )
        for i, d in enumerate(devices)
    )
    if planned:
        binding = min(range(len(planned)), key=lambda i: (planned[i].memory.headroom, i))
        shortfall = max(0, -planned[binding].memory.headroom)
    else:
        binding, shortfall = None, 0
    # Up to the training context, or the asked one when larger: never report less than what fits.
    cap = opts.n_ctx_cap or max(profile.n_ctx_train, n_ctx, CTX_PAD)
    largest = _largest_ctx(profile, devices, assignment, opts, ngl, cap) if devices else cap
    if ngl < n_all + 1:
        notes.append(f"{n_all + 1 - ngl} of {n_all + 1} layers stay on the CPU")
    fit = Fit(fits=shortfall == 0, binding_device=binding, shortfall=shortfall, largest_n_ctx=largest)
    return Plan(
        schema_version=SCHEMA_VERSION,
        model_path=str(profile.path),
        model_name=profile.name,
        n_layer=n_all,
        devices=planned,
        tensor_split=split,
        n_gpu_layers=ngl,
        split_mode="layer",
        main_gpu=main_gpu,
        n_ctx=n_ctx,
        pipeline_parallel=pred.pipeline_parallel,
        host=pred.host,
        fit=fit,
        options=replace(
            opts, tensor_split=tuple(opts.tensor_split) if opts.tensor_split is not None else None
        ),
        notes=tuple(notes),
    )


# --------------------------------------------------------------------------------------------------
# renderers


def _fmt_split(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def cli_device_names(plan: Plan) -> list[str]:
    """Device names a fresh llama.cpp process gives the plan's devices: RPC devices are `RPC<k>` with k a
    process-wide counter in registration order (ggml_backend_rpc_add_server); local GPUs keep theirs."""
    names: list[str] = []
    k = 0
    for d in plan.devices:
        if d.endpoint is not None:
            names.append(f"RPC{k}")
            k += 1
        else:
            names.append(d.name)
    return names


def llama_cli_args(plan: Plan, model_path: str | Path | None = None) -> list[str]:
    """Arguments for llama-cli / llama-server (same llama.cpp) that reproduce this plan.

    `--rpc` comes before `--device` because the RPC devices exist only once registered. `--fit off`
    keeps llama.cpp from adjusting the plan's values to its own fit.
    """
    args = ["-m", str(model_path or plan.model_path)]
    if plan.endpoints:
        args += ["--rpc", ",".join(plan.endpoints)]
    if plan.devices:
        args += ["--device", ",".join(cli_device_names(plan))]
        args += [
            "--split-mode",
            plan.split_mode,
            "--tensor-split",
            ",".join(map(_fmt_split, plan.tensor_split)),
        ]
        if plan.main_gpu:
            args += ["--main-gpu", str(plan.main_gpu)]
    else:
        args += ["--device", "none"]
    opts = plan.options
    args += [
        "-ngl",
        str(plan.n_gpu_layers),
        "-c",
        str(plan.n_ctx),
        "-ub",
        str(opts.n_ubatch),
        "-ctk",
        opts.type_k,
        "-ctv",
        opts.type_v,
        "-fa",
        "on" if opts.flash_attn else "off",
        "--fit",
        "off",
    ]
    return args


def python_snippet(
    plan: Plan, model_path: str | Path | None = None, plan_path: str | Path = "plan.json"
) -> str:
    """A Python program that loads this plan (saved in `plan_path`) through rpcfleet's loader."""
    path = str(model_path or plan.model_path)
    return (
        "import orchestrator\n"
        "from orchestrator.planner import Plan\n"
        "\n"
        f"plan = Plan.from_path({str(plan_path)!r})\n"
        f"llm = orchestrator.load_llama(plan, {path!r})\n"
        "try:\n"
        "    out = llm('The capital of France is', max_tokens=16)\n"
        "    print(out['choices'][0]['text'])\n"
        "finally:\n"
        "    llm.close()\n"
    )
