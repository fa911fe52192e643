"""A lab and its nodes as typed data, with the state file that records them."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from orchestrator.core.errors import LabError
from orchestrator.core.files import write_atomic
from orchestrator.core.paths import DEFAULT_LAB, labs_root
from orchestrator.lab import sshd
from orchestrator.lab.faults import LabFaults
from orchestrator.lab.procs import cmdline, proc_alive, read_pid, start_time

PREFIX = "rfl"


NODE_RPC_PORT = 50052


NODE_INSTALL_DIR = "~/rpcfleet"


MAX_NODES = 200


LAB_GROUP = "lab"


STATE_VERSION = 1


NAME_RE = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


_MAX_NAME = 16


USER_COMMENT = "rpcfleet-lab"


NS_RE = re.compile(rf"^{PREFIX}(\d+)-")


LINK_RE = re.compile(rf"^{PREFIX}(\d+)(br|v\d+)$")


USER_RE = re.compile(rf"^{PREFIX}(\d+)$")


CAP_NET_ADMIN = 12


CAP_SYS_ADMIN = 21


LabKind = Literal["netns", "local"]


NodeInit = Literal["none", "systemd"]  # none: sshd under unshare; systemd: systemd-nspawn boots systemd


def lab_dir(name: str = DEFAULT_LAB) -> Path:
    return labs_root() / name


def check_name(name: str) -> str:
    """A lab name becomes part of hostnames and namespace names: lowercase letters, digits, dashes."""
    if len(name) > _MAX_NAME or not NAME_RE.match(name):
        raise LabError(
            f"invalid lab name {name!r}",
            hint=f"use up to {_MAX_NAME} lowercase letters, digits and inner dashes, starting with a letter",
        )
    return name


@dataclass(frozen=True)
class LabNode:
    """One node of a lab. `namespace` and `veth` are None in a local-connection lab."""

    name: str
    index: int
    address: str
    dir: Path
    namespace: str | None = None
    veth: str | None = None
    init: NodeInit = "none"

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
        return sshd.running_pid(self)

    def holder_pid(self) -> int | None:
        """The holder's pid, when it runs. Its file outlives it (a power cut kills it, not the file),
        and this machine's pids wrap around (32768 by default): a live pid is the holder only if it bears
        the holder's name (`exec -a`), else a fault would SIGKILL, or `node_exec` enter, whatever
        process took that pid, another lab's rpc-server too. Before its `exec` the holder is the shell
        that wrote the file: its command line names the file."""
        pid = read_pid(self.holder_pid_file)
        if pid is None or not proc_alive(pid):
            return None
        argv = cmdline(pid)
        ours = bool(argv) and (
            argv[0] == str(self.dir / "holder") or str(self.holder_pid_file) in " ".join(argv)
        )
        return pid if ours else None


@dataclass(frozen=True)
class Owner:
    """A process, identified by pid and start time so a reused pid is not mistaken for it."""

    pid: int
    started: float

    @classmethod
    def current(cls) -> Owner:
        return cls(os.getpid(), start_time(os.getpid()) or 0.0)

    @classmethod
    def of(cls, pid: int) -> Owner:
        started = start_time(pid)
        if started is None:
            raise LabError(f"no process {pid} to own the lab")
        return cls(pid, started)

    def alive(self) -> bool:
        started = start_time(self.pid)
        return started is not None and abs(started - self.started) < 0.05


@dataclass(frozen=True)
class Lab(LabFaults):
    """A lab as recorded in its lab.json, with the fault helpers the tier-2 tests use (lab/faults.py)."""

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
    cpus: float | None = None  # each node's CPU share (`--cpus`, lab/cgroups.py); None: no quota
    memory: int | None = None  # each node's memory limit in bytes (`--memory`, lab/cgroups.py); None: none

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
                        init=n.get("init", "none"),
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
                cpus=float(data["cpus"]) if data.get("cpus") is not None else None,
                memory=int(data["memory"]) if data.get("memory") is not None else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise LabError(f"unreadable lab state: {exc!r}") from exc

    def save(self) -> None:
        write_atomic(self.state_file, json.dumps(self.to_json(), indent=2) + "\n")

    def live(self) -> bool:
        """Whether this lab is in use: being created by a live process, or up with a live owner (if any)."""
        if self.state == "starting":
            return self.creator is not None and self.creator.alive()
        if self.bridge is not None and not Path("/sys/class/net", self.bridge).exists():
            return False  # its network is gone (a reboot, a manual cleanup): only leftovers remain
        return self.owner is None or self.owner.alive()


@dataclass(frozen=True)
class NodeStatus:
    name: str
    address: str
    namespace: str | None
    namespace_present: bool | None  # None: not a netns lab
    sshd_pid: int | None
    reachable: bool | None  # TCP connect to :22 within the probe timeout; None: no sshd in a local lab
    home: Path
    init: NodeInit = "none"

    @property
    def sshd_alive(self) -> bool:
        return self.sshd_pid is not None


@dataclass(frozen=True)
class NodeRepair:
    """What `lab repair` found on a node and did about it."""

    name: str
    fault: str | None  # None: the node was healthy and was left alone
    action: str | None = None  # what was done (None: nothing)
    sshd_pid: int | None = None  # the listening sshd afterwards
    error: str | None = None  # why the node could not be repaired

    @property
    def ok(self) -> bool:
        return self.error is None


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
