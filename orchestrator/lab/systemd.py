"""Lab nodes that boot systemd (`rpcfleet lab up --init systemd`): systemd-nspawn in the node's namespace.

Each such node runs a real systemd as PID 1 (`systemd-nspawn -b`) in its network namespace, on a root of
its own: a persistent overlay of the host's `/` (lower) with an upper layer on a per-node tmpfs (host
memory; an upper on the same file system as the lower would overlap it). The first boot is prepared
through that merged root, before systemd starts: its own machine id (also nspawn's `--uuid`), hostname,
SSH host key and an sshd drop-in (sshd runs as the node's `ssh.service`), the host's enabled services and
timers masked (except ssh), a persistent journal (user units' journals need it), and per-node bind mounts
for `/root`, the lab user's home (`/home/<user>`, over a tmpfs `/home`) and `/opt/rpcfleet`.

A small bash loop (`<node dir>/boot.sh`, argv[0] `<node dir>/boot`) moves itself into the node's own
cgroup (`rfl<k>-<node>` in every writable hierarchy: otherwise all containers share one `/payload` tree)
and runs nspawn (argv[0] `<node dir>/nspawn`), booting again when the node reboots itself (exit 133).
The veth peer gets a fixed MAC derived from the address, so the host's ARP entry survives a reboot;
the namespace's iptables rules do not (each boot flushes them, as a real boot starts with none).

Stop = SIGTERM to nspawn (an orderly poweroff of the node's systemd), then whatever is left in the
namespace is killed. The root stays mounted while a node is down (a reboot); `lab down` unmounts it.
The findings behind each step: docs/lab.md.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.core.errors import LabError
from orchestrator.engine.children import run_child
from orchestrator.engine.threads import thread_pool
from orchestrator.lab import cgroups as cpu_groups
from orchestrator.lab.procs import (
    SSHD_COMMON,
    child_env,
    cmdline,
    netns_pids,
    proc_alive,
    read_pid,
    run,
    tail,
    tcp_open,
)

if TYPE_CHECKING:
    from orchestrator.lab.state import Lab, LabNode

NSPAWN = "systemd-nspawn"


INSTALL_MOUNT = "/opt/rpcfleet"  # an install dir outside every home, bound to <node dir>/opt


BOOT_TIMEOUT = 40.0


STOP_TIMEOUT = 15.0  # nspawn's own poweroff timeout is 10 s


_ROOT_TMPFS_SIZE = "2g"  # upper layer: journal and what the node writes (a few MiB); a limit, not a use


_REBOOT_EXIT = 133  # nspawn's exit status when the container's systemd asked for a reboot


_KEPT_UNITS = frozenset({"ssh.service", "sshd.service"})


def _cgroup_roots() -> list[Path]:
    """Hierarchies a node's cgroup is made in: cgroup v1's name=systemd and unified, or a v2 root."""
    base = Path("/sys/fs/cgroup")
    if (base / "cgroup.controllers").exists():
        return [base]
    return [base / h for h in ("systemd", "unified") if (base / h / "cgroup.procs").exists()]


def machine(node: LabNode) -> str:
    """nspawn's machine name: the namespace's (slot-prefixed, so reaping finds its leftovers)."""
    assert node.namespace
    return node.namespace


def os_dir(node: LabNode) -> Path:
    """The per-node tmpfs with the overlay's upper and work dirs and the merged root."""
    return node.dir / "os"


def root_dir(node: LabNode) -> Path:
    return os_dir(node) / "root"


def mac_of(address: str) -> str:
    """A fixed, locally administered MAC per IPv4 address (02:99:a:b:c:d)."""
    return "02:99:" + ":".join(f"{int(part):02x}" for part in address.split("."))


def check_prerequisites() -> None:
    missing = [
        tool for tool in (NSPAWN, "mount", "umount") if shutil.which(tool, path=child_env()["PATH"]) is None
    ]
    if missing:
        raise LabError(
            f"lab nodes with --init systemd need {', '.join(missing)}",
            hint="apt-get install systemd-container (or `make setup`)",
        )
    if not _cgroup_roots():
        raise LabError("no writable cgroup hierarchy under /sys/fs/cgroup for the nodes' own cgroups")


def prepare(lab: Lab, node: LabNode, client_pub: str, uid: int, gid: int, sshd_extra: list[str]) -> None:
    """First boot only: mount the node's root and write its identity through it (into the upper layer)."""
    assert lab.user
    osd = os_dir(node)
    osd.mkdir(mode=0o755)
    run(["mount", "-t", "tmpfs", "-o", f"size={_ROOT_TMPFS_SIZE},mode=0755", f"{machine(node)}-os", str(osd)])
    for sub in ("upper", "work", "root"):
        (osd / sub).mkdir()
    options = f"lowerdir=/,upperdir={osd / 'upper'},workdir={osd / 'work'}"
    run(["mount", "-t", "overlay", "-o", options, machine(node), str(root_dir(node))])
    root = root_dir(node)
    (root / "etc/machine-id").write_text(secrets.token_hex(16) + "\n")
    (root / "etc/hostname").write_text(node.name + "\n")
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    for suffix in ("", ".pub"):
        target = root / f"etc/ssh/ssh_host_ed25519_key{suffix}"
        shutil.copyfile(f"{node.host_key}{suffix}", target)
        target.chmod(0o600 if suffix == "" else 0o644)
    (root / "etc/ssh/sshd_config.d").mkdir(exist_ok=True)
    (root / "etc/ssh/sshd_config.d/rpcfleet-lab.conf").write_text(_sshd_dropin(lab, node, sshd_extra))
    _mask_host_units(root)
    journald = root / "etc/systemd/journald.conf.d"
    journald.mkdir(parents=True, exist_ok=True)
    (journald / "rpcfleet-lab.conf").write_text("[Journal]\nStorage=persistent\nSystemMaxUse=16M\n")
    # /root and /opt/rpcfleet of the node: directories of its own (the host's /root stays out).
    roothome = node.dir / "roothome"
    (roothome / ".ssh").mkdir(parents=True, mode=0o700)
    roothome.chmod(0o700)
    for name in (".bashrc", ".profile"):
        with contextlib.suppress(OSError):
            shutil.copyfile(f"/etc/skel/{name}", roothome / name)
    authorized = roothome / ".ssh/authorized_keys"
    authorized.write_text(client_pub)
    authorized.chmod(0o600)
    opt = node.dir / "opt"
    opt.mkdir(mode=0o755)
    os.chown(opt, uid, gid)


def _sshd_dropin(lab: Lab, node: LabNode, extra: list[str]) -> str:
    # Read before the distribution's settings (Include comes first in sshd_config): first value wins.
    lines = [
        f"# rpcfleet lab {lab.name}, node {node.name}",
        f"ListenAddress {node.address}",
        "Port 22",
        "HostKey /etc/ssh/ssh_host_ed25519_key",
        f"AllowUsers {lab.user} root",
        "PermitRootLogin prohibit-password",
        *SSHD_COMMON,
        *extra,
    ]
    return "\n".join(lines) + "\n"


def _mask_host_units(root: Path) -> None:
    """Services and timers the host enables would run in every node (databases, apt timers): mask
    them there, except sshd. Targets stay (they start nothing by themselves)."""
    system = root / "etc/systemd/system"
    wanted = {p.name for p in system.glob("*.wants/*") if p.suffix in (".service", ".timer")}
    for unit in sorted(wanted - _KEPT_UNITS | {"getty@tty1.service", "console-getty.service"}):
        target = system / unit
        if target.is_symlink() or not target.exists():
            target.unlink(missing_ok=True)
            target.symlink_to("/dev/null")


def _boot_script(lab: Lab, node: LabNode) -> str:
    q = shlex.quote
    d = q(str(node.dir))
    uuid = (root_dir(node) / "etc/machine-id").read_text().strip()
    nspawn = [
        NSPAWN,
        "-q",
        "-D",
        str(root_dir(node)),
        "-b",
        "-M",
        machine(node),
        f"--uuid={uuid}",
        f"--network-namespace-path=/run/netns/{node.namespace}",
        "--register=no",
        "--keep-unit",
        # root of a machine may change its own firewall (rpc_allow_from); the namespace is the node's
        "--capability=CAP_NET_ADMIN",
        "--console=read-only",
        f"--bind={node.dir / 'roothome'}:/root",
        "--tmpfs=/home:mode=0755",
        f"--bind={node.home}:/home/{lab.user}",
        f"--bind={node.dir / 'opt'}:{INSTALL_MOUNT}",
        "systemd.firstboot=off",
    ]
    cgroups = " ".join(q(str(root / machine(node))) for root in _cgroup_roots())
    return "\n".join(
        [
            "#!/bin/bash",
            f"# rpcfleet lab {lab.name}: node {node.name} boots systemd; again when it reboots itself.",
            f"D={d}",
            'echo $$ > "$D/holder.pid"',
            f'for c in {cgroups}; do mkdir -p "$c" && echo $$ > "$c/cgroup.procs" || exit 1; done',
            # the node's CPU share (--cpus): the boot loop, so nspawn and the whole container, inherit it
            *(cpu_groups.join_lines(machine(node), lab.cpus) if lab.cpus is not None else []),
            "while :; do",
            '  echo "=== $(date +%T.%N) boot"',
            # A machine's firewall rules live in its kernel, lost at each boot unless something saves
            # them; the node's namespace outlives its container, so a boot forgets them here.
            f"  for t in filter nat mangle raw; do ip netns exec {q(node.namespace or '')} "
            "iptables -w -t $t -F 2>/dev/null; done",
            f'  ( exec -a "$D/nspawn" {shlex.join(nspawn)} ) &',
            '  echo $! > "$D/nspawn.pid"; wait $!; rc=$?',
            '  echo "=== $(date +%T.%N) nspawn exit $rc"',
            f'  [ "$rc" = {_REBOOT_EXIT} ] && [ ! -e "$D/stopping" ] || break',
            "done",
            'rm -f "$D/nspawn.pid"',
        ]
    )


def boot(lab: Lab, node: LabNode) -> None:
    """Start the node's boot loop (detached: it outlives a CLI `lab up`); `wait_booted` waits for it."""
    script = node.dir / "boot.sh"
    script.write_text(_boot_script(lab, node) + "\n")
    (node.dir / "stopping").unlink(missing_ok=True)
    with node.log.open("ab") as out:
        run_child(
            [
                "setsid",
                "-f",
                "bash",
                "-c",
                'exec -a "$0" /bin/bash "$1"',
                str(node.dir / "boot"),
                str(script),
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            env=child_env(),
            check=True,
            timeout=10,
        )


def leader(node: LabNode) -> int | None:
    """Host pid of the node's systemd (PID 1 of its pid namespace), when it runs."""
    for pid in netns_pids([node.namespace or ""]):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("NSpid:"):
                    ids = line.split()[1:]
                    if len(ids) > 1 and ids[-1] == "1":
                        return pid
    return None


def sshd_pid(node: LabNode) -> int | None:
    """The node's listening sshd (ssh.service), as a host pid."""
    for pid in netns_pids([node.namespace or ""]):
        argv = " ".join(cmdline(pid))
        if (argv.startswith("sshd: ") and "[listener]" in argv) or argv.startswith("/usr/sbin/sshd -D"):
            return pid
    return None


def wait_booted(lab: Lab, nodes: Sequence[LabNode], timeout: float = BOOT_TIMEOUT) -> None:
    """Until every node's systemd finished booting and its sshd accepts connections (in parallel)."""

    def one(node: LabNode) -> None:
        deadline = time.monotonic() + timeout
        while True:
            pid = leader(node)
            if pid is not None:
                left = max(1.0, deadline - time.monotonic())
                state = run(
                    ["nsenter", "-t", str(pid), "-a", "systemctl", "is-system-running", "--wait"],
                    check=False,
                    timeout=left,
                ).stdout.strip()
                if state in ("running", "degraded") and tcp_open(node.address, 22, 1.0, lab.bridge):
                    return
            holder = read_pid(node.holder_pid_file)
            if holder is not None and not proc_alive(holder):
                raise LabError(f"node {node.name} did not boot", stderr=tail(node.log, 20))
            if time.monotonic() > deadline:
                raise LabError(f"node {node.name} did not boot within {timeout:.0f} s", stderr=tail(node.log))
            time.sleep(0.05)

    with thread_pool(min(16, len(nodes)), "lab-node") as pool:
        for future in [pool.submit(one, node) for node in nodes]:
            future.result()


def _ours(pid: int | None, node: LabNode, name: str) -> bool:
    argv = cmdline(pid) if pid is not None else []
    return pid is not None and bool(argv) and argv[0] == str(node.dir / name) and proc_alive(pid)


def shutdown(nodes: Sequence[LabNode], timeout: float = STOP_TIMEOUT) -> None:
    """Power the nodes off (SIGTERM to nspawn: an orderly shutdown), all at once; kill what is left."""
    waiting = []
    for node in nodes:
        holder = read_pid(node.holder_pid_file)
        if not _ours(holder, node, "boot"):
            continue
        (node.dir / "stopping").touch()
        nspawn = read_pid(node.dir / "nspawn.pid")
        if _ours(nspawn, node, "nspawn") and nspawn is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(nspawn, signal.SIGTERM)
        waiting.append((node, holder))
    deadline = time.monotonic() + timeout
    while any(h is not None and proc_alive(h) for _, h in waiting) and time.monotonic() < deadline:
        time.sleep(0.02)
    for node, holder in waiting:
        if holder is not None and proc_alive(holder):  # a hung shutdown: power cut
            with contextlib.suppress(ProcessLookupError):
                os.kill(holder, signal.SIGKILL)
        # A container whose nspawn died lives on: its processes are in the namespace.
        pids = netns_pids([node.namespace or ""])
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _wait_gone(pids)
        _empty_cgroups(machine(node))
        for path in ("stopping", "nspawn.pid", "holder.pid"):
            (node.dir / path).unlink(missing_ok=True)
        _remove_cgroups(machine(node))


def _cgroup_members(name: str) -> list[int]:
    """Live processes in the node's cgroups (its container's, wherever its namespaces went)."""
    pids: set[int] = set()
    for root in _cgroup_roots():
        for procs in (root / name).rglob("cgroup.procs"):
            with contextlib.suppress(OSError, ValueError):
                pids |= {int(line) for line in procs.read_text().split()}
    return [pid for pid in sorted(pids) if proc_alive(pid)]


def _empty_cgroups(name: str, timeout: float = 5.0) -> None:
    """Kill what is still in the node's cgroups (a process that left its network namespace) and wait for
    it: a cgroup with a process in it cannot be removed."""
    deadline = time.monotonic() + timeout
    while (pids := _cgroup_members(name)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _wait_gone(pids: Sequence[int], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while any(proc_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)


def reboot(lab: Lab, node: LabNode) -> None:
    """Stop the node's container and boot it again (its root, namespace and link stay)."""
    shutdown([node])
    boot(lab, node)
    wait_booted(lab, [node])


def power_cut(node: LabNode) -> None:
    """Kill every process of the node at once (boot loop, nspawn, the container): no shutdown runs."""
    pids = []
    for name, pid in (
        ("boot", read_pid(node.holder_pid_file)),
        ("nspawn", read_pid(node.dir / "nspawn.pid")),
    ):
        if pid is not None and _ours(pid, node, name):
            pids.append(pid)
    pids += netns_pids([node.namespace or ""]) + _cgroup_members(machine(node))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _wait_gone(pids)


def restart(lab: Lab, node: LabNode) -> None:
    """Boot again a node whose container died (a power cut, a crash) on its root, which stays mounted
    while the node is down; returns once its sshd accepts connections."""
    if not (root_dir(node) / "etc/machine-id").is_file():
        raise LabError(f"node {node.name} has lost its root file system ({root_dir(node)})")
    shutdown([node])  # a boot loop that still runs is stopped in order; pid files and cgroups go
    # A boot loop that is gone leaves shutdown nothing to find: what its container left is killed here.
    pids = netns_pids([node.namespace or ""]) + _cgroup_members(machine(node))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _wait_gone(pids)
    _empty_cgroups(machine(node))
    for path in ("stopping", "nspawn.pid", "holder.pid"):  # stale ones would read as a failed boot
        (node.dir / path).unlink(missing_ok=True)
    _remove_cgroups(machine(node))  # the dead container's: the new boot makes its own, as a reboot does
    boot(lab, node)
    wait_booted(lab, [node])


def _remove_cgroups(name: str) -> list[str]:
    removed = []
    for root in _cgroup_roots():
        top = root / name
        if not top.is_dir():
            continue
        for path in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                path.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()
            removed.append(f"cgroup {top}")
    with contextlib.suppress(OSError):
        Path("/run/systemd/nspawn/propagate", name).rmdir()  # nspawn leaves it where /run is no tmpfs
    return removed


def release_slot(prefix: str) -> list[str]:
    """Cgroups and nspawn run dirs of machines named `prefix*` (a slot's nodes)."""
    names = {p.name for root in _cgroup_roots() for p in root.glob(f"{prefix}*") if p.is_dir()}
    with contextlib.suppress(OSError):
        names |= {p.name for p in Path("/run/systemd/nspawn/propagate").glob(f"{prefix}*")}
    removed = []
    for name in sorted(names):
        removed += _remove_cgroups(name)
    for empty in ("propagate", "locks", ""):  # nspawn's run dirs, once no container uses them
        with contextlib.suppress(OSError):
            Path("/run/systemd/nspawn", empty).rmdir()
    return removed


def unmount_under(directory: Path) -> list[str]:
    """Unmount every mount at or below `directory` (a node's root overlay and tmpfs), deepest first."""
    prefix = str(directory).rstrip("/") + "/"
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    points = [_unescape(line.split()[4]) for line in lines]
    mine = sorted({p for p in points if p.startswith(prefix)}, key=lambda p: -p.count("/"))
    for point in mine:
        if run(["umount", point], check=False).returncode != 0:
            run(["umount", "-l", point], check=False)
    return [f"mount {point}" for point in mine]


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
