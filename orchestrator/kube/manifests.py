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
- NetworkPolicy `<name>`: every pod of the set takes, on its own, only llama-server's port, from the pods
  `http_from` selects; `<name>-group-<g>` (a group of two pods or more, one per group of `replicas`):
  the pods of group g take the RPC port from that group's leader only. rpc-server has no authentication
  and listens on every address, so nothing else may reach it. A group beyond `replicas` (after `kubectl
  scale`) has no such policy: its workers refuse its leader, which fails its wait (closed, not open).

Security: every pod runs as the image's user (65532, `runAsNonRoot`), with RuntimeDefault seccomp, no
privilege escalation, no capability, a read-only root filesystem and no service-account token: the Pod
Security "restricted" profile. What the programs write goes to emptyDir volumes: `run` (the pid file,
llama-server's arguments, RPCFLEET_HOME) and `tmp` (/tmp). llama-server runs with `--no-slots` (its
/slots endpoint shows every slot's prompt), and with `api_key_secret` reads its key from that Secret.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from orchestrator.core.units import MiB
from orchestrator.kube.constants import API_KEY_ITEM, CLIENT_LABEL, NODE_CPUS, PID_FILE, RUN_DIR
from orchestrator.kube.group import GroupSettings, pod_endpoint
from orchestrator.planning.plan import Plan

LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"  # leaders and workers (LWS's pod webhook)
CONFIG_DIR = "/etc/rpcfleet"
MODELS_DIR = "/models"
TMP_DIR = "/tmp"
ARGS_FILE = f"{RUN_DIR}/llama-server.json"
API_KEY_DIR = "/var/run/secrets/rpcfleet"
API_KEY_FILE = f"{API_KEY_DIR}/{API_KEY_ITEM}"
# deploy/Containerfile's USER, named here too: runAsNonRoot alone lets the kubelet start only an image
# whose user is a number other than 0, and fsGroup makes the volumes' files the pods' group's
RUN_AS = 65532
ENGINE_ALLOWANCE = 512 * MiB  # llama-server's own process: HTTP server, slots, tokenizer
RPC_ALLOWANCE = 128 * MiB  # a CPU rpc-server's own process: the program, ggml's libraries, thread stacks
# a GPU rpc-server's host side besides the tensor it receives: the CUDA/ROCm runtime and driver (hundreds
# of MiB at start), more allowed above the request as they grow with the device's work
GPU_HOST_REQUEST = 512 * MiB
GPU_HOST_LIMIT = 1536 * MiB
INIT_REQUEST, INIT_LIMIT = 128 * MiB, 512 * MiB  # the init step: Python, a GGUF header, the planner
INIT_CPU_REQUEST = "100m"  # it mostly waits for the group's servers


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
    node_cpus: int = NODE_CPUS
    # the pods that may call llama-server (labels; None: rpcfleet/client=<name>, {}: every pod), in the
    # namespaces `http_from_namespace` selects (None: the objects' own; {}: every namespace)
    http_from: Mapping[str, str] | None = None
    http_from_namespace: Mapping[str, str] | None = None
    api_key_secret: str | None = None  # a Secret with llama-server's keys under `api-key`


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
    # as many CPUs as threads (`lws worker --threads`): more threads than the limit would be throttled
    cpus = str(spec.node_cpus)
    if spec.gpu_resource is None:
        planned = min(_pod_bytes(spec.plan, pods, settings.rpc_port), settings.node_memory)
        return {
            "requests": {"cpu": cpus, "memory": quantity(planned + RPC_ALLOWANCE)},
            "limits": {"cpu": cpus, "memory": quantity(settings.node_memory + receive + RPC_ALLOWANCE)},
        }
    return {
        "requests": {"cpu": cpus, "memory": quantity(GPU_HOST_REQUEST + receive), spec.gpu_resource: "1"},
        "limits": {"cpu": cpus, "memory": quantity(GPU_HOST_LIMIT + receive), spec.gpu_resource: "1"},
    }


def pod_security() -> dict[str, Any]:
    """The pods' securityContext (Pod Security "restricted")."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security() -> dict[str, Any]:
    """Every container's securityContext: nothing to escalate to, no capability, the image read-only."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _pod_spec(**parts: Any) -> dict[str, Any]:
    """A pod's spec: `parts` (containers, volumes...) with what every pod has."""
    volumes = [*parts.pop("volumes", []), {"name": "run", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    return {
        **parts,
        "volumes": volumes,
        "securityContext": pod_security(),
        "automountServiceAccountToken": False,  # the pods never call the API server
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


def _tmp() -> dict[str, Any]:
    return {"name": "tmp", "mountPath": TMP_DIR}


def rpc_server_container(spec: ExportSpec, pods: Sequence[int], *, sidecar: bool = False) -> dict[str, Any]:
    """The rpc-server of pods `pods` (the leader's: a native sidecar)."""
    port = spec.settings.rpc_port
    alive = ["rpcfleet", "lws", "alive", "--pid-file", PID_FILE]
    command = ["rpcfleet", "lws", "worker", "--port", str(port), "--threads", str(spec.node_cpus)]
    container: dict[str, Any] = {
        "name": "rpc-server",
        "image": spec.image,
        "command": [*command, "--pid-file", PID_FILE],
        "env": _env(),
        "ports": [{"name": "rpc", "containerPort": port, "protocol": "TCP"}],
        "resources": _rpc_resources(spec, pods),
        # a HELLO only until the server is up: once llama-server holds it, HELLOs fail (see the module)
        "startupProbe": _exec_probe(["rpcfleet", "lws", "hello", "--port", str(port)], 2, 60),
        "readinessProbe": _exec_probe(alive, 10, 3),
        "livenessProbe": _exec_probe(list(alive), 20, 3),
        "securityContext": container_security(),
        "volumeMounts": [{"name": "run", "mountPath": RUN_DIR}, _tmp()],
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
            "requests": {"cpu": INIT_CPU_REQUEST, "memory": quantity(INIT_REQUEST)},
            "limits": {"cpu": "1", "memory": quantity(INIT_LIMIT)},
        },
        "securityContext": container_security(),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "run", "mountPath": RUN_DIR},
            {"name": "models", "mountPath": MODELS_DIR, "readOnly": True},
            _tmp(),
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
    host = quantity(spec.plan.host.total + spec.plan.options.margin + ENGINE_ALLOWANCE)
    command = ["rpcfleet", "lws", "serve", "--args", ARGS_FILE]
    mounts = [
        {"name": "run", "mountPath": RUN_DIR, "readOnly": True},
        {"name": "models", "mountPath": MODELS_DIR, "readOnly": True},
        _tmp(),
    ]
    if spec.api_key_secret is not None:
        command += ["--api-key-file", API_KEY_FILE]
        mounts.append({"name": "api-key", "mountPath": API_KEY_DIR, "readOnly": True})
    # one CPU for HTTP, the tokenizer and sampling, up to the pods' CPUs for what the plan keeps on its host
    cpus = {"requests": "1", "limits": str(spec.node_cpus)}
    return {
        "name": "llama-server",
        "image": spec.image,
        "command": command,
        "env": _env(),
        "ports": [{"name": "http", "containerPort": spec.settings.http_port, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": cpus["requests"], "memory": host},
            "limits": {"cpu": cpus["limits"], "memory": host},
        },
        # /health answers 503 while the model loads (and needs no key): the startup probe gives the load
        # 30 minutes
        "startupProbe": _health(5, 360),
        "readinessProbe": _health(5, 3),
        "livenessProbe": _health(20, 3),
        "securityContext": container_security(),
        "volumeMounts": mounts,
    }


def leader_template(spec: ExportSpec) -> dict[str, Any]:
    """Pod 0: its rpc-server (a sidecar), the init step, llama-server."""
    name = spec.settings.name
    claim = {"claimName": spec.model_claim, "readOnly": True}
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": f"{name}-config"}},
        {"name": "models", "persistentVolumeClaim": claim},
    ]
    if spec.api_key_secret is not None:
        key = {"secretName": spec.api_key_secret, "items": [{"key": API_KEY_ITEM, "path": API_KEY_ITEM}]}
        volumes.append({"name": "api-key", "secret": {**key, "defaultMode": 0o440}})
    return {
        "metadata": {"labels": {"app.kubernetes.io/instance": name, "app.kubernetes.io/component": "leader"}},
        "spec": _pod_spec(
            initContainers=[rpc_server_container(spec, [0], sidecar=True), plan_container(spec)],
            containers=[llama_server_container(spec)],
            volumes=volumes,
        ),
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
        "spec": _pod_spec(containers=[rpc_server_container(spec, pods)]),
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


def _network_policy(
    spec: ExportSpec, name: str, pods: dict[str, str], rule: dict[str, Any]
) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(spec, name, "network"),
        "spec": {"podSelector": {"matchLabels": pods}, "policyTypes": ["Ingress"], "ingress": [rule]},
    }


def network_policies(spec: ExportSpec) -> list[dict[str, Any]]:
    """What may reach the pods (see the module): llama-server's port from `http_from`, each group's RPC
    port from its leader."""
    name, settings = spec.settings.name, spec.settings
    peer: dict[str, Any] = {
        "podSelector": {
            "matchLabels": dict(spec.http_from if spec.http_from is not None else {CLIENT_LABEL: name})
        }
    }
    if spec.http_from_namespace is not None:
        peer["namespaceSelector"] = {"matchLabels": dict(spec.http_from_namespace)}
    http = {"from": [peer], "ports": [{"protocol": "TCP", "port": settings.http_port}]}
    policies = [_network_policy(spec, name, {LWS_NAME_LABEL: name}, http)]
    if settings.group_size == 1:
        return policies  # the leader reaches its own server on loopback, which no policy governs
    for group in range(spec.replicas):
        pods = {LWS_NAME_LABEL: name, LWS_GROUP_INDEX_LABEL: str(group)}
        leader = {"podSelector": {"matchLabels": {**pods, LWS_WORKER_INDEX_LABEL: "0"}}}
        rpc = {"from": [leader], "ports": [{"protocol": "TCP", "port": settings.rpc_port}]}
        policies.append(_network_policy(spec, f"{name}-group-{group}", pods, rpc))
    return policies


def manifests(spec: ExportSpec) -> dict[str, list[dict[str, Any]]]:
    """File name -> its objects, in the order to apply them (the policies before the pods)."""
    return {
        "configmap.yaml": [config_map(spec)],
        "networkpolicy.yaml": network_policies(spec),
        "leaderworkerset.yaml": [leaderworkerset(spec)],
        "service.yaml": [service(spec)],
    }


class _Dumper(yaml.SafeDumper):
    """YAML a reviewer reads: no anchors and aliases for repeated values, text of several lines (the
    ConfigMap's JSON files) as a block, as it will be in the pod."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _text)


def to_yaml(objects: Sequence[dict[str, Any]]) -> str:
    """`objects` as one YAML stream (documents separated by `---`)."""
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=110)
