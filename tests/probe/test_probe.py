"""The fleet probe: capacity tables (pure), JSON schema, plan devices, and real servers on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from orchestrator.core.errors import PlanError, ProbeError
from orchestrator.engine.executor import Session
from orchestrator.facts.base import gather_command, parse_gathered
from orchestrator.facts.gpus import Gpu, GpuReport
from orchestrator.facts.system import MemInfo
from orchestrator.inventory.model import Host
from orchestrator.planning.devices import to_plan_devices
from orchestrator.planning.plan import PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan
from orchestrator.probe.capacity import (
    DeviceCapacity,
    compute_capacity,
    fleet_capacity,
    usable_bytes,
    without_own_connection,
)
from orchestrator.probe.fleet import (
    FleetProbe,
    NodeProbe,
    fleet_failed,
    fleet_totals,
    node_state,
    probe_fleet,
    query_fleet_memory,
)
from orchestrator.probe.host import CpuModelFact, HostFacts, probe_facts
from orchestrator.rpc.records import AggregateMemory, DeviceMemory, Outcome, ProbeResult, ProtocolVersion
from orchestrator.rpc.wire import HELLO_REPLY_SIZE, hello_request
from tests.fakerpc import FakeConnection, Handler, drip, fake_rpc_server, hello_payload, protocol
from tests.plugins.servers import LocalServer, free_port, write_local_inventory

StartServer = Callable[..., LocalServer]
GiB = 1 << 30
MiB = 1 << 20
V7 = ProtocolVersion(7, 0, 0)


# --- pure: capacity ---------------------------------------------------------------------------------------


def host(name: str = "n1", **kw: Any) -> Host:
    kw.setdefault("address", "10.0.0.1")
    kw.setdefault("rpc_host", kw["address"])
    return Host(name=name, **kw)


def ok_result(endpoint: str, *devices: tuple[int, int]) -> ProbeResult:
    mems = tuple(DeviceMemory(i, free, total) for i, (free, total) in enumerate(devices))
    return ProbeResult(endpoint, Outcome.OK, V7, mems, "protocol 7.0.0", 0.004)


def bad_result(endpoint: str, outcome: Outcome, message: str = "nope") -> ProbeResult:
    return ProbeResult(endpoint, outcome, None, (), message, 0.5)


RAM = 32 * GiB
CPU_FACTS = HostFacts(memory=MemInfo(total=RAM, available=20 * GiB), cpu_model="AMD EPYC 7713", cpu_count=8)


def nvidia(*gpus: tuple[int, str, int | None, int | None], error: str | None = None) -> GpuReport:
    return GpuReport("nvidia-smi", True, tuple(Gpu("nvidia", i, n, t, f) for i, n, t, f in gpus), error)


GPU_FACTS = HostFacts(
    memory=MemInfo(total=RAM, available=20 * GiB),
    cpu_model="Xeon",
    nvidia=nvidia((0, "NVIDIA L4", 24 * GiB, 23 * GiB), (1, "NVIDIA A100", 80 * GiB, 70 * GiB)),
    rocm=GpuReport("rocm-smi", False),
)

# (case, host kwargs, devices (free, total), facts,
#  expected per device: (kind, description, free, usable, source_of_free, warning substrings))
CAPACITY_CASES: list[
    tuple[str, dict[str, Any], list[tuple[int, int]], HostFacts | None, list[tuple[Any, ...]]]
] = [
    (
        "cpu node: free is MemAvailable",
        {},
        [(RAM, RAM)],
        CPU_FACTS,
        [("cpu", "AMD EPYC 7713", 20 * GiB, 20 * GiB, "meminfo", ())],
    ),
    (
        "cpu node with reserve",
        {"memory_reserve": 4 * GiB},
        [(RAM, RAM)],
        CPU_FACTS,
        [("cpu", "AMD EPYC 7713", 20 * GiB, 16 * GiB, "meminfo", ())],
    ),
    (
        "cpu node with a limit below free",
        {"memory_limit": 8 * GiB},
        [(RAM, RAM)],
        CPU_FACTS,
        [("cpu", "AMD EPYC 7713", 20 * GiB, 8 * GiB, "meminfo", ())],
    ),
    (
        "reserve and limit: the smaller wins",
        {"memory_reserve": 14 * GiB, "memory_limit": 8 * GiB},
        [(RAM, RAM)],
        CPU_FACTS,
        [("cpu", "AMD EPYC 7713", 20 * GiB, 6 * GiB, "meminfo", ())],
    ),
    (
        "reserve above free clamps to zero",
        {"memory_reserve": 24 * GiB},
        [(RAM, RAM)],
        CPU_FACTS,
        [("cpu", "AMD EPYC 7713", 20 * GiB, 0, "meminfo", ())],
    ),
    (
        "cpu node without facts: the server's figure (total RAM) is not usable memory",
        {"memory_reserve": 1 * GiB},
        [(RAM, RAM)],
        None,
        [("cpu", "CPU", RAM, 0, "rpc", ("not measured (no host facts)",))],
    ),
    (
        "cpu node whose MemAvailable is unknown (old kernel): not measured either",
        {},
        [(RAM, RAM)],
        HostFacts(memory=MemInfo(total=RAM, available=None), cpu_model=None),
        [("cpu", "CPU", RAM, 0, "rpc", ("not measured (MemAvailable unreadable)",))],
    ),
    (
        "gpu node: RPC numbers, names from nvidia-smi, agreeing",
        {"rpc_backend": "cuda", "memory_reserve": 1 * GiB},
        [(23 * GiB, 24 * GiB), (70 * GiB, 80 * GiB)],
        GPU_FACTS,
        [
            ("gpu", "NVIDIA L4", 23 * GiB, 22 * GiB, "rpc", ()),
            ("gpu", "NVIDIA A100", 70 * GiB, 69 * GiB, "rpc", ()),
        ],
    ),
    (
        "gpu node: nvidia-smi disagrees on free beyond the tolerance",
        {"rpc_backend": "cuda"},
        [(10 * GiB, 24 * GiB)],
        GPU_FACTS,
        [("gpu", "NVIDIA L4", 10 * GiB, 10 * GiB, "rpc", ("nvidia-smi says free 23",))],
    ),
    (
        "gpu node: small differences are within the tolerance",
        {"rpc_backend": "cuda"},
        [(23 * GiB - 100 * MiB, 24 * GiB - 12 * MiB)],
        GPU_FACTS,
        [("gpu", "NVIDIA L4", 23 * GiB - 100 * MiB, 23 * GiB - 100 * MiB, "rpc", ())],
    ),
    (
        "rpc_devices CUDA1: device 0 is nvidia GPU 1",
        {"rpc_backend": "cuda", "rpc_devices": ("CUDA1",)},
        [(70 * GiB, 80 * GiB)],
        GPU_FACTS,
        [("gpu", "NVIDIA A100", 70 * GiB, 70 * GiB, "rpc", ())],
    ),
    (
        "rpc_devices CUDA0,CPU: the second is the CPU",
        {"rpc_backend": "cuda", "rpc_devices": ("CUDA0", "CPU")},
        [(23 * GiB, 24 * GiB), (RAM, RAM)],
        GPU_FACTS,
        [
            ("gpu", "NVIDIA L4", 23 * GiB, 23 * GiB, "rpc", ()),
            ("cpu", "Xeon", 20 * GiB, 20 * GiB, "meminfo", ()),
        ],
    ),
    (
        "nvidia-smi lists no such GPU",
        {"rpc_backend": "cuda", "rpc_devices": ("CUDA5",)},
        [(23 * GiB, 24 * GiB)],
        GPU_FACTS,
        [("gpu", "cuda device 0", 23 * GiB, 23 * GiB, "rpc", ("lists no GPU 5",))],
    ),
    (
        "gpu node without facts: RPC numbers, generic description",
        {"rpc_backend": "cuda", "memory_limit": 16 * GiB},
        [(23 * GiB, 24 * GiB)],
        None,
        [("gpu", "cuda device 0", 23 * GiB, 16 * GiB, "rpc", ())],
    ),
    (
        "a cuda host whose server found no GPU: free == total == RAM is the CPU",
        {"rpc_backend": "cuda"},
        [(RAM, RAM)],
        HostFacts(memory=MemInfo(total=RAM, available=20 * GiB), nvidia=GpuReport("nvidia-smi", False)),
        [("cpu", "CPU", 20 * GiB, 20 * GiB, "meminfo", ("so it is the CPU",))],
    ),
    (
        "rocm node: names from rocm-smi",
        {"rpc_backend": "rocm"},
        [(60 * GiB, 64 * GiB)],
        HostFacts(rocm=GpuReport("rocm-smi", True, (Gpu("amd", 0, "MI210", 64 * GiB, 60 * GiB),))),
        [("gpu", "MI210", 60 * GiB, 60 * GiB, "rpc", ())],
    ),
    (
        "vulkan node: no tool to cross-check",
        {"rpc_backend": "vulkan"},
        [(7 * GiB, 8 * GiB)],
        CPU_FACTS,
        [("gpu", "vulkan device 0", 7 * GiB, 7 * GiB, "rpc", ())],
    ),
]


@pytest.mark.parametrize(
    ("case", "host_kw", "devices", "facts", "expected"), CAPACITY_CASES, ids=[c[0] for c in CAPACITY_CASES]
)
def test_compute_capacity(
    case: str,
    host_kw: dict[str, Any],
    devices: list[tuple[int, int]],
    facts: HostFacts | None,
    expected: list[tuple[Any, ...]],
) -> None:
    h = host(**host_kw)
    result = ok_result(h.endpoint, *devices)
    caps = compute_capacity(h, result, facts)
    got = [(c.kind, c.description, c.free, c.usable, c.source_of_free) for c in caps]
    assert got == [e[:5] for e in expected]
    for cap, exp in zip(caps, expected, strict=True):
        assert len(cap.warnings) == len(exp[5]), cap.warnings
        for fragment, warning in zip(exp[5], cap.warnings, strict=True):
            assert fragment in warning
        assert (cap.host, cap.endpoint, cap.backend) == (h.name, h.endpoint, h.rpc_backend)
        assert cap.name == f"{h.endpoint}#{cap.index}"
        assert (cap.reserve, cap.limit) == (h.memory_reserve, h.memory_limit)
    assert [c.total for c in caps] == [total for _free, total in devices]


@pytest.mark.parametrize("outcome", [o for o in Outcome if o is not Outcome.OK])
def test_no_devices_unless_ok(outcome: Outcome) -> None:
    h = host()
    assert compute_capacity(h, bad_result(h.endpoint, outcome), CPU_FACTS) == ()


@pytest.mark.parametrize(
    ("free", "reserve", "limit", "usable"),
    [
        (10, 0, None, 10),
        (10, 3, None, 7),
        (10, 0, 4, 4),
        (10, 3, 8, 7),
        (10, 3, 5, 5),
        (10, 11, None, 0),
        (10, 0, 0, 0),
    ],
)
def test_usable_bytes(free: int, reserve: int, limit: int | None, usable: int) -> None:
    assert usable_bytes(free, reserve, limit) == usable


@pytest.mark.parametrize(
    ("outcome", "clients", "state"),
    [
        (Outcome.OK, (), "ok"),
        (Outcome.OK, ("10.0.0.9:4000",), "ok"),  # it answered us: nobody else was being served
        (Outcome.TIMEOUT, None, "timeout"),
        (Outcome.TIMEOUT, (), "timeout"),
        (Outcome.TIMEOUT, ("10.0.0.9:4000",), "busy"),  # accept queue full: the connect never completed
        (Outcome.BUSY, (), "busy"),
        (Outcome.REFUSED, ("10.0.0.9:4000",), "refused"),
        (Outcome.VERSION_MISMATCH, (), "version_mismatch"),
        (Outcome.PROTOCOL_ERROR, None, "protocol_error"),
        (Outcome.CLOSED, None, "closed"),
    ],
)
def test_node_state(outcome: Outcome, clients: tuple[str, ...] | None, state: str) -> None:
    result = ok_result("h:1", (1, 1)) if outcome is Outcome.OK else bad_result("h:1", outcome)
    assert node_state(result, HostFacts(rpc_clients=clients)) == state
    if clients is None:
        assert node_state(result, None) == state


def test_cpu_model_fact_parses_what_its_command_prints() -> None:
    fact = CpuModelFact()
    assert fact.parse(" AMD EPYC   7713  64-Core\n", "", 0) == "AMD EPYC 7713 64-Core"
    assert fact.parse("\n", "", 0) is None
    out = subprocess.run(
        ["bash", "-c", fact.command()], capture_output=True, text=True, timeout=10, check=True
    )
    model = fact.parse(out.stdout, out.stderr, out.returncode)
    cpuinfo = Path("/proc/cpuinfo").read_text()
    assert model is not None and model in " ".join(cpuinfo.split())


def test_probe_facts_gathered_on_this_machine() -> None:
    h = host(rpc_port=free_port())
    facts = probe_facts(h)
    out = subprocess.run(
        ["bash", "-c", gather_command(facts, "tok1")], capture_output=True, text=True, timeout=30, check=True
    )
    values = HostFacts.from_values(parse_gathered(facts, out.stdout, "tok1"))
    meminfo = Path("/proc/meminfo").read_text().split()
    assert (
        values.memory is not None
        and values.memory.total == int(meminfo[meminfo.index("MemTotal:") + 1]) * 1024
    )
    assert values.memory.available is not None and 0 < values.memory.available <= values.memory.total
    assert values.cpu_count is not None and values.cpu_count >= 1
    assert values.rpc_clients == ()  # nothing listens on that port
    assert values.nvidia is not None and values.rocm is not None


# --- pure: totals, JSON, plan devices ---------------------------------------------------------------------


def cap(h: Host, index: int, free: int, total: int, usable: int, **kw: Any) -> DeviceCapacity:
    return DeviceCapacity(
        host=h.name,
        endpoint=h.endpoint,
        index=index,
        name=f"{h.endpoint}#{index}",
        description=kw.pop("description", "AMD EPYC"),
        backend=h.rpc_backend,
        kind=kw.pop("kind", "cpu"),
        total=total,
        free=free,
        reserve=h.memory_reserve,
        limit=h.memory_limit,
        usable=usable,
        source_of_free=kw.pop("source_of_free", "meminfo"),
        warnings=kw.pop("warnings", ()),
    )


def node(h: Host, result: ProbeResult, facts: HostFacts | None = None, **kw: Any) -> NodeProbe:
    return NodeProbe(
        host=h.name,
        endpoint=result.endpoint,
        rpc=result,
        facts=facts,
        devices=compute_capacity(h, result, facts),
        state=node_state(result, facts),
        **kw,
    )


A = host("a", address="10.0.0.1", rpc_port=50052, memory_reserve=GiB)
B = host("b", address="10.0.0.2", rpc_port=50052, rpc_backend="cuda")
C = host("c", address="10.0.0.3", rpc_port=50052)
A_TWIN = host("a2", address="10.0.0.1", rpc_port=50052)


def sample_fleet() -> FleetProbe:
    facts_a = HostFacts(
        memory=MemInfo(total=8 * GiB, available=6 * GiB), cpu_model="AMD EPYC", rpc_clients=()
    )
    facts_b = HostFacts(
        memory=MemInfo(total=8 * GiB, available=6 * GiB),
        nvidia=nvidia((0, "L4", 24 * GiB, 20 * GiB), (1, "L4", 24 * GiB, 24 * GiB)),
        rpc_clients=(),
    )
    nodes = [
        node(A, ok_result(A.endpoint, (8 * GiB, 8 * GiB)), facts_a),
        node(B, ok_result(B.endpoint, (20 * GiB, 24 * GiB), (24 * GiB, 24 * GiB)), facts_b),
        node(
            C,
            bad_result(C.endpoint, Outcome.TIMEOUT, "connect timed out after 3 s"),
            None,
            facts_error="facts not read within 3 s",
        ),
        node(A_TWIN, ok_result(A.endpoint, (8 * GiB, 8 * GiB)), facts_a, duplicate_of="a"),
    ]
    return FleetProbe.of(nodes, protocol="7.0.0", timeout=3.0, elapsed=3.0012)


def test_totals_count_each_endpoint_once_and_only_ok_ones() -> None:
    fleet = sample_fleet()
    assert fleet_totals(fleet.nodes) == fleet.totals
    t = fleet.totals
    assert (t.endpoints, t.ok_endpoints, t.devices) == (3, 2, 3)
    assert t.total == 8 * GiB + 48 * GiB
    assert t.free == 6 * GiB + 44 * GiB
    assert t.usable == 5 * GiB + 44 * GiB  # a's reserve; a2 (same server) not counted again
    assert [d.name for d in fleet.devices] == ["10.0.0.1:50052#0", "10.0.0.2:50052#0", "10.0.0.2:50052#1"]
    assert not fleet.ok and [n.host for n in fleet.failed] == ["c"]
    assert fleet.memory() is None  # like RpcMemoryQuery: nothing when any endpoint fails
    healthy = FleetProbe.of([n for n in fleet.nodes if n.ok], protocol="7.0.0", timeout=3.0)
    assert healthy.memory() == AggregateMemory(free=50 * GiB, total=56 * GiB, server_count=2, device_count=3)
    assert FleetProbe.of([], protocol="7.0.0", timeout=1.0).memory() == AggregateMemory(0, 0, 0, 0)


# (host, port, machine id, backend, memory_reserve) per row; MemAvailable is 20 GiB on every machine.
SHARE_CASES: dict[str, tuple[list[tuple[str, int, str | None, str, int]], list[int]]] = {
    "two endpoints on one machine: half each": (
        [("a", 1, "boot_id:m1", "cpu", 0), ("b", 2, "boot_id:m1", "cpu", 0)],
        [10 * GiB, 10 * GiB],
    ),
    "three on one machine, one elsewhere": (
        [
            ("a", 1, "m1", "cpu", 0),
            ("b", 2, "m1", "cpu", 0),
            ("c", 3, "m1", "cpu", 0),
            ("d", 4, "m2", "cpu", 0),
        ],
        [20 * GiB // 3] * 3 + [20 * GiB],
    ),
    "the reserve applies per host, to the share": (
        [("a", 1, "m1", "cpu", GiB), ("b", 2, "m1", "cpu", 0)],
        [10 * GiB - GiB, 10 * GiB],
    ),
    "one endpoint named twice is one server": (
        [("a", 1, "m1", "cpu", 0), ("a-again", 1, "m1", "cpu", 0)],
        [20 * GiB, 20 * GiB],
    ),
    "no machine identity: no sharing": (
        [("a", 1, None, "cpu", 0), ("b", 2, None, "cpu", 0)],
        [20 * GiB, 20 * GiB],
    ),
    "a GPU server's device takes no share of the RAM": (
        [("a", 1, "m1", "cpu", 0), ("g", 2, "m1", "cuda", 0)],
        [20 * GiB, 16 * GiB],
    ),
}


@pytest.mark.parametrize("case", list(SHARE_CASES), ids=list(SHARE_CASES))
def test_cpu_devices_of_one_machine_share_its_mem_available(case: str) -> None:
    rows, usable = SHARE_CASES[case]
    probed = []
    for name, port, machine, backend, reserve in rows:
        h = host(name, address="10.0.0.1", rpc_port=port, rpc_backend=backend, memory_reserve=reserve)
        if backend == "cpu":
            result = ok_result(h.endpoint, (RAM, RAM))
        else:
            result = ok_result(h.endpoint, (16 * GiB, 24 * GiB))
        probed.append((h, result, dataclasses.replace(CPU_FACTS, machine_id=machine)))
    capacities = fleet_capacity(probed)
    assert [d.usable for devices in capacities for d in devices] == usable
    for devices in capacities:
        for d in devices:
            sharing = [w for w in d.warnings if "shared among" in w]
            assert bool(sharing) == (d.kind == "cpu" and d.free < 20 * GiB), d


def test_a_machines_ram_counts_once_in_the_total_and_the_footnote_says_free_is_a_share() -> None:
    """Three CPU servers on one 32 GiB machine (the lab's shape) and one on another: each shows a third
    of the first machine's MemAvailable, and the total row counts each machine's RAM once."""
    from orchestrator.cli.probe import free_footnote

    hosts = [host(n, address="10.0.0.1", rpc_port=50052 + i) for i, n in enumerate(["a", "b", "c"])]
    hosts.append(host("d", address="10.0.0.2"))
    machines = ["m1", "m1", "m1", "m2"]
    probed = [
        (h, ok_result(h.endpoint, (RAM, RAM)), dataclasses.replace(CPU_FACTS, machine_id=m))
        for h, m in zip(hosts, machines, strict=True)
    ]
    nodes = [
        NodeProbe(h.name, r.endpoint, r, f, devices, "ok")
        for (h, r, f), devices in zip(probed, fleet_capacity(probed), strict=True)
    ]
    fleet = FleetProbe.of(nodes, protocol="7.0.0", timeout=3.0)
    assert [d.free for d in fleet.devices] == [20 * GiB // 3] * 3 + [20 * GiB]
    assert fleet.totals.total == 2 * RAM  # not 4 x 32 GiB
    assert fleet.totals.free == 3 * (20 * GiB // 3) + 20 * GiB
    note = free_footnote(fleet)
    assert note.startswith("* free = MemAvailable on the host (CPU devices), divided evenly among")
    assert "(a, b, c on one machine)" in note and "counts each machine's RAM once" in note
    alone = FleetProbe.of(nodes[3:], protocol="7.0.0", timeout=3.0)
    assert free_footnote(alone) == "* free = MemAvailable on the host (CPU devices)"
    assert alone.totals.total == RAM


@pytest.mark.parametrize(
    ("states", "fail_on", "failed"),
    [
        (["ok", "ok"], "any", False),
        (["ok", "timeout"], "any", True),
        (["ok", "timeout"], "all", False),
        (["busy", "timeout"], "all", True),
        (["busy", "timeout"], "none", False),
        ([], "all", False),
        ([], "any", False),
    ],
)
def test_fail_on(states: list[str], fail_on: str, failed: bool) -> None:
    nodes = []
    for i, state in enumerate(states):
        h = host(f"h{i}", address=f"10.0.0.{i + 1}")
        result = ok_result(h.endpoint, (1, 1)) if state == "ok" else bad_result(h.endpoint, Outcome(state))
        nodes.append(node(h, result))
    assert fleet_failed(FleetProbe.of(nodes, protocol="7.0.0", timeout=1.0), fail_on) is failed
    with pytest.raises(ValueError, match="fail_on"):
        fleet_failed(FleetProbe.of(nodes, protocol="7.0.0", timeout=1.0), "some")


GOLDEN: dict[str, Any] = {
    "schema_version": 1,
    "ok": False,
    "protocol": "7.0.0",
    "timeout": 3.0,
    "elapsed": 3.0012,
    "totals": {
        "endpoints": 3,
        "ok_endpoints": 2,
        "devices": 3,
        "total": 56 * GiB,
        "free": 50 * GiB,
        "usable": 49 * GiB,
    },
    "nodes": [
        {
            "host": "a",
            "endpoint": "10.0.0.1:50052",
            "transport": "tcp",
            "state": "ok",
            "ok": True,
            "outcome": "ok",
            "protocol": "7.0.0",
            "message": "protocol 7.0.0",
            "elapsed": 0.004,
            "clients": [],
            "duplicate_of": None,
            "warnings": [],
            "facts_error": None,
            "untrusted": None,
            "facts": {
                "mem_total": 8 * GiB,
                "mem_available": 6 * GiB,
                "cpu_model": "AMD EPYC",
                "cpu_count": None,
                "gpus": [],
                "gpu_errors": [],
                "rpc_clients": [],
                "machine_id": None,
            },
            "devices": [
                {
                    "index": 0,
                    "name": "10.0.0.1:50052#0",
                    "description": "AMD EPYC",
                    "backend": "cpu",
                    "kind": "cpu",
                    "total": 8 * GiB,
                    "free": 6 * GiB,
                    "reserve": GiB,
                    "limit": None,
                    "usable": 5 * GiB,
                    "source_of_free": "meminfo",
                    "memory_rule": "meminfo",
                    "alignment": None,
                    "max_size": None,
                    "warnings": [],
                    "measured": True,
                    "untrusted": None,
                }
            ],
        },
        {
            "host": "b",
            "endpoint": "10.0.0.2:50052",
            "transport": "tcp",
            "state": "ok",
            "ok": True,
            "outcome": "ok",
            "protocol": "7.0.0",
            "message": "protocol 7.0.0",
            "elapsed": 0.004,
            "clients": [],
            "duplicate_of": None,
            "warnings": [],
            "facts_error": None,
            "untrusted": None,
            "facts": {
                "mem_total": 8 * GiB,
                "mem_available": 6 * GiB,
                "cpu_model": None,
                "cpu_count": None,
                "gpus": [
                    {"vendor": "nvidia", "index": 0, "name": "L4", "total": 24 * GiB, "free": 20 * GiB},
                    {"vendor": "nvidia", "index": 1, "name": "L4", "total": 24 * GiB, "free": 24 * GiB},
                ],
                "gpu_errors": [],
                "rpc_clients": [],
                "machine_id": None,
            },
            "devices": [
                {
                    "index": i,
                    "name": f"10.0.0.2:50052#{i}",
                    "description": "L4",
                    "backend": "cuda",
                    "kind": "gpu",
                    "total": 24 * GiB,
                    "free": free,
                    "reserve": 0,
                    "limit": None,
                    "usable": free,
                    "source_of_free": "rpc",
                    "memory_rule": "device",
                    "alignment": None,
                    "max_size": None,
                    "warnings": [],
                    "measured": True,
                    "untrusted": None,
                }
                for i, free in ((0, 20 * GiB), (1, 24 * GiB))
            ],
        },
        {
            "host": "c",
            "endpoint": "10.0.0.3:50052",
            "transport": "tcp",
            "state": "timeout",
            "ok": False,
            "outcome": "timeout",
            "protocol": None,
            "message": "connect timed out after 3 s",
            "elapsed": 0.5,
            "clients": None,
            "duplicate_of": None,
            "warnings": [],
            "facts_error": "facts not read within 3 s",
            "untrusted": None,
            "facts": None,
            "devices": [],
        },
        {
            "host": "a2",
            "endpoint": "10.0.0.1:50052",
            "transport": "tcp",
            "state": "ok",
            "ok": True,
            "outcome": "ok",
            "protocol": "7.0.0",
            "message": "protocol 7.0.0",
            "elapsed": 0.004,
            "clients": [],
            "duplicate_of": "a",
            "warnings": [],
            "facts_error": None,
            "untrusted": None,
            "facts": {
                "mem_total": 8 * GiB,
                "mem_available": 6 * GiB,
                "cpu_model": "AMD EPYC",
                "cpu_count": None,
                "gpus": [],
                "gpu_errors": [],
                "rpc_clients": [],
                "machine_id": None,
            },
            "devices": [
                {
                    "index": 0,
                    "name": "10.0.0.1:50052#0",
                    "description": "AMD EPYC",
                    "backend": "cpu",
                    "kind": "cpu",
                    "total": 8 * GiB,
                    "free": 6 * GiB,
                    "reserve": 0,
                    "limit": None,
                    "usable": 6 * GiB,
                    "source_of_free": "meminfo",
                    "memory_rule": "meminfo",
                    "alignment": None,
                    "max_size": None,
                    "warnings": [],
                    "measured": True,
                    "untrusted": None,
                }
            ],
        },
    ],
}


def test_json_schema_is_stable() -> None:
    data = sample_fleet().to_json()
    assert data == GOLDEN
    assert json.loads(json.dumps(data)) == GOLDEN  # plain JSON types only


def test_plan_devices_raise_skip_or_flag_failed_nodes(tiny_model: Path) -> None:
    fleet = sample_fleet()
    with pytest.raises(ProbeError, match=r"1 node\(s\) not ok: c \(10.0.0.3:50052: timeout\)"):
        to_plan_devices(fleet)
    devices = to_plan_devices(fleet, failed="skip")
    assert [(d.endpoint, d.index, d.host, d.usable, d.alignment) for d in devices] == [
        ("10.0.0.1:50052", 0, "a", 5 * GiB, 32),
        ("10.0.0.2:50052", 0, "b", 20 * GiB, 128),
        ("10.0.0.2:50052", 1, "b", 24 * GiB, 128),
    ]
    assert all(d.ok and d.state == "ok" and d.is_rpc for d in devices)
    assert [d.description for d in devices] == ["AMD EPYC", "L4", "L4"]
    profile = profile_model(tiny_model)
    plan = make_plan(devices, profile, PlanOptions(n_ctx=256))
    assert plan.endpoints == ("10.0.0.1:50052", "10.0.0.2:50052")
    assert sum(plan.layer_counts) == profile.n_layer + 1
    flagged = to_plan_devices(fleet, failed="flag")
    assert [(d.endpoint, d.ok, d.state) for d in flagged][-1] == ("10.0.0.3:50052", False, "timeout")
    with pytest.raises(PlanError, match=r"10\.0\.0\.3:50052#0 is not usable: timeout") as info:
        make_plan(flagged, profile, PlanOptions(n_ctx=256))
    assert info.value.host == "c"


def test_cpu_memory_that_was_not_measured_is_not_trusted() -> None:
    h = host(memory_reserve=GiB, memory_limit=16 * GiB)
    result = ok_result(h.endpoint, (RAM, RAM))
    (refused,) = compute_capacity(h, result, None)
    assert (refused.free, refused.usable, refused.measured) == (RAM, 0, False)
    assert refused.untrusted == "CPU memory not measured (no host facts)"
    assert any("--trust-rpc-memory" in w for w in refused.warnings)
    # Trusted on request: the server's figure, with reserve and limit, and a warning that says so.
    (trusted,) = compute_capacity(h, result, None, trust_rpc_memory=True)
    assert (trusted.usable, trusted.measured, trusted.untrusted) == (16 * GiB, False, None)
    assert any("used as free (--trust-rpc-memory)" in w for w in trusted.warnings)
    # Measured memory and GPU memory (the driver's numbers) need no trust.
    (measured,) = compute_capacity(h, result, CPU_FACTS)
    assert (measured.usable, measured.measured, measured.untrusted) == (16 * GiB, True, None)
    gpu = host(rpc_backend="cuda")
    (card,) = compute_capacity(gpu, ok_result(gpu.endpoint, (23 * GiB, 24 * GiB)), None)
    assert (card.usable, card.measured, card.untrusted) == (23 * GiB, True, None)


def test_a_node_without_facts_is_refused_by_the_planner_unless_trusted(tiny_model: Path) -> None:
    blind = node(A, ok_result(A.endpoint, (RAM, RAM)), None, facts_error="ssh: connection refused")
    seeing = sample_fleet().nodes[1]
    fleet = FleetProbe.of([blind, seeing], protocol="7.0.0", timeout=3.0)
    assert blind.ok and blind.untrusted == "CPU memory not measured (no host facts): ssh: connection refused"
    assert fleet.totals.usable == 44 * GiB  # the blind node's RAM is not counted as usable
    with pytest.raises(
        ProbeError, match=r"a \(10\.0\.0\.1:50052: CPU memory not measured .*refused\)"
    ) as info:
        to_plan_devices(fleet)
    assert "--trust-rpc-memory" in (info.value.hint or "")
    assert [d.endpoint for d in to_plan_devices(fleet, failed="skip")] == [seeing.endpoint] * 2
    flagged = to_plan_devices(fleet, failed="flag")
    assert (flagged[0].ok, flagged[0].state, flagged[0].host) == (False, "unmeasured", "a")
    with pytest.raises(PlanError, match=r"10\.0\.0\.1:50052#0 is not usable: unmeasured"):
        make_plan(flagged, profile_model(tiny_model), PlanOptions(n_ctx=256))
    trusted_devices = compute_capacity(A, blind.rpc, None, trust_rpc_memory=True)
    trusted = FleetProbe.of(
        [dataclasses.replace(blind, devices=trusted_devices), seeing], protocol="7.0.0", timeout=3.0
    )
    assert next(d.usable for d in to_plan_devices(trusted)) == RAM - A.memory_reserve


# --- real servers on loopback -----------------------------------------------------------------------------


def local_host(name: str, port: int, **kw: Any) -> Host:
    return Host(name=name, address="127.0.0.1", connection="local", rpc_host="127.0.0.1", rpc_port=port, **kw)


def mem_available() -> int:
    fields = Path("/proc/meminfo").read_text().split()
    return int(fields[fields.index("MemAvailable:") + 1]) * 1024


@asynccontextmanager
async def holder(server: LocalServer) -> AsyncIterator[str]:
    """A client that completed HELLO and stays connected (like a loaded model); yields its address."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(hello_request())
    await reader.readexactly(8 + HELLO_REPLY_SIZE)
    local = writer.get_extra_info("sockname")
    try:
        yield f"{local[0]}:{local[1]}"
    finally:
        writer.close()
        await writer.wait_closed()


@pytest.mark.llama
async def test_ok_node_uses_mem_available_and_stopped_node_is_refused(start_rpc_server: StartServer) -> None:
    server = start_rpc_server()
    ok = local_host("up", server.port, memory_reserve=GiB, memory_limit=64 * GiB)
    limited = start_rpc_server()
    small = local_host("small", limited.port, memory_limit=2 * GiB)
    stopped_port = free_port()
    down = local_host("down", stopped_port)
    before = mem_available()
    fleet = await probe_fleet([ok, small, down], timeout=10.0)
    after = mem_available()
    up, lim, gone = fleet.nodes
    assert (up.state, lim.state, gone.state) == ("ok", "ok", "refused")
    assert up.rpc.version == V7 and up.facts is not None and up.facts_error is None
    (dev,) = up.devices
    assert dev.kind == "cpu" and dev.source_of_free == "meminfo"
    assert up.facts.memory is not None and dev.total == up.facts.memory.total  # CPU total = RAM, both ways
    # Both ok servers run on this machine (one machine id): each gets half of MemAvailable.
    assert up.facts.machine_id is not None and up.facts.machine_id == lim.facts.machine_id  # type: ignore[union-attr]
    assert min(before, after) // 2 - 256 * MiB <= dev.free <= max(before, after) // 2 + 256 * MiB
    assert dev.free < up.rpc.devices[0].free  # the server claims all RAM is free; MemAvailable is less
    assert dev.usable == dev.free - GiB
    assert any("shared among the 2 CPU servers" in w for w in dev.warnings)
    assert lim.devices[0].usable == 2 * GiB
    assert gone.devices == () and "refused" in gone.rpc.message
    assert gone.facts is not None  # the host itself is fine: only its server is not running
    assert fleet.totals.ok_endpoints == 2 and not fleet.ok
    assert fleet_failed(fleet, "any") and not fleet_failed(fleet, "all")
    assert fleet.elapsed < 5.0  # no node waited for its timeout (10 s); headroom for a busy machine
    assert server.alive() and limited.alive()
    no_facts = await probe_fleet([ok], timeout=2.0, facts=False)
    (raw,) = no_facts.nodes[0].devices
    assert no_facts.nodes[0].facts is None and no_facts.nodes[0].facts_error is None
    assert raw.source_of_free == "rpc" and raw.free == up.rpc.devices[0].free
    assert (raw.usable, raw.measured) == (0, False) and any("no host facts" in w for w in raw.warnings)
    trusted = await probe_fleet([ok], timeout=2.0, facts=False, trust_rpc_memory=True)
    assert trusted.nodes[0].devices[0].usable == raw.free - GiB
    memory = await query_fleet_memory([ok, small], timeout=2.0)
    assert memory is not None and (memory.server_count, memory.device_count) == (2, 2)
    assert await query_fleet_memory([ok, small, down], timeout=2.0) is None


@pytest.mark.llama
async def test_busy_node_is_reported_and_keeps_serving(start_rpc_server: StartServer) -> None:
    server = start_rpc_server()
    other = start_rpc_server()
    busy_host, free_host = local_host("held", server.port), local_host("free", other.port)
    async with holder(server) as client:
        started = time.monotonic()
        fleet = await probe_fleet([busy_host, free_host], timeout=0.5)
        elapsed = time.monotonic() - started
        held, fine = fleet.nodes
        assert held.state == "busy" and held.devices == ()
        assert held.clients is not None and client in held.clients  # ss saw the holder
        assert fine.state == "ok"
        assert elapsed < 3.0  # bounded by the 0.5 s timeout (headroom for load); the holder: forever
        assert fleet_failed(fleet, "any") and not fleet_failed(fleet, "none")
    assert server.alive()
    for _ in range(40):  # the server takes the next client once it noticed the holder left
        again = await probe_fleet([busy_host], timeout=1.0, facts=False)
        if again.ok:
            break
        await asyncio.sleep(0.05)
    assert again.nodes[0].state == "ok" and len(again.nodes[0].devices) == 1
    assert server.alive()


async def test_our_own_connection_does_not_make_a_stalled_server_busy() -> None:
    # The reply starts and then stalls: a timeout. `ss` runs while the probe is connected, so it lists
    # the probe itself; that connection must not turn the timeout into `busy`.
    with fake_rpc_server(drip(hello_payload((7, 0, 0)), 0.3)) as server:
        fleet = await probe_fleet([local_host("stalled", server.port)], timeout=0.5)
    (node,) = fleet.nodes
    assert node.rpc.outcome is Outcome.TIMEOUT and node.rpc.local_address is not None
    assert node.clients == () and node.state == "timeout"


@pytest.mark.parametrize(
    ("clients", "own", "left"),
    [
        (("127.0.0.1:5000", "127.0.0.1:5001"), "127.0.0.1:5000", ("127.0.0.1:5001",)),
        (("[::ffff:127.0.0.1]:5000", "10.0.0.2:5000"), "127.0.0.1:5000", ("10.0.0.2:5000",)),
        (("[::1]:6000", "[::1]:6001"), "[::1]:6001", ("[::1]:6000",)),
        (("127.0.0.1:5000",), None, ("127.0.0.1:5000",)),
    ],
)
def test_without_own_connection(clients: tuple[str, ...], own: str | None, left: tuple[str, ...]) -> None:
    assert without_own_connection(clients, own) == left


@pytest.mark.llama
async def test_remote_host_with_loopback_bind_is_not_probed_here(start_rpc_server: StartServer) -> None:
    server = start_rpc_server()
    # An SSH host whose server binds its own loopback: 127.0.0.1 here is another machine's loopback.
    remote = Host(name="far", address="192.0.2.10", rpc_host="127.0.0.1", rpc_port=server.port)
    fleet = await probe_fleet([remote], timeout=0.5, facts=False)
    assert fleet.nodes[0].state == "refused"
    assert "unreachable from this controller" in fleet.nodes[0].rpc.message


class _Gauge:
    """Probes waiting for their answer at once, across several fake servers (each on its own thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = self.peak = 0

    def holding(self, hold: float) -> Handler:
        serve = protocol()

        async def handle(conn: FakeConnection) -> None:
            with self.lock:
                self.open += 1
                self.peak = max(self.peak, self.open)
            try:
                await asyncio.sleep(hold)  # the answer comes late: overlapping probes overlap here
            finally:
                # Counted off before answering: once answered, the client may start its next probe
                # before this thread gets to run again, which is not an overlap.
                with self.lock:
                    self.open -= 1
            await serve(conn)

        return handle


@pytest.mark.parametrize(("forks", "session_forks", "peak"), [(2, None, 2), (None, 3, 3), (None, None, 6)])
def test_the_rpc_fan_out_honours_forks(forks: int | None, session_forks: int | None, peak: int) -> None:
    gauge = _Gauge()
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(fake_rpc_server(gauge.holding(0.3))) for _ in range(6)]
        hosts = [local_host(f"n{i}", server.port) for i, server in enumerate(servers)]

        async def go() -> FleetProbe:
            if session_forks is None:
                return await probe_fleet(hosts, timeout=5.0, facts=False, forks=forks)
            async with Session(forks=session_forks) as session:
                return await probe_fleet(hosts, timeout=5.0, facts=False, session=session)

        fleet = asyncio.run(go())
    assert fleet.ok and gauge.peak == peak  # default: the session's forks, else DEFAULT_FORKS (16)


def test_duplicate_endpoints_are_probed_once() -> None:
    async def go(port: int) -> FleetProbe:
        return await probe_fleet(
            [local_host("one", port), dataclasses.replace(local_host("two", port), memory_reserve=GiB)],
            timeout=1.0,
        )

    fleet = asyncio.run(go(free_port()))
    one, two = fleet.nodes
    assert one.rpc is two.rpc and two.duplicate_of == "one" and one.duplicate_of is None
    assert fleet.totals.endpoints == 1


# --- the command line -------------------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "probe", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def write_inventory(path: Path, ports: dict[str, int], **extra: str) -> Path:
    return write_local_inventory(path, {name: {"rpc_port": port, **extra} for name, port in ports.items()})


@pytest.mark.llama
def test_cli_json_and_exit_status(start_rpc_server: StartServer, tmp_path: Path) -> None:
    s1, s2 = start_rpc_server(), start_rpc_server()
    good = write_inventory(tmp_path / "good.yml", {"n1": s1.port, "n2": s2.port}, memory_reserve="512MiB")
    out = run_cli("-i", str(good), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)  # stdout is the JSON document and nothing else
    assert data["schema_version"] == 1 and data["ok"] is True
    assert [n["host"] for n in data["nodes"]] == ["n1", "n2"]
    dev = data["nodes"][0]["devices"][0]
    assert dev["source_of_free"] == "meminfo" and dev["usable"] == dev["free"] - 512 * MiB
    assert data["totals"]["devices"] == 2

    mixed = write_inventory(tmp_path / "mixed.yml", {"n1": s1.port, "dead": free_port()})
    assert run_cli("-i", str(mixed), "--json").returncode == 1
    assert run_cli("-i", str(mixed), "--json", "--fail-on", "all").returncode == 0
    table = run_cli("-i", str(mixed), "--no-facts", "--timeout", "1")
    assert table.returncode == 1
    assert "refused" in table.stdout and "1/2 ok" in table.stdout and "n1" in table.stdout
    dead = write_inventory(tmp_path / "dead.yml", {"dead": free_port()})
    assert run_cli("-i", str(dead), "--json", "--fail-on", "all").returncode == 1
    assert run_cli("-i", str(dead), "--json", "--fail-on", "none").returncode == 0
    bad = run_cli("-i", str(dead), "--timeout", "0")
    assert bad.returncode == 2 and "--timeout" in bad.stderr
