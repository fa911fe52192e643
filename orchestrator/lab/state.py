"""A lab and its nodes as typed data, with the state file that records them."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from orchestrator.core.errors import LabError
from orchestrator.core.files import write_atomic
from orchestrator.core.paths import DEFAULT_LAB, labs_root
from orchestrator.core.poll import poll
from orchestrator.lab import cgroups, systemd
from orchestrator.lab.procs import (
    KILL_TIMEOUT,
    PATH,
    SSHD,
    SSHD_COMMON,
    is_sshd,
    kill,
    netns_pids,
    pids_under,
    proc_alive,
    read_pid,
    run,
    start_time,
    tail,
    tcp_open,
    wait_dead,
)

PREFIX = "rfl"


SSH_PORT = 22


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


UP_TIMEOUT = 15.0


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
        if self.init == "systemd":
            return systemd.sshd_pid(self)
        pid = read_pid(self.sshd_pid_file)
        if pid is not None and is_sshd(pid, self.sshd_config):
            return pid
        return self._adopt_listening_sshd()

    def _adopt_listening_sshd(self) -> int | None:
        """The node's own sshd listening on :22 without a valid pid file: it writes that file a moment
        after it listens (a check in between would start a second one), or the file was lost. Its pid
        is written back."""
        if self.namespace is None:
            return None
        listening = subprocess.run(
            ["ip", "netns", "exec", self.namespace, "ss", "-Hltnp", f"sport = :{SSH_PORT}"],
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        ).stdout
        for pid in sorted({int(found) for found in re.findall(r"pid=(\d+)", listening)}):
            if is_sshd(pid, self.sshd_config):
                write_atomic(self.sshd_pid_file, f"{pid}\n")
                return pid
        return None

    def holder_pid(self) -> int | None:
        pid = read_pid(self.holder_pid_file)
        return pid if pid is not None and proc_alive(pid) else None


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
    cpus: float | None = None  # each node's CPU share (`--cpus`, lab/cgroups.py); None: no quota

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

    # -- faults (netns labs)
    def _netns(self, node: str | int | LabNode) -> LabNode:
        found = self.node(node)
        if self.kind != "netns" or found.namespace is None or found.veth is None:
            raise LabError(f"lab {self.name!r} is a local-connection lab: no network faults")
        return found

    def cut_link(self, node: str | int | LabNode) -> None:
        """Pull the node's cable: its veth goes down, packets to it are dropped silently."""
        run(["ip", "link", "set", self._netns(node).veth or "", "down"])

    def restore_link(self, node: str | int | LabNode) -> None:
        run(["ip", "link", "set", self._netns(node).veth or "", "up"])

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
        if shutil.which("iptables", path=PATH) is None:
            raise LabError("iptables is not installed", hint="apt-get install iptables (or `make setup`)")
        run(["ip", "netns", "exec", found.namespace or "", "iptables", "-w", *args])

    def kill_sshd(self, node: str | int | LabNode) -> None:
        """Kill the node's listening sshd: new connects are refused, open sessions keep working."""
        found = self._netns(node)
        if found.init == "systemd":  # ssh.service would restart a killed sshd: stop the service
            self.node_exec(found, ["systemctl", "stop", "ssh.service"])
            return
        pid = found.sshd_pid()
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        wait_dead([pid], KILL_TIMEOUT)
        found.sshd_pid_file.unlink(missing_ok=True)

    def start_sshd(self, node: str | int | LabNode) -> int:
        """(Re)start the node's sshd inside its namespaces; returns its pid once it accepts connections."""
        found = self._netns(node)
        existing = found.sshd_pid()
        if existing is not None:
            return existing
        if found.init == "systemd":
            # A unit that failed too often in a row is refused until its counter is reset.
            self.node_exec(found, ["systemctl", "reset-failed", "ssh.service"], check=False)
            self.node_exec(found, ["systemctl", "start", "ssh.service"])
            systemd.wait_booted(self, [found])
            return found.sshd_pid() or 0
        holder = found.holder_pid()
        if holder is None:
            raise LabError(f"node {found.name} is gone (no holder process)", hint="recreate the lab")
        found.sshd_pid_file.unlink(missing_ok=True)
        argv = ["nsenter", "-t", str(holder), "-m", "-u", "-n", "--", *sshd_argv(found)]
        run(cgroups.in_share(found.namespace or "", self.cpus, argv))  # back in the node's CPU share
        wait_ready([found], UP_TIMEOUT, self.bridge)
        pid = found.sshd_pid()
        if pid is None:
            raise LabError(f"sshd on {found.name} did not start", stderr=tail(found.sshd_log))
        return pid

    def node_exec(
        self, node: str | int | LabNode, argv: Sequence[str], *, check: bool = True, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run argv as root inside the node's network, mount and UTS namespaces (a mount is the node's)."""
        found = self._netns(node)
        if found.init == "systemd":  # every namespace of the node's systemd: its mounts, pids, cgroups
            leader = systemd.leader(found)
            if leader is None:
                raise LabError(f"node {found.name} is not running (no systemd in its namespace)")
            return run(["nsenter", "-t", str(leader), "-a", "--", *argv], check=check, timeout=timeout)
        holder = found.holder_pid()
        if holder is None:
            raise LabError(f"node {found.name} is gone (no holder process)")
        return run(
            ["nsenter", "-t", str(holder), "-m", "-u", "-n", "--", *argv], check=check, timeout=timeout
        )

    def reboot(self, node: str | int | LabNode) -> None:
        """Stop a systemd node's container and boot it again; returns once its sshd accepts connections."""
        found = self._netns(node)
        if found.init != "systemd":
            raise LabError(f"node {found.name} does not boot systemd (lab up --init systemd)")
        systemd.reboot(self, found)

    def kill_node(self, node: str | int | LabNode) -> None:
        """A power cut: every process of the node is killed at once (its servers too); its namespace,
        link and files stay. `lab repair` (lifecycle.lab_repair) starts it again."""
        found = self._netns(node)
        if found.init == "systemd":
            systemd.power_cut(found)
            return
        holder = found.holder_pid()
        kill([*self.node_pids(found), *([holder] if holder is not None else [])])

    def node_pids(self, node: str | int | LabNode) -> list[int]:
        """Every live process of the node: holder, sshd, sessions, whatever they started."""
        found = self.node(node)
        if found.namespace is not None:
            return netns_pids([found.namespace])
        return pids_under(found.dir)

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


def sshd_argv(node: LabNode) -> list[str]:
    # Daemon mode: sshd writes its pid file once its socket is bound.
    return [SSHD, "-f", str(node.sshd_config), "-E", str(node.sshd_log)]


def sshd_extra_options() -> list[str]:
    # OpenSSH >= 9.8 penalises sources that fail auth or close early: the controller is one source.
    probe = subprocess.run([SSHD, "-V"], capture_output=True, text=True, check=False, timeout=5)
    match = re.search(r"OpenSSH_(\d+)\.(\d+)", probe.stderr + probe.stdout)
    if match and (int(match.group(1)), int(match.group(2))) >= (9, 8):
        return ["PerSourcePenalties no"]
    return []


def sshd_config_text(lab: Lab, node: LabNode, extra: list[str]) -> str:
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
        "UsePAM no",
        "Subsystem sftp internal-sftp",
        *SSHD_COMMON,
        *extra,
    ]
    return "\n".join(lines) + "\n"


def wait_ready(nodes: Sequence[LabNode], timeout: float, device: str | None) -> None:
    """Until every node's sshd wrote its pid file and accepts TCP on :22; fail early if a node died."""
    pending = list(nodes)

    def all_ready() -> bool | None:
        for node in list(pending):
            if node.sshd_pid_file.exists() and tcp_open(node.address, SSH_PORT, 0.2, device):
                pending.remove(node)
                continue
            holder = read_pid(node.holder_pid_file)
            if holder is not None and not proc_alive(holder):
                raise LabError(
                    f"node {node.name} failed to start",
                    stderr=tail(node.log) + "\n" + tail(node.sshd_log),
                )
        return not pending or None

    if not poll(all_ready, timeout=timeout, interval=0.01):
        names = ", ".join(n.name for n in pending)
        logs = "\n".join(tail(n.sshd_log) for n in pending)
        raise LabError(f"sshd did not accept connections within {timeout:.0f} s on {names}", stderr=logs)
