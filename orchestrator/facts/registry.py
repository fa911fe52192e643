"""Every fact type by name (the data-driven tests and `--fact` look them up here)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass
from orchestrator.facts.base import Fact
from orchestrator.facts.gpus import NvidiaGpuFact, RocmGpuFact
from orchestrator.facts.server import (
    CurrentLinkFact,
    HistoryFact,
    InstallDirFact,
    InstalledManifestFact,
    LaunchFact,
    ListenersFact,
    LogMatchFact,
    LogTailFact,
    PortOwnersFact,
    RpcClientsFact,
    ServerProcessFact,
    SupervisorFact,
    VersionsFact,
)
from orchestrator.facts.system import CpuCountFact, FreeSpaceFact, MachineIdFact, MemoryFact, OsFact
from orchestrator.facts.systemd import SystemdFact, UnitFact

FACT_TYPES: Mapping[str, type[Fact[Any]]] = {
    cls.name: cls
    for cls in (
        OsFact,
        CpuCountFact,
        MachineIdFact,
        MemoryFact,
        NvidiaGpuFact,
        RocmGpuFact,
        RpcClientsFact,
        ListenersFact,
        InstallDirFact,
        CurrentLinkFact,
        VersionsFact,
        HistoryFact,
        FreeSpaceFact,
        InstalledManifestFact,
        ServerProcessFact,
        LogMatchFact,
        LogTailFact,
        LaunchFact,
        PortOwnersFact,
        SupervisorFact,
        SystemdFact,
        UnitFact,
    )
}
