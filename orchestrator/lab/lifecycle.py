"""The emulated lab: a fleet of nodes on this machine, for demos, benchmarks and tests.

As root, each node is a network namespace on a bridge, with its own address, hostname, HOME and a real
OpenSSH sshd (`kind="netns"`). Without the privileges, a local-connection lab (`kind="local"`) gives
each node a 127.0.x.y address and its own HOME directory, and no sshd.

Every kernel object and user the lab creates carries the lab's slot in its name, so teardown and
reaping touch only what the lab made:

    slot k            one per lab, chosen free at `lab_up`; subnet 10.77.k.0/24 (local: 127.0.k.0/24)
    rfl<k>br          the bridge, address 10.77.k.1, its ifalias names the lab's state dir
    rfl<k>v<i>        the host side of node i's veth (inside the node it is eth0)
    rfl<k>-<node>     node i's network namespace; node i is `<lab name>n<i>` at 10.77.k.(10+i)
    rfl<k>            the system user every node logs in as (home /home/rfl<k>, a mount point that
                      each node's mount namespace binds to its own home directory)

State lives in `$RPCFLEET_HOME/lab/<name>/` (lab.json, keys, known_hosts, inventory.yml, one directory
per node with its sshd_config, host key, pid files, logs and home). A node is anchored by a holder
process (`sleep`, renamed `<node dir>/holder`) that owns the node's mount and UTS namespaces inside
its network namespace; sshd runs beside it, so killing sshd leaves the node up and `start_sshd`
brings it back. `lab_repair` does that for every broken node of a lab, and starts again a node none of
whose processes is left (a power cut), touching no healthy node. Namespaces have no default route;
ip_forward and NAT are never touched.

This is lab plumbing run with local subprocesses, not the product's remote path; it is synchronous
and parallelises per-node steps by starting all processes before waiting for any.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from orchestrator.core.errors import InventoryError, LabError
from orchestrator.core.log import get_logger
from orchestrator.core.paths import DEFAULT_LAB, labs_root
from orchestrator.engine.threads import thread_pool
from orchestrator.inventory.load import load_inventory_text
from orchestrator.lab import cgroups as cpu_groups
from orchestrator.lab import systemd
from orchestrator.lab.netns import (
    check_netns_prerequisites,
    create_local,
    create_netns,
    lab_users,
    link_is_down,
    list_links,
    list_namespaces,
    privileged,
    restart_node,
    restore_holder,
    teardown,
    teardown_slot,
)
from orchestrator.lab.procs import tcp_open
from orchestrator.lab.sshd import SSH_PORT
from orchestrator.lab.state import (
    LAB_GROUP,
    LINK_RE,
    MAX_NODES,
    NAME_RE,
    NODE_INSTALL_DIR,
    NODE_RPC_PORT,
    NS_RE,
    PREFIX,
    USER_RE,
    Lab,
    LabKind,
    LabNode,
    LabStatus,
    NodeInit,
    NodeRepair,
    NodeStatus,
    Owner,
    check_name,
    lab_dir,
)


def lab_up(
    nodes: int,
    *,
    name: str = DEFAULT_LAB,
    local: bool = False,
    output: Path | None = None,
    owner_pid: int | None = None,
    init: NodeInit = "none",
    variables: Mapping[str, Any] | None = None,
    node_variables: Mapping[str, Mapping[str, Any]] | None = None,
    cpus: float | None = None,
    node_init: Mapping[int, NodeInit] | None = None,
    memory: int | None = None,
) -> Lab:
    """Bring a lab of `nodes` nodes up, write its key, known_hosts and inventory, and return it.

    `owner_pid`: the lab counts as stale (reaped by `reap_stale`) once that process is gone.
    `init="systemd"`: every node boots systemd as PID 1 (systemd-nspawn; lab/systemd.py).
    `variables`: inventory variables for every node (`--var rpc_cache=true`), checked before anything
    is made; `node_variables`: a node's own, by its number (`--var 2:rpc_servers=[50052, 50053]`).
    `cpus`: each node's CPU share, a cgroup quota (lab/cgroups.py; network-namespace labs).
    `node_init`: a node's own init by its number, over `init` (a lab of plain and systemd nodes).
    `memory`: each node's memory limit in bytes, a cgroup's `memory.max` (lab/cgroups.py; network-namespace
    labs whose nodes boot no systemd).
    """
    check_name(name)
    extra = check_variables(variables or {})
    if not 1 <= nodes <= MAX_NODES:
        raise LabError(f"--nodes must be between 1 and {MAX_NODES}, not {nodes}")
    per_node = check_node_variables(node_variables or {}, nodes, extra)
    if cpus is not None:
        if local:
            raise LabError("--cpus needs a network-namespace lab, not --local (its nodes are this machine)")
        cpu_groups.check_cpus(cpus)
        cpu_groups.node_groups(f"{PREFIX}check")  # no cpu controller: said before anything is made
    if memory is not None:
        if local:
            raise LabError("--memory needs a network-namespace lab, not --local (its nodes are this machine)")
        cpu_groups.check_memory(memory)
        cpu_groups.memory_group(f"{PREFIX}check")  # no memory controller: said before anything is made
    kind: LabKind = "local" if local else "netns"
    inits = {index: (node_init or {}).get(index, init) for index in range(1, nodes + 1)}
    booting: NodeInit = "systemd" if "systemd" in inits.values() else "none"
    if local and booting != "none":
        raise LabError("--init systemd needs a network-namespace lab, not --local")
    if memory is not None and booting != "none":
        # nspawn makes the container's own cgroups and mounts; reading the limit there is not done yet
        raise LabError("--memory is for nodes that boot no systemd (--init none)")
    if kind == "netns":
        check_netns_prerequisites(booting)
    owner = Owner.of(owner_pid) if owner_pid is not None else None
    started = time.monotonic()
    with _lock():
        existing = _load(lab_dir(name))
        if existing is not None and existing.live():
            faults = _lab_faults(existing, probe_timeout=0.5)
            if faults:
                broken = ", ".join(f"{node} {fault}" for node, fault in faults.items())
                raise LabError(
                    f"lab {name!r} is already up ({len(existing.nodes)} nodes; {broken})",
                    hint=f"`rpcfleet lab repair --name {name}` brings {', '.join(faults)} back and leaves "
                    f"the other nodes as they are; or `rpcfleet lab down --name {name}` first",
                )
            raise LabError(
                f"lab {name!r} is already up ({len(existing.nodes)} nodes)",
                hint=f"`rpcfleet lab down --name {name}` first, or choose another --name",
            )
        if existing is not None or lab_dir(name).exists():
            teardown(existing, lab_dir(name))
        slot = _free_slot(name, kind)
        lab = replace(_plan(name, kind, slot, owner, inits), cpus=cpus, memory=memory)
        lab.dir.mkdir(parents=True, mode=0o700)
        lab.save()
    try:
        if kind == "netns":
            create_netns(lab)
        else:
            create_local(lab)
        written = _write_inventory(lab, output, extra, per_node)
        lab = replace(lab, state="up", outputs=written)
        lab.save()
    except BaseException:
        teardown(lab, lab.dir)
        raise
    get_logger().info(
        "lab_up", lab=name, kind=kind, init=init, nodes=nodes, seconds=round(time.monotonic() - started, 3)
    )
    return lab


def lab_down(name: str = DEFAULT_LAB) -> bool:
    """Tear a lab down completely. Returns False when there was nothing to remove."""
    check_name(name)
    with _lock():
        directory = lab_dir(name)
        lab = _load(directory)
        if lab is None and not directory.exists():
            return False
        started = time.monotonic()
        teardown(lab, directory)
    get_logger().info("lab_down", lab=name, seconds=round(time.monotonic() - started, 3))
    return True


def lab_down_all(*, include_owned: bool = False) -> list[str]:
    """Tear down every lab under $RPCFLEET_HOME and reap stale lab objects; returns what was removed.

    A lab owned by another live process (a running test session) is its owner's to remove: kept
    unless `include_owned`.
    """
    removed = []
    for name in list_labs():
        lab = _load(lab_dir(name))
        owned = lab is not None and lab.owner is not None and lab.owner.pid != os.getpid()
        if owned and not include_owned and lab is not None and lab.live():
            continue
        if lab_down(name):
            removed.append(f"lab {name}")
    return removed + reap_stale()


def load_lab(name: str = DEFAULT_LAB) -> Lab:
    """The lab recorded under `name`; LabError when there is none."""
    check_name(name)
    lab = _load(lab_dir(name))
    if lab is None or lab.state != "up":
        raise LabError(f"no lab named {name!r} is up", hint=_up_hint(name))
    return lab


def list_labs() -> list[str]:
    root = labs_root()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and NAME_RE.match(p.name))


def lab_status(name: str = DEFAULT_LAB, *, probe_timeout: float = 1.0) -> LabStatus:
    """What runs of the lab: per node, its namespace, sshd and whether :22 accepts a TCP connect."""
    lab = load_lab(name)
    namespaces = set(list_namespaces()) if lab.kind == "netns" else set()

    def one(node: LabNode) -> NodeStatus:
        if lab.kind == "local":
            return NodeStatus(node.name, node.address, None, None, None, None, node.home)
        return NodeStatus(
            name=node.name,
            address=node.address,
            namespace=node.namespace,
            namespace_present=node.namespace in namespaces,
            sshd_pid=node.sshd_pid(),
            reachable=tcp_open(node.address, SSH_PORT, probe_timeout, lab.bridge),
            home=node.home,
            init=node.init,
        )

    with thread_pool(min(16, len(lab.nodes)), "lab-node") as pool:
        statuses = tuple(pool.map(one, lab.nodes))
    return LabStatus(
        name=lab.name,
        kind=lab.kind,
        slot=lab.slot,
        dir=lab.dir,
        inventory=lab.inventory,
        user=lab.user,
        owner_pid=lab.owner.pid if lab.owner else None,
        nodes=statuses,
    )


def lab_repair(name: str = DEFAULT_LAB, *, probe_timeout: float = 1.0) -> tuple[NodeRepair, ...]:
    """Bring a lab's broken nodes back with their own addresses, host keys and homes: a dead sshd is
    started again inside the node's namespaces, a dead holder replaced, a node with no process left (a
    power cut) started as `lab up` did, a pulled cable put back. Healthy nodes are not touched (their
    sshd and servers keep their pids). One record per node, in node order; LabError when no lab is up.
    """
    check_name(name)
    started = time.monotonic()
    with _lock():  # one repair at a time: two would each start an sshd for the same node
        lab = load_lab(name)
        if not lab.live():
            flag = "" if name == DEFAULT_LAB else f" --name {name}"
            raise LabError(
                f"lab {name!r} is stale: its network is gone, or the process that owned it exited",
                hint=f"`rpcfleet lab down{flag}`, then `rpcfleet lab up{flag}`",
            )
        namespaces = set(list_namespaces()) if lab.kind == "netns" else set()
        with thread_pool(min(16, len(lab.nodes)), "lab-node") as pool:
            results = tuple(pool.map(lambda n: _repair_node(lab, n, namespaces, probe_timeout), lab.nodes))
    get_logger().info(
        "lab_repair",
        lab=name,
        repaired=[r.name for r in results if r.fault is not None and r.ok],
        failed=[r.name for r in results if not r.ok],
        seconds=round(time.monotonic() - started, 3),
    )
    return results


def _node_fault(lab: Lab, node: LabNode, namespaces: set[str], probe_timeout: float) -> str | None:
    """What is wrong with a node of a live lab, or None when it is healthy."""
    if lab.kind == "local":
        return None if node.home.is_dir() else "home missing"
    if node.namespace not in namespaces:
        return "namespace gone"
    if link_is_down(node):  # first: a started sshd is waited for through the link
        return "link down"
    sshd = node.sshd_pid()
    if node.init == "systemd":
        if systemd.leader(node) is None:
            return "down"
    elif sshd is None and node.holder_pid() is None:
        return "down"
    elif sshd is not None and node.holder_pid() is None:
        return "holder dead"
    if sshd is None:
        return "sshd dead"
    if tcp_open(node.address, SSH_PORT, probe_timeout, lab.bridge):
        return None
    return "unreachable"


def _lab_faults(lab: Lab, *, probe_timeout: float) -> dict[str, str]:
    """Broken nodes of a live lab -> what is wrong with each."""
    namespaces = set(list_namespaces()) if lab.kind == "netns" else set()
    with thread_pool(min(16, len(lab.nodes)), "lab-node") as pool:
        faults = list(pool.map(lambda n: _node_fault(lab, n, namespaces, probe_timeout), lab.nodes))
    return {node.name: fault for node, fault in zip(lab.nodes, faults, strict=True) if fault is not None}


def _repair_node(lab: Lab, node: LabNode, namespaces: set[str], probe_timeout: float) -> NodeRepair:
    first = fault = _node_fault(lab, node, namespaces, probe_timeout)
    if first is None:
        return NodeRepair(node.name, None, sshd_pid=node.sshd_pid() if lab.kind == "netns" else None)
    actions: list[str] = []
    error = None
    try:
        # A node may have several faults (a dead holder and a pulled cable): fixed one at a time.
        while fault is not None and len(actions) < 4:
            actions.append(_fix(lab, node, fault))
            previous, fault = fault, _node_fault(lab, node, namespaces, probe_timeout)
            if fault == previous:
                error = f"still {fault} after: {actions[-1]}"
                break
        if fault is not None and error is None:
            error = f"still {fault} after: {'; '.join(actions)}"
    except LabError as exc:
        error = exc.describe()
    return NodeRepair(
        node.name,
        first,
        "; ".join(actions) or None,
        node.sshd_pid() if lab.kind == "netns" else None,
        error,
    )


def _fix(lab: Lab, node: LabNode, fault: str) -> str:
    """Repair one fault of a node; what was done. LabError for what repair cannot fix."""
    if fault == "home missing":
        node.home.mkdir(parents=True, exist_ok=True)
        return "home created (empty)"
    if fault == "down":
        restart_node(lab, node)
        return "node started" if node.init == "none" else "node booted"
    if fault == "holder dead":
        sshd = node.sshd_pid()
        if sshd is None:
            return "nothing (its sshd died meanwhile)"
        restore_holder(node, sshd, lab.cpus, lab.memory)
        return "holder started"
    if fault == "sshd dead":
        return f"sshd started (pid {lab.start_sshd(node)})"
    if fault == "link down":
        lab.restore_link(node)
        return "link up"
    flag = "" if lab.name == DEFAULT_LAB else f" --name {lab.name}"
    if fault == "namespace gone":
        raise LabError(
            f"the network namespace {node.namespace} was removed: lab repair does not make it again",
            hint=f"`rpcfleet lab down{flag}`, then `rpcfleet lab up{flag}`",
        )
    raise LabError(
        f"sshd runs but {node.address}:{SSH_PORT} does not answer (a firewall in the node?)",
        hint=f"`ip netns exec {node.namespace} iptables -L INPUT` shows its rules",
    )


def labs_up() -> list[Lab]:
    """The labs that are up with an inventory, by name."""
    labs = [lab for lab in map(_load, map(lab_dir, list_labs())) if lab is not None]
    return [lab for lab in labs if lab.state == "up" and lab.inventory.exists()]


def default_lab_inventory() -> Path:
    """The default lab's inventory (what commands use when no inventory is given)."""
    lab = _load(lab_dir(DEFAULT_LAB))
    if lab is None or lab.state != "up" or not lab.inventory.exists():
        named = labs_up()
        if named:  # "no lab is up" would be false: say which are, and how to use one
            raise LabError(
                f"no inventory given and no lab named {DEFAULT_LAB!r} is up (commands use only that one)",
                hint="pass the inventory of a lab that is up: "
                + ", ".join(f"{other.name}: -i {other.inventory}" for other in named),
            )
        raise LabError(
            "no inventory given and no lab is up",
            hint="pass -i INVENTORY, or run `rpcfleet lab up` (or `rpcfleet lab up --local`) first",
        )
    return lab.inventory


def reap_stale() -> list[str]:
    """Remove what dead labs left behind (killed runs, labs whose owner exited, orphaned objects).

    Only objects with the lab's own names are touched: namespaces `rfl<k>-*`, links `rfl<k>br` and
    `rfl<k>v<i>`, users `rfl<k>` marked as lab users, state dirs under $RPCFLEET_HOME/lab.
    Returns a description of each thing removed.
    """
    removed: list[str] = []
    with _lock():
        live_slots: set[int] = set()
        for name in list_labs():
            directory = lab_dir(name)
            lab = _load(directory)
            if lab is not None and lab.live():
                live_slots.add(lab.slot)
                continue
            removed += teardown(lab, directory)
        if not privileged():
            return removed
        # Labs of other $RPCFLEET_HOMEs are found through their bridge's alias.
        links = list_links()
        for link, alias in links.items():
            match = LINK_RE.match(link)
            if match and match.group(2) == "br" and alias:
                other = _load(Path(alias))
                if other is not None and other.slot == int(match.group(1)) and other.live():
                    live_slots.add(other.slot)
        stale_slots: set[int] = set()
        for name in [*list_namespaces(), *links]:
            match = NS_RE.match(name) or LINK_RE.match(name)
            if match and int(match.group(1)) not in live_slots:
                stale_slots.add(int(match.group(1)))
        for user in lab_users():
            user_match = USER_RE.match(user)
            if user_match and int(user_match.group(1)) not in live_slots:
                stale_slots.add(int(user_match.group(1)))
        for slot in sorted(stale_slots):
            removed += teardown_slot(slot)
    if removed:
        get_logger().info("lab_reaped", removed=removed)
    return removed


def _plan(name: str, kind: LabKind, slot: int, owner: Owner | None, inits: Mapping[int, NodeInit]) -> Lab:
    directory = lab_dir(name)
    nodes = []
    for index in inits:
        node = f"{name}n{index}"
        if kind == "netns":
            address = f"10.77.{slot}.{10 + index}"
            nodes.append(
                LabNode(
                    node,
                    index,
                    address,
                    directory / "nodes" / node,
                    namespace=f"{PREFIX}{slot}-{node}",
                    veth=f"{PREFIX}{slot}v{index}",
                    init=inits[index],
                )
            )
        else:
            nodes.append(LabNode(node, index, f"127.0.{slot}.{10 + index}", directory / "nodes" / node))
    netns = kind == "netns"
    return Lab(
        name=name,
        kind=kind,
        slot=slot,
        dir=directory,
        nodes=tuple(nodes),
        user=f"{PREFIX}{slot}" if netns else None,
        bridge=f"{PREFIX}{slot}br" if netns else None,
        bridge_address=f"10.77.{slot}.1" if netns else None,
        state="starting",
        creator=Owner.current(),
        owner=owner,
    )


def _free_slot(name: str, kind: LabKind) -> int:
    """A slot no other lab uses; stable per name when free (the default lab gets 0)."""
    taken: set[int] = set()
    for other in list_labs():
        lab = _load(lab_dir(other))
        if lab is not None and other != name:
            taken.add(lab.slot)
    if kind == "netns":
        for obj in [*list_namespaces(), *list_links(), *lab_users(all_users=True)]:
            match = NS_RE.match(obj) or LINK_RE.match(obj) or USER_RE.match(obj)
            if match:
                taken.add(int(match.group(1)))
    preferred = 0 if name == DEFAULT_LAB else zlib.crc32(name.encode()) % 255 + 1
    for offset in range(256):
        slot = (preferred + offset) % 256
        if slot not in taken:
            return slot
    raise LabError("all 256 lab slots are in use", hint="`rpcfleet lab down --all`")


def check_variables(variables: Mapping[str, Any], node: int | None = None) -> dict[str, Any]:
    """Inventory variables for every lab node (or node `node`), checked as an inventory's would be
    (unknown names with the closest one, bad values): an `InventoryError` naming the `--var`."""
    if not variables:
        return {}
    flag = "--var " if node is None else f"--var {node}:"
    for key, value in variables.items():  # each alone first, so that the error names its --var
        shown = value if isinstance(value, str) else json.dumps(value)
        _check_document({key: value}, f"{flag}{key}={shown}")
    _check_document(variables, "--var")  # then together (rpc_devices with rpc_servers)
    return dict(variables)


def _check_document(variables: Mapping[str, Any], flag: str) -> None:
    # As group vars (an unknown name is only warned about there) and on a host itself (where the host's
    # own address would otherwise hide a bad `--var N:address=x:y`).
    for document in (
        {"vars": dict(variables), "hosts": {"labcheck": {"address": "127.0.0.1"}}},
        {"hosts": {"labcheck": {"address": "127.0.0.1", **variables}}},
    ):
        try:
            checked = load_inventory_text(yaml.safe_dump(document), path=Path("--var"))
        except InventoryError as err:
            message = _without_location(err.message).replace("host 'labcheck': ", "")
            raise InventoryError(f"{flag}: {message}") from None
        if checked.warnings:  # a typo here would silently do nothing on every node: refused, not kept
            found = "; ".join(_without_location(w) for w in checked.warnings).replace(" is kept as is", "")
            raise InventoryError(f"{flag}: {found}")


def _without_location(text: str) -> str:
    """An error about the document made from --var, less its lines and columns (of a text the user
    never wrote) and the snippets quoted from it."""
    lines = text.splitlines()
    return "; ".join(re.sub(r"^--var(:\d+)*: ", "", line) for line in lines if not line.startswith("    "))


def check_node_variables(
    node_variables: Mapping[str, Mapping[str, Any]], nodes: int, common: Mapping[str, Any]
) -> dict[int, dict[str, Any]]:
    """Per-node variables (`--var N:KEY=VALUE`, N the node's number): N in range, each node's variables
    checked as an inventory's would be, over the common ones."""
    out: dict[int, dict[str, Any]] = {}
    for key, variables in node_variables.items():
        index = int(key) if str(key).isdigit() else 0
        if not 1 <= index <= nodes:
            raise InventoryError(
                f"--var {key}:...: no node {key} in a lab of {nodes} (nodes are 1 to {nodes})"
            )
        check_variables(variables, index)
        _check_document({**common, **variables}, f"--var (node {index})")
        out[index] = dict(variables)
    return out


LAB_VULKAN_ENV = "GGML_VK_VISIBLE_DEVICES"


def inventory_document(
    lab: Lab,
    variables: Mapping[str, Any] | None = None,
    node_variables: Mapping[int, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The lab's inventory in rpcfleet's native YAML form: common vars (then `variables`), one entry per
    node (then its `node_variables`, by node number), group `lab`."""
    hosts: dict[str, dict[str, Any]] = {}
    if lab.kind == "netns":
        common: dict[str, Any] = {
            "connection": "ssh",
            "ssh_user": lab.user,
            "ssh_port": SSH_PORT,
            "ssh_key": str(lab.client_key),
            "ssh_known_hosts": str(lab.known_hosts),
            "rpc_port": NODE_RPC_PORT,
            "install_dir": NODE_INSTALL_DIR,
        }
        for node in lab.nodes:
            hosts[node.name] = {"address": node.address}
    else:
        # Local nodes are this machine: under `auto`, a CI host with systemd as PID 1 (and rpcfleet as
        # root) would get system units installed on itself. The process supervisor keeps them in HOME.
        common = {"connection": "local", "rpc_port": NODE_RPC_PORT, "supervisor": "process"}
        for node in lab.nodes:
            # `home`: the node's HOME for its local connection; install_dir is absolute either way.
            hosts[node.name] = {
                "address": node.address,
                "rpc_host": node.address,
                "home": str(node.home),
                "install_dir": str(node.home / "rpcfleet"),
            }
    for node in lab.nodes:
        hosts[node.name].update((node_variables or {}).get(node.index, {}))
        backend = hosts[node.name].get("rpc_backend", (variables or {}).get("rpc_backend"))
        if backend == "vulkan" and "rpc_env" not in hosts[node.name] and "rpc_env" not in (variables or {}):
            # The lab's GPU is Mesa's llvmpipe, a Vulkan device of type CPU, which ggml-vulkan uses only
            # when GGML_VK_VISIBLE_DEVICES lists it: device 0, with a 2 GiB device-local heap.
            hosts[node.name]["rpc_env"] = {LAB_VULKAN_ENV: "0"}
    return {
        "vars": {**common, **(variables or {})},
        "hosts": hosts,
        "groups": {LAB_GROUP: {"hosts": list(hosts)}},
    }


def _write_inventory(
    lab: Lab,
    output: Path | None,
    variables: Mapping[str, Any],
    node_variables: Mapping[int, Mapping[str, Any]] | None = None,
) -> tuple[str, ...]:
    kind = "network namespaces with OpenSSH" if lab.kind == "netns" else "local connections"
    header = (
        f"# rpcfleet lab {lab.name!r}: {len(lab.nodes)} nodes ({kind}), written by `rpcfleet lab up`.\n"
        f"# Gone with `rpcfleet lab down --name {lab.name}`.\n"
    )
    text = header + yaml.safe_dump(inventory_document(lab, variables, node_variables), sort_keys=False)
    lab.inventory.write_text(text)
    if output is None:
        return ()
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text)
    except OSError as exc:
        raise LabError(f"cannot write the inventory to {output}: {exc.strerror}") from exc
    return (str(output.resolve()),)


def _load(directory: Path) -> Lab | None:
    try:
        data = json.loads((directory / "lab.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    try:
        return Lab.from_json(data)
    except LabError:
        return None


def _up_hint(name: str) -> str:
    flag = "" if name == DEFAULT_LAB else f" --name {name}"
    return f"run `rpcfleet lab up --nodes 3{flag}` (add --local without root)"


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    """One lab operation at a time per $RPCFLEET_HOME (slot choice, state writes, reaping)."""
    root = labs_root()
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
