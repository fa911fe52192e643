"""orchestrator.rpc against pure inputs and scriptable fake servers (tests/fakerpc.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import tarfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypedDict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.artifacts.local_protocol import _version_from_manifest, local_protocol_version
from orchestrator.artifacts.manifest import Artifact, llama_cpp_python_version
from orchestrator.artifacts.source import sdist_path
from orchestrator.core.errors import ProbeError
from orchestrator.core.target import Target
from orchestrator.rpc.client import probe_endpoint, probe_endpoint_or_raise, probe_endpoints, query_memory
from orchestrator.rpc.errors import (
    ERROR_FOR_OUTCOME,
    EndpointBusyError,
    EndpointProbeError,
    EndpointUnreachableError,
    ProtocolMismatchError,
    error_for,
)
from orchestrator.rpc.records import (
    LLAMA_CPP_PYTHON_0_3_36_PROTOCOL,
    AggregateMemory,
    DeviceMemory,
    Endpoint,
    EndpointError,
    Outcome,
    ProbeResult,
    ProtocolVersion,
    check_version,
    needed_version,
    parse_endpoint,
    parse_header_version,
)
from orchestrator.rpc.wire import (
    MAX_DEVICES,
    ReplyError,
    decode_device_count,
    decode_device_memory,
    decode_hello,
    device_count_request,
    device_memory_request,
    hello_request,
)
from tests.fakerpc import FakeRpcServer, GiB, Handler, drip, hello_payload, protocol, raw_after_hello, silent

V7 = ProtocolVersion(7, 0, 0)
# What the fake server (like a real CPU server) answers GET_ALIGNMENT and GET_MAX_SIZE with.
CPU_LIMITS = (32, (1 << 64) - 1)


class Timeouts(TypedDict):
    connect_timeout: float
    read_timeout: float
    deadline: float


FAST = Timeouts(connect_timeout=0.3, read_timeout=0.3, deadline=1.0)
# For outcomes that must come at once: a long read timeout, so that "fast" proves no waiting happened.
PATIENT = Timeouts(connect_timeout=0.3, read_timeout=10.0, deadline=12.0)

MakeFake = Callable[[Handler], FakeRpcServer]


@pytest.fixture
def fake() -> Iterator[MakeFake]:
    servers: list[FakeRpcServer] = []

    def make(handler: Handler) -> FakeRpcServer:
        server = FakeRpcServer(handler).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def hello_reply(version: tuple[int, int, int]) -> bytes:
    payload = hello_payload(version)
    return struct.pack("<Q", len(payload)) + payload


# --- pure parts -------------------------------------------------------------------------------------------


def test_protocol_version_parse_and_str() -> None:
    assert ProtocolVersion.parse("7.0.0") == V7
    assert ProtocolVersion.parse("v7.1") == ProtocolVersion(7, 1, 0)
    assert str(ProtocolVersion(7, 0, 5)) == "7.0.5"
    for bad in ("7", "seven", "7.0.0.0", "", "7.256.0"):
        with pytest.raises(ValueError):
            ProtocolVersion.parse(bad)


@pytest.mark.parametrize(
    ("server", "client", "usable"),
    [
        ("7.0.0", "7.0.0", True),
        ("7.0.5", "7.0.0", True),  # patch does not matter
        ("7.0.0", "7.1.0", True),  # an older server minor is fine
        ("7.1.0", "7.0.0", False),  # a newer server minor is not
        ("6.0.0", "7.0.0", False),
        ("8.0.0", "7.0.0", False),
    ],
)
def test_version_rule(server: str, client: str, usable: bool) -> None:
    message = check_version(ProtocolVersion.parse(server), ProtocolVersion.parse(client))
    assert (message is None) is usable
    if message is not None:
        assert server in message and needed_version(ProtocolVersion.parse(client)) in message


def test_local_protocol_version(tmp_path: Path) -> None:
    assert local_protocol_version() == V7
    header = tmp_path / "ggml-rpc.h"
    header.write_text(
        "#define RPC_PROTO_MAJOR_VERSION    7\n#define RPC_PROTO_MINOR_VERSION    0\n"
        "#define RPC_PROTO_PATCH_VERSION    0\n"
    )
    assert parse_header_version(header.read_text()) == V7
    assert parse_header_version(
        "#define RPC_PROTO_MAJOR_VERSION 9\n#define RPC_PROTO_MINOR_VERSION 2\n"
        "# define RPC_PROTO_PATCH_VERSION 1"
    ) == ProtocolVersion(9, 2, 1)
    with pytest.raises(ValueError):
        parse_header_version("#define RPC_PROTO_MAJOR_VERSION 7\n")


def test_local_protocol_version_matches_the_vendored_header() -> None:
    """The header of the sdist that setup built the binding and the servers from (always in the cache once
    set up: the tests never run without it), read independently of the manifest."""
    sdist = sdist_path(llama_cpp_python_version())
    name = f"llama_cpp_python-{llama_cpp_python_version()}/vendor/llama.cpp/ggml/include/ggml-rpc.h"
    with tarfile.open(sdist) as tar:
        member = tar.extractfile(name)
        assert member is not None, f"{sdist} has no {name}"
        header = member.read().decode()
    assert parse_header_version(header) == local_protocol_version()
    assert str(local_protocol_version()) == LLAMA_CPP_PYTHON_0_3_36_PROTOCOL


@pytest.mark.parametrize(
    ("text", "host", "port", "canonical"),
    [
        ("127.0.0.1:50052", "127.0.0.1", 50052, "127.0.0.1:50052"),
        (" Node-1.lab:1 ", "node-1.lab", 1, "node-1.lab:1"),
        ("[::1]:50052", "::1", 50052, "[::1]:50052"),
        ("[FE80::1%eth0]:65535", "fe80::1%eth0", 65535, "[fe80::1%eth0]:65535"),
    ],
)
def test_parse_endpoint(text: str, host: str, port: int, canonical: str) -> None:
    endpoint = parse_endpoint(text)
    assert (endpoint.host, endpoint.port, str(endpoint)) == (host, port, canonical)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "host",
        "host:",
        ":50052",
        "host:0",
        "host:65536",
        "host:5o",
        "::1:50052",
        "[::1]50052",
        "[nothost]:1",
        "[::1:1",
        "a b:1",
        "host;rm:1",
    ],
)
def test_parse_endpoint_rejects(text: str) -> None:
    with pytest.raises(EndpointError):
        parse_endpoint(text)


def test_parse_endpoint_default_port() -> None:
    assert parse_endpoint("10.0.0.5", default_port=50052) == Endpoint("10.0.0.5", 50052)
    assert parse_endpoint("[::1]", default_port=1) == Endpoint("::1", 1)


def test_requests_match_the_documented_bytes() -> None:
    assert hello_request() == bytes.fromhex("0e" + "1800000000000000") + bytes(24)
    assert device_count_request() == bytes.fromhex("0f" + "0000000000000000")
    assert device_memory_request(3) == bytes.fromhex("0b" + "0400000000000000" + "03000000")


def test_decoders() -> None:
    assert decode_hello(hello_reply((7, 0, 5))) == ProtocolVersion(7, 0, 5)
    assert decode_device_count(struct.pack("<QI", 4, 2)) == 2
    assert decode_device_memory(struct.pack("<QQQ", 16, 5, 9), 1) == DeviceMemory(1, 5, 9)
    cases = [
        (hello_reply((7, 0, 0))[:20], Outcome.CLOSED),
        (hello_reply((7, 0, 0))[:5], Outcome.CLOSED),
        (hello_reply((7, 0, 0)) + b"x", Outcome.PROTOCOL_ERROR),
        (struct.pack("<Q", 2**63) + bytes(28), Outcome.PROTOCOL_ERROR),
        (b"HTTP/1.1 400 Bad Request\r\n", Outcome.PROTOCOL_ERROR),
    ]
    for data, outcome in cases:
        with pytest.raises(ReplyError) as info:
            decode_hello(data)
        assert info.value.outcome is outcome
    with pytest.raises(ReplyError) as info:
        decode_device_count(struct.pack("<QI", 4, MAX_DEVICES + 1))
    assert info.value.outcome is Outcome.PROTOCOL_ERROR


@settings(database=None)
@given(st.binary(max_size=64))
def test_decoders_take_any_bytes(data: bytes) -> None:
    for decode in (decode_hello, decode_device_count, lambda b: decode_device_memory(b, 0)):
        try:
            decode(data)
        except ReplyError as exc:
            assert exc.outcome in (Outcome.CLOSED, Outcome.PROTOCOL_ERROR)


@settings(database=None)
@given(st.tuples(*[st.integers(0, 255)] * 3), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_decoders_round_trip(version: tuple[int, int, int], free: int, total: int) -> None:
    assert decode_hello(hello_reply(version)) == ProtocolVersion(*version)
    assert decode_device_memory(struct.pack("<QQQ", 16, free, total), 2) == DeviceMemory(2, free, total)


# --- against fake servers ---------------------------------------------------------------------------------


async def test_ok_reads_every_device_and_closes_gracefully(fake: MakeFake) -> None:
    server = fake(protocol(devices=[(3 * GiB, 4 * GiB), (10, 20)]))
    result = await probe_endpoint(server.endpoint, **FAST)
    assert result.outcome is Outcome.OK and result.ok
    assert result.version == V7
    assert result.devices == (
        DeviceMemory(0, 3 * GiB, 4 * GiB, *CPU_LIMITS),
        DeviceMemory(1, 10, 20, *CPU_LIMITS),
    )
    assert (result.free, result.total) == (3 * GiB + 10, 4 * GiB + 20)
    assert result.endpoint == server.endpoint
    await asyncio.to_thread(server.wait_idle)
    # HELLO, DEVICE_COUNT, then the memory, alignment and largest buffer of each device
    assert server.connections[0].commands == [
        14,
        15,
        11,
        1,
        2,
        11,
        1,
        2,
    ]  # memory, alignment, max size of each
    assert server.connections[0].ended == "eof"


async def test_a_target_is_dialed_at_its_dial_and_its_result_names_its_endpoint(fake: MakeFake) -> None:
    server = fake(protocol())
    target = Target("node-a.invalid:50052", server.endpoint)  # e.g. an SSH forward's local end
    result = await probe_endpoint(target, **FAST)
    assert result.ok and result.endpoint == target.endpoint and result.target == target
    direct = await probe_endpoint(Target.direct(server.endpoint), **FAST)
    assert direct.ok and direct.dial is None and direct.target == Target.direct(server.endpoint)
    # One server reached by two names is probed once (two probes at once would find it busy).
    both = await probe_endpoints([target, server.endpoint], **FAST)
    assert [r.endpoint for r in both] == [target.endpoint]
    gone = Target("node-b.invalid:50052", f"127.0.0.1:{closed_port()}")
    refused = await probe_endpoint(gone, **FAST)
    assert refused.outcome is Outcome.REFUSED and refused.endpoint == gone.endpoint
    with pytest.raises(EndpointUnreachableError) as info:
        await probe_endpoint_or_raise(gone, **FAST)
    assert info.value.host == gone.endpoint and str(info.value).startswith(f"{gone}: refused")


async def test_hello_only_sends_nothing_else(fake: MakeFake) -> None:
    server = fake(protocol())
    result = await probe_endpoint(server.endpoint, hello_only=True, **FAST)
    assert (result.outcome, result.version, result.devices) == (Outcome.OK, V7, ())
    await asyncio.to_thread(server.wait_idle)
    assert server.connections[0].commands == [14]
    assert server.connections[0].ended == "eof"


@pytest.mark.parametrize("version", [(6, 0, 0), (8, 0, 0), (7, 1, 0)])
async def test_version_mismatch(fake: MakeFake, version: tuple[int, int, int]) -> None:
    server = fake(protocol(version))
    result = await probe_endpoint(server.endpoint, **FAST)
    assert result.outcome is Outcome.VERSION_MISMATCH
    assert result.version == ProtocolVersion(*version)
    assert f"the server speaks {ProtocolVersion(*version)}, this client needs 7.0.x" in result.message
    await asyncio.to_thread(server.wait_idle)
    assert server.connections[0].commands == [14]  # nothing after HELLO
    assert server.connections[0].ended == "eof"  # the reply was read, then a clean close


async def test_newer_patch_is_ok_and_expected_is_a_parameter(fake: MakeFake) -> None:
    server = fake(protocol((7, 0, 5)))
    assert (await probe_endpoint(server.endpoint, **FAST)).outcome is Outcome.OK
    newer = fake(protocol((7, 1, 0)))
    result = await probe_endpoint(newer.endpoint, expected=ProtocolVersion(7, 1, 0), **FAST)
    assert result.outcome is Outcome.OK
    result = await probe_endpoint(server.endpoint, expected=ProtocolVersion(6, 0, 0), **FAST)
    assert result.outcome is Outcome.VERSION_MISMATCH


async def test_garbage_is_a_protocol_error(fake: MakeFake) -> None:
    server = fake(raw_after_hello(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", then="wait"))
    result = await probe_endpoint(server.endpoint, **PATIENT)
    assert result.outcome is Outcome.PROTOCOL_ERROR
    assert result.elapsed < 3.0  # decided from the 8-byte header, not after the 10 s read timeout
    await asyncio.to_thread(server.wait_idle)
    assert server.connections[0].ended == "reset"  # abandoned: aborted, nothing more sent


@pytest.mark.parametrize("size", [2**63, 2**64 - 1, 29, 1 << 40])
async def test_huge_announced_size_allocates_nothing(fake: MakeFake, size: int) -> None:
    server = fake(raw_after_hello(struct.pack("<Q", size) + b"\xff" * 4096, then="wait"))
    tracemalloc.start()
    try:
        result = await probe_endpoint(server.endpoint, **FAST)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.outcome is Outcome.PROTOCOL_ERROR
    assert str(size) in result.message
    assert peak < 1 << 20


async def test_drip_is_bounded_by_the_deadline(fake: MakeFake) -> None:
    server = fake(drip(hello_reply((7, 0, 0)), interval=1.0))
    started = time.monotonic()
    result = await probe_endpoint(server.endpoint, connect_timeout=0.3, read_timeout=30, deadline=0.5)
    assert result.outcome is Outcome.TIMEOUT  # bytes came, so not busy
    assert "deadline" in result.message
    assert 0.45 < time.monotonic() - started < 3.0  # the 0.5 s deadline (headroom), not 30 s of dripping


async def test_drip_is_bounded_by_the_read_timeout(fake: MakeFake) -> None:
    server = fake(drip(hello_reply((7, 0, 0)), interval=0.05))
    result = await probe_endpoint(server.endpoint, connect_timeout=0.3, read_timeout=0.3, deadline=30)
    assert result.outcome is Outcome.TIMEOUT
    assert "read timeout" in result.message
    assert 0.25 < result.elapsed < 3.0  # the 0.3 s read timeout (headroom for load), not the 30 s deadline


@pytest.mark.parametrize("cut", [0, 5, 8, 20])
async def test_close_mid_reply(fake: MakeFake, cut: int) -> None:
    server = fake(raw_after_hello(hello_reply((7, 0, 0))[:cut]))
    result = await probe_endpoint(server.endpoint, **PATIENT)
    assert result.outcome is Outcome.CLOSED
    assert result.elapsed < 3.0  # at once (headroom for load), not after the 10 s read timeout


async def test_device_count_zero(fake: MakeFake) -> None:
    server = fake(protocol(devices=[]))
    result = await probe_endpoint(server.endpoint, **FAST)
    assert (result.outcome, result.devices) == (Outcome.OK, ())
    assert "no devices" in result.message


async def test_device_index_error_closes(fake: MakeFake) -> None:
    # The server claims two devices but knows one: asking for #1 makes it close, as the real one does.
    server = fake(protocol(devices=[(1, 2)], device_count=2))
    result = await probe_endpoint(server.endpoint, **FAST)
    assert result.outcome is Outcome.CLOSED
    assert "GET_DEVICE_MEMORY(1)" in result.message
    assert result.version == V7 and result.devices == (DeviceMemory(0, 1, 2, *CPU_LIMITS),)


async def test_absurd_device_count(fake: MakeFake) -> None:
    server = fake(protocol(device_count=2**32 - 1))
    result = await probe_endpoint(server.endpoint, **FAST)
    assert result.outcome is Outcome.PROTOCOL_ERROR
    await asyncio.to_thread(server.wait_idle)
    assert server.connections[0].commands == [14, 15]


async def test_silent_server_is_busy_and_is_reset(fake: MakeFake) -> None:
    server = fake(silent())
    result = await probe_endpoint(server.endpoint, connect_timeout=0.3, read_timeout=0.3, deadline=10)
    assert result.outcome is Outcome.BUSY
    assert 0.28 < result.elapsed < 3.0  # the 0.3 s read timeout (headroom for load), not the deadline
    await asyncio.to_thread(server.wait_idle)
    assert server.connections[0].ended == "reset"


async def test_silent_server_within_a_short_deadline_is_still_busy(fake: MakeFake) -> None:
    server = fake(silent())
    result = await probe_endpoint(server.endpoint, connect_timeout=0.3, read_timeout=5, deadline=0.3)
    assert result.outcome is Outcome.BUSY
    assert "deadline" in result.message


async def test_refused() -> None:
    result = await probe_endpoint(f"127.0.0.1:{closed_port()}", **FAST)
    assert result.outcome is Outcome.REFUSED
    assert (result.version, result.devices) == (None, ())


async def test_full_accept_queue_is_a_connect_timeout() -> None:
    # A listener that never accepts, with its queue full: the kernel drops the SYN, like a dead link.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        queued = [socket.create_connection(("127.0.0.1", port), timeout=1) for _ in range(1)]
        try:
            result = await probe_endpoint(
                f"127.0.0.1:{port}", connect_timeout=0.3, read_timeout=0.3, deadline=10
            )
        finally:
            for sock in queued:
                sock.close()
    assert result.outcome is Outcome.TIMEOUT
    assert "connect" in result.message
    assert 0.28 < result.elapsed < 3.0  # the 0.3 s connect timeout (headroom), not the 10 s deadline


async def test_bad_endpoint_raises_from_both_apis() -> None:
    with pytest.raises(EndpointError):
        await probe_endpoint("no-port")
    with pytest.raises(EndpointError):
        await probe_endpoint_or_raise("no-port")


async def test_raising_api(fake: MakeFake) -> None:
    good = fake(protocol())
    assert (await probe_endpoint_or_raise(good.endpoint, **FAST)).ok
    cases: list[tuple[str, type[EndpointProbeError], Outcome]] = [
        (f"127.0.0.1:{closed_port()}", EndpointUnreachableError, Outcome.REFUSED),
        (fake(silent()).endpoint, EndpointBusyError, Outcome.BUSY),
        (fake(protocol((8, 0, 0))).endpoint, ProtocolMismatchError, Outcome.VERSION_MISMATCH),
        (fake(raw_after_hello(b"\x00" * 3)).endpoint, EndpointUnreachableError, Outcome.CLOSED),
        (fake(raw_after_hello(b"garbage!" * 5)).endpoint, ProtocolMismatchError, Outcome.PROTOCOL_ERROR),
        (fake(drip(hello_reply((7, 0, 0)), 0.1)).endpoint, EndpointUnreachableError, Outcome.TIMEOUT),
    ]
    for endpoint, error, outcome in cases:
        with pytest.raises(error) as info:
            await probe_endpoint_or_raise(endpoint, **FAST)
        assert isinstance(info.value, ProbeError)
        assert info.value.outcome is outcome and info.value.result.outcome is outcome
        assert info.value.result.endpoint == endpoint
        assert str(info.value).startswith(f"{endpoint}: {outcome}: ")
    assert set(ERROR_FOR_OUTCOME) == set(Outcome) - {Outcome.OK}
    with pytest.raises(ValueError):
        error_for(await probe_endpoint(good.endpoint, **FAST))


async def test_probe_endpoints_dedups_keeps_order_and_runs_concurrently(fake: MakeFake) -> None:
    a, b, c, d = fake(protocol()), fake(silent()), fake(silent()), fake(silent())
    refused = f"127.0.0.1:{closed_port()}"
    started = time.monotonic()
    results = await probe_endpoints(
        [b.endpoint, a.endpoint, refused, f" {b.endpoint} ", a.endpoint, c.endpoint, d.endpoint],
        connect_timeout=0.5,
        read_timeout=1.5,
        deadline=5,
    )
    assert [r.endpoint for r in results] == [b.endpoint, a.endpoint, refused, c.endpoint, d.endpoint]
    assert [r.outcome for r in results] == [Outcome.BUSY, Outcome.OK, Outcome.REFUSED] + [Outcome.BUSY] * 2
    assert time.monotonic() - started < 3.5  # concurrent: one wait of 1.5 s, not three (4.5 s)
    await asyncio.to_thread(a.wait_idle)
    await asyncio.to_thread(b.wait_idle)
    assert len(a.connections) == len(b.connections) == 1


async def test_query_memory(fake: MakeFake) -> None:
    a = fake(protocol(devices=[(1 * GiB, 2 * GiB), (3 * GiB, 4 * GiB)]))
    b = fake(protocol(devices=[(5 * GiB, 6 * GiB)]))
    total = await query_memory([a.endpoint, b.endpoint, a.endpoint], **FAST)
    assert total == AggregateMemory(free=9 * GiB, total=12 * GiB, server_count=2, device_count=3)
    assert await query_memory([a.endpoint, f"127.0.0.1:{closed_port()}"], **FAST) is None
    assert await query_memory([a.endpoint, fake(protocol((8, 0, 0))).endpoint], **FAST) is None
    assert await query_memory([a.endpoint, "not an endpoint"], **FAST) is None
    assert await query_memory([], **FAST) == AggregateMemory(0, 0, 0, 0)


async def test_query_memory_never_raises_whatever_it_is_given(fake: MakeFake) -> None:
    """query_all's rule (the drop-in spec's queryAll is null on any failure): None, never an exception."""
    a = fake(protocol(devices=[(1 * GiB, 2 * GiB)]))
    b = fake(protocol(devices=[(5 * GiB, 6 * GiB)]))
    both = AggregateMemory(free=6 * GiB, total=8 * GiB, server_count=2, device_count=2)
    assert await query_memory(f"{a.endpoint},{b.endpoint}", **FAST) == both  # a bare string: a list

    def exploding() -> Iterator[str]:
        yield a.endpoint
        raise RuntimeError("boom")

    odd: list[Any] = [None, [None], "", "garbage", 5, b"x", object(), [a.endpoint, 7], exploding()]
    odd += [[["nested"]], "[::1", float("nan"), {a.endpoint: None, 3: None}]
    for value in odd:
        assert await query_memory(value, **FAST) is None, value


# --- property: any reply bytes, the client stays within its deadline and raises only its own errors ------


def _framed(size: int) -> st.SearchStrategy[bytes]:
    """A size header followed by about that many random bytes (capped: 2**63 is announced, not sent)."""
    sent = min(size, 28)
    return st.binary(min_size=sent, max_size=sent + 3).map(lambda p: struct.pack("<Q", size) + p)


_REPLIES = st.one_of(
    st.binary(max_size=80),
    # Well-framed replies with random payloads reach the later stages of the conversation.
    st.lists(
        st.sampled_from([28, 4, 16, 0, 2**63]).flatmap(_framed),
        max_size=5,
    ).map(b"".join),
    st.builds(
        lambda major, count, mems: hello_reply((major, 0, 0)) + struct.pack("<QI", 4, count) + mems,
        st.sampled_from([7, 7, 6]),
        st.integers(0, 3),
        st.binary(max_size=60),
    ),
)


@pytest.fixture(scope="module")
def shared_fake() -> Iterator[FakeRpcServer]:
    server = FakeRpcServer(silent()).start()
    yield server
    server.stop()


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_REPLIES, then=st.sampled_from(["close", "wait"]), raising=st.booleans())
def test_any_reply_bytes(shared_fake: FakeRpcServer, data: bytes, then: str, raising: bool) -> None:
    shared_fake.handler = raw_after_hello(data, then=then)
    deadline = 0.25

    async def go() -> ProbeResult:
        probe = probe_endpoint_or_raise if raising else probe_endpoint
        return await probe(shared_fake.endpoint, connect_timeout=0.2, read_timeout=0.15, deadline=deadline)

    started = time.monotonic()
    try:
        result = asyncio.run(go())
    except EndpointProbeError as exc:
        assert raising
        result = exc.result
    assert time.monotonic() - started < deadline + 2.0  # bounded (headroom for load); the server: forever
    # What the bytes allow, not just "some outcome": the fake listens (never refused); no byte of a reply
    # is busy while the server holds the connection, closed once it closes it; any byte is not busy.
    assert result.outcome is not Outcome.REFUSED
    if not data:
        assert result.outcome is (Outcome.BUSY if then == "wait" else Outcome.CLOSED), result
    else:
        assert result.outcome is not Outcome.BUSY, result
    if result.ok:  # only a well-framed HELLO reply of protocol 7 (28 bytes) can be ok
        assert struct.unpack_from("<Q", data)[0] == 28 and data[8] == 7, data
        assert result.version is not None and V7.accepts(result.version)


def _record_artifact(home: Path, real: Artifact, protocol: str) -> None:
    """A cache in `home` whose CPU artifact for this llama-cpp-python is `real`, but whose manifest
    records `protocol` (the archive is a symlink: only the record is read)."""
    from orchestrator.artifacts.build import build_key, effective_cmake_args
    from orchestrator.artifacts.manifest import llama_cpp_python_version

    cache = home / "artifacts"
    (cache / "keys").mkdir(parents=True)
    data = json.loads((real.archive.parent / f"{real.id}.json").read_text())
    data["manifest"]["protocol"] = protocol
    (cache / f"{real.id}.json").write_text(json.dumps(data))
    (cache / f"{real.id}.tar.gz").symlink_to(real.archive)
    key = build_key(llama_cpp_python_version(), "cpu", effective_cmake_args("cpu"))
    (cache / "keys" / key).write_text(real.id + "\n")


def test_local_protocol_version_sources(cpu_artifact: Artifact, artifact_home: Path, tmp_path: Path) -> None:
    header = tmp_path / "ggml-rpc.h"
    header.write_text(
        "#define RPC_PROTO_MAJOR_VERSION 7\n#define RPC_PROTO_MINOR_VERSION 3\n"
        "#define RPC_PROTO_PATCH_VERSION 1\n"
    )
    # An empty cache: the header when given, else the constant of llama-cpp-python 0.3.36.
    assert _version_from_manifest() is None
    assert local_protocol_version(header) == ProtocolVersion(7, 3, 1)
    assert local_protocol_version() == V7
    # A cached artifact: its manifest wins over the header.
    _record_artifact(artifact_home, cpu_artifact, "7.2.0")
    assert _version_from_manifest() == ProtocolVersion(7, 2, 0)
    assert local_protocol_version(header) == ProtocolVersion(7, 2, 0)


def test_an_unreadable_manifest_falls_back(cpu_artifact: Artifact, artifact_home: Path) -> None:
    _record_artifact(artifact_home, cpu_artifact, "garbage")
    assert _version_from_manifest() is None
    assert local_protocol_version() == V7


def test_the_real_cache_gives_the_artifact_protocol(cpu_artifact: Artifact) -> None:
    assert local_protocol_version() == ProtocolVersion.parse(cpu_artifact.manifest.protocol)
