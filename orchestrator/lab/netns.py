"""Creating and removing lab nodes: namespaces, veth links, users and their sshd."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from orchestrator.core.errors import LabError
from orchestrator.core.poll import poll
from orchestrator.engine.children import run_child
from orchestrator.lab import cgroups, systemd
from orchestrator.lab.procs import (
    SSHD,
    child_env,
    kill,
    netns_pids,
    pids_under,
    run,
    run_all,
    tail,
    which,
)
from orchestrator.lab.sshd import UP_TIMEOUT, sshd_argv, sshd_config_text, sshd_extra_options, wait_ready
from orchestrator.lab.state import (
    CAP_NET_ADMIN,
    CAP_SYS_ADMIN,
    LINK_RE,
    PREFIX,
    USER_COMMENT,
    USER_RE,
    Lab,
    LabNode,
)


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
    return bool(caps & (1 << CAP_NET_ADMIN)) and bool(caps & (1 << CAP_SYS_ADMIN))


def check_netns_prerequisites(init: str = "none") -> None:
    if not privileged():
        raise LabError(
            "an emulated lab with network namespaces and sshd needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN)",
            hint="run as root, or make a local-connection lab without them: `rpcfleet lab up --local`",
        )
    missing = [tool for tool in ("ip", "nsenter", "unshare", "ssh-keygen", "useradd") if not which(tool)]
    if not Path(SSHD).exists():
        missing.append(SSHD)
    if missing:
        raise LabError(
            f"the lab needs {', '.join(missing)}",
            hint="apt-get install openssh-server iptables iproute2 (or `make setup`)",
        )
    if init == "systemd":
        systemd.check_prerequisites()


def create_local(lab: Lab) -> None:
    for node in lab.nodes:
        node.home.mkdir(parents=True)


def create_netns(lab: Lab) -> None:
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
            f"link add {node.veth} type veth peer name eth0 netns {node.namespace}"
            # systemd nodes reboot: a fixed MAC keeps the host's ARP entry right across it
            + (f" address {systemd.mac_of(node.address)}" if node.init == "systemd" else ""),
            f"link set {node.veth} master {lab.bridge} up",
        ]
    run(["ip", "-batch", "-"], input="\n".join(batch) + "\n")
    run_all(
        [["ip", "-n", node.namespace or "", "-batch", "-"] for node in lab.nodes],
        inputs=[
            f"addr add {node.address}/24 dev eth0\nlink set eth0 up\nlink set lo up\n" for node in lab.nodes
        ],
    )
    # Keys: all ssh-keygens at once.
    keygens = [(lab.client_key, f"rpcfleet-lab-{lab.name}")] + [
        (node.host_key, node.name) for node in lab.nodes
    ]
    run_all(
        [
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)]
            for path, comment in keygens
        ]
    )
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    lab.home_mount.mkdir(mode=0o755, exist_ok=True)
    run(
        [
            "useradd",
            "-M",
            "-N",
            "-p",
            "*",
            "-s",
            "/bin/bash",
            "-c",
            USER_COMMENT,
            "-d",
            str(lab.home_mount),
            lab.user,
        ]
    )
    uid = int(run(["id", "-u", lab.user]).stdout)
    gid = int(run(["id", "-g", lab.user]).stdout)
    client_pub = lab.client_key.with_suffix(".pub").read_text()
    extra = sshd_extra_options()
    for node in lab.nodes:
        authorized = node.home / ".ssh" / "authorized_keys"
        authorized.write_text(client_pub)
        for path in (node.home, node.home / ".ssh", authorized):
            os.chown(path, uid, gid)
        node.sshd_config.write_text(sshd_config_text(lab, node, extra))
    # Nodes: a holder owns the node's mount and UTS namespaces and starts sshd inside them.
    booting = [node for node in lab.nodes if node.init == "systemd"]
    for node in booting:
        systemd.prepare(lab, node, client_pub, uid, gid, extra)
        systemd.boot(lab, node)
    for node in lab.nodes:
        if node.init == "none":
            _start_node(lab, node)
    wait_ready([node for node in lab.nodes if node.init == "none"], UP_TIMEOUT, lab.bridge)
    systemd.wait_booted(lab, booting)
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
            # the node's memory limit readable inside it, as on a machine (--memory)
            *(cgroups.mount_lines() if lab.memory is not None else []),
            " ".join(q(a) for a in sshd_argv(node)),
            f"exec -a {q(str(node.dir / 'holder'))} sleep infinity",
        ]
    )
    argv = ["ip", "netns", "exec", node.namespace, "unshare", "--mount", "--uts"]
    argv += ["--propagation", "private", "bash", "-c", script]
    # The node's CPU share and memory limit first (--cpus, --memory): sshd and all it starts inherit them.
    argv = ["setsid", "-f", *cgroups.in_share(node.namespace, lab.cpus, argv, lab.memory)]
    with node.log.open("ab") as out:
        # setsid -f forks: the node never is our child, so it outlives a CLI `lab up`.
        run_child(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=child_env(), check=True, timeout=10
        )


def restart_node(lab: Lab, node: LabNode) -> None:
    """Start a node none of whose processes is left (a power cut) as `lab up` did: new mount and UTS
    namespaces in its network namespace, its home bound, its hostname, sshd with its own host key."""
    if node.init == "systemd":
        systemd.restart(lab, node)
        return
    # Stale pid files would read as a node that failed at once.
    node.holder_pid_file.unlink(missing_ok=True)
    node.sshd_pid_file.unlink(missing_ok=True)
    _start_node(lab, node)
    wait_ready([node], UP_TIMEOUT, lab.bridge)


def restore_holder(node: LabNode, sshd: int, cpus: float | None = None, memory: int | None = None) -> None:
    """A new holder for a node whose holder died while its sshd runs, in that sshd's namespaces (the
    node's mounts and hostname): `node_exec` enters the holder's."""
    q = shlex.quote
    node.holder_pid_file.unlink(missing_ok=True)
    script = f"echo $$ > {q(str(node.holder_pid_file))}; exec -a {q(str(node.dir / 'holder'))} sleep infinity"
    argv = ["nsenter", "-t", str(sshd), "-m", "-u", "-n", "--", "bash", "-c", script]
    argv = ["setsid", "-f", *cgroups.in_share(node.namespace or "", cpus, argv, memory)]
    with node.log.open("ab") as out:
        run_child(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=child_env(), check=False, timeout=10
        )
    if not poll(lambda: node.holder_pid() is not None or None, timeout=5.0, interval=0.01):
        raise LabError(f"the holder of node {node.name} did not start", stderr=tail(node.log))


def link_is_down(node: LabNode) -> bool:
    """Whether the host side of the node's veth is administratively down (a pulled cable)."""
    try:
        flags = int(Path("/sys/class/net", node.veth or "", "flags").read_text(), 16)
    except (OSError, ValueError):
        return False
    return not flags & 0x1  # IFF_UP


def teardown(lab: Lab | None, directory: Path) -> list[str]:
    """Remove a lab: its processes, kernel objects, user and state dir. Idempotent."""
    removed: list[str] = []
    if lab is not None and lab.kind == "netns":
        systemd.shutdown([node for node in lab.nodes if node.init == "systemd"])
        removed += teardown_slot(lab.slot, lab)
    pids = pids_under(directory)
    if pids:
        kill(pids)
        removed.append(f"{len(pids)} processes of {directory}")
    removed += systemd.unmount_under(directory)  # systemd nodes' roots: before their files go
    if directory.exists():
        shutil.rmtree(directory, ignore_errors=True)
        removed.append(f"state dir {directory}")
    return removed


def teardown_slot(slot: int, lab: Lab | None = None) -> list[str]:
    """Remove every namespace, link, user and process of slot `slot` (found by name)."""
    removed: list[str] = []
    namespaces = [ns for ns in list_namespaces() if ns.startswith(f"{PREFIX}{slot}-")]
    links = [link for link in list_links() if (m := LINK_RE.match(link)) and int(m.group(1)) == slot]
    pids = netns_pids(namespaces)
    if lab is not None:
        pids += pids_under(lab.dir)
    if pids:
        kill(pids)
        removed.append(f"{len(set(pids))} processes")
    # Deleting a namespace (no process left in it) takes its veth with it, all namespaces in one
    # batched kernel cleanup: much faster than deleting veths one by one. The bridge goes explicitly.
    batch = [f"link del {link}" for link in links if link.endswith("br")]
    batch += [f"netns del {ns}" for ns in namespaces]
    if batch:
        run(["ip", "-force", "-batch", "-"], input="\n".join(batch) + "\n", check=False)
        removed += [f"link {link}" for link in links] + [f"namespace {ns}" for ns in namespaces]
    veths = [link for link in links if not link.endswith("br")]

    def veths_gone() -> bool | None:
        nonlocal veths
        veths = [link for link in list_links() if link in veths]
        return not veths or None

    # A veth whose peer namespace lives on (a process we could not kill) is deleted here.
    if veths and not poll(veths_gone, timeout=2.0, interval=0.005):
        run(["ip", "-force", "-batch", "-"], input="".join(f"link del {v}\n" for v in veths), check=False)
    removed += systemd.release_slot(f"{PREFIX}{slot}-")
    removed += cgroups.remove(f"{PREFIX}{slot}-")  # the nodes' CPU shares and memory limits
    user = f"{PREFIX}{slot}"
    if user in lab_users():
        run(["userdel", user], check=False)
        removed.append(f"user {user}")
    mount_point = Path("/home") / user
    # Only the empty mount point we made: a node's files live in its own home dir, never here.
    with contextlib.suppress(OSError):
        mount_point.rmdir()
    return removed


def list_namespaces() -> list[str]:
    result = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def list_links() -> dict[str, str]:
    """Links of the root namespace with the lab's prefix -> their alias ("" when none)."""
    result = run(["ip", "-j", "link", "show"], check=False)
    try:
        links = json.loads(result.stdout or "[]")
    except json.JSONDecodeError:
        return {}
    return {
        link["ifname"]: link.get("ifalias", "")
        for link in links
        if isinstance(link, dict) and str(link.get("ifname", "")).startswith(PREFIX)
    }


def lab_users(*, all_users: bool = False) -> list[str]:
    """Users the lab created (name rfl<k> and the lab's comment); `all_users`: any rfl<k> name."""
    try:
        lines = Path("/etc/passwd").read_text().splitlines()
    except OSError:
        return []
    users = []
    for line in lines:
        fields = line.split(":")
        if len(fields) > 4 and USER_RE.match(fields[0]) and (all_users or fields[4] == USER_COMMENT):
            users.append(fields[0])
    return users
