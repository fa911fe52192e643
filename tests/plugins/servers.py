"""Real ggml-rpc-server processes on loopback, built from the same source as llama-cpp-python."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

RPCFLEET_HOME = Path(os.environ.get("RPCFLEET_HOME", Path.home() / ".cache" / "rpcfleet"))


def _find_server_binary() -> Path:
    """The ggml-rpc-server to test against (the cached CPU artifact once it exists)."""
    try:
        from orchestrator import artifacts

        return artifacts.local_server_binary()
    except (ImportError, AttributeError):
        return RPCFLEET_HOME / "dev-server" / "ggml-rpc-server"


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


@pytest.fixture(scope="session")
def rpc_server_binary() -> Path:
    path = _find_server_binary()
    assert path.exists(), f"no ggml-rpc-server at {path}: run `make setup`"
    return path


@pytest.fixture
def start_rpc_server(rpc_server_binary: Path, tmp_path: Path) -> Iterator[Callable[..., LocalServer]]:
    """Factory: start a real server on 127.0.0.1 and a free port, SIGPIPE ignored; stopped at teardown."""
    started: list[LocalServer] = []

    def start(*extra: str, host: str = "127.0.0.1", sigpipe_guard: bool = True) -> LocalServer:
        port = free_port(host)
        log = tmp_path / f"rpc-{port}.log"
        argv = [str(rpc_server_binary), "-H", host, "-p", str(port), *extra]
        line = " ".join(shlex.quote(a) for a in argv)
        guard = "trap '' PIPE; " if sigpipe_guard else ""
        with log.open("wb") as out:
            process = subprocess.Popen(
                ["bash", "-c", f"{guard}exec {line}"], stdout=out, stderr=subprocess.STDOUT
            )
        server = LocalServer(host, port, process, log)
        started.append(server)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            # Connect and close without sending: harmless to the server, unlike an unread HELLO.
            try:
                socket.create_connection((host, port), timeout=0.2).close()
                return server
            except OSError:
                if process.poll() is not None:
                    raise RuntimeError(f"rpc-server exited: {log.read_text()}") from None
                time.sleep(0.02)
        raise RuntimeError(f"rpc-server on {server.endpoint} did not listen within 10 s")

    yield start
    for server in started:
        server.stop()
