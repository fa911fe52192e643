"""The runtime's child processes, the one place that starts them (tests/project/test_children_home.py):
how rpcfleet starts a long-lived child (the llama.cpp worker, serve's llama-server), a tool it runs to
its end (`run_child`), one whose output it reads as it comes (`open_child`, `start_child` on the loop),
where a log goes, how an end is told, and how a child's TCP connections to the nodes are found, tuned and
measured from this side.

Each start is logged (`child_started`: the program and the pid; never the arguments, which may hold a
secret), so a run's log says what it ran.

* `spawn_child`: a new session (a Ctrl-C at the terminal reaches the parent only); with
  `die_with_parent`, PR_SET_PDEATHSIG (SIGKILL) set between fork and exec. Linux fires that signal when
  the *thread* that forked the child exits, so such children are started by one long-lived thread here,
  never by the caller's (possibly short-lived) thread.
* `child_log_path`: a fresh log under `$RPCFLEET_HOME/logs`; beyond the newest `KEEP_LOGS` of its kind,
  those untouched for an hour are removed (a younger one may belong to a child still running).
* `connections_to`: a process's TCP connections to some peers (this process's own, or another's
  through pidfd_getfd), for `tune_socket` (keepalive, TCP_USER_TIMEOUT) and `bytes_acked`.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

from orchestrator.core.log import get_logger
from orchestrator.core.paths import rpcfleet_home

KEEP_LOGS = 20  # logs of one kind kept under $RPCFLEET_HOME/logs
_SYS_PIDFD_GETFD = 438  # the same number on every Linux architecture (asm-generic)
_PR_SET_PDEATHSIG = 1
_BYTES_ACKED = 120  # offset of tcpi_bytes_acked (u64) in Linux's struct tcp_info (since 4.1)
_libc: Any = None

Redirect = int | IO[Any] | None
T = TypeVar("T")


def _syscall() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def child_log_path(kind: str, *, unique: bool = False) -> Path:
    """`$RPCFLEET_HOME/logs/KIND-DATE-TIME-PID.log` (`unique`: with a sub-second suffix too, for a parent
    that starts several a second), old ones of `kind` pruned (see the module's docstring)."""
    folder = rpcfleet_home() / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    # Several parents (serve's formations loading at once) prune the same folder: a log another one
    # removed meanwhile is simply gone.
    found = ((_mtime(path), path) for path in folder.glob(f"{kind}-*.log"))
    logs = sorted(((mtime, path) for mtime, path in found if mtime is not None), reverse=True)
    for mtime, stale in logs[KEEP_LOGS - 1 :]:
        if time.time() - mtime > 3600:
            stale.unlink(missing_ok=True)
    suffix = f"-{time.monotonic_ns() % 10**6}" if unique else ""
    return folder / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}{suffix}.log"


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


def exit_description(returncode: int | None) -> str:
    """`signal SIGABRT`, `exit status 1`, or `still running`."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"


class _Spawner:
    """The one long-lived thread that starts the children that die with their parent."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], queue.Queue[Any]]] = queue.Queue()
        threading.Thread(target=self._run, name="child-spawner", daemon=True).start()

    def _run(self) -> None:
        while True:
            job, answer = self._jobs.get()
            try:
                answer.put((True, job()))
            except BaseException as exc:
                answer.put((False, exc))

    def call(self, job: Callable[[], Any]) -> Any:
        answer: queue.Queue[Any] = queue.Queue()
        self._jobs.put((job, answer))
        ok, value = answer.get()
        if not ok:
            raise value
        return value


_spawner: _Spawner | None = None
_spawner_lock = threading.Lock()


def run_child(argv: Sequence[str], **options: Any) -> subprocess.CompletedProcess[Any]:
    """`subprocess.run(argv, **options)`: a tool run to its end (its `timeout`, `check`, ... as given)."""
    _log_start(argv, None)
    return subprocess.run(list(argv), **options)


def open_child(argv: Sequence[str], **options: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen(argv, **options)`: a child whose output the caller reads as it comes."""
    process = subprocess.Popen(list(argv), **options)
    _log_start(argv, process.pid)
    return process


async def start_child(argv: Sequence[str], **options: Any) -> asyncio.subprocess.Process:
    """`asyncio.create_subprocess_exec(*argv, **options)` on the running loop (the runtime's)."""
    process = await asyncio.create_subprocess_exec(*argv, **options)
    _log_start(argv, process.pid)
    return process


async def start_shell_child(command: str, **options: Any) -> asyncio.subprocess.Process:
    """`asyncio.create_subprocess_shell(command, **options)` on the running loop."""
    process = await asyncio.create_subprocess_shell(command, **options)
    _log_start(["sh"], process.pid)
    return process


def _log_start(argv: Sequence[str], pid: int | None) -> None:
    get_logger().debug("child_started", program=Path(argv[0]).name if argv else "", pid=pid)


def spawn_child(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    log_path: Path | None = None,
    stdin: Redirect = subprocess.DEVNULL,
    stdout: Redirect = None,
    die_with_parent: bool = False,
) -> subprocess.Popen[bytes]:
    """Start `argv` in a session of its own. Its stderr goes to `log_path` (appended; None: this
    process's stderr); `stdout=None` sends its stdout there too. `die_with_parent`: see the module."""

    def start(preexec: Callable[[], None] | None) -> subprocess.Popen[bytes]:
        log: IO[bytes] | None = log_path.open("ab") if log_path is not None else None
        try:
            return subprocess.Popen(
                list(argv),
                stdin=stdin,
                stdout=stdout if stdout is not None else log,
                stderr=log,
                env=dict(env),
                start_new_session=True,  # a Ctrl-C at the terminal reaches the parent only
                preexec_fn=preexec,
            )
        finally:
            if log is not None:
                log.close()

    if not die_with_parent:
        return start(None)
    libc = _syscall()  # loaded here: the child between fork and exec only calls it

    def die_with_parent_now() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return on_spawner_thread(lambda: start(die_with_parent_now))


async def process_ended(process: subprocess.Popen[Any], limit: float | None = None) -> int | None:
    """Await a child's end without a thread (its pidfd is readable once it ended, Linux 5.3+): its
    return code, reaped; None when it still runs after `limit` seconds."""
    if process.poll() is not None:
        return process.returncode
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()
    try:
        pidfd = os.pidfd_open(process.pid)
    except ProcessLookupError:  # reaped meanwhile
        return process.wait()

    def readable() -> None:
        if not ended.done():
            ended.set_result(None)

    try:
        loop.add_reader(pidfd, readable)
        try:
            await asyncio.wait_for(ended, limit)
        except TimeoutError:
            return None
        finally:
            loop.remove_reader(pidfd)
    finally:
        os.close(pidfd)
    return process.wait()


def on_spawner_thread(job: Callable[[], T]) -> T:
    """`job()` on the one long-lived thread that starts the children that die with their parent (the
    parent-death signal is the forking thread's: see the module), its result or exception returned here.
    Also for children that set it themselves (the SSH forwards' `setpriv --pdeathsig`)."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = _Spawner()
    return _spawner.call(job)  # type: ignore[no-any-return]


def _own_descriptors() -> Iterator[int]:
    for name in os.listdir("/proc/self/fd"):  # noqa: PTH208 (names, not paths)
        try:
            yield os.dup(int(name))
        except OSError:
            continue  # gone since the listing


def _foreign_descriptors(pid: int) -> Iterator[int]:
    try:
        pidfd = os.pidfd_open(pid)
        names = os.listdir(f"/proc/{pid}/fd")  # noqa: PTH208 (names, not paths)
    except OSError:
        return
    try:
        for name in names:
            try:
                if not str(Path(f"/proc/{pid}/fd/{name}").readlink()).startswith("socket:"):
                    continue
            except OSError:
                continue
            fd = _syscall().syscall(_SYS_PIDFD_GETFD, pidfd, int(name), 0)
            if fd >= 0:
                yield fd
    finally:
        os.close(pidfd)


def socket_access_denied() -> str | None:
    """Why this process may not take a duplicate of its children's descriptors (None: it may).

    `pidfd_getfd` needs ptrace rights over the child: Yama's `ptrace_scope` 2 or 3 and Docker's default
    seccomp profile deny them, and then `connections_to(pid=...)` finds nothing: no link timeout is set
    on an engine's RPC connections. Asked of a `sleep` child of this process, its stdin."""
    child = subprocess.Popen(["sleep", "30"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        pidfd = os.pidfd_open(child.pid)
        try:
            fd = _syscall().syscall(_SYS_PIDFD_GETFD, pidfd, 0, 0)
            if fd >= 0:
                os.close(fd)
                return None
            code = ctypes.get_errno()
        finally:
            os.close(pidfd)
    except OSError as exc:
        code = exc.errno or 0
    finally:
        child.kill()
        child.wait()
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    try:
        yama = f"; kernel.yama.ptrace_scope is {scope.read_text().strip()}"
    except OSError:
        yama = ""
    return f"pidfd_getfd: {os.strerror(code)} (a seccomp filter, or Yama's ptrace_scope 2 or 3{yama})"


def connections_to(
    wanted: set[tuple[str, int]], pid: int | None = None
) -> Iterator[tuple[tuple[str, int], socket.socket]]:
    """Process `pid`'s (default: this process's) TCP connections to one of `wanted` (address, port),
    each with its peer: duplicates of its descriptors, closed after the caller's turn. Nothing for a
    process this one may not look into."""
    for fd in _own_descriptors() if pid is None else _foreign_descriptors(pid):
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)  # not a socket: the duplicate is ours to close
            continue
        with sock:
            try:
                peer = sock.getpeername()[:2] if sock.type == socket.SOCK_STREAM else None
            except OSError:
                continue
            if peer in wanted:
                yield peer, sock


def tune_socket(sock: socket.socket, link_timeout: float) -> None:
    """Keepalive and TCP_USER_TIMEOUT: data (or keepalives) unacknowledged for `link_timeout` seconds
    abort the connection."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, int(link_timeout / 2)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, int(link_timeout / 5)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(link_timeout * 1000))


def socket_bytes_acked(sock: socket.socket) -> int:
    """The bytes the peer has acknowledged on `sock` (TCP_INFO's tcpi_bytes_acked; 0 if unreadable)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return 0
    if len(info) < _BYTES_ACKED + 8:
        return 0
    return int.from_bytes(info[_BYTES_ACKED : _BYTES_ACKED + 8], "little")


def peers_of(endpoints: Mapping[str, tuple[str, int]]) -> dict[tuple[str, int], str]:
    """(address, port) a connection to each endpoint has as its peer (names resolved) -> its name;
    `endpoints`: a name (the plan's endpoint) -> the host and port dialed for it."""
    peers: dict[tuple[str, int], str] = {}
    for name, (host, port) in endpoints.items():
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            infos = []
        for info in infos:
            peers[(str(info[4][0]), int(info[4][1]))] = name
        peers.setdefault((host, port), name)
    return peers
