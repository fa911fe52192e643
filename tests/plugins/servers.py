"""Real ggml-rpc-server processes on loopback, built from the same source as llama-cpp-python."""

from __future__ import annotations

import shlex
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.artifacts.build import local_server_binary


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class LocalServer:
    host: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def launch_rpc_server(
    binary: Path,
    log_dir: Path,
    *extra: str,
    host: str = "127.0.0.1",
    sigpipe_guard: bool = True,
    env: Mapping[str, str] | None = None,
    wrapper: Sequence[str] = (),
    log_prefix: str = "rpc",
    port: int | None = None,
) -> LocalServer:
    """Start `binary` (under `wrapper`, e.g. stdbuf) on `host` and a free port, SIGPIPE ignored unless
    told otherwise; wait until it accepts a connection (connect and close without a byte: harmless to
    the server, unlike an unread HELLO). `port`: that one (default: a free one). Its stdout and stderr go
    to `<log_dir>/<log_prefix>-<port>.log`."""
    port = free_port(host) if port is None else port
    log = log_dir / f"{log_prefix}-{port}.log"
    argv = [*wrapper, str(binary), "-H", host, "-p", str(port), *extra]
    line = " ".join(shlex.quote(a) for a in argv)
    guard = "trap '' PIPE; " if sigpipe_guard else ""
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["bash", "-c", f"{guard}exec {line}"], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    server = LocalServer(host, port, process, log)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return server
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"rpc-server exited: {log.read_text()}") from None
            time.sleep(0.02)
    server.stop()
    raise RuntimeError(f"rpc-server on {server.endpoint} did not listen within 10 s")


@pytest.fixture(scope="session")
def rpc_server_binary() -> Path:
    """The ggml-rpc-server to test against: the cached CPU artifact's."""
    path = local_server_binary()
    assert path.exists(), f"no ggml-rpc-server at {path}: run `make setup`"
    return path


@pytest.fixture
def start_rpc_server(rpc_server_binary: Path, tmp_path: Path) -> Iterator[Callable[..., LocalServer]]:
    """Factory: start a real server on 127.0.0.1 and a free port, SIGPIPE ignored; stopped at teardown."""
    started: list[LocalServer] = []

    def start(
        *extra: str, host: str = "127.0.0.1", sigpipe_guard: bool = True, port: int | None = None
    ) -> LocalServer:
        server = launch_rpc_server(
            rpc_server_binary, tmp_path, *extra, host=host, sigpipe_guard=sigpipe_guard, port=port
        )
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def write_local_inventory(path: Path, hosts: dict[str, dict[str, object]]) -> Path:
    """A native inventory of `connection: local` hosts on 127.0.0.1 (servers on this machine): each
    entry's variables (rpc_port, memory_limit...) on top of those defaults, in the order given. The
    server runs as this machine's own account (`rpc_run_as`): no dedicated user is made here."""
    import getpass

    import yaml

    local = {"connection": "local", "address": "127.0.0.1", "rpc_host": "127.0.0.1"}
    document = {
        "hosts": {
            name: {**local, "rpc_run_as": getpass.getuser(), **variables} for name, variables in hosts.items()
        }
    }
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


# The llama-cpp-python release whose vendored rpc-server speaks protocol 2.0.0 (before the transport
# capabilities): it closes the connection on the current HELLO and answers only the empty one.
OLD_LLAMA_CPP_PYTHON = "0.3.16"


@pytest.fixture(scope="session")
def old_rpc_server_binary() -> Path:
    """The rpc-server of llama-cpp-python 0.3.16 (protocol 2.0.0), built once through the same artifact
    code as the current one (`make setup` builds it; else about 3 minutes here, then cached)."""
    path = local_server_binary(OLD_LLAMA_CPP_PYTHON)
    assert path.exists(), f"no old rpc-server at {path}"
    return path


@pytest.fixture
def old_rpc_server(old_rpc_server_binary: Path, tmp_path: Path) -> Iterator[LocalServer]:
    """A real protocol-2.0.0 server on 127.0.0.1 and a free port; stopped at teardown."""
    server = launch_rpc_server(old_rpc_server_binary, tmp_path, log_prefix="rpc-old")
    yield server
    server.stop()
