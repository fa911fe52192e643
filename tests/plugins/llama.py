"""Fixtures for real llama.cpp loads over RPC (marker `llama`).

Native RPC registrations last for the life of the process and a process may register at most
`preflight.MAX_ENDPOINTS` distinct endpoints, so real loads share one set of session-scoped servers: three
real `ggml-rpc-server`s on loopback, started with `GGML_RPC_DEBUG=1` so their logs record every buffer
allocation to the byte. Each load runs in the test process (no subprocess): the loader preflights every
endpoint before native code, so a refused server cannot abort pytest, and tests can check the process's
own registry. A test reads only the log written since it started (`log_offset` / `allocations_since`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from orchestrator.planning.plan import PlanDevice
from orchestrator.rpc.records import parse_endpoint
from orchestrator.rpc.wire import HELLO_REPLY_SIZE, SIZE_HEADER, hello_request
from tests.plugins.servers import LocalServer, launch_rpc_server

GiB = 1 << 30


class DebugServer(LocalServer):
    """A real server whose log (stdout line-buffered, plus stderr) holds GGML_RPC_DEBUG allocations."""

    def log_offset(self) -> int:
        return self.log.stat().st_size

    def log_since(self, offset: int) -> str:
        with self.log.open("rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")

    def allocations_since(self, offset: int) -> dict[int, list[int]]:
        """Sizes the model's connection allocated per device since `offset` (weights, KV, compute...)."""
        from orchestrator.llama.logs import model_allocations, parse_server_log

        return model_allocations(parse_server_log(self.log_since(offset)))


def start_debug_server(
    binary: Path, log_dir: Path, *extra: str, env: Mapping[str, str] | None = None, port: int | None = None
) -> DebugServer:
    """Start `binary` on 127.0.0.1 and `port` (default: a free one) with GGML_RPC_DEBUG=1 (and `env`),
    SIGPIPE ignored."""
    env = {**os.environ, **(env or {}), "GGML_RPC_DEBUG": "1"}
    server = launch_rpc_server(
        binary, log_dir, *extra, env=env, wrapper=("stdbuf", "-oL"), log_prefix="rpc-debug", port=port
    )
    return DebugServer(server.host, server.port, server.process, server.log)


@pytest.fixture(scope="session")
def debug_rpc_servers(
    rpc_server_binary: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[DebugServer]]:
    """Three real servers with GGML_RPC_DEBUG=1, shared by every real load of the session."""
    log_dir = tmp_path_factory.mktemp("rpc-debug")
    servers: list[DebugServer] = []
    try:
        for _ in range(3):
            servers.append(start_debug_server(rpc_server_binary, log_dir))
        yield servers
    finally:
        for server in servers:
            server.stop()


def plan_devices(
    servers: Sequence[DebugServer | str], usable: Sequence[int] | None = None
) -> list[PlanDevice]:
    """One PlanDevice per server or endpoint (device 0, CPU backend, alignment 32), `usable` bytes each
    (default 8 GiB): the planner's input as a fleet probe would give it."""
    sizes = list(usable) if usable is not None else [8 * GiB] * len(servers)
    endpoints = [s if isinstance(s, str) else s.endpoint for s in servers]
    return [
        PlanDevice(
            endpoint=endpoints[i],
            index=0,
            name="CPU",
            description=endpoints[i],
            total=sizes[i],
            free=sizes[i],
            usable=sizes[i],
        )
        for i in range(len(endpoints))
    ]


@pytest.fixture
def hold_server() -> Iterator[Callable[[str], socket.socket]]:
    """`hold(endpoint)`: connect, complete HELLO and keep the connection open, so the server is busy
    serving us (it takes one client at a time). Closed at teardown."""
    held: list[socket.socket] = []

    def hold(endpoint: str) -> socket.socket:
        ep = parse_endpoint(endpoint)
        sock = socket.create_connection((ep.host, ep.port), timeout=5)
        sock.sendall(hello_request())
        want = SIZE_HEADER + HELLO_REPLY_SIZE
        got = b""
        while len(got) < want:
            chunk = sock.recv(want - len(got))
            if not chunk:
                raise RuntimeError(f"{endpoint} closed during HELLO")
            got += chunk
        held.append(sock)
        return sock

    yield hold
    for sock in held:
        sock.close()


def completion_bytes(llm: Any, prompt: str, n: int, temperature: float, seed: int) -> bytes:
    """The bytes of the first `n` tokens (or up to the end of generation) that llama-cpp-python's
    completion of `prompt` samples, detokenized at once: its non-streamed text before the UTF-8 decode
    (its prompt: BOS and the text's tokens; its sampler's settings are `generate`'s defaults)."""
    import llama_cpp.llama_cpp as lc

    llm.set_seed(seed)
    tokens: list[int] = []
    for token in llm.generate(
        [llm.token_bos(), *llm.tokenize(prompt.encode(), False, True)], temp=temperature
    ):
        if lc.llama_vocab_is_eog(llm._model.vocab, token) or len(tokens) == n:
            break
        tokens.append(token)
    data: bytes = llm.detokenize(tokens)
    return data
