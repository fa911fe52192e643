"""`rpcfleet export lws`: a formation as Kubernetes manifests (LeaderWorkerSet, Service, ConfigMap,
NetworkPolicies)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from orchestrator.cli import _inputs, _output, _parser, _planning
from orchestrator.core import fields
from orchestrator.kube.constants import API_KEY_ITEM, BACKENDS, CLIENT_LABEL, NODE_CPUS
from orchestrator.serve.settings import DEFAULT_PARALLEL as SLOTS  # llama-server's slots, as serve


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("export", help="write a formation as another system's configuration")
    sub = parser.add_subparsers(dest="export_command", metavar="FORMAT", required=True)
    lws = sub.add_parser(
        "lws",
        help="Kubernetes manifests: a LeaderWorkerSet of rpc-server pods whose leader runs llama-server",
        description=(
            "Plan the model for a group of identical pods (each one rpc-server with one device of "
            "--node-memory; the leader also runs llama-server) and write a LeaderWorkerSet, a Service, a "
            "ConfigMap and NetworkPolicies into -o DIR. Nothing is probed here: the leader's init step "
            "probes the pods and plans again when they differ. See docs/kubernetes.md."
        ),
    )
    lws.add_argument("--model", "-m", type=Path, required=True, help="the GGUF model (first shard)")
    lws.add_argument("-o", "--output", type=Path, required=True, metavar="DIR", help="where to write")
    lws.add_argument(
        "--node-memory",
        type=_parser.flag(fields.size),
        required=True,
        metavar="SIZE",
        help="each pod's device: a GPU's memory, or the memory a CPU pod's server may fill (its limit adds "
        "the largest tensor it receives and 128 MiB) (8GiB, 24GB...)",
    )
    lws.add_argument(
        "--backend", choices=BACKENDS, default="cpu", help="the pods' rpc-server build (default: cpu)"
    )
    lws.add_argument(
        "--gpu-resource",
        default=None,
        metavar="NAME",
        help="the GPU's extended resource, domain/name (default: nvidia.com/gpu for cuda, amd.com/gpu for "
        "rocm; not with --backend cpu)",
    )
    lws.add_argument(
        "--nodes-per-group",
        type=_parser.flag(fields.integer(minimum=1, maximum=15)),
        default=None,
        metavar="K",
        help="pods per group (default: the fewest on which the model fits)",
    )
    lws.add_argument(
        "--node-cpus",
        type=_parser.flag(fields.integer(minimum=1, maximum=1024)),
        default=NODE_CPUS,
        metavar="N",
        help=f"each pod's rpc-server: CPUs requested and its limit, and its threads (default: {NODE_CPUS})",
    )
    from orchestrator.workflows.options import CTX, FLASH_ATTN, MARGIN, PARALLEL, TYPE_K, TYPE_V, UBATCH
    from orchestrator.workflows.serve_options import REPLICAS

    replicas_help = (
        "groups, each a copy of the model (default: auto = 1); each has a NetworkPolicy of its own: export "
        "again for more"
    )
    _planning.add_options(lws, (REPLICAS,), helps={"replicas": replicas_help})

    # llama-server's slots: 4, as serve
    parallel_help = (
        f"llama-server's slots, served at once and batched together: each gets --ctx/N (default: {SLOTS}, "
        "as serve)"
    )
    _planning.add_options(
        lws,
        (CTX, PARALLEL, UBATCH, TYPE_K, TYPE_V, FLASH_ATTN, MARGIN),
        defaults={"parallel": SLOTS},
        helps={"parallel": parallel_help},
    )
    lws.add_argument("--name", default=None, help="the LeaderWorkerSet's name (default: from the model's)")
    lws.add_argument("--namespace", default=None, help="the objects' namespace (default: none set)")
    lws.add_argument("--image", default=None, help="the image (default: rpcfleet:VERSION-BACKEND)")
    lws.add_argument(
        "--model-claim",
        default=None,
        metavar="PVC",
        help="the PersistentVolumeClaim holding the model, mounted at /models (default: NAME-models)",
    )
    lws.add_argument(
        "--chat-template", default=None, metavar="NAME", help="one of llama-server's template names"
    )
    lws.add_argument(
        "--http-from",
        default=None,
        metavar="LABELS",
        help="the pods that may call llama-server, by labels key=value[,key=value] ('': every pod) "
        f"(default: {CLIENT_LABEL}=NAME)",
    )
    lws.add_argument(
        "--http-from-namespace",
        default=None,
        metavar="LABELS",
        help="those pods in the namespaces with these labels ('': every namespace) (default: the objects' "
        "own namespace)",
    )
    lws.add_argument(
        "--api-key-secret",
        default=None,
        metavar="SECRET",
        help=f"a Secret holding llama-server's keys (one a line) under {API_KEY_ITEM!r}: calls then need one "
        "(default: no key; /health needs none)",
    )
    lws.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from orchestrator import __version__
    from orchestrator.core.units import format_size
    from orchestrator.kube.export import ExportRequest, export_lws
    from orchestrator.kube.group import parse_labels
    from orchestrator.workflows.options import plan_options

    _inputs.require_model(args.model)
    http_from = None if args.http_from is None else parse_labels(args.http_from, "--http-from")
    namespaces = args.http_from_namespace
    http_from_namespace = None if namespaces is None else parse_labels(namespaces, "--http-from-namespace")
    request = ExportRequest(
        model=args.model,
        options=plan_options(vars(args), llama_server=True),  # the exported pods run llama-server
        node_memory=args.node_memory,
        out=args.output,
        image=args.image or f"rpcfleet:{__version__}-{args.backend}",
        backend=args.backend,
        nodes_per_group=args.nodes_per_group,
        replicas=args.replicas if isinstance(args.replicas, int) else None,
        name=args.name,
        namespace=args.namespace,
        model_claim=args.model_claim,
        gpu_resource=args.gpu_resource,
        chat_template=args.chat_template,
        node_cpus=args.node_cpus,
        http_from=http_from,
        http_from_namespace=http_from_namespace,
        api_key_secret=args.api_key_secret,
    )
    result = export_lws(request)
    spec, plan = result.spec, result.spec.plan
    settings = spec.settings
    out = _output.console
    out.print(
        f"{settings.name}: {spec.replicas} group(s) of {settings.group_size} pod(s), {settings.backend}, "
        f"{format_size(settings.node_memory)} each; context {plan.n_ctx}, {plan.options.parallel} slot(s)",
        highlight=False,
        markup=False,
    )
    for device in plan.devices:
        m = device.memory
        out.print(
            f"  {device.label}: layers {device.layers_label}, {format_size(m.total)} planned",
            highlight=False,
            markup=False,
        )
    for path in result.files:
        out.print(f"wrote {path}", highlight=False, markup=False)
    return 0
