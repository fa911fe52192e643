"""The faults a netns lab can inject into its nodes, and their undoing (`heal`), for the chaos soak and the
tier-2 tests: `Lab` (lab/state.py) mixes them in, so a test writes `lab.cut_link(node)`."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, cast

from orchestrator.core.errors import LabError
from orchestrator.lab import cgroups, systemd
from orchestrator.lab.procs import KILL_TIMEOUT, PATH, kill, netns_pids, pids_under, run, tail, wait_dead
from orchestrator.lab.sshd import UP_TIMEOUT, sshd_argv, wait_ready

if TYPE_CHECKING:
    from orchestrator.lab.state import Lab, LabKind, LabNode


class LabFaults:
    """Fault helpers over a lab's recorded nodes (the fields below are `Lab`'s)."""

    name: str
    kind: LabKind
    bridge: str | None
    cpus: float | None
    memory: int | None
    nodes: tuple[LabNode, ...]

    if TYPE_CHECKING:

        def node(self, node: str | int | LabNode) -> LabNode: ...

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

    def firewall_drop(self, node: str | int | LabNode, *, outgoing: bool = False) -> None:
        """Every packet into the node is dropped (connects time out); `outgoing`: every packet out of it
        too (the node vanished: not even a FIN or RST of its leaves)."""
        self._iptables(node, ["-I", "INPUT", "-j", "DROP"])
        if outgoing:
            self._iptables(node, ["-I", "OUTPUT", "-j", "DROP"])

    def firewall_reject(self, node: str | int | LabNode) -> None:
        """Every TCP connect to the node is reset (connects are refused at once)."""
        self._iptables(node, ["-I", "INPUT", "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"])

    def firewall_clear(self, node: str | int | LabNode) -> None:
        self._iptables(node, ["-F", "INPUT"])
        self._iptables(node, ["-F", "OUTPUT"])

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
            systemd.wait_booted(cast("Lab", self), [found])
            return found.sshd_pid() or 0
        holder = found.holder_pid()
        if holder is None:
            raise LabError(f"node {found.name} is gone (no holder process)", hint="recreate the lab")
        found.sshd_pid_file.unlink(missing_ok=True)
        argv = ["nsenter", "-t", str(holder), "-m", "-u", "-n", "--", *sshd_argv(found)]
        # back in the node's CPU share and memory limit
        run(cgroups.in_share(found.namespace or "", self.cpus, argv, self.memory))
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
        systemd.reboot(cast("Lab", self), found)

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
