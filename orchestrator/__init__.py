"""rpcfleet: orchestrate fleets of llama.cpp ggml-rpc-server nodes.

The package namespace is the API: `orchestrator.load_inventory`, `orchestrator.probe_fleet`,
`orchestrator.make_plan`, `orchestrator.load_llama`, ... Names are resolved lazily from `_API`, so
`import orchestrator` stays cheap (no asyncssh, numpy or llama_cpp) until a name is used. The stages,
in the order data flows through them, are the subpackages:

    core → inventory → connectors → engine → facts → rpc → artifacts → operations → probe → planning
    → llama → report → playbooks → lab → cli

and a stage imports only the stages before it (checked by `make lint`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_API: dict[str, str] = {
    "RpcfleetError": "orchestrator.core.errors",
    "InputError": "orchestrator.core.errors",
    "InventoryError": "orchestrator.core.errors",
    "PlaybookError": "orchestrator.core.errors",
    "UsageError": "orchestrator.core.errors",
    "HostError": "orchestrator.core.errors",
    "UnreachableError": "orchestrator.core.errors",
    "AuthenticationError": "orchestrator.core.errors",
    "HostKeyError": "orchestrator.core.errors",
    "CommandError": "orchestrator.core.errors",
    "CommandTimeoutError": "orchestrator.core.errors",
    "TransferError": "orchestrator.core.errors",
    "NodeScriptError": "orchestrator.core.errors",
    "LabError": "orchestrator.core.errors",
    "ArtifactError": "orchestrator.core.errors",
    "InstallError": "orchestrator.core.errors",
    "ServiceError": "orchestrator.core.errors",
    "ProbeError": "orchestrator.core.errors",
    "ModelError": "orchestrator.core.errors",
    "PlanError": "orchestrator.core.errors",
    "LoaderError": "orchestrator.core.errors",
    "Host": "orchestrator.inventory.model",
    "Inventory": "orchestrator.inventory.model",
    "select_hosts": "orchestrator.inventory.model",
    "load_inventory": "orchestrator.inventory.load",
    "ConnectOptions": "orchestrator.connectors.base",
    "Connection": "orchestrator.connectors.base",
    "CommandResult": "orchestrator.connectors.base",
    "connect": "orchestrator.connectors.connect",
    "Tunnels": "orchestrator.connectors.tunnel",
    "Session": "orchestrator.engine.executor",
    "Recap": "orchestrator.engine.executor",
    "RunResult": "orchestrator.engine.executor",
    "HostResult": "orchestrator.engine.executor",
    "ProtocolVersion": "orchestrator.rpc.records",
    "ProbeResult": "orchestrator.rpc.records",
    "Outcome": "orchestrator.rpc.records",
    "parse_endpoint": "orchestrator.rpc.records",
    "probe_endpoint": "orchestrator.rpc.client",
    "probe_endpoints": "orchestrator.rpc.client",
    "query_memory": "orchestrator.rpc.client",
    "RpcDeviceMemory": "orchestrator.rpc.records",
    "RpcMemoryInfo": "orchestrator.rpc.records",
    "EndpointProbeError": "orchestrator.rpc.errors",
    "EndpointUnreachableError": "orchestrator.rpc.errors",
    "EndpointBusyError": "orchestrator.rpc.errors",
    "ProtocolMismatchError": "orchestrator.rpc.errors",
    "Artifact": "orchestrator.artifacts.manifest",
    "build_artifact": "orchestrator.artifacts.build",
    "default_artifact": "orchestrator.artifacts.build",
    "import_artifact": "orchestrator.artifacts.imports",
    "probe_fleet": "orchestrator.probe.fleet",
    "FleetProbe": "orchestrator.probe.fleet",
    "NodeProbe": "orchestrator.probe.fleet",
    "query_fleet_memory": "orchestrator.probe.fleet",
    "profile_model": "orchestrator.planning.profile",
    "ModelProfile": "orchestrator.planning.profile",
    "Plan": "orchestrator.planning.plan",
    "PlanOptions": "orchestrator.planning.plan",
    "PlanDevice": "orchestrator.planning.plan",
    "make_plan": "orchestrator.planning.strategy",
    "order_devices": "orchestrator.planning.layer_assignment",
    "to_plan_devices": "orchestrator.planning.devices",
    "write_tiny_llama": "orchestrator.models.synth",
    "write_tiny_mmproj": "orchestrator.models.synth_mm",
    "Llama": "orchestrator.workflows.dropin",
    "MultimodalError": "orchestrator.llama.native.multimodal",
    "load_llama": "orchestrator.llama.native.loader",
    "preflight": "orchestrator.llama.native.preflight",
    "supports_rpc": "orchestrator.llama.native.registry",
    "add_rpc_server": "orchestrator.llama.native.registry",
    "add_rpc_servers": "orchestrator.llama.native.registry",
    "rpc_device_handles": "orchestrator.llama.native.registry",
    "print_summary": "orchestrator.llama.native.registry",
    "query_rpc_memory": "orchestrator.llama.native.registry",
    "query_all": "orchestrator.llama.native.registry",
    "RpcDevice": "orchestrator.llama.native.registry",
    "placement_of": "orchestrator.llama.observed_placement",
    "Placement": "orchestrator.llama.observed_placement",
    "Worker": "orchestrator.llama.worker.parent",
    "plan_cache": "orchestrator.caches.plan",
    "CacheTensor": "orchestrator.caches.plan",
    "hash_file_range": "orchestrator.core.fnv",
    "WorkerError": "orchestrator.llama.worker.parent",
    "NodeLostError": "orchestrator.llama.worker.parent",
    "build_report": "orchestrator.report.build",
    "ReportOptions": "orchestrator.report.build",
    "Report": "orchestrator.report.build",
    "render": "orchestrator.report.render",
    "load_playbook": "orchestrator.playbooks.reader",
    "run_playbook": "orchestrator.playbooks.runner",
    "lab_up": "orchestrator.lab.lifecycle",
    "lab_down": "orchestrator.lab.lifecycle",
}

__all__ = sorted(_API)

if TYPE_CHECKING:
    from orchestrator.artifacts.build import build_artifact as build_artifact
    from orchestrator.artifacts.build import default_artifact as default_artifact
    from orchestrator.artifacts.imports import import_artifact as import_artifact
    from orchestrator.artifacts.manifest import Artifact as Artifact
    from orchestrator.caches.plan import CacheTensor as CacheTensor
    from orchestrator.caches.plan import plan_cache as plan_cache
    from orchestrator.connectors.base import CommandResult as CommandResult
    from orchestrator.connectors.base import Connection as Connection
    from orchestrator.connectors.base import ConnectOptions as ConnectOptions
    from orchestrator.connectors.connect import connect as connect
    from orchestrator.connectors.tunnel import Tunnels as Tunnels
    from orchestrator.core.errors import ArtifactError as ArtifactError
    from orchestrator.core.errors import AuthenticationError as AuthenticationError
    from orchestrator.core.errors import CommandError as CommandError
    from orchestrator.core.errors import CommandTimeoutError as CommandTimeoutError
    from orchestrator.core.errors import HostError as HostError
    from orchestrator.core.errors import HostKeyError as HostKeyError
    from orchestrator.core.errors import InputError as InputError
    from orchestrator.core.errors import InstallError as InstallError
    from orchestrator.core.errors import InventoryError as InventoryError
    from orchestrator.core.errors import LabError as LabError
    from orchestrator.core.errors import LoaderError as LoaderError
    from orchestrator.core.errors import ModelError as ModelError
    from orchestrator.core.errors import NodeScriptError as NodeScriptError
    from orchestrator.core.errors import PlanError as PlanError
    from orchestrator.core.errors import PlaybookError as PlaybookError
    from orchestrator.core.errors import ProbeError as ProbeError
    from orchestrator.core.errors import RpcfleetError as RpcfleetError
    from orchestrator.core.errors import ServiceError as ServiceError
    from orchestrator.core.errors import TransferError as TransferError
    from orchestrator.core.errors import UnreachableError as UnreachableError
    from orchestrator.core.errors import UsageError as UsageError
    from orchestrator.core.fnv import hash_file_range as hash_file_range
    from orchestrator.engine.executor import HostResult as HostResult
    from orchestrator.engine.executor import Recap as Recap
    from orchestrator.engine.executor import RunResult as RunResult
    from orchestrator.engine.executor import Session as Session
    from orchestrator.inventory.load import load_inventory as load_inventory
    from orchestrator.inventory.model import Host as Host
    from orchestrator.inventory.model import Inventory as Inventory
    from orchestrator.inventory.model import select_hosts as select_hosts
    from orchestrator.lab.lifecycle import lab_down as lab_down
    from orchestrator.lab.lifecycle import lab_up as lab_up
    from orchestrator.llama.native.loader import load_llama as load_llama
    from orchestrator.llama.native.preflight import preflight as preflight
    from orchestrator.llama.native.registry import RpcDevice as RpcDevice
    from orchestrator.llama.native.registry import add_rpc_server as add_rpc_server
    from orchestrator.llama.native.registry import add_rpc_servers as add_rpc_servers
    from orchestrator.llama.native.registry import print_summary as print_summary
    from orchestrator.llama.native.registry import query_all as query_all
    from orchestrator.llama.native.registry import query_rpc_memory as query_rpc_memory
    from orchestrator.llama.native.registry import rpc_device_handles as rpc_device_handles
    from orchestrator.llama.native.registry import supports_rpc as supports_rpc
    from orchestrator.llama.observed_placement import Placement as Placement
    from orchestrator.llama.observed_placement import placement_of as placement_of
    from orchestrator.llama.worker.parent import NodeLostError as NodeLostError
    from orchestrator.llama.worker.parent import Worker as Worker
    from orchestrator.llama.worker.parent import WorkerError as WorkerError
    from orchestrator.models.synth import write_tiny_llama as write_tiny_llama
    from orchestrator.planning.devices import to_plan_devices as to_plan_devices
    from orchestrator.planning.layer_assignment import order_devices as order_devices
    from orchestrator.planning.plan import Plan as Plan
    from orchestrator.planning.plan import PlanDevice as PlanDevice
    from orchestrator.planning.plan import PlanOptions as PlanOptions
    from orchestrator.planning.profile import ModelProfile as ModelProfile
    from orchestrator.planning.profile import profile_model as profile_model
    from orchestrator.planning.strategy import make_plan as make_plan
    from orchestrator.playbooks.reader import load_playbook as load_playbook
    from orchestrator.playbooks.runner import run_playbook as run_playbook
    from orchestrator.probe.fleet import FleetProbe as FleetProbe
    from orchestrator.probe.fleet import NodeProbe as NodeProbe
    from orchestrator.probe.fleet import probe_fleet as probe_fleet
    from orchestrator.probe.fleet import query_fleet_memory as query_fleet_memory
    from orchestrator.report.build import Report as Report
    from orchestrator.report.build import ReportOptions as ReportOptions
    from orchestrator.report.build import build_report as build_report
    from orchestrator.report.render import render as render
    from orchestrator.rpc.client import probe_endpoint as probe_endpoint
    from orchestrator.rpc.client import probe_endpoints as probe_endpoints
    from orchestrator.rpc.client import query_memory as query_memory
    from orchestrator.rpc.errors import EndpointBusyError as EndpointBusyError
    from orchestrator.rpc.errors import EndpointProbeError as EndpointProbeError
    from orchestrator.rpc.errors import EndpointUnreachableError as EndpointUnreachableError
    from orchestrator.rpc.errors import ProtocolMismatchError as ProtocolMismatchError
    from orchestrator.rpc.records import Outcome as Outcome
    from orchestrator.rpc.records import ProbeResult as ProbeResult
    from orchestrator.rpc.records import ProtocolVersion as ProtocolVersion
    from orchestrator.rpc.records import RpcDeviceMemory as RpcDeviceMemory
    from orchestrator.rpc.records import RpcMemoryInfo as RpcMemoryInfo
    from orchestrator.rpc.records import parse_endpoint as parse_endpoint
    from orchestrator.workflows.dropin import Llama as Llama


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
