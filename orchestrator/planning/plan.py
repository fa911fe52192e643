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
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from orchestrator.core.errors import PlanError, PlanFileError
from orchestrator.planning.settings import DEFAULT_MARGIN, STRATEGIES, Strategy
from orchestrator.rpc.records import EndpointError, parse_endpoint

SCHEMA_VERSION = 1


MAX_DEVICES = 16  # llama_max_devices(): tensor_split entries


MAX_RPC_DEVICES = 15  # the scheduler takes 16 backends including the CPU


CTX_PAD = 256  # llama-context.cpp: cparams.n_ctx = GGML_PAD(cparams.n_ctx, 256)
MAX_CTX = 1 << 24  # where the search for the largest context that fits stops (16M tokens)


SCHED_MAX_COPIES = 4  # GGML_SCHED_MAX_COPIES: input copies with pipeline parallelism


MiB = 1024 * 1024


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
    alignment: int = 32  # buffer alignment: CPU and RPC-to-CPU 32, CUDA 128, Vulkan the device's
    max_size: int | None = None  # the largest single buffer (ggml splits weight buffers above it)
    backend: str = "cpu"  # the server's ggml backend (cpu, vulkan, cuda...): which measurements apply
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
    strategy: Strategy = STRATEGIES[0]
    split_mode: str = "layer"
    main_gpu: int = 0
    tensor_split: tuple[float, ...] | None = None  # user-given split: overrides the strategy
    n_ctx_cap: int | None = None  # upper bound of the largest-context search (default: the training context)
    swa_full: bool = False  # llama-server's --swa-full: sliding-window layers get a full-context cache
    parallel: int = 1  # llama-server's --parallel: sequences (n_seq_max)
    kv_unified: bool = False  # llama-server's --kv-unified: one KV stream shared by all sequences
    n_cpu_moe: int = 0  # llama-server's --n-cpu-moe: the expert tensors of the first N layers stay on the CPU
    # Logits rows a ubatch reserves (llama.cpp's n_outputs_max): 0 = n_batch, llama-cpp-python's (and
    # llama.cpp's C default); llama-server's is its --parallel (x (1 + drafted tokens) with a draft).
    n_outputs_max: int = 0


@dataclass(frozen=True)
class MemoryBytes:
    """Bytes one device holds for a model: weights, KV cache, compute buffer."""

    weights: int
    kv: int
    compute: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute


@dataclass(frozen=True)
class PlannedMemory(MemoryBytes):
    """The plan's prediction for one device against what it may use; what a server reports is
    `rpc.records.DeviceMemory`, what a load allocated `llama.observed_placement.DevicePlacement.actual`."""

    usable: int
    margin: int

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
    memory: PlannedMemory
    has_output: bool = False  # holds the output layer (output + output_norm, or token_embd's copy)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def label(self) -> str:
        return f"{self.endpoint}#{self.index}" if self.endpoint is not None else self.name

    @property
    def layers_label(self) -> str:
        """`5`, or `4 + output` when the output layer is among this device's layers (counted in n_layers)."""
        return f"{self.n_layers - 1} + output" if self.has_output else str(self.n_layers)


@dataclass(frozen=True)
class Fit:
    fits: bool
    binding_device: int | None  # index into plan.devices with the smallest headroom
    shortfall: int  # bytes missing on the binding device (0 when it fits)
    largest_n_ctx: int  # largest context that fits (planned at it, it fits; 0: none)
    ctx_cap: int = 0  # the search stopped there (the training context per sequence); 0: no cap


def largest_ctx_text(fit: Fit) -> str:
    """ "the largest context that fits: N", saying when N is only the search's cap (more may fit)."""
    if not fit.largest_n_ctx:
        return "no context fits"
    text = f"the largest context that fits: {fit.largest_n_ctx}"
    if fit.ctx_cap and fit.largest_n_ctx >= fit.ctx_cap:
        text += " (capped at the model's training context; a larger --ctx searches past it)"
    return text


@dataclass(frozen=True)
class DraftPlan:
    """A draft model for speculative decoding (llama-server's `--spec-draft-model`), planned beside the
    target: `device` is "none" (llama-server's word: not offloaded, on this machine's CPU) or "first" (all
    its layers on the plan's first device, whose usable memory it took before the target's layers were
    placed). `weights`, `kv` and `compute` are on that device (the CPU for "none"); `host` is what it
    keeps on this machine besides (its token_embd, inputs and logits; everything for "none")."""

    model_path: str
    model_name: str | None
    device: str
    n_max: int
    n_min: int
    weights: int
    kv: int
    compute: int
    host: int

    @property
    def total(self) -> int:
        """Bytes of the draft on its device (on the CPU for "none": then with its host bytes)."""
        return self.weights + self.kv + self.compute + (self.host if self.device == "none" else 0)


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
    draft: DraftPlan | None = None  # speculative decoding's draft model, planned with the target

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

    def with_endpoints(self, dial: Mapping[str, str]) -> Plan:
        """This plan with its RPC endpoints replaced as `dial` says (real endpoint -> the one to dial,
        e.g. an SSH forward); endpoints not in `dial` are kept."""
        if not dial:
            return self
        devices = tuple(
            replace(d, endpoint=dial.get(d.endpoint, d.endpoint)) if d.endpoint is not None else d
            for d in self.devices
        )
        return replace(self, devices=devices)

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON data (`from_json` reads it back); `to_text` is the same as a file's text."""
        data: dict[str, Any] = json.loads(json.dumps(asdict(self)))  # tuples become lists, as in JSON
        return data

    def to_text(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=True)

    @classmethod
    def from_path(cls, path: str | Path) -> Plan:
        """The plan saved in `path`; PlanError naming the file when it is unreadable, not UTF-8 or not
        a valid plan."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise PlanFileError(f"cannot read plan {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise PlanFileError(f"plan {path} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
        try:
            return cls.from_text(text)
        except PlanError as exc:
            raise PlanFileError(f"{path}: {exc.message}", hint=exc.hint) from None

    @classmethod
    def from_text(cls, text: str) -> Plan:
        """The plan in a file's text (`to_text`); PlanError when it is not JSON or not a valid plan."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan is not valid JSON: {exc}") from exc
        return cls.from_json(data)

    @classmethod
    def from_json(cls, data: Any) -> Plan:
        """The plan in JSON data (`to_json`); PlanError when it is not a valid plan."""
        if not isinstance(data, dict):
            raise PlanError("plan JSON must be an object")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanError(
                f"unsupported plan schema version {version!r} (this rpcfleet reads version {SCHEMA_VERSION})",
                hint="re-create the plan with this version of rpcfleet",
            )
        try:
            plan = _plan_from_dict(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"plan JSON is malformed: {exc!r}") from exc
        for i, device in enumerate(plan.devices):
            if device.endpoint is not None:
                try:  # a bad host:port is the file's fault, named here, not a failure of the load later
                    parse_endpoint(device.endpoint)
                except EndpointError as exc:
                    raise PlanError(f"device {i}: {exc.message}") from None
        return plan


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
            memory=PlannedMemory(**x["memory"]),
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
        draft=DraftPlan(**d["draft"]) if d.get("draft") else None,  # plans saved before drafts: none
    )
