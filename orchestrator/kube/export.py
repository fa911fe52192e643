"""`rpcfleet export lws`: plan a formation for a group of identical pods and write its LeaderWorkerSet,
Service, ConfigMap and NetworkPolicies.

The pods' memory is an assumption (`--node-memory`, `--backend`): the Kubernetes scheduler, not an
inventory, decides where they run, so nothing is probed here. The leader's init step probes the real
pods and plans again when they differ (`kube/pods.py`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from orchestrator.core.errors import RpcfleetError
from orchestrator.core.files import write_atomic
from orchestrator.kube.constants import NODE_CPUS
from orchestrator.kube.group import (
    ExportError,
    GroupSettings,
    check_secret_name,
    choose_group,
    gpu_resource,
    largest_tensors,
)
from orchestrator.kube.manifests import MODELS_DIR, ExportSpec, manifests, to_yaml
from orchestrator.planning.plan import PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.serve.templates import BUILTIN_TEMPLATES

NAME_MAX = 40  # pods are `<name>-<group>-<index>`, and their hostnames DNS labels (63 characters at most)
_NAME_RE = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


@dataclass(frozen=True)
class ExportRequest:
    model: Path
    options: PlanOptions
    node_memory: int
    out: Path
    image: str  # the image deploy/Containerfile builds
    backend: str = "cpu"
    nodes_per_group: int | None = None  # None: the fewest pods that hold the model
    replicas: int | None = None  # None: auto (one group; scale the LeaderWorkerSet for more)
    name: str | None = None
    namespace: str | None = None
    model_claim: str | None = None
    gpu_resource: str | None = None
    chat_template: str | None = None
    node_cpus: int = NODE_CPUS
    http_from: Mapping[str, str] | None = None  # None: rpcfleet/client=<name>
    http_from_namespace: Mapping[str, str] | None = None  # None: the objects' own namespace
    api_key_secret: str | None = None


@dataclass(frozen=True)
class ExportResult:
    spec: ExportSpec
    files: tuple[Path, ...]


def default_name(model: Path) -> str:
    """A DNS label from the model's file name: `gemma-3-270m-q4_k_m.gguf` -> `gemma-3-270m-q4-k-m`."""
    stem = re.sub(r"[^a-z0-9]+", "-", model.stem.lower()).strip("-")
    if not stem or not stem[0].isalpha():
        stem = f"m-{stem}".rstrip("-")
    return stem[:NAME_MAX].rstrip("-")


def check_name(name: str, flag: str = "--name") -> str:
    if len(name) > NAME_MAX or not _NAME_RE.fullmatch(name):
        raise ExportError(
            f"{flag} {name!r}: not a DNS label of at most {NAME_MAX} characters",
            hint="lower-case letters, digits and '-', from a letter to a letter or digit",
        )
    return name


def export_lws(request: ExportRequest) -> ExportResult:
    """Plan the group and write its manifests into `request.out`; ExportError (exit status 2) when the
    request cannot be met: an unknown GPU resource, a bad name, a model that fits no group."""
    resource = gpu_resource(request.backend, request.gpu_resource)
    name = check_name(request.name) if request.name else default_name(request.model)
    if request.namespace:
        check_name(request.namespace, "--namespace")
    if request.api_key_secret is not None:
        check_secret_name(request.api_key_secret)
    if request.chat_template is not None and request.chat_template not in BUILTIN_TEMPLATES:
        raise ExportError(
            f"--chat-template {request.chat_template}: not one of llama-server's template names (a file "
            "would have to be in the image)",
            hint=f"names: {', '.join(BUILTIN_TEMPLATES)}",
        )
    profile = profile_model(request.model)
    wanted = GroupSettings(
        name=name,
        group_size=request.nodes_per_group or 1,
        backend=request.backend,
        node_memory=request.node_memory,
        model=request.model.name,
        chat_template=request.chat_template,
    )
    settings, plan = choose_group(profile, request.options, wanted, fixed=request.nodes_per_group is not None)
    # the model as the pods see it, not this machine's path (the init step loads it from there)
    plan = replace(plan, model_path=f"{MODELS_DIR}/{settings.model}")
    spec = ExportSpec(
        settings=settings,
        plan=plan,
        replicas=request.replicas or 1,
        image=request.image,
        model_claim=request.model_claim or f"{name}-models",
        gpu_resource=resource,
        namespace=request.namespace,
        largest_tensors=largest_tensors(profile, plan, settings.group_size),
        node_cpus=request.node_cpus,
        http_from=request.http_from,
        http_from_namespace=request.http_from_namespace,
        api_key_secret=request.api_key_secret,
    )
    written: list[Path] = []
    try:
        request.out.mkdir(parents=True, exist_ok=True)
        for file_name, objects in manifests(spec).items():
            path = request.out / file_name
            write_atomic(path, to_yaml(objects))
            written.append(path)
    except OSError as exc:
        raise ExportError(f"cannot write into {request.out}: {exc.strerror or exc}") from None
    except RpcfleetError as exc:
        raise ExportError(exc.message) from None
    return ExportResult(spec, tuple(written))
