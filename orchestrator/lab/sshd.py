"""A lab node's OpenSSH sshd: its config, its command line, finding it running, and waiting for it."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from orchestrator.core.errors import LabError
from orchestrator.core.files import write_atomic
from orchestrator.core.poll import poll
from orchestrator.engine.children import run_child
from orchestrator.lab import systemd
from orchestrator.lab.procs import SSHD, SSHD_COMMON, is_sshd, proc_alive, read_pid, tail, tcp_open

if TYPE_CHECKING:
    from orchestrator.lab.state import Lab, LabNode

SSH_PORT = 22


UP_TIMEOUT = 15.0


def running_pid(node: LabNode) -> int | None:
    """The node's listening sshd's pid, when it runs."""
    if node.init == "systemd":
        return systemd.sshd_pid(node)
    pid = read_pid(node.sshd_pid_file)
    if pid is not None and is_sshd(pid, node.sshd_config):
        return pid
    return adopt_listening_sshd(node)


def adopt_listening_sshd(node: LabNode) -> int | None:
    """The node's own sshd listening on :22 without a valid pid file: it writes that file a moment
    after it listens (a check in between would start a second one), or the file was lost. Its pid
    is written back."""
    if node.namespace is None:
        return None
    listening = run_child(
        ["ip", "netns", "exec", node.namespace, "ss", "-Hltnp", f"sport = :{SSH_PORT}"],
        capture_output=True,
        text=True,
        check=False,
        timeout=10,
    ).stdout
    for pid in sorted({int(found) for found in re.findall(r"pid=(\d+)", listening)}):
        if is_sshd(pid, node.sshd_config):
            write_atomic(node.sshd_pid_file, f"{pid}\n")
            return pid
    return None


def sshd_argv(node: LabNode) -> list[str]:
    # Daemon mode: sshd writes its pid file once its socket is bound.
    return [SSHD, "-f", str(node.sshd_config), "-E", str(node.sshd_log)]


def sshd_extra_options() -> list[str]:
    # OpenSSH >= 9.8 penalises sources that fail auth or close early: the controller is one source.
    probe = run_child([SSHD, "-V"], capture_output=True, text=True, check=False, timeout=5)
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
