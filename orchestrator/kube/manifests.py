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
  comes back whole, probed and planned again.
- Service `<name>-api`: the leaders' llama-server (the OpenAI API) on port `http_port`. LWS makes the
  headless service `<name>` that names the pods itself.

Probes: an rpc-server's startup, readiness and liveness are a HELLO (`rpcfleet lws hello`: a server
busy with its one client, llama-server, counts as alive); llama-server's are its `/health`.
Resources: a CPU pod's rpc-server asks for what the plan puts on its device and is limited to the
assumed `--node-memory`; a GPU pod's asks for one GPU of the backend's resource and a fixed host
allowance; llama-server asks for the plan's host memory (what stays on the leader's CPU) and an allowance
for the process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from orchestrator.kube.group import GroupSettings, pod_endpoint
from orchestrator.planning.plan import Plan

LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
CONFIG_DIR = "/etc/rpcfleet"
RUN_DIR = "/run/rpcfleet"
MODELS_DIR = "/models"
ARGS_FILE = f"{RUN_DIR}/llama-server.json"
MiB = 1024 * 1024
ENGINE_ALLOWANCE = 512 * MiB  # llama-server's own process: HTTP server, slots, tokenizer
GPU_HOST_REQUEST = 512 * MiB  # a GPU pod's rpc-server on the host side (transfers pass through it)
GPU_HOST_LIMIT = 2048 * MiB
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


def _rpc_resources(spec: ExportSpec, pods: Sequence[int]) -> dict[str, Any]:
    settings = spec.settings
    if spec.gpu_resource is None:
        planned = min(_pod_bytes(spec.plan, pods, settings.rpc_port), settings.node_memory)
        return {
            "requests": {"memory": quantity(planned)},
            "limits": {"memory": quantity(settings.node_memory)},
        }
    return {
        "requests": {"memory": quantity(GPU_HOST_REQUEST), spec.gpu_resource: "1"},
        "limits": {"memory": quantity(GPU_HOST_LIMIT), spec.gpu_resource: "1"},
    }


def _hello_probe(port: int, period: int, failures: int) -> dict[str, Any]:
    return {
        "exec": {"command": ["rpcfleet", "lws", "hello", "--port", str(port)]},
        "periodSeconds": period,
        "timeoutSeconds": 10,
        "failureThreshold": failures,
    }


def _env(spec: ExportSpec) -> list[dict[str, str]]:
    return [{"name": "RPCFLEET_HOME", "value": f"{RUN_DIR}/home"}]


def rpc_server_container(spec: ExportSpec, pods: Sequence[int], *, sidecar: bool = False) -> dict[str, Any]:
    """The rpc-server of pods `pods` (the leader's: a native sidecar)."""
    port = spec.settings.rpc_port
    container: dict[str, Any] = {
        "name": "rpc-server",
        "image": spec.image,
        "command": ["rpcfleet", "lws", "worker", "--port", str(port)],
        "env": _env(spec),
        "ports": [{"name": "rpc", "containerPort": port, "protocol": "TCP"}],
        "resources": _rpc_resources(spec, pods),
        "startupProbe": _hello_probe(port, 2, 60),
        "readinessProbe": _hello_probe(port, 10, 3),
        "livenessProbe": _hello_probe(port, 20, 3),
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
        "env": _env(spec),
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
        "env": _env(spec),
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
    pods = range(1, max(2, spec.settings.group_size))
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


def leaderworkerset(spec: ExportSpec) -> dict[str, Any]:
    return {
        "apiVersion": LWS_API,
        "kind": "LeaderWorkerSet",
        "metadata": _metadata(spec, spec.settings.name),
        "spec": {
            "replicas": spec.replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": spec.settings.group_size,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader_template(spec),
                "workerTemplate": worker_template(spec),
            },
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
