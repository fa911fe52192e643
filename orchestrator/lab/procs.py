"""Processes of the lab: pids in a namespace, liveness, waiting for exit."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from orchestrator.core.errors import LabError

SSHD = "/usr/sbin/sshd"


# Tools live in sbin; a non-login root shell may not have it on PATH.
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


_KILL_TIMEOUT = 5.0


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
