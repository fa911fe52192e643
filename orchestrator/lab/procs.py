"""Processes of the lab: pids in a namespace, liveness, waiting for exit.

psutil reads /proc here; it is imported where it is used, so that the command line starts without it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

from orchestrator.core.errors import LabError
from orchestrator.core.poll import poll
from orchestrator.engine.children import open_child, run_child

SSHD = "/usr/sbin/sshd"


# Tools live in sbin; a non-login root shell may not have it on PATH.
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


KILL_TIMEOUT = 5.0

# Every lab sshd (a plain node's and a systemd node's): keys only, no delays, room for parallel sessions.
SSHD_COMMON = (
    "PasswordAuthentication no",
    "KbdInteractiveAuthentication no",
    "StrictModes no",
    "PrintMotd no",
    "PrintLastLog no",
    "UseDNS no",
    "MaxStartups 100",
    "MaxSessions 64",
)


def kill(pids: Iterable[int]) -> None:
    unique = [pid for pid in set(pids) if pid not in _protected_pids()]
    for pid in unique:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    wait_dead(unique, KILL_TIMEOUT)


def _protected_pids() -> set[int]:
    """This process and its ancestors: never killed, whatever their command line says."""
    import psutil

    return {os.getpid(), *(parent.pid for parent in psutil.Process().parents())}


def netns_pids(namespaces: Iterable[str]) -> list[int]:
    """Live processes in any of the named network namespaces (one pass over /proc)."""
    import psutil

    wanted = set()
    for ns in namespaces:
        with contextlib.suppress(OSError):
            info = Path("/run/netns", ns).stat()
            wanted.add((info.st_dev, info.st_ino))
    if not wanted:
        return []
    found = []
    for pid in psutil.pids():
        try:  # psutil has no namespaces: the link /proc/PID/ns/net names the process's one
            info = Path(f"/proc/{pid}/ns/net").stat()
        except OSError:
            continue
        if (info.st_dev, info.st_ino) in wanted and proc_alive(pid):
            found.append(pid)
    return found


def pids_under(directory: Path) -> list[int]:
    """Live processes whose executable path (argv[0]) lies in `directory`, or sshds configured there."""
    import psutil

    prefix = str(directory).rstrip("/") + "/"
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        argv = [part for part in proc.info["cmdline"] or () if part]
        if not argv or proc.info["status"] in _DEAD:
            continue
        if argv[0].startswith(prefix) or (_looks_like_sshd(argv) and prefix in " ".join(argv)):
            found.append(proc.pid)
    return found


def cmdline(pid: int) -> list[str]:
    import psutil

    try:
        argv: list[str] = psutil.Process(pid).cmdline()
    except psutil.Error:
        return []
    return [part for part in argv if part]  # a rewritten title leaves empty ones behind


_DEAD = ("zombie", "dead")  # psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD


def proc_alive(pid: int) -> bool:
    """Running, not a zombie (kill -0 succeeds on a zombie; here pid 1 may never reap orphans)."""
    import psutil

    try:
        return psutil.Process(pid).status() not in _DEAD
    except psutil.Error:
        return False


def start_time(pid: int) -> float | None:
    """Process start time in clock ticks since boot (stable per process, distinct on pid reuse).

    Read from /proc/PID/stat, not psutil: psutil's `create_time()` is boot time + these ticks in
    wall-clock seconds, and boot time moves with clock adjustments; lab state files keep this value and
    other rpcfleet processes compare it, so it must not move (a live lab would look dead and be reaped).
    """
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()  # after the command name: state, ppid, ...
    if fields[0] in ("Z", "X"):
        return None
    return float(fields[19])


def _looks_like_sshd(argv: Sequence[str]) -> bool:
    # sshd rewrites its title: "sshd: /usr/sbin/sshd -f CONFIG ... [listener] ..." (one argument, which
    # psutil splits at its blanks).
    title = " ".join(argv)
    return title == SSHD or title.startswith(("sshd: ", f"{SSHD} "))


def is_sshd(pid: int, config: Path) -> bool:
    argv = cmdline(pid)
    return _looks_like_sshd(argv) and f"-f {config} " in " ".join(argv) + " " and proc_alive(pid)


def wait_dead(pids: Sequence[int], timeout: float) -> None:
    # Not psutil.wait_procs: it waits for a pid to vanish, and a zombie that pid 1 never reaps does not.
    if poll(lambda: not any(proc_alive(pid) for pid in pids) or None, timeout=timeout, interval=0.005):
        return
    alive = [pid for pid in pids if proc_alive(pid)]
    raise LabError(f"processes {alive} did not exit within {timeout:.0f} s of SIGKILL")


def read_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def tcp_open(address: str, port: int, timeout: float, device: str | None = None) -> bool:
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


def tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = PATH + ":" + env.get("PATH", "")
    env["LC_ALL"] = "C"
    return env


def which(tool: str) -> str | None:
    return shutil.which(tool, path=PATH + ":" + os.environ.get("PATH", ""))


def run(
    argv: Sequence[str], *, input: str | None = None, check: bool = True, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    try:
        result = run_child(
            list(argv),
            input=input,
            capture_output=True,
            text=True,
            env=child_env(),
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


def run_all(argvs: Sequence[Sequence[str]], *, inputs: Sequence[str] | None = None) -> None:
    """Run commands concurrently (all started before any is waited for); fail if any failed."""
    env = child_env()
    procs: list[tuple[Sequence[str], subprocess.Popen[str], str | None]] = []
    for i, argv in enumerate(argvs):
        try:
            proc = open_child(
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
