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
brings it back. Namespaces have no default route; ip_forward and NAT are never touched.

This is lab plumbing run with local subprocesses, not the product's remote path; it is synchronous
and parallelises per-node steps by starting all processes before waiting for any.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from orchestrator.errors import LabError
from orchestrator.log import get_logger
from orchestrator.paths import rpcfleet_home

DEFAULT_LAB = "lab"
PREFIX = "rfl"
SSHD = "/usr/sbin/sshd"
SSH_PORT = 22
NODE_RPC_PORT = 50052
NODE_INSTALL_DIR = "~/rpcfleet"
MAX_NODES = 200
LAB_GROUP = "lab"
STATE_VERSION = 1
# Tools live in sbin; a non-login root shell may not have it on PATH.
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_NAME_RE = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")
_MAX_NAME = 16
_USER_COMMENT = "rpcfleet-lab"
_NS_RE = re.compile(rf"^{PREFIX}(\d+)-")
_LINK_RE = re.compile(rf"^{PREFIX}(\d+)(br|v\d+)$")
_USER_RE = re.compile(rf"^{PREFIX}(\d+)$")
_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21
_UP_TIMEOUT = 15.0
_KILL_TIMEOUT = 5.0

LabKind = Literal["netns", "local"]


# ---------------------------------------------------------------------------------------------- paths


def labs_root() -> Path:
    return rpcfleet_home() / "lab"


def lab_dir(name: str = DEFAULT_LAB) -> Path:
    return labs_root() / name


def check_name(name: str) -> str:
    """A lab name becomes part of hostnames and namespace names: lowercase letters, digits, dashes."""
    if len(name) > _MAX_NAME or not _NAME_RE.match(name):
        raise LabError(
            f"invalid lab name {name!r}",
            hint=f"use up to {_MAX_NAME} lowercase letters, digits and inner dashes, starting with a letter",
        )
    return name


# ---------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class LabNode:
    """One node of a lab. `namespace` and `veth` are None in a local-connection lab."""

    name: str
    index: int
    address: str
    dir: Path
    namespace: str | None = None
    veth: str | None = None

    @property
    def home(self) -> Path:
        """The node's HOME as seen from the controller (inside the node it is the user's home)."""
        return self.dir / "home"

    @property
    def sshd_config(self) -> Path:
        return self.dir / "sshd_config"

    @property
    def host_key(self) -> Path:
        return self.dir / "ssh_host_ed25519_key"

    @property
    def sshd_pid_file(self) -> Path:
        return self.dir / "sshd.pid"

    @property
    def holder_pid_file(self) -> Path:
        return self.dir / "holder.pid"

    @property
    def log(self) -> Path:
        return self.dir / "node.log"

    @property
    def sshd_log(self) -> Path:
        return self.dir / "sshd.log"

    def sshd_pid(self) -> int | None:
        """The listening sshd's pid, when it runs."""
        pid = _read_pid(self.sshd_pid_file)
        return pid if pid is not None and _is_sshd(pid, self.sshd_config) else None

    def holder_pid(self) -> int | None:
        pid = _read_pid(self.holder_pid_file)
        return pid if pid is not None and _proc_alive(pid) else None


@dataclass(frozen=True)
class Owner:
    """A process, identified by pid and start time so a reused pid is not mistaken for it."""

    pid: int
    started: float

    @classmethod
    def current(cls) -> Owner:
        return cls(os.getpid(), _start_time(os.getpid()) or 0.0)

    @classmethod
    def of(cls, pid: int) -> Owner:
        started = _start_time(pid)
        if started is None:
            raise LabError(f"no process {pid} to own the lab")
        return cls(pid, started)

    def alive(self) -> bool:
        started = _start_time(self.pid)
        return started is not None and abs(started - self.started) < 0.05


@dataclass(frozen=True)
class Lab:
    """A lab as recorded in its lab.json, with the fault helpers the tier-2 tests use."""

    name: str
    kind: LabKind
    slot: int
    dir: Path
    nodes: tuple[LabNode, ...]
    user: str | None  # the ssh user (netns labs)
    bridge: str | None
    bridge_address: str | None
    state: Literal["starting", "up"] = "up"
    creator: Owner | None = None
    owner: Owner | None = None  # the lab is stale once its owner is gone (test sessions)
    outputs: tuple[str, ...] = ()  # extra inventory copies (-o); left in place by `down`
    created: float = field(default_factory=time.time)

    # -- files
    @property
    def state_file(self) -> Path:
        return self.dir / "lab.json"

    @property
    def inventory(self) -> Path:
        return self.dir / "inventory.yml"

    @property
    def client_key(self) -> Path:
        return self.dir / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"

    @property
    def home_mount(self) -> Path | None:
        """The user's home in the root mount namespace: an empty mount point each node binds over."""
        return Path("/home") / self.user if self.user else None

    def node(self, node: str | int | LabNode) -> LabNode:
        """A node by name, 1-based index, or itself."""
        if isinstance(node, LabNode):
            return node
        for candidate in self.nodes:
            if candidate.name == node or candidate.index == node:
                return candidate
        raise LabError(f"lab {self.name!r} has no node {node!r}")

    # -- state
    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["version"] = STATE_VERSION
        data["dir"] = str(self.dir)
        data["nodes"] = [{**asdict(n), "dir": str(n.dir)} for n in self.nodes]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Lab:
        try:
            return cls(
                name=data["name"],
                kind=data["kind"],
                slot=int(data["slot"]),
                dir=Path(data["dir"]),
                nodes=tuple(
                    LabNode(
                        name=n["name"],
                        index=int(n["index"]),
                        address=n["address"],
                        dir=Path(n["dir"]),
                        namespace=n.get("namespace"),
                        veth=n.get("veth"),
                    )
                    for n in data["nodes"]
                ),
                user=data.get("user"),
                bridge=data.get("bridge"),
                bridge_address=data.get("bridge_address"),
                state=data.get("state", "up"),
                creator=Owner(**data["creator"]) if data.get("creator") else None,
                owner=Owner(**data["owner"]) if data.get("owner") else None,
                outputs=tuple(data.get("outputs", ())),
                created=float(data.get("created", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise LabError(f"unreadable lab state: {exc!r}") from exc

    def save(self) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        tmp.replace(self.state_file)

    def live(self) -> bool:
        """Whether this lab is in use: being created by a live process, or up with a live owner (if any)."""
        if self.state == "starting":
            return self.creator is not None and self.creator.alive()
        if self.bridge is not None and not Path("/sys/class/net", self.bridge).exists():
            return False  # its network is gone (a reboot, a manual cleanup): only leftovers remain
        return self.owner is None or self.owner.alive()

    # -- faults (netns labs)
    def _netns(self, node: str | int | LabNode) -> LabNode:
        found = self.node(node)
        if self.kind != "netns" or found.namespace is None or found.veth is None:
            raise LabError(f"lab {self.name!r} is a local-connection lab: no network faults")
        return found

    def cut_link(self, node: str | int | LabNode) -> None:
        """Pull the node's cable: its veth goes down, packets to it are dropped silently."""
        _run(["ip", "link", "set", self._netns(node).veth or "", "down"])

    def restore_link(self, node: str | int | LabNode) -> None:
        _run(["ip", "link", "set", self._netns(node).veth or "", "up"])

    def firewall_drop(self, node: str | int | LabNode) -> None:
        """Every packet into the node is dropped (connects time out)."""
        self._iptables(node, ["-I", "INPUT", "-j", "DROP"])

    def firewall_reject(self, node: str | int | LabNode) -> None:
        """Every TCP connect to the node is reset (connects are refused at once)."""
        self._iptables(node, ["-I", "INPUT", "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"])

    def firewall_clear(self, node: str | int | LabNode) -> None:
        self._iptables(node, ["-F", "INPUT"])

    def _iptables(self, node: str | int | LabNode, args: list[str]) -> None:
        found = self._netns(node)
        if shutil.which("iptables", path=_PATH) is None:
            raise LabError("iptables is not installed", hint="apt-get install iptables (or `make setup`)")
        _run(["ip", "netns", "exec", found.namespace or "", "iptables", "-w", *args])

    def kill_sshd(self, node: str | int | LabNode) -> None:
        """Kill the node's listening sshd: new connects are refused, open sessions keep working."""
        found = self._netns(node)
        pid = found.sshd_pid()
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _wait_dead([pid], _KILL_TIMEOUT)
        found.sshd_pid_file.unlink(missing_ok=True)

    def start_sshd(self, node: str | int | LabNode) -> int:
        """(Re)start the node's sshd inside its namespaces; returns its pid once it accepts connections."""
        found = self._netns(node)
        existing = found.sshd_pid()
        if existing is not None:
            return existing
        holder = found.holder_pid()
        if holder is None:
            raise LabError(f"node {found.name} is gone (no holder process)", hint="recreate the lab")
        found.sshd_pid_file.unlink(missing_ok=True)
        _run(["nsenter", "-t", str(holder), "-m", "-u", "-n", "--", *_sshd_argv(found)])
        _wait_ready([found], _UP_TIMEOUT, self.bridge)
        pid = found.sshd_pid()
        if pid is None:
            raise LabError(f"sshd on {found.name} did not start", stderr=_tail(found.sshd_log))
        return pid

    def node_exec(
        self, node: str | int | LabNode, argv: Sequence[str], *, check: bool = True, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run argv as root inside the node's network, mount and UTS namespaces (a mount is the node's)."""
        found = self._netns(node)
        holder = found.holder_pid()
        if holder is None:
            raise LabError(f"node {found.name} is gone (no holder process)")
        return _run(
            ["nsenter", "-t", str(holder), "-m", "-u", "-n", "--", *argv], check=check, timeout=timeout
        )

    def node_pids(self, node: str | int | LabNode) -> list[int]:
        """Every live process of the node: holder, sshd, sessions, whatever they started."""
        found = self.node(node)
        if found.namespace is not None:
            return _netns_pids([found.namespace])
        return _pids_under(found.dir)

    def heal(self, nodes: Iterable[str | int | LabNode] | None = None) -> None:
        """Undo the faults: links up, firewalls cleared, sshd running. For per-test restore fixtures."""
        for node in self.nodes if nodes is None else [self.node(n) for n in nodes]:
            if self.kind != "netns":
                continue
            self.restore_link(node)
            self.firewall_clear(node)
            self.start_sshd(node)


@dataclass(frozen=True)
class NodeStatus:
    name: str
    address: str
    namespace: str | None
    namespace_present: bool | None  # None: not a netns lab
    sshd_pid: int | None
    reachable: bool | None  # TCP connect to :22 within the probe timeout; None: no sshd in a local lab
    home: Path

    @property
    def sshd_alive(self) -> bool:
        return self.sshd_pid is not None


@dataclass(frozen=True)
class LabStatus:
    name: str
    kind: LabKind
    slot: int
    dir: Path
    inventory: Path
    user: str | None
    owner_pid: int | None
    nodes: tuple[NodeStatus, ...]

    @property
    def healthy(self) -> bool:
        if self.kind == "local":
            return all(n.home.is_dir() for n in self.nodes)
        return all(n.namespace_present and n.sshd_alive and n.reachable for n in self.nodes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "slot": self.slot,
            "dir": str(self.dir),
            "inventory": str(self.inventory),
            "user": self.user,
            "owner_pid": self.owner_pid,
            "healthy": self.healthy,
            "nodes": [{**asdict(n), "home": str(n.home), "sshd_alive": n.sshd_alive} for n in self.nodes],
        }


# ---------------------------------------------------------------------------------------------- public API


def privileged() -> bool:
    """Whether this process can make namespaces, links and users (root with NET_ADMIN and SYS_ADMIN)."""
    if os.geteuid() != 0:
        return False
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    match = re.search(r"^CapEff:\s*([0-9a-f]+)$", status, re.M)
    caps = int(match.group(1), 16) if match else 0
    return bool(caps & (1 << _CAP_NET_ADMIN)) and bool(caps & (1 << _CAP_SYS_ADMIN))


def lab_up(
    nodes: int,
    *,
    name: str = DEFAULT_LAB,
    local: bool = False,
    output: Path | None = None,
    owner_pid: int | None = None,
) -> Lab:
    """Bring a lab of `nodes` nodes up, write its key, known_hosts and inventory, and return it.

    `owner_pid`: the lab counts as stale (reaped by `reap_stale`) once that process is gone.
    """
    check_name(name)
    if not 1 <= nodes <= MAX_NODES:
        raise LabError(f"--nodes must be between 1 and {MAX_NODES}, not {nodes}")
    kind: LabKind = "local" if local else "netns"
    if kind == "netns":
        _check_netns_prerequisites()
    owner = Owner.of(owner_pid) if owner_pid is not None else None
    started = time.monotonic()
    with _lock():
        existing = _load(lab_dir(name))
        if existing is not None and existing.live():
            raise LabError(
                f"lab {name!r} is already up ({len(existing.nodes)} nodes)",
                hint=f"`rpcfleet lab down --name {name}` first, or choose another --name",
            )
        if existing is not None or lab_dir(name).exists():
            _teardown(existing, lab_dir(name))
        slot = _free_slot(name, kind)
        lab = _plan(name, kind, slot, nodes, owner)
        lab.dir.mkdir(parents=True, mode=0o700)
        lab.save()
    try:
        if kind == "netns":
            _create_netns(lab)
        else:
            _create_local(lab)
        written = _write_inventory(lab, output)
        lab = replace(lab, state="up", outputs=written)
        lab.save()
    except BaseException:
        _teardown(lab, lab.dir)
        raise
    get_logger().info(
        "lab_up", lab=name, kind=kind, nodes=nodes, seconds=round(time.monotonic() - started, 3)
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
        _teardown(lab, directory)
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
    return sorted(p.name for p in root.iterdir() if p.is_dir() and _NAME_RE.match(p.name))


def lab_status(name: str = DEFAULT_LAB, *, probe_timeout: float = 1.0) -> LabStatus:
    """What runs of the lab: per node, its namespace, sshd and whether :22 accepts a TCP connect."""
    lab = load_lab(name)
    namespaces = set(_list_namespaces()) if lab.kind == "netns" else set()

    def one(node: LabNode) -> NodeStatus:
        if lab.kind == "local":
            return NodeStatus(node.name, node.address, None, None, None, None, node.home)
        return NodeStatus(
            name=node.name,
            address=node.address,
            namespace=node.namespace,
            namespace_present=node.namespace in namespaces,
            sshd_pid=node.sshd_pid(),
            reachable=_tcp_open(node.address, SSH_PORT, probe_timeout, lab.bridge),
            home=node.home,
        )

    with ThreadPoolExecutor(max_workers=min(16, len(lab.nodes))) as pool:
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


def default_lab_inventory() -> Path:
    """The default lab's inventory (what commands use when no inventory is given)."""
    lab = _load(lab_dir(DEFAULT_LAB))
    if lab is None or lab.state != "up" or not lab.inventory.exists():
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
            removed += _teardown(lab, directory)
        if not privileged():
            return removed
        # Labs of other $RPCFLEET_HOMEs are found through their bridge's alias.
        links = _list_links()
        for link, alias in links.items():
            match = _LINK_RE.match(link)
            if match and match.group(2) == "br" and alias:
                other = _load(Path(alias))
                if other is not None and other.slot == int(match.group(1)) and other.live():
                    live_slots.add(other.slot)
        stale_slots: set[int] = set()
        for name in [*_list_namespaces(), *links]:
            match = _NS_RE.match(name) or _LINK_RE.match(name)
            if match and int(match.group(1)) not in live_slots:
                stale_slots.add(int(match.group(1)))
        for user in _lab_users():
            user_match = _USER_RE.match(user)
            if user_match and int(user_match.group(1)) not in live_slots:
                stale_slots.add(int(user_match.group(1)))
        for slot in sorted(stale_slots):
            removed += _teardown_slot(slot)
    if removed:
        get_logger().info("lab_reaped", removed=removed)
    return removed


# ---------------------------------------------------------------------------------------------- planning


def _plan(name: str, kind: LabKind, slot: int, count: int, owner: Owner | None) -> Lab:
    directory = lab_dir(name)
    nodes = []
    for index in range(1, count + 1):
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
        for obj in [*_list_namespaces(), *_list_links(), *_lab_users(all_users=True)]:
            match = _NS_RE.match(obj) or _LINK_RE.match(obj) or _USER_RE.match(obj)
            if match:
                taken.add(int(match.group(1)))
    preferred = 0 if name == DEFAULT_LAB else zlib.crc32(name.encode()) % 255 + 1
    for offset in range(256):
        slot = (preferred + offset) % 256
        if slot not in taken:
            return slot
    raise LabError("all 256 lab slots are in use", hint="`rpcfleet lab down --all`")


def _check_netns_prerequisites() -> None:
    if not privileged():
        raise LabError(
            "an emulated lab with network namespaces and sshd needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN)",
            hint="run as root, or make a local-connection lab without them: `rpcfleet lab up --local`",
        )
    missing = [tool for tool in ("ip", "nsenter", "unshare", "ssh-keygen", "useradd") if not _which(tool)]
    if not Path(SSHD).exists():
        missing.append(SSHD)
    if missing:
        raise LabError(
            f"the lab needs {', '.join(missing)}",
            hint="apt-get install openssh-server iptables iproute2 (or `make setup`)",
        )


# ---------------------------------------------------------------------------------------------- creation


def _create_local(lab: Lab) -> None:
    for node in lab.nodes:
        node.home.mkdir(parents=True)


def _create_netns(lab: Lab) -> None:
    assert lab.user and lab.bridge and lab.bridge_address and lab.home_mount
    for node in lab.nodes:
        node.dir.mkdir(parents=True)
        (node.home / ".ssh").mkdir(parents=True, mode=0o700)
    # Links first: the bridge's alias marks the slot as this lab's for reapers in other processes.
    # One batch in the root namespace, then one per node namespace, those in parallel.
    batch = [
        f"link add {lab.bridge} type bridge",
        f'link set {lab.bridge} alias "{lab.dir}"',
        f"addr add {lab.bridge_address}/24 dev {lab.bridge}",
        f"link set {lab.bridge} up",
    ]
    for node in lab.nodes:
        batch += [
            f"netns add {node.namespace}",
            f"link add {node.veth} type veth peer name eth0 netns {node.namespace}",
            f"link set {node.veth} master {lab.bridge} up",
        ]
    _run(["ip", "-batch", "-"], input="\n".join(batch) + "\n")
    _run_all(
        [["ip", "-n", node.namespace or "", "-batch", "-"] for node in lab.nodes],
        inputs=[
            f"addr add {node.address}/24 dev eth0\nlink set eth0 up\nlink set lo up\n" for node in lab.nodes
        ],
    )
    # Keys: all ssh-keygens at once.
    keygens = [(lab.client_key, f"rpcfleet-lab-{lab.name}")] + [
        (node.host_key, node.name) for node in lab.nodes
    ]
    _run_all(
        [
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)]
            for path, comment in keygens
        ]
    )
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    lab.home_mount.mkdir(mode=0o755, exist_ok=True)
    _run(
        [
            "useradd",
            "-M",
            "-N",
            "-p",
            "*",
            "-s",
            "/bin/bash",
            "-c",
            _USER_COMMENT,
            "-d",
            str(lab.home_mount),
            lab.user,
        ]
    )
    uid = int(_run(["id", "-u", lab.user]).stdout)
    gid = int(_run(["id", "-g", lab.user]).stdout)
    client_pub = lab.client_key.with_suffix(".pub").read_text()
    extra = _sshd_extra_options()
    for node in lab.nodes:
        authorized = node.home / ".ssh" / "authorized_keys"
        authorized.write_text(client_pub)
        for path in (node.home, node.home / ".ssh", authorized):
            os.chown(path, uid, gid)
        node.sshd_config.write_text(_sshd_config(lab, node, extra))
    # Nodes: a holder owns the node's mount and UTS namespaces and starts sshd inside them.
    for node in lab.nodes:
        _start_node(lab, node)
    _wait_ready(lab.nodes, _UP_TIMEOUT, lab.bridge)
    lines = []
    for node in lab.nodes:
        key_type, key = node.host_key.with_suffix(".pub").read_text().split()[:2]
        lines.append(f"{node.address} {key_type} {key}\n")
    lab.known_hosts.write_text("".join(lines))


def _start_node(lab: Lab, node: LabNode) -> None:
    assert lab.home_mount and node.namespace
    q = shlex.quote
    script = "; ".join(
        [
            "set -e",
            f"echo $$ > {q(str(node.holder_pid_file))}",
            f"mount --bind {q(str(node.home))} {q(str(lab.home_mount))}",
            f"hostname {q(node.name)}",
            " ".join(q(a) for a in _sshd_argv(node)),
            f"exec -a {q(str(node.dir / 'holder'))} sleep infinity",
        ]
    )
    argv = ["setsid", "-f", "ip", "netns", "exec", node.namespace, "unshare", "--mount", "--uts"]
    argv += ["--propagation", "private", "bash", "-c", script]
    with node.log.open("ab") as out:
        # setsid -f forks: the node never is our child, so it outlives a CLI `lab up`.
        subprocess.run(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=_env(), check=True, timeout=10
        )


def _sshd_argv(node: LabNode) -> list[str]:
    # Daemon mode: sshd writes its pid file once its socket is bound.
    return [SSHD, "-f", str(node.sshd_config), "-E", str(node.sshd_log)]


def _sshd_extra_options() -> list[str]:
    # OpenSSH >= 9.8 penalises sources that fail auth or close early: the controller is one source.
    probe = subprocess.run([SSHD, "-V"], capture_output=True, text=True, check=False, timeout=5)
    match = re.search(r"OpenSSH_(\d+)\.(\d+)", probe.stderr + probe.stdout)
    if match and (int(match.group(1)), int(match.group(2))) >= (9, 8):
        return ["PerSourcePenalties no"]
    return []


def _sshd_config(lab: Lab, node: LabNode, extra: list[str]) -> str:
    lines = [
        f"# rpcfleet lab {lab.name}, node {node.name}",
        f"ListenAddress {node.address}",
        f"Port {SSH_PORT}",
        f'HostKey "{node.host_key}"',
        f'PidFile "{node.sshd_pid_file}"',
        # Read with the user's rights: it must be inside the (bind-mounted) home, not under /root.
        "AuthorizedKeysFile %h/.ssh/authorized_keys",
        f"AllowUsers {lab.user}",
        "PermitRootLogin no",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",
        "PrintMotd no",
        "PrintLastLog no",
        "UseDNS no",
        "MaxStartups 100",
        "MaxSessions 64",
        "Subsystem sftp internal-sftp",
        *extra,
    ]
    return "\n".join(lines) + "\n"


def _wait_ready(nodes: Sequence[LabNode], timeout: float, device: str | None) -> None:
    """Until every node's sshd wrote its pid file and accepts TCP on :22; fail early if a node died."""
    deadline = time.monotonic() + timeout
    pending = list(nodes)
    while pending:
        for node in list(pending):
            if node.sshd_pid_file.exists() and _tcp_open(node.address, SSH_PORT, 0.2, device):
                pending.remove(node)
                continue
            holder = _read_pid(node.holder_pid_file)
            if holder is not None and not _proc_alive(holder):
                raise LabError(
                    f"node {node.name} failed to start",
                    stderr=_tail(node.log) + "\n" + _tail(node.sshd_log),
                )
        if pending and time.monotonic() > deadline:
            names = ", ".join(n.name for n in pending)
            logs = "\n".join(_tail(n.sshd_log) for n in pending)
            raise LabError(f"sshd did not accept connections within {timeout:.0f} s on {names}", stderr=logs)
        if pending:
            time.sleep(0.01)


# ---------------------------------------------------------------------------------------------- inventory


def inventory_document(lab: Lab) -> dict[str, Any]:
    """The lab's inventory in rpcfleet's native YAML form: common vars, one entry per node, group `lab`."""
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
        common = {"connection": "local", "rpc_port": NODE_RPC_PORT}
        for node in lab.nodes:
            # `home`: the node's HOME for its local connection; install_dir is absolute either way.
            hosts[node.name] = {
                "address": node.address,
                "rpc_host": node.address,
                "home": str(node.home),
                "install_dir": str(node.home / "rpcfleet"),
            }
    return {"vars": common, "hosts": hosts, "groups": {LAB_GROUP: {"hosts": list(hosts)}}}


def _write_inventory(lab: Lab, output: Path | None) -> tuple[str, ...]:
    kind = "network namespaces with OpenSSH" if lab.kind == "netns" else "local connections"
    header = (
        f"# rpcfleet lab {lab.name!r}: {len(lab.nodes)} nodes ({kind}), written by `rpcfleet lab up`.\n"
        f"# Gone with `rpcfleet lab down --name {lab.name}`.\n"
    )
    text = header + yaml.safe_dump(inventory_document(lab), sort_keys=False)
    lab.inventory.write_text(text)
    if output is None:
        return ()
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text)
    except OSError as exc:
        raise LabError(f"cannot write the inventory to {output}: {exc.strerror}") from exc
    return (str(output.resolve()),)


# ---------------------------------------------------------------------------------------------- teardown


def _teardown(lab: Lab | None, directory: Path) -> list[str]:
    """Remove a lab: its processes, kernel objects, user and state dir. Idempotent."""
    removed: list[str] = []
    if lab is not None and lab.kind == "netns":
        removed += _teardown_slot(lab.slot, lab)
    pids = _pids_under(directory)
    if pids:
        _kill(pids)
        removed.append(f"{len(pids)} processes of {directory}")
    if directory.exists():
        shutil.rmtree(directory, ignore_errors=True)
        removed.append(f"state dir {directory}")
    return removed


def _teardown_slot(slot: int, lab: Lab | None = None) -> list[str]:
    """Remove every namespace, link, user and process of slot `slot` (found by name)."""
    removed: list[str] = []
    namespaces = [ns for ns in _list_namespaces() if ns.startswith(f"{PREFIX}{slot}-")]
    links = [link for link in _list_links() if (m := _LINK_RE.match(link)) and int(m.group(1)) == slot]
    pids = _netns_pids(namespaces)
    if lab is not None:
        pids += _pids_under(lab.dir)
    if pids:
        _kill(pids)
        removed.append(f"{len(set(pids))} processes")
    # Deleting a namespace (no process left in it) takes its veth with it, all namespaces in one
    # batched kernel cleanup: much faster than deleting veths one by one. The bridge goes explicitly.
    batch = [f"link del {link}" for link in links if link.endswith("br")]
    batch += [f"netns del {ns}" for ns in namespaces]
    if batch:
        _run(["ip", "-force", "-batch", "-"], input="\n".join(batch) + "\n", check=False)
        removed += [f"link {link}" for link in links] + [f"namespace {ns}" for ns in namespaces]
    veths = [link for link in links if not link.endswith("br")]
    deadline = time.monotonic() + 2.0
    while veths and time.monotonic() < deadline:
        time.sleep(0.005)
        veths = [link for link in _list_links() if link in veths]
    if veths:  # a veth whose peer namespace lives on (a process we could not kill): delete it here
        _run(["ip", "-force", "-batch", "-"], input="".join(f"link del {v}\n" for v in veths), check=False)
    user = f"{PREFIX}{slot}"
    if user in _lab_users():
        _run(["userdel", user], check=False)
        removed.append(f"user {user}")
    mount_point = Path("/home") / user
    # Only the empty mount point we made: a node's files live in its own home dir, never here.
    with contextlib.suppress(OSError):
        mount_point.rmdir()
    return removed


def _kill(pids: Iterable[int]) -> None:
    unique = [pid for pid in set(pids) if pid not in _protected_pids()]
    for pid in unique:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    _wait_dead(unique, _KILL_TIMEOUT)


def _protected_pids() -> set[int]:
    """This process and its ancestors: never killed, whatever their command line says."""
    pids = {os.getpid()}
    pid = os.getppid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        pid = _ppid(pid) or 1
    return pids


# ---------------------------------------------------------------------------------------------- inspection


def _list_namespaces() -> list[str]:
    result = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def _list_links() -> dict[str, str]:
    """Links of the root namespace with the lab's prefix -> their alias ("" when none)."""
    result = _run(["ip", "-j", "link", "show"], check=False)
    try:
        links = json.loads(result.stdout or "[]")
    except json.JSONDecodeError:
        return {}
    return {
        link["ifname"]: link.get("ifalias", "")
        for link in links
        if isinstance(link, dict) and str(link.get("ifname", "")).startswith(PREFIX)
    }


def _lab_users(*, all_users: bool = False) -> list[str]:
    """Users the lab created (name rfl<k> and the lab's comment); `all_users`: any rfl<k> name."""
    try:
        lines = Path("/etc/passwd").read_text().splitlines()
    except OSError:
        return []
    users = []
    for line in lines:
        fields = line.split(":")
        if len(fields) > 4 and _USER_RE.match(fields[0]) and (all_users or fields[4] == _USER_COMMENT):
            users.append(fields[0])
    return users


def _netns_pids(namespaces: Iterable[str]) -> list[int]:
    """Live processes in any of the named network namespaces (one pass over /proc)."""
    wanted = set()
    for ns in namespaces:
        with contextlib.suppress(OSError):
            info = Path("/run/netns", ns).stat()
            wanted.add((info.st_dev, info.st_ino))
    if not wanted:
        return []
    found = []
    for pid in _all_pids():
        try:
            info = Path(f"/proc/{pid}/ns/net").stat()
        except OSError:
            continue
        if (info.st_dev, info.st_ino) in wanted and _proc_alive(pid):
            found.append(pid)
    return found


def _pids_under(directory: Path) -> list[int]:
    """Live processes whose executable path (argv[0]) lies in `directory`, or sshds configured there."""
    prefix = str(directory).rstrip("/") + "/"
    found = []
    for pid in _all_pids():
        argv = _cmdline(pid)
        if not argv:
            continue
        if argv[0].startswith(prefix) or (_looks_like_sshd(argv) and prefix in " ".join(argv)):
            found.append(pid)
    return [pid for pid in found if _proc_alive(pid)]


def _all_pids() -> Iterator[int]:
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                yield int(entry.name)


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name: [state, ppid, ...]."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()


def _proc_alive(pid: int) -> bool:
    """Running, not a zombie (kill -0 succeeds on a zombie; here pid 1 may never reap orphans)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _ppid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def _start_time(pid: int) -> float | None:
    """Process start time in clock ticks since boot (stable per process, distinct on pid reuse)."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return float(fields[19])


def _looks_like_sshd(argv: Sequence[str]) -> bool:
    # sshd rewrites its title: "sshd: /usr/sbin/sshd -f CONFIG ... [listener] ...".
    return bool(argv) and (argv[0] == SSHD or argv[0].startswith(("sshd: ", f"{SSHD} ")))


def _is_sshd(pid: int, config: Path) -> bool:
    argv = _cmdline(pid)
    return _looks_like_sshd(argv) and f"-f {config} " in " ".join(argv) + " " and _proc_alive(pid)


def _wait_dead(pids: Sequence[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(_proc_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            alive = [pid for pid in pids if _proc_alive(pid)]
            raise LabError(f"processes {alive} did not exit within {timeout:.0f} s of SIGKILL")
        time.sleep(0.005)


def _read_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _tcp_open(address: str, port: int, timeout: float, device: str | None = None) -> bool:
    """Whether address:port accepts a TCP connect. With `device`, only through that interface: a probe
    of a lab whose bridge is gone must fail here, never leave the machine by the default route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            if device is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, device.encode())
            sock.settimeout(timeout)
            sock.connect((address, port))
            return True
    except OSError:
        return False


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


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


# ---------------------------------------------------------------------------------------------- subprocess


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = _PATH + ":" + env.get("PATH", "")
    env["LC_ALL"] = "C"
    return env


def _which(tool: str) -> str | None:
    return shutil.which(tool, path=_PATH + ":" + os.environ.get("PATH", ""))


def _run(
    argv: Sequence[str], *, input: str | None = None, check: bool = True, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(
            list(argv),
            input=input,
            capture_output=True,
            text=True,
            env=_env(),
            timeout=timeout,
            check=False,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
    except FileNotFoundError as exc:
        raise LabError(f"{argv[0]} is not installed", command=shlex.join(argv)) from exc
    except subprocess.TimeoutExpired as exc:
        raise LabError(f"timed out after {timeout:.0f} s", command=shlex.join(argv)) from exc
    if check and result.returncode != 0:
        raise LabError(
            "lab command failed",
            command=shlex.join(argv),
            exit_status=result.returncode,
            stderr=result.stderr or result.stdout,
        )
    return result


def _run_all(argvs: Sequence[Sequence[str]], *, inputs: Sequence[str] | None = None) -> None:
    """Run commands concurrently (all started before any is waited for); fail if any failed."""
    env = _env()
    procs: list[tuple[Sequence[str], subprocess.Popen[str], str | None]] = []
    for i, argv in enumerate(argvs):
        try:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE if inputs else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        except OSError as exc:
            # Those already started must not run on unwatched: kill and reap them before failing.
            for _, started, _ in procs:
                started.kill()
                started.communicate()
            raise LabError(f"cannot run {argv[0]}: {exc.strerror or exc}", command=shlex.join(argv)) from None
        procs.append((argv, proc, inputs[i] if inputs else None))
    failures: list[tuple[Sequence[str], int | None, str]] = []
    for argv, proc, data in procs:
        try:
            _, err = proc.communicate(data, timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            failures.append((argv, None, "timed out"))
            continue
        if proc.returncode != 0:
            failures.append((argv, proc.returncode, err))
    if failures:
        argv, status, err = failures[0]
        raise LabError("lab command failed", command=shlex.join(argv), exit_status=status, stderr=err)
