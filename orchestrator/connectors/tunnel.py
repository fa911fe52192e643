"""SSH local forwards to rpc-servers bound to their node's loopback (`rpc_transport: ssh`).

The one place that maps a host to the address this controller dials: `Tunnels.target(host)` is the
host's `Target` (`core.target`): its endpoint, dialed directly for `tcp`, or through
`127.0.0.1:<local port>` of a forward for `ssh` (one forward per host, opened on first use and reused;
a dead one is opened again). Probes, readiness checks, loads and `serve` all dial through targets;
plans, reports and errors name `host.endpoint` (`str(target)` adds "via" the forward).

Two forwarders (measured in bench/transport.py, BENCHMARKS.md "transport"):
- `openssh`: an OpenSSH master (`ssh -M -S sock -N -L ...`, a control socket to check on it), one
  process per host. The bytes are moved by C code outside this process, so a model load in a worker
  is not slowed by this process's interpreter. The default.
- `asyncssh`: `forward_local_port` on an asyncssh connection run by the runtime's `LoopThread`.

Both keep host-key verification as the inventory says (known_hosts, `ssh_host_key_checking`), use
keepalives (a cut link closes the forward within about 15 s), and die with this process. A forward
that goes away closes its connections: llama.cpp sees the node as lost, like a dead server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, Protocol

from orchestrator.core.errors import HostKeyError, InputError, RpcfleetError, UnreachableError
from orchestrator.core.log import get_logger
from orchestrator.core.target import Target
from orchestrator.inventory.model import Host

if TYPE_CHECKING:
    from orchestrator.engine.runtime import LoopThread

Forwarder = Literal["openssh", "openssh-n", "asyncssh"]


FORWARDERS: tuple[str, ...] = ("openssh", "openssh-n", "asyncssh")  # openssh-n: `-N`, no pty (bench)


DEFAULT_FORWARDER: Forwarder = "openssh"


KEEPALIVE_INTERVAL = 5  # seconds; ServerAliveInterval / keepalive_interval
KEEPALIVE_COUNT = 3


HOLD_COMMAND = "exec sleep 2147483647"  # the session that keeps a forward's connection interactive


class Tunnel(Protocol):
    host: Host
    local_port: int

    def alive(self) -> bool: ...

    def close(self) -> None: ...


def _key(host: Host) -> tuple[object, ...]:
    return (host.name, host.address, host.ssh_port, host.ssh_user, host.rpc_host, host.rpc_port)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _known_hosts(host: Host) -> Path:
    if host.ssh_known_hosts:
        return Path(host.ssh_known_hosts).expanduser()
    return Path.home() / ".ssh" / "known_hosts"


def ssh_options(host: Host, timeout: float) -> list[str]:
    """OpenSSH client options for `host`: batch mode, keepalives, AES-GCM first, its host key checking,
    key, user and port (what the asyncssh connection uses, for the `ssh` binary)."""
    # The asyncssh connector's ~/.ssh/config (HOME's, or none): ssh itself would read the passwd entry's
    # home, whatever HOME says (a test's empty ~/.ssh, a service's own HOME)
    config = Path.home() / ".ssh" / "config"
    argv = ["-F", str(config) if config.is_file() else "/dev/null"]
    argv += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, round(timeout))}"]
    argv += ["-o", f"ServerAliveInterval={KEEPALIVE_INTERVAL}", "-o", "LogLevel=ERROR"]
    argv += ["-o", f"ServerAliveCountMax={KEEPALIVE_COUNT}"]
    # AES-GCM first (AES-NI makes it the cheapest on x86 and arm64); the rest of the default list after it
    argv += ["-o", "Ciphers=^aes128-gcm@openssh.com"]
    if host.ssh_host_key_checking:
        argv += ["-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={_known_hosts(host)}"]
    else:
        argv += ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]
    if host.ssh_key:
        argv += ["-i", str(Path(host.ssh_key).expanduser()), "-o", "IdentitiesOnly=yes"]
    if host.ssh_user:
        argv += ["-l", host.ssh_user]
    return [*argv, "-p", str(host.ssh_port)]


def openssh_argv(
    host: Host, control: Path, local_port: int, timeout: float, *, interactive: bool = True
) -> list[str]:
    """The OpenSSH master that holds one forward: 127.0.0.1:local_port -> rpc_host:rpc_port on the node."""
    # A session with a pty (-tt) that only sleeps: OpenSSH sets TCP_NODELAY on both ends of the SSH
    # connection only for interactive (pty) sessions; without it (-N) Nagle's algorithm and delayed ACKs
    # stall RPC's small writes (llama.cpp's decode ran at a third of tcp's speed: BENCHMARKS.md).
    argv = ["ssh", "-M", "-S", str(control), "-tt" if interactive else "-N", "-o", "ExitOnForwardFailure=yes"]
    argv += ["-o", "ControlPersist=no", *ssh_options(host, timeout)]
    argv += ["-L", f"127.0.0.1:{local_port}:{host.rpc_host}:{host.rpc_port}", "--", host.address]
    return [*argv, HOLD_COMMAND] if interactive else argv


def _ssh_error(host: Host, stderr: str) -> RpcfleetError:
    where = f"{host.address}:{host.ssh_port}"
    text = stderr.strip().splitlines()[-1] if stderr.strip() else "ssh exited"
    if "Host key verification failed" in stderr or "REMOTE HOST IDENTIFICATION" in stderr:
        return HostKeyError(
            f"SSH forward to {where}: host key not verified",
            host=host.name,
            stderr=stderr,
            hint=f"the key must be in {_known_hosts(host)} (or set ssh_host_key_checking: false)",
        )
    return UnreachableError(f"cannot open the SSH forward to {where}: {text}", host=host.name, stderr=stderr)


def spawn_bound(argv: list[str], *, stderr: IO[bytes]) -> subprocess.Popen[bytes]:
    """Start `argv` (no stdin or stdout) so that it gets SIGTERM when this process dies, however it dies
    (`setpriv --pdeathsig`, util-linux): a controller killed with SIGKILL leaves no forward behind. Its
    own session: a Ctrl-C at the terminal reaches rpcfleet, which closes it. Linux sends the parent-death
    signal when the *thread* that forked the child ends: forwards are started by the runtime's one
    long-lived spawner thread (`engine.children.on_spawner_thread`)."""
    from orchestrator.engine.children import on_spawner_thread, open_child  # the runtime's (pyproject)

    if shutil.which("setpriv") is not None:
        argv = ["setpriv", "--pdeathsig", "TERM", "--", *argv]

    def start() -> subprocess.Popen[bytes]:
        process: subprocess.Popen[bytes] = open_child(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True
        )
        return process

    return on_spawner_thread(start)


@dataclass
class OpenSSHTunnel:
    """An OpenSSH master process holding one local forward."""

    host: Host
    local_port: int
    process: subprocess.Popen[bytes]
    control: Path
    _dir: Path = field(repr=False)

    @classmethod
    def open(cls, host: Host, timeout: float, *, interactive: bool = True) -> OpenSSHTunnel:
        if shutil.which("ssh") is None:
            raise UnreachableError(
                "rpc_transport: ssh needs the OpenSSH client (ssh) on this machine",
                host=host.name,
                hint="install openssh-client",
            )
        folder = Path(tempfile.mkdtemp(prefix="rpcfleet-fwd-"))
        control = folder / "ctl"
        for _attempt in range(3):  # the free port may be taken between choosing and binding it
            port = _free_port()
            errlog = (folder / "stderr").open("w+b")
            process = spawn_bound(
                openssh_argv(host, control, port, timeout, interactive=interactive), stderr=errlog
            )
            tunnel = cls(host, port, process, control, folder)
            deadline = time.monotonic() + timeout + 2.0
            while process.poll() is None and time.monotonic() < deadline:
                if control.exists() and tunnel._check():
                    errlog.close()
                    get_logger(host=host.name).debug("ssh_forward_open", local_port=port, forwarder="openssh")
                    return tunnel
                time.sleep(0.02)
            tunnel.close()
            errlog.seek(0)
            stderr = errlog.read().decode(errors="replace")
            errlog.close()
            if "Address already in use" not in stderr and "cannot listen" not in stderr:
                shutil.rmtree(folder, ignore_errors=True)
                if process.returncode is None or process.returncode < 0:
                    stderr = stderr or f"no answer within {timeout:g} s"
                raise _ssh_error(host, stderr)
        shutil.rmtree(folder, ignore_errors=True)
        raise UnreachableError("could not bind a local port for the SSH forward", host=host.name)

    def _check(self) -> bool:
        from orchestrator.engine.children import run_child  # the runtime's (a layer above: pyproject)

        check = run_child(
            ["ssh", "-S", str(self.control), "-O", "check", "x"],
            capture_output=True,
            timeout=5,
            check=False,
        )
        return check.returncode == 0

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=3)
        shutil.rmtree(self._dir, ignore_errors=True)


@dataclass
class AsyncsshTunnel:
    """`forward_local_port` on an asyncssh connection driven by the tunnels' `LoopThread` (the forwards
    outlive any one phase of the command: a load in the worker reads through them while this process's
    command thread waits)."""

    host: Host
    local_port: int
    _conn: Any = field(repr=False)
    _listener: Any = field(repr=False)
    _loop: LoopThread = field(repr=False)

    @classmethod
    def open(cls, host: Host, timeout: float, loop: LoopThread) -> AsyncsshTunnel:
        from orchestrator.connectors.base import ConnectOptions
        from orchestrator.connectors.ssh import SSHConnection

        options = ConnectOptions(
            connect_timeout=timeout,
            keepalive_interval=KEEPALIVE_INTERVAL,
            keepalive_count_max=KEEPALIVE_COUNT,
        )

        async def start() -> tuple[Any, Any]:
            wrapped = await SSHConnection.open(host, options)
            conn = wrapped._conn
            listener = await conn.forward_local_port("127.0.0.1", 0, host.rpc_host, host.rpc_port)
            # A pty session makes sshd set TCP_NODELAY on its end (see openssh_argv)
            await conn.create_process(HOLD_COMMAND, term_type="dumb")
            return conn, listener

        conn, listener = loop.call(start(), timeout + 5.0)
        port = int(listener.get_port())
        get_logger(host=host.name).debug("ssh_forward_open", local_port=port, forwarder="asyncssh")
        return cls(host, port, conn, listener, loop)

    def alive(self) -> bool:
        return not self._conn.is_closed()

    def close(self) -> None:
        async def stop() -> None:
            self._listener.close()
            self._conn.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(3):
                    await self._conn.wait_closed()

        with contextlib.suppress(Exception):
            self._loop.call(stop(), 5.0)


class Tunnels:
    """Forwards for the hosts that need one, opened on first `dial` and kept until `close`."""

    def __init__(
        self, forwarder: Forwarder = DEFAULT_FORWARDER, *, connect_timeout: float | None = None
    ) -> None:
        if forwarder not in FORWARDERS:
            raise ValueError(f"forwarder must be one of {', '.join(FORWARDERS)}, got {forwarder!r}")
        self.forwarder = forwarder
        self.connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._open: dict[tuple[object, ...], Tunnel] = {}
        self._host_locks: dict[tuple[object, ...], threading.Lock] = {}
        self._loop: LoopThread | None = None

    def target(self, host: Host) -> Target:
        """`host`'s server: its endpoint and the address this controller connects to for it."""
        if not host.tunneled:
            return Target.direct(host.endpoint)
        return Target(host.endpoint, f"127.0.0.1:{self.tunnel(host).local_port}")

    def tunnel(self, host: Host) -> Tunnel:
        """The live forward of `host` (opened now when there is none or it died)."""
        key = _key(host)
        with self._lock:  # one opener per host; different hosts open at the same time
            host_lock = self._host_locks.setdefault(key, threading.Lock())
        with host_lock:
            found = self._open.get(key)
            if found is not None and found.alive():
                return found
            if found is not None:
                get_logger(host=host.name).info("ssh_forward_reopen", forwarder=self.forwarder)
                found.close()
                with self._lock:
                    self._open.pop(key, None)
            timeout = self.connect_timeout if self.connect_timeout is not None else host.ssh_connect_timeout
            made: Tunnel
            if self.forwarder in ("openssh", "openssh-n"):
                made = OpenSSHTunnel.open(host, timeout, interactive=self.forwarder == "openssh")
            else:
                if self._loop is None:
                    from orchestrator.engine.runtime import LoopThread  # the runtime's (see pyproject)

                    self._loop = LoopThread("rpcfleet-tunnels")
                made = AsyncsshTunnel.open(host, timeout, self._loop)
            with self._lock:
                self._open[key] = made
            return made

    def targets(self, hosts: Iterable[Host]) -> dict[str, Target]:
        """Endpoint -> target of each host (what a worker load or an engine takes); the forwards that
        are missing are opened in parallel."""
        hosts = list(hosts)
        tunneled = [h for h in hosts if h.tunneled]
        found = {h.endpoint: Target.direct(h.endpoint) for h in hosts if not h.tunneled}
        if len(tunneled) > 1:
            from orchestrator.engine.threads import thread_pool  # the runtime's (see pyproject)

            with thread_pool(min(8, len(tunneled)), "rpcfleet-forward-open") as pool:
                found.update((t.endpoint, t) for t in pool.map(self.target, tunneled))
        else:
            found.update((h.endpoint, self.target(h)) for h in tunneled)
        return found

    async def target_async(self, host: Host) -> Target:
        if not host.tunneled:
            return Target.direct(host.endpoint)
        return await asyncio.to_thread(self.target, host)

    def close(self) -> None:
        with self._lock:
            tunnels, self._open = list(self._open.values()), {}
        for tunnel in tunnels:
            tunnel.close()
        if self._loop is not None:
            self._loop.stop()
            self._loop = None

    def __enter__(self) -> Tunnels:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_DEFAULT: Tunnels | None = None
_DEFAULT_LOCK = threading.Lock()


def default_tunnels() -> Tunnels:
    """This process's tunnels (what commands use); closed by `close_default_tunnels` at their end.
    `RPCFLEET_FORWARDER` picks the forwarder (default openssh; the others are for bench/transport.py)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            name = os.environ.get("RPCFLEET_FORWARDER", DEFAULT_FORWARDER)
            if name not in FORWARDERS:
                raise InputError(f"RPCFLEET_FORWARDER={name!r}: expected one of {', '.join(FORWARDERS)}")
            _DEFAULT = Tunnels(name)  # type: ignore[arg-type]
        return _DEFAULT


def close_default_tunnels() -> None:
    global _DEFAULT
    with _DEFAULT_LOCK:
        tunnels, _DEFAULT = _DEFAULT, None
    if tunnels is not None:
        tunnels.close()


async def target_of(host: Host) -> Target:
    """`host`'s target through this process's tunnels (dialed directly unless `rpc_transport: ssh`)."""
    if not host.tunneled:
        return Target.direct(host.endpoint)
    return await default_tunnels().target_async(host)
