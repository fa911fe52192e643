"""A CPU device's free memory under a memory cgroup's limit (pure): a node whose processes run in a cgroup
with `memory.max` (a container, a slice with MemoryMax, a lab node of `lab up --memory`) counts what the
cgroup leaves when that is less than its share of MemAvailable (issue 43)."""

from __future__ import annotations

from orchestrator.facts.system import MemInfo
from orchestrator.inventory.model import Host
from orchestrator.probe.capacity import fleet_capacity
from orchestrator.probe.host import HostFacts
from orchestrator.rpc.records import DeviceMemory, Outcome, ProbeResult, ProtocolVersion

GiB = 1 << 30
MiB = 1 << 20


def _result(endpoint: str) -> ProbeResult:
    """A CPU server's answer: free == total == the machine's RAM, as CPU servers report it."""
    device = DeviceMemory(0, 24 * GiB, 24 * GiB, 32, GiB)
    return ProbeResult(endpoint, Outcome.OK, ProtocolVersion(7, 0, 0), (device,), "protocol 7.0.0", 0.004)


def _host(index: int, port: int = 50052) -> Host:
    address = f"10.77.0.{10 + index}"
    return Host(name=f"n{index}", address=address, rpc_host=address, rpc_port=port)


def _facts(cgroup: str | None, left: int | None) -> HostFacts:
    memory = MemInfo(total=24 * GiB, available=18 * GiB, cgroup=cgroup, cgroup_free=left)
    return HostFacts(memory=memory, machine_id="boot_id:one-kernel")


def test_lab_nodes_of_one_machine_each_count_what_their_own_cgroup_leaves() -> None:
    """Three nodes on one kernel: a third of MemAvailable each (6 GiB) without a limit; with one, what
    each node's own cgroup leaves, each its own (not divided among the nodes)."""
    unlimited = fleet_capacity(
        [(_host(i), _result(_host(i).endpoint), _facts(None, None)) for i in (1, 2, 3)]
    )
    assert [(d.free, d.memory_rule) for (d,) in unlimited] == [(6 * GiB, "meminfo")] * 3
    limited = fleet_capacity(
        [
            (
                _host(i),
                _result(_host(i).endpoint),
                _facts(f"/sys/fs/cgroup/memory/rfl3-n{i}", (100 + i) * MiB),
            )
            for i in (1, 2, 3)
        ]
    )
    assert [(d.free, d.usable, d.memory_rule) for (d,) in limited] == [
        ((100 + i) * MiB, (100 + i) * MiB, "cgroup") for i in (1, 2, 3)
    ]


def test_servers_of_one_cgroup_share_what_it_leaves_and_reserve_and_limit_still_apply() -> None:
    one, two = _host(1), _host(1, 50053)
    group = _facts("/sys/fs/cgroup/memory/rfl3-n1", 600 * MiB)
    reserved = Host(
        name="n1b", address=two.address, rpc_host=two.address, rpc_port=50054, memory_reserve=100 * MiB
    )
    devices = fleet_capacity([(h, _result(h.endpoint), group) for h in (one, two, reserved)])
    assert [(d.free, d.usable, d.memory_rule) for (d,) in devices] == [
        (200 * MiB, 200 * MiB, "cgroup"),
        (200 * MiB, 200 * MiB, "cgroup"),
        (200 * MiB, 100 * MiB, "cgroup"),
    ]


def test_a_cgroup_that_leaves_more_than_the_share_of_mem_available_changes_nothing() -> None:
    ((device,),) = fleet_capacity(
        [(_host(1), _result(_host(1).endpoint), _facts("/sys/fs/cgroup/box", 20 * GiB))]
    )
    assert (device.free, device.memory_rule) == (18 * GiB, "meminfo")
    # a cgroup over its limit leaves nothing: nothing is planned there
    ((full,),) = fleet_capacity([(_host(1), _result(_host(1).endpoint), _facts("/sys/fs/cgroup/box", 0))])
    assert (full.free, full.usable, full.memory_rule) == (0, 0, "cgroup")
