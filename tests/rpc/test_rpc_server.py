"""orchestrator.rpc against real ggml-rpc-server processes (protocol 7.0.0) on loopback."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from orchestrator.rpc.client import probe_endpoint, query_memory
from orchestrator.rpc.records import AggregateMemory, Outcome, ProbeResult, ProtocolVersion
from orchestrator.rpc.wire import HELLO_REPLY_SIZE, hello_request
from tests.plugins.servers import LocalServer

StartServer = Callable[..., LocalServer]
SHORT = 0.3


@asynccontextmanager
async def holder(server: LocalServer) -> AsyncIterator[None]:
    """A client that completed HELLO and stays connected, like a loaded model does."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(hello_request())
    await reader.readexactly(8 + HELLO_REPLY_SIZE)
    try:
        yield
    finally:
        writer.close()
        await writer.wait_closed()


async def wait_ok(endpoint: str) -> ProbeResult:
    """The server takes the next client only after it noticed the previous one left."""
    result = await probe_endpoint(endpoint, read_timeout=1, deadline=2)
    for _ in range(20):
        if result.ok:
            break
        await asyncio.sleep(0.05)
        result = await probe_endpoint(endpoint, read_timeout=1, deadline=2)
    return result


@pytest.mark.llama
async def test_ok(start_rpc_server: StartServer) -> None:
    server = start_rpc_server()
    result = await probe_endpoint(server.endpoint)
    assert result.outcome is Outcome.OK, result.message
    assert result.version == ProtocolVersion(7, 0, 0)
    assert len(result.devices) == 1
    assert result.devices[0].index == 0
    assert 0 < result.devices[0].free <= result.devices[0].total  # its time: bench/probe.py
    hello = await probe_endpoint(server.endpoint, hello_only=True)
    assert (hello.outcome, hello.version, hello.devices) == (Outcome.OK, result.version, ())
    memory = await query_memory([server.endpoint, server.endpoint])
    assert memory == AggregateMemory(result.free, result.total, server_count=1, device_count=1)
    assert server.alive()


@pytest.mark.llama
async def test_stopped_server_is_refused(start_rpc_server: StartServer) -> None:
    server = start_rpc_server()
    server.stop()
    result = await probe_endpoint(server.endpoint, connect_timeout=SHORT, read_timeout=SHORT)
    assert result.outcome is Outcome.REFUSED
    assert await query_memory([server.endpoint]) is None


@pytest.mark.llama
async def test_busy_then_served_again(start_rpc_server: StartServer) -> None:
    server = start_rpc_server()
    async with holder(server):
        started = time.monotonic()
        result = await probe_endpoint(server.endpoint, connect_timeout=SHORT, read_timeout=SHORT)
        assert result.outcome is Outcome.BUSY, result.message
        assert SHORT <= time.monotonic() - started < SHORT + 2.0  # its timeout (headroom); holder: forever
        assert server.alive()
    after = await wait_ok(server.endpoint)
    assert after.outcome is Outcome.OK, after.message
    assert server.alive()
    # The server did get to our abandoned HELLO once the holder left; its reply failed, harmlessly.
    assert "send failed" in server.log.read_text()


@pytest.mark.llama
async def test_busy_probe_does_not_kill_an_unguarded_server(start_rpc_server: StartServer) -> None:
    # Without `trap '' PIPE` a reply to a closed client raises SIGPIPE. The probe closes an abandoned
    # connection with a reset, so the late reply fails with ECONNRESET instead, which raises no signal.
    server = start_rpc_server(sigpipe_guard=False)
    async with holder(server):
        result = await probe_endpoint(server.endpoint, connect_timeout=SHORT, read_timeout=SHORT)
        assert result.outcome is Outcome.BUSY
    after = await wait_ok(server.endpoint)
    assert after.outcome is Outcome.OK, after.message
    assert server.alive()


@pytest.mark.llama
async def test_why_the_reset_matters_a_graceful_close_kills_an_unguarded_server(
    start_rpc_server: StartServer,
) -> None:
    # What a naive probe does: HELLO to a busy server, give up, close normally. When the server gets
    # to the queued HELLO, its reply meets a closed socket: EPIPE, SIGPIPE, the server dies (exit 141).
    server = start_rpc_server(sigpipe_guard=False)
    async with holder(server):
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(hello_request())
        await writer.drain()
        try:
            await asyncio.wait_for(reader.read(1), SHORT)
            raise AssertionError("a busy server answered")
        except TimeoutError:
            pass
        writer.close()
        await writer.wait_closed()
    assert await asyncio.to_thread(server.process.wait, 5) == -13  # killed by SIGPIPE


@pytest.mark.llama
async def test_full_accept_queue_times_out_at_connect(start_rpc_server: StartServer) -> None:
    # listen backlog 1: the kernel queues two more connections (not read by anyone), then drops SYNs.
    server = start_rpc_server()
    async with holder(server):
        queued = [socket.create_connection((server.host, server.port), timeout=1) for _ in range(2)]
        try:
            result = await probe_endpoint(server.endpoint, connect_timeout=SHORT, read_timeout=SHORT)
        finally:
            for sock in queued:
                sock.close()  # they sent nothing, so closing them is harmless
        assert result.outcome is Outcome.TIMEOUT, result.message
    after = await wait_ok(server.endpoint)
    assert after.outcome is Outcome.OK
    assert server.alive()
