"""A formation as a group of identical pods (pure): its settings, the plan on the devices the group is
assumed to have, the devices its servers report once running, and whether those differ enough to plan
again.

Every pod of a group runs one rpc-server (the leader's beside llama-server), so a group of K pods is a
formation of K nodes, planned by the one planner (`planning.strategy.make_plan`). The exported plan
names its servers `pod-0:PORT` ... `pod-<K-1>:PORT` (pod 0 is the leader): the leader's init step puts
the addresses it found in their place.

What a pod's device may hold: a GPU's own free memory as its server reports it; for a CPU pod the
server reports the node's RAM, of which the container may use only its memory limit, so the lower of the
two (the limit is the export's `--node-memory`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from orchestrator.core.errors import InputError, PlanError, ProbeError
from orchestrator.core.units import MiB, format_size
from orchestrator.kube.constants import BACKENDS, HTTP_PORT, RPC_PORT
from orchestrator.planning.formations import MAX_RPC_DEVICES
from orchestrator.planning.plan import Plan, PlanDevice, PlanOptions, largest_ctx_text
from orchestrator.planning.profile import ModelProfile
from orchestrator.planning.strategy import make_plan
from orchestrator.probe.capacity import ALIGNMENT
from orchestrator.rpc.records import ProbeResult

# The device plugins' resource names. Vulkan has none of its own: it runs on any vendor's GPU.
GPU_RESOURCES = {"cuda": "nvidia.com/gpu", "rocm": "amd.com/gpu"}
DEVICE_NAMES = {"cpu": "CPU", "cuda": "CUDA", "rocm": "ROCm", "vulkan": "Vulkan"}
WAIT_SECONDS = 600.0  # how long the leader's init step waits for the group's servers
# A pod's memory "differs" from the assumption by more than this fraction of it, or TOLERANCE_MIN bytes.
TOLERANCE = 0.01
TOLERANCE_MIN = 16 * MiB


class ExportError(InputError):
    """The formation asked cannot be exported (bad input: exit status 2)."""


# Kubernetes' validation of an extended resource's name (apimachinery's IsQualifiedName with a prefix,
# k8s.io/kubernetes' IsExtendedResourceName): `domain/name`, the domain a DNS subdomain outside
# kubernetes.io, the name at most 63 characters.
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_RESOURCE_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def check_gpu_resource(name: str) -> str:
    """`name` when Kubernetes takes it as an extended resource (`vendor.example/gpu`); ExportError
    otherwise (the API server would refuse the LeaderWorkerSet only when it is applied)."""
    domain, slash, resource = name.partition("/")
    wrong = ""
    if not slash or not domain or not _DNS_SUBDOMAIN.fullmatch(domain) or len(domain) > 253:
        wrong = "its domain (before the '/') must be a DNS subdomain: lower-case letters, digits, '-' and '.'"
    elif domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        wrong = "the kubernetes.io domain is Kubernetes' own, not a device plugin's"
    elif not _RESOURCE_NAME.fullmatch(resource) or len(resource) > 63:
        wrong = (
            "its name (after the '/') must be at most 63 letters, digits, '-', '_' or '.', from and to a "
            "letter or digit"
        )
    if wrong:
        raise ExportError(
            f"--gpu-resource {name!r} is not an extended resource name: {wrong}",
            hint="name your device plugin's resource as domain/name: nvidia.com/gpu, amd.com/gpu, "
            "gpu.intel.com/i915",
        )
    return name


_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


def _label_key_error(key: str) -> str:
    """What is wrong with `key` as a label key (`[prefix/]name`, as apimachinery's IsQualifiedName); ""."""
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        return "its prefix (before the '/') must be a DNS subdomain"
    if not name or len(name) > 63 or not _RESOURCE_NAME.fullmatch(name):
        return "its name must be 1 to 63 letters, digits, '-', '_' or '.', from and to a letter or digit"
    return ""


def parse_labels(text: str, flag: str) -> dict[str, str]:
    """`key=value,key=value` as labels ("": none, which as a selector matches everything); ExportError
    naming the pair Kubernetes would refuse."""
    labels: dict[str, str] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        key, equals, value = pair.partition("=")
        wrong = "not key=value" if not equals else _label_key_error(key)
        if not wrong and (len(value) > 63 or not _LABEL_VALUE.fullmatch(value)):
            wrong = (
                "its value must be at most 63 letters, digits, '-', '_' or '.', from and to a letter or digit"
            )
        if wrong:
            raise ExportError(
                f"{flag} {pair!r} is not a label: {wrong}",
                hint=f"labels as key=value[,key=value], e.g. {flag} app.kubernetes.io/name=gateway",
            )
        labels[key] = value
    return labels


def check_secret_name(name: str) -> str:
    """`name` when Kubernetes takes it as a Secret's name (a DNS subdomain); ExportError otherwise."""
    if len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
        raise ExportError(
            f"--api-key-secret {name!r} is not a Secret's name",
            hint="a DNS subdomain: lower-case letters, digits, '-' and '.', from and to a letter or digit",
        )
    return name


def gpu_resource(backend: str, override: str | None = None) -> str | None:
    """The extended resource a pod of `backend` asks for one GPU (None: a CPU pod); ExportError for a
    resource given to a CPU backend, a name Kubernetes would refuse, or a GPU backend whose resource name
    is not known (Vulkan) and not given."""
    if backend == "cpu":
        if override is not None:
            raise ExportError(
                f"--gpu-resource {override} with --backend cpu: a CPU pod asks for no GPU",
                hint="drop --gpu-resource, or choose a GPU --backend (cuda, rocm, vulkan)",
            )
        return None
    if override is not None:
        return check_gpu_resource(override)
    known = GPU_RESOURCES.get(backend)
    if known is None:
        names = ", ".join(f"{v} ({k})" for k, v in GPU_RESOURCES.items())
        raise ExportError(
            f"backend {backend} has no known GPU resource name (it runs on any vendor's GPU)",
            hint=f"name your device plugin's resource with --gpu-resource: {names}, gpu.intel.com/i915...",
        )
    return known


@dataclass(frozen=True)
class GroupSettings:
    """What the pods need besides the plan (the ConfigMap's `settings.json`)."""

    name: str
    group_size: int
    backend: str
    node_memory: int  # bytes of each pod's device: a GPU's memory, or the CPU pod's memory limit
    model: str  # the model's file in the models volume (its first shard), relative to it
    rpc_port: int = RPC_PORT
    http_port: int = HTTP_PORT
    chat_template: str | None = None
    wait_seconds: float = WAIT_SECONDS

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def to_text(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_text(cls, text: str, where: str) -> GroupSettings:
        """The settings in `text` (read from `where`, named in the error); InputError when malformed."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"{where}: not JSON: {exc.msg} at line {exc.lineno}") from None
        if not isinstance(data, dict):
            raise InputError(f"{where}: the settings must be a JSON object")
        try:
            settings = cls(**data)
        except TypeError as exc:
            raise InputError(f"{where}: {exc}") from None
        checks = {
            "name": isinstance(settings.name, str) and bool(settings.name),
            "group_size": isinstance(settings.group_size, int) and 0 < settings.group_size <= MAX_RPC_DEVICES,
            "backend": settings.backend in BACKENDS,
            "node_memory": isinstance(settings.node_memory, int) and settings.node_memory > 0,
            "model": isinstance(settings.model, str)
            and bool(settings.model)
            and not settings.model.startswith("/")
            and ".." not in settings.model.split("/"),
            "rpc_port": isinstance(settings.rpc_port, int) and 0 < settings.rpc_port < 65536,
            "http_port": isinstance(settings.http_port, int) and 0 < settings.http_port < 65536,
            "chat_template": settings.chat_template is None
            or (isinstance(settings.chat_template, str) and bool(settings.chat_template)),
            "wait_seconds": isinstance(settings.wait_seconds, int | float) and settings.wait_seconds > 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            values = ", ".join(f"{name}={getattr(settings, name)!r}" for name in bad)
            raise InputError(f"{where}: invalid {values}")
        return settings


def pod_endpoint(index: int, port: int = RPC_PORT) -> str:
    """The exported plan's name of pod `index`'s server (the leader's init step replaces it)."""
    return f"pod-{index}:{port}"


def pod_index(endpoint: str) -> int | None:
    """The pod an exported plan's endpoint names (`pod-2:50052` -> 2; None: not such a name)."""
    name, _, port = endpoint.rpartition(":")
    number = name.removeprefix("pod-")
    return int(number) if name.startswith("pod-") and number.isdigit() and port.isdigit() else None


def largest_tensors(profile: ModelProfile, plan: Plan, size: int) -> tuple[int, ...]:
    """Per pod of a group of `size` (pod order): bytes of the largest tensor `plan` puts on its server."""
    layers: list[set[int]] = [set() for _ in range(size)]
    for device in plan.devices:
        pod = pod_index(device.endpoint or "")
        if pod is not None and pod < size:
            layers[pod].update(device.layers)
    return tuple(profile.largest_tensor(sorted(held)) for held in layers)


def assumed_devices(size: int, node_memory: int, backend: str, port: int = RPC_PORT) -> list[PlanDevice]:
    """The devices of a group of `size` pods as assumed: one device of `node_memory` bytes each."""
    name = DEVICE_NAMES[backend] + ("" if backend == "cpu" else "0")
    return [
        PlanDevice(
            endpoint=pod_endpoint(i, port),
            index=0,
            name=name,
            description=f"pod {i}: {backend}, {format_size(node_memory)} assumed",
            total=node_memory,
            free=node_memory,
            usable=node_memory,
            alignment=ALIGNMENT.get(backend, 32),
            backend=backend,
        )
        for i in range(size)
    ]


def plan_group(profile: ModelProfile, options: PlanOptions, settings: GroupSettings) -> Plan:
    """The plan on the group's assumed devices (it may not fit: `plan.fit`); PlanError when the planner
    can make none (no device has memory beyond the margin)."""
    devices = assumed_devices(settings.group_size, settings.node_memory, settings.backend, settings.rpc_port)
    return make_plan(devices, profile, options)


def _misfit(
    profile: ModelProfile, options: PlanOptions, settings: GroupSettings
) -> tuple[Plan | None, str, str]:
    """(the plan when it fits, else None; why it does not; what of the options would make it smaller)."""
    try:
        plan = plan_group(profile, options, settings)
    except (PlanError, ProbeError) as exc:
        return None, exc.message, _smaller(options, None)
    if plan.fit.fits:
        return plan, "", ""
    binding = plan.devices[plan.fit.binding_device or 0]
    short = format_size(plan.fit.shortfall)
    return None, f"{binding.label} is short by {short}; {largest_ctx_text(plan.fit)}", _smaller(options, plan)


def _smaller(options: PlanOptions, plan: Plan | None) -> str:
    """What of the plan's options would make it smaller: the context while some context fits; when none
    does (the weights and the compute buffer alone are too large), only the batch the compute buffer is
    sized for, --ubatch."""
    if plan is not None and plan.fit.largest_n_ctx:
        return "a smaller --ctx or --parallel"
    return f"a smaller --ubatch (now {options.n_ubatch}: no context fits, the compute buffer is sized by it)"


def choose_group(
    profile: ModelProfile, options: PlanOptions, settings: GroupSettings, *, fixed: bool
) -> tuple[GroupSettings, Plan]:
    """The group and its plan: `settings.group_size` pods when `fixed`, else the fewest pods (1 to 15, the
    most RPC devices one llama-server takes) on which the model fits. ExportError when it fits no such
    group, saying how many pods would hold it when some would."""
    size = format_size(settings.node_memory)
    if fixed:
        plan, why, smaller = _misfit(profile, options, settings)
        if plan is not None:
            return settings, plan
        enough = next(
            (
                k
                for k in range(settings.group_size + 1, MAX_RPC_DEVICES + 1)
                if _misfit(profile, options, replace(settings, group_size=k))[0] is not None
            ),
            None,
        )
        more = f"--nodes-per-group {enough}, " if enough else ""
        raise ExportError(
            f"the model fits no group of {settings.group_size} pod(s) of {size} at --ctx {options.n_ctx}: "
            + why,
            hint=f"use {more}a larger --node-memory, or {smaller}",
        )
    why = smaller = ""
    for k in range(1, MAX_RPC_DEVICES + 1):
        tried = replace(settings, group_size=k)
        plan, why, smaller = _misfit(profile, options, tried)
        if plan is not None:
            return tried, plan
    raise ExportError(
        f"the model fits no group of up to {MAX_RPC_DEVICES} pods of {size} at --ctx {options.n_ctx} (one "
        f"llama-server takes at most {MAX_RPC_DEVICES} RPC devices): with {MAX_RPC_DEVICES}, {why}",
        hint=f"use a larger --node-memory, or {smaller}",
    )


def measured_devices(
    results: Sequence[ProbeResult], settings: GroupSettings, dial: Mapping[str, str] | None = None
) -> list[PlanDevice]:
    """The planner's devices from the group's probes (in pod order, every one `ok`): a GPU's free memory
    as reported; a CPU pod's the lower of its server's figure (the node's RAM) and its memory limit.
    `dial` names each result's endpoint as the plan should (default: as probed)."""
    devices: list[PlanDevice] = []
    for pod, result in enumerate(results):
        endpoint = (dial or {}).get(result.endpoint, result.endpoint)
        for device in result.devices:
            cpu = settings.backend == "cpu"
            usable = min(device.free, settings.node_memory) if cpu else device.free
            name = DEVICE_NAMES[settings.backend] + ("" if cpu else str(device.index))
            devices.append(
                PlanDevice(
                    endpoint=endpoint,
                    index=device.index,
                    name=name,
                    description=f"pod {pod}: {settings.backend}",
                    total=device.total,
                    free=device.free,
                    usable=usable,
                    alignment=device.alignment or ALIGNMENT.get(settings.backend, 32),
                    max_size=device.max_size,
                    backend=settings.backend,
                )
            )
    return devices


def differences(devices: Sequence[PlanDevice], settings: GroupSettings) -> list[str]:
    """How the measured `devices` differ from the group's assumption (one device of `node_memory` per
    pod), one line each; empty: close enough to keep the exported plan."""
    lines: list[str] = []
    per_pod: dict[str, list[PlanDevice]] = {}
    for device in devices:
        per_pod.setdefault(device.endpoint or "", []).append(device)
    if len(per_pod) != settings.group_size:
        lines.append(f"{len(per_pod)} server(s) answer, the plan assumed {settings.group_size}")
    assumed = settings.node_memory
    slack = max(TOLERANCE_MIN, int(TOLERANCE * assumed))
    for endpoint, found in per_pod.items():
        if len(found) != 1:
            lines.append(f"{endpoint} reports {len(found)} devices, the plan assumed 1")
        for device in found:
            if abs(device.usable - assumed) > slack:
                has, had = format_size(device.usable), format_size(assumed)
                lines.append(f"{device.label} may use {has}, the plan assumed {had}")
    return lines
