"""The Kubernetes objects of a formation exported as a LeaderWorkerSet (pure: plain data in, dicts out).

- ConfigMap `<name>-config`: the plan (`plan.json`, as `rpcfleet plan -o` writes it) and the group's
  settings (`settings.json`), mounted in the leader at /etc/rpcfleet.
- LeaderWorkerSet `<name>` (leaderworkerset.x-k8s.io/v1): groups of `size` pods, each running the
  rpc-server (`rpcfleet lws worker`). The leader's rpc-server is a native sidecar (an init container
  with `restartPolicy: Always`, Kubernetes 1.29+), so it runs before the init step `plan` (`rpcfleet lws
  plan`: wait for the group's servers, probe them, plan again when their memory differs from the
  plan's assumption, write llama-server's arguments), and then the container `llama-server`
  (`rpcfleet lws serve`). `startupPolicy: LeaderCreated`: the workers start with the leader, whose init
  step waits for them (`LeaderReady` would wait for a leader that waits for its workers).
  `restartPolicy: RecreateGroupOnPodRestart`: llama-server aborts when a server is lost, and the group
  comes back whole, probed and planned again. A group of one pod has only the leader: its spec is the
  `workerTemplate` (LWS makes leaders from it when there is no `leaderTemplate`), not a template for a
  worker that does not exist.
- Service `<name>-api`: the leaders' llama-server (the OpenAI API) on port `http_port`. LWS makes the
  headless service `<name>` that names the pods itself.

Probes: an rpc-server's startup probe is a HELLO (`rpcfleet lws hello`), which passes before
llama-server connects; its readiness and liveness are `rpcfleet lws alive`, which checks the server's
process from the pid file `lws worker` writes in the pod's `run` volume and never connects. A HELLO
cannot be them: rpc-server serves one client and listens with a backlog of 1, so once llama-server holds
it a HELLO is answered "busy" and the next ones wait in the accept queue until they time out; the
kubelet would mark the leader NotReady and restart a healthy server, which recreates the group, again
and again. llama-server's probes are its `/health`.

Resources: an rpc-server receives each tensor whole into memory of its own before copying it into its
device's buffer, so a load needs, beside what the plan puts on the pod, the largest tensor planned there.
A CPU pod's rpc-server requests what the plan puts on its device and the process allowance; its limit is
`--node-memory` (what the plan may fill) plus the largest tensor and the process allowance. That buffer
is added to the limit rather than taken from the memory the planner is given: it depends on where the
plan puts the tensors (known only after planning), and `--node-memory` stays the figure the init step
compares the pods' servers with. A GPU pod's asks for one GPU of the backend's resource and host memory
for the largest tensor plus the runtime's allowance. llama-server asks for the plan's host memory (what
stays on the leader's CPU) and an allowance for the process. The resources are the export's plan's: the
init step may plan again on the pods it finds, but it cannot change its own pods' resources.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from orchestrator.core.units import MiB
from orchestrator.kube.constants import PID_FILE, RUN_DIR
from orchestrator.kube.group import GroupSettings, pod_endpoint
from orchestrator.planning.plan import Plan

LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
CONFIG_DIR = "/etc/rpcfleet"
MODELS_DIR = "/models"
ARGS_FILE = f"{RUN_DIR}/llama-server.json"
ENGINE_ALLOWANCE = 512 * MiB  # llama-server's own process: HTTP server, slots, tokenizer
RPC_ALLOWANCE = 128 * MiB  # a CPU rpc-server's own process: the program, ggml's libraries, thread stacks
# a GPU rpc-server's host side besides the tensor it receives: the CUDA/ROCm runtime and driver (hundreds
# of MiB at start), more allowed above the request as they grow with the device's work
GPU_HOST_REQUEST = 512 * MiB
GPU_HOST_LIMIT = 1536 * MiB
INIT_REQUEST, INIT_LIMIT = 128 * MiB, 512 * MiB  # the init step: Python, a GGUF header, the planner


@dataclass(frozen=True)
class ExportSpec:
    """Everything the manifests say: the group's settings and plan, and the cluster-side choices."""

    settings: GroupSettings
    plan: Plan
    replicas: int
    image: str
    model_claim: str  # the PersistentVolumeClaim holding the model, mounted read-only at /models
    gpu_resource: str | None = None
    namespace: str | None = None
    # per pod (pod order): bytes of the largest tensor the plan puts on its server, which the server holds
    # twice while it receives it (`ModelProfile.largest_tensor`); empty: none known
    largest_tensors: tuple[int, ...] = ()


def quantity(n_bytes: int) -> str:
    """Bytes as a Kubernetes quantity in whole MiB, rounded up."""
    return f"{math.ceil(n_bytes / MiB)}Mi"


def _metadata(spec: ExportSpec, name: str, component: str | None = None) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "rpcfleet", "app.kubernetes.io/instance": spec.settings.name}
    if component is not None:
        labels["app.kubernetes.io/component"] = component
    meta: dict[str, Any] = {"name": name, "labels": labels}
    if spec.namespace:
        meta["namespace"] = spec.namespace
    return meta


def _pod_bytes(plan: Plan, pods: Sequence[int], port: int) -> int:
    """The most the plan puts on one of `pods` (weights, KV, compute and the margin)."""
    wanted = {pod_endpoint(i, port) for i in pods}
    sizes = [d.memory.total + d.memory.margin for d in plan.devices if d.endpoint in wanted]
    return max(sizes, default=0)


def _receive_bytes(spec: ExportSpec, pods: Sequence[int]) -> int:
    """The largest tensor the plan puts on one of `pods`: the memory a load adds to the plan's there."""
    sizes = spec.largest_tensors
    return max((sizes[i] for i in pods if i < len(sizes)), default=0)


def _rpc_resources(spec: ExportSpec, pods: Sequence[int]) -> dict[str, Any]:
    settings = spec.settings
    receive = _receive_bytes(spec, pods)
    if spec.gpu_resource is None:
        planned = min(_pod_bytes(spec.plan, pods, settings.rpc_port), settings.node_memory)
        return {
            "requests": {"memory": quantity(planned + RPC_ALLOWANCE)},
            "limits": {"memory": quantity(settings.node_memory + receive + RPC_ALLOWANCE)},
        }
    return {
        "requests": {"memory": quantity(GPU_HOST_REQUEST + receive), spec.gpu_resource: "1"},
        "limits": {"memory": quantity(GPU_HOST_LIMIT + receive), spec.gpu_resource: "1"},
    }


def _exec_probe(command: list[str], period: int, failures: int) -> dict[str, Any]:
    return {
        "exec": {"command": command},
        "periodSeconds": period,
        "timeoutSeconds": 10,
        "failureThreshold": failures,
    }


def _env() -> list[dict[str, str]]:
    return [{"name": "RPCFLEET_HOME", "value": f"{RUN_DIR}/home"}]


def rpc_server_container(spec: ExportSpec, pods: Sequence[int], *, sidecar: bool = False) -> dict[str, Any]:
    """The rpc-server of pods `pods` (the leader's: a native sidecar)."""
    port = spec.settings.rpc_port
    alive = ["rpcfleet", "lws", "alive", "--pid-file", PID_FILE]
    container: dict[str, Any] = {
        "name": "rpc-server",
        "image": spec.image,
        "command": ["rpcfleet", "lws", "worker", "--port", str(port), "--pid-file", PID_FILE],
        "env": _env(),
        "ports": [{"name": "rpc", "containerPort": port, "protocol": "TCP"}],
        "resources": _rpc_resources(spec, pods),
        # a HELLO only until the server is up: once llama-server holds it, HELLOs fail (see the module)
        "startupProbe": _exec_probe(["rpcfleet", "lws", "hello", "--port", str(port)], 2, 60),
        "readinessProbe": _exec_probe(alive, 10, 3),
        "livenessProbe": _exec_probe(alive, 20, 3),
        "volumeMounts": [{"name": "run", "mountPath": RUN_DIR}],
    }
    if sidecar:
        container["restartPolicy"] = "Always"
    return container


def plan_container(spec: ExportSpec) -> dict[str, Any]:
    """The leader's init step: wait for the group, probe, plan again if needed, write the arguments."""
    return {
        "name": "plan",
        "image": spec.image,
        "command": [
            "rpcfleet",
            "lws",
            "plan",
            "--config",
            CONFIG_DIR,
            "--models",
            MODELS_DIR,
            "--out",
            ARGS_FILE,
        ],
        "env": _env(),
        "resources": {
            "requests": {"memory": quantity(INIT_REQUEST)},
            "limits": {"memory": quantity(INIT_LIMIT)},
        },
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "run", "mountPath": RUN_DIR},
            {"name": "models", "mountPath": MODELS_DIR, "readOnly": True},
        ],
    }


def _health(period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def llama_server_container(spec: ExportSpec) -> dict[str, Any]:
    """The leader's llama-server, with the arguments the init step wrote."""
    host = spec.plan.host.total + spec.plan.options.margin + ENGINE_ALLOWANCE
    return {
        "name": "llama-server",
        "image": spec.image,
        "command": ["rpcfleet", "lws", "serve", "--args", ARGS_FILE],
        "env": _env(),
        "ports": [{"name": "http", "containerPort": spec.settings.http_port, "protocol": "TCP"}],
        "resources": {"requests": {"memory": quantity(host)}, "limits": {"memory": quantity(host)}},
        # /health answers 503 while the model loads: the startup probe gives the load 30 minutes
        "startupProbe": _health(5, 360),
        "readinessProbe": _health(5, 3),
        "livenessProbe": _health(20, 3),
        "volumeMounts": [
            {"name": "run", "mountPath": RUN_DIR, "readOnly": True},
            {"name": "models", "mountPath": MODELS_DIR, "readOnly": True},
        ],
    }


def leader_template(spec: ExportSpec) -> dict[str, Any]:
    """Pod 0: its rpc-server (a sidecar), the init step, llama-server."""
    name = spec.settings.name
    claim = {"claimName": spec.model_claim, "readOnly": True}
    return {
        "metadata": {"labels": {"app.kubernetes.io/instance": name, "app.kubernetes.io/component": "leader"}},
        "spec": {
            "initContainers": [rpc_server_container(spec, [0], sidecar=True), plan_container(spec)],
            "containers": [llama_server_container(spec)],
            "volumes": [
                {"name": "config", "configMap": {"name": f"{name}-config"}},
                {"name": "run", "emptyDir": {}},
                {"name": "models", "persistentVolumeClaim": claim},
            ],
        },
    }


def worker_template(spec: ExportSpec) -> dict[str, Any]:
    """Pods 1 to size-1 (a group of two pods or more): each an rpc-server."""
    pods = range(1, spec.settings.group_size)
    if not pods:
        raise ValueError("a group of one pod has no worker")
    return {
        "metadata": {
            "labels": {
                "app.kubernetes.io/instance": spec.settings.name,
                "app.kubernetes.io/component": "worker",
            }
        },
        "spec": {
            "containers": [rpc_server_container(spec, pods)],
            "volumes": [{"name": "run", "emptyDir": {}}],
        },
    }


def templates(spec: ExportSpec) -> dict[str, Any]:
    """The `leaderWorkerTemplate`: a leader's and a worker's pod; a group of one pod has only the leader,
    whose spec is then the `workerTemplate` (the one LWS requires; it makes leaders from it when no
    `leaderTemplate` is given)."""
    size = spec.settings.group_size
    policy = {"size": size, "restartPolicy": "RecreateGroupOnPodRestart"}
    if size == 1:
        return {**policy, "workerTemplate": leader_template(spec)}
    return {**policy, "leaderTemplate": leader_template(spec), "workerTemplate": worker_template(spec)}


def leaderworkerset(spec: ExportSpec) -> dict[str, Any]:
    return {
        "apiVersion": LWS_API,
        "kind": "LeaderWorkerSet",
        "metadata": _metadata(spec, spec.settings.name),
        "spec": {
            "replicas": spec.replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": templates(spec),
        },
    }


def service(spec: ExportSpec) -> dict[str, Any]:
    name = spec.settings.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(spec, f"{name}-api", "api"),
        "spec": {
            "type": "ClusterIP",
            "selector": {LWS_NAME_LABEL: name, LWS_WORKER_INDEX_LABEL: "0"},
            "ports": [
                {"name": "http", "port": spec.settings.http_port, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def config_map(spec: ExportSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(spec, f"{spec.settings.name}-config"),
        "data": {"plan.json": spec.plan.to_text() + "\n", "settings.json": spec.settings.to_text()},
    }


def manifests(spec: ExportSpec) -> dict[str, dict[str, Any]]:
    """File name -> object, in the order to apply them."""
    return {
        "configmap.yaml": config_map(spec),
        "leaderworkerset.yaml": leaderworkerset(spec),
        "service.yaml": service(spec),
    }


def to_yaml(obj: dict[str, Any]) -> str:
    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False, width=110)
