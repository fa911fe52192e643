"""A pure-Python client for the ggml RPC protocol: enough to probe a `ggml-rpc-server`.

It speaks HELLO, DEVICE_COUNT and GET_DEVICE_MEMORY (wire format: §2 of docs/llama-rpc.md) and turns
every network outcome into a typed `ProbeResult`. No native code runs, so an unreachable or mismatched
server can never abort the process the way the native client does.

Being gentle with the server matters as much as the answer:

* Every read is bounded: a reply's announced size must equal the size the command defines, and nothing
  is ever allocated from a size the peer sent.
* Every reply is read fully before a graceful close, so the server sees a clean EOF.
* "Busy": the server serves one client at a time (listen backlog 1). A second client is accepted by the
  kernel but nobody reads it, so a HELLO sent there is answered only once the current client leaves.
  The client cannot tell this from the outside without sending HELLO, so it sends HELLO and, when no
  byte of the reply arrives within the read timeout, reports `busy`. It then closes *abortively*
  (SO_LINGER 0, a TCP reset). When the server later gets to the queued HELLO its reply fails with
  ECONNRESET, which raises no SIGPIPE, instead of EPIPE after a graceful close, which kills a server
  that does not ignore SIGPIPE (exit 141; measured against the real server, see tests/rpc/test_rpc_server.py).
  A reset can be lost on a real network, so servers must still be started with SIGPIPE ignored, as
  rpcfleet's launcher does.
* Every connection abandoned half-way (timeout, protocol error) is closed the same abortive way, and
  nothing more is sent on it.
* Busy versus timeout: a connect that does not complete (packets dropped, or the server's accept queue
  is full because two clients already wait) is `timeout`; a connected server that sends nothing is
  `busy`; a reply that starts but does not finish in time is `timeout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace

from orchestrator.core.target import Target
from orchestrator.rpc.errors import error_for
from orchestrator.rpc.records import (
    CLIENT_PROTOCOL,
    AggregateMemory,
    DeviceMemory,
    Endpoint,
    Outcome,
    ProbeResult,
    ProtocolVersion,
    check_version,
    log,
    parse_endpoint,
)
from orchestrator.rpc.wire import (
    BUFFER_LIMIT_REPLY_SIZE,
    DEVICE_COUNT_REPLY_SIZE,
    DEVICE_MEMORY_REPLY_SIZE,
    HELLO_REPLY_SIZE,
    LEGACY_HELLO_REPLY_SIZE,
    SIZE_HEADER,
    ReplyError,
    alignment_request,
    check_reply_header,
    decode_buffer_limit,
    decode_device_count,
    decode_device_memory,
    decode_hello,
    decode_legacy_hello,
    device_count_request,
    device_memory_request,
    hello_request,
    legacy_hello_request,
    max_size_request,
)


class _Stop(Exception):
    """Ends a conversation early with an outcome (internal); `empty`: no byte of the reply came."""

    def __init__(self, outcome: Outcome, message: str, *, empty: bool = False) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message
        self.empty = empty


class _Conversation:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        read_timeout: float,
        deadline_at: float,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.read_timeout = read_timeout
        self.deadline_at = deadline_at

    async def exchange(self, request: bytes, expected: int, what: str, *, first: bool = False) -> bytes:
        """Send one request, read its whole reply (header + exactly `expected` bytes)."""
        loop = asyncio.get_running_loop()
        self.writer.write(request)
        received = bytearray()
        limit = min(loop.time() + self.read_timeout, self.deadline_at)
        try:
            async with asyncio.timeout_at(limit):
                await self.writer.drain()
                await self._read_into(received, SIZE_HEADER, what)
                check_reply_header(bytes(received), expected, what)
                await self._read_into(received, SIZE_HEADER + expected, what)
        except TimeoutError:
            by_deadline = limit >= self.deadline_at
            waited = "the overall deadline" if by_deadline else f"the read timeout ({self.read_timeout:g} s)"
            if first and not received:
                raise _Stop(
                    Outcome.BUSY,
                    f"connected, but no HELLO reply within {waited}: the server is serving another client "
                    "(it serves one at a time) or is hung",
                ) from None
            raise _Stop(
                Outcome.TIMEOUT, f"{what} reply incomplete after {waited} ({len(received)} bytes received)"
            ) from None
        except ReplyError as exc:
            raise _Stop(exc.outcome, str(exc), empty=not received) from None
        except (ConnectionError, OSError) as exc:
            raise _Stop(Outcome.CLOSED, f"connection lost during {what}: {exc}", empty=not received) from None
        return bytes(received)

    async def _read_into(self, buf: bytearray, size: int, what: str) -> None:
        # Reads at most what is still missing: memory never depends on what the peer announces.
        while len(buf) < size:
            chunk = await self.reader.read(size - len(buf))
            if not chunk:
                raise ReplyError(
                    Outcome.CLOSED,
                    f"server closed the connection after {len(buf)} of {size} bytes of the {what} reply",
                )
            buf += chunk


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset: a reply the server sends later fails with ECONNRESET, not SIGPIPE."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(1.0):
            await writer.wait_closed()


async def _connect(endpoint: Endpoint, limit_s: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    async with asyncio.timeout(limit_s):
        # A small buffer limit: a peer flooding us fills the kernel buffers, not ours.
        return await asyncio.open_connection(endpoint.host, endpoint.port, limit=4096)


def _format_address(sockname: object) -> str | None:
    """A socket address as `ss` prints it: `host:port`, or `[host]:port` for IPv6."""
    if not isinstance(sockname, tuple) or len(sockname) < 2:
        return None
    host, port = str(sockname[0]), int(sockname[1])
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _legacy_hello(
    endpoint: Endpoint, read_timeout: float, deadline_at: float
) -> ProtocolVersion | None:
    """The version of a server older than protocol 3, which closes the connection on the current HELLO:
    one more connection with the empty HELLO those servers expect. None when that fails too."""
    loop = asyncio.get_running_loop()
    try:
        reader, writer = await _connect(endpoint, max(0.0, min(read_timeout, deadline_at - loop.time())))
    except (OSError, TimeoutError):
        return None
    talk = _Conversation(reader, writer, read_timeout, deadline_at)
    try:
        reply = await talk.exchange(legacy_hello_request(), LEGACY_HELLO_REPLY_SIZE, "legacy HELLO")
        version = decode_legacy_hello(reply)
    except (_Stop, ReplyError):
        _abort(writer)
        await asyncio.sleep(0)
        return None
    await _close(writer)
    return version


async def probe_endpoint(
    endpoint: str | Target,
    *,
    expected: ProtocolVersion | None = None,
    connect_timeout: float = 2.0,
    read_timeout: float = 2.0,
    deadline: float = 5.0,
    hello_only: bool = False,
) -> ProbeResult:
    """Probe one server: HELLO, then (unless `hello_only`) DEVICE_COUNT and each device's memory.

    Never raises for a network outcome; the outcome is in the result. Raises EndpointError for a
    malformed endpoint. `expected` is the client's protocol (default: `CLIENT_PROTOCOL`). A server that
    closes the connection on HELLO without a byte is asked once more, on a new connection, with the
    empty HELLO of servers older than protocol 3: one that answers is a `version_mismatch` naming its
    version.
    `read_timeout` bounds each reply, `deadline` the whole probe, connect included.
    A `Target` is dialed at `target.dial`; its result names `target.endpoint` and keeps the dial.
    """
    target = endpoint if isinstance(endpoint, Target) else None
    parsed = parse_endpoint(endpoint.dial if isinstance(endpoint, Target) else endpoint)
    dial = target.dial if target is not None and target.tunneled else None
    client = expected if expected is not None else CLIENT_PROTOCOL
    started = time.monotonic()
    loop = asyncio.get_running_loop()
    deadline_at = loop.time() + deadline
    name = target.endpoint if target is not None else str(parsed)
    version: ProtocolVersion | None = None
    devices: list[DeviceMemory] = []
    local: str | None = None

    def result(outcome: Outcome, message: str) -> ProbeResult:
        elapsed = time.monotonic() - started
        res = ProbeResult(name, outcome, version, tuple(devices), message, elapsed, local, dial)
        log.debug("rpc_probe", endpoint=str(res.target), outcome=str(outcome), elapsed=round(res.elapsed, 4))
        return res

    try:
        reader, writer = await _connect(parsed, max(0.0, min(connect_timeout, deadline)))
    except TimeoutError:
        return result(Outcome.TIMEOUT, f"connect timed out after {min(connect_timeout, deadline):g} s")
    except ConnectionRefusedError:
        return result(Outcome.REFUSED, "connection refused: no rpc-server listens there")
    except socket.gaierror as exc:
        return result(Outcome.REFUSED, f"cannot resolve host {parsed.host!r}: {exc.strerror}")
    except OSError as exc:
        return result(Outcome.REFUSED, f"cannot connect: {exc.strerror or exc}")

    local = _format_address(writer.get_extra_info("sockname"))
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    talk = _Conversation(reader, writer, read_timeout, deadline_at)
    graceful = False
    closed_on_hello: _Stop | None = None
    try:
        reply = await talk.exchange(hello_request(), HELLO_REPLY_SIZE, "HELLO", first=True)
        version = decode_hello(reply)
        mismatch = check_version(version, client)
        if mismatch is not None:
            graceful = True  # every reply was read; nothing more is sent
            return result(Outcome.VERSION_MISMATCH, mismatch)
        if not hello_only:
            count = decode_device_count(
                await talk.exchange(device_count_request(), DEVICE_COUNT_REPLY_SIZE, "DEVICE_COUNT")
            )
            for index in range(count):
                reply = await talk.exchange(
                    device_memory_request(index), DEVICE_MEMORY_REPLY_SIZE, f"GET_DEVICE_MEMORY({index})"
                )
                memory = decode_device_memory(reply, index)
                alignment = decode_buffer_limit(
                    await talk.exchange(alignment_request(index), BUFFER_LIMIT_REPLY_SIZE, "GET_ALIGNMENT"),
                    "GET_ALIGNMENT",
                )
                max_size = decode_buffer_limit(
                    await talk.exchange(max_size_request(index), BUFFER_LIMIT_REPLY_SIZE, "GET_MAX_SIZE"),
                    "GET_MAX_SIZE",
                )
                devices.append(replace(memory, alignment=alignment, max_size=max_size))
        graceful = True
        if hello_only:
            return result(Outcome.OK, f"protocol {version}")
        if not devices:
            return result(Outcome.OK, f"protocol {version}, the server reports no devices")
        return result(Outcome.OK, f"protocol {version}, {len(devices)} device(s)")
    except _Stop as stop:
        if stop.outcome is Outcome.CLOSED and stop.empty and version is None:
            closed_on_hello = stop
        else:
            return result(stop.outcome, stop.message)
    except ReplyError as exc:
        return result(exc.outcome, str(exc))
    finally:
        if graceful:
            await _close(writer)
        else:
            _abort(writer)
            await asyncio.sleep(0)  # let the transport close the socket before we return
    version = await _legacy_hello(parsed, read_timeout, deadline_at)
    if version is None:
        return result(closed_on_hello.outcome, closed_on_hello.message)
    why = check_version(version, client) or f"the server answers only the empty HELLO of protocol {version}"
    return result(Outcome.VERSION_MISMATCH, why)


async def probe_endpoint_or_raise(
    endpoint: str | Target,
    *,
    expected: ProtocolVersion | None = None,
    connect_timeout: float = 2.0,
    read_timeout: float = 2.0,
    deadline: float = 5.0,
    hello_only: bool = False,
) -> ProbeResult:
    """Like `probe_endpoint`, but a non-ok outcome raises its `EndpointProbeError` subclass."""
    res = await probe_endpoint(
        endpoint,
        expected=expected,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        deadline=deadline,
        hello_only=hello_only,
    )
    if not res.ok:
        raise error_for(res)
    return res


def unique_endpoints(endpoints: Iterable[str]) -> list[Endpoint]:
    """Parsed endpoints, duplicates (same canonical host:port) dropped, first-seen order kept."""
    seen: dict[Endpoint, None] = {}
    for text in endpoints:
        seen.setdefault(parse_endpoint(text), None)
    return list(seen)


async def probe_endpoints(
    endpoints: Iterable[str | Target],
    *,
    expected: ProtocolVersion | None = None,
    connect_timeout: float = 2.0,
    read_timeout: float = 2.0,
    deadline: float = 5.0,
    hello_only: bool = False,
) -> list[ProbeResult]:
    """Probe distinct endpoints concurrently; one result per distinct endpoint, first-seen order.

    Duplicates (the same address dialed) are probed once: two probes of one server at once would make
    one of them `busy`. A `Target`'s result names its endpoint (`probe_endpoint`).
    """
    unique: dict[Endpoint, str | Target] = {}
    for item in endpoints:
        parsed = parse_endpoint(item.dial if isinstance(item, Target) else item)
        unique.setdefault(parsed, item if isinstance(item, Target) else str(parsed))
    return list(
        await asyncio.gather(
            *(
                probe_endpoint(
                    item,
                    expected=expected,
                    connect_timeout=connect_timeout,
                    read_timeout=read_timeout,
                    deadline=deadline,
                    hello_only=hello_only,
                )
                for item in unique.values()
            )
        )
    )


def aggregate(results: Sequence[ProbeResult]) -> AggregateMemory | None:
    """Sum over results (assumed distinct); None if any is not ok."""
    if any(not r.ok for r in results):
        return None
    return AggregateMemory(
        free=sum(r.free for r in results),
        total=sum(r.total for r in results),
        server_count=len(results),
        device_count=sum(len(r.devices) for r in results),
    )


def endpoint_list(value: object) -> list[str] | None:
    """`value` as a list of endpoint strings (a bare string is read as "h1:p,h2:p"), or None when it is
    not one: None, bytes, a non-iterable, or an item that is not a string. Iterating may raise."""
    if isinstance(value, str):
        value = value.split(",")
    if value is None or isinstance(value, bytes | bytearray) or not isinstance(value, Iterable):
        return None
    items = list(value)
    if not all(isinstance(item, str) for item in items):
        return None
    return items


async def query_memory(
    endpoints: Iterable[str],
    *,
    expected: ProtocolVersion | None = None,
    connect_timeout: float = 2.0,
    read_timeout: float = 2.0,
    deadline: float = 5.0,
) -> AggregateMemory | None:
    """Free/total memory summed over distinct servers, or None if any endpoint fails or is malformed.

    Never raises, whatever it is given (llamaj.cpp's `RpcMemoryQuery.queryAll` returns null on any
    failure): None, [None], a bare string read as "h1:p,h2:p", an iterable that raises. No endpoints:
    zeros and a server count of 0.
    """
    try:
        items = endpoint_list(endpoints)
        if items is None:
            return None
        results = await probe_endpoints(
            items,
            expected=expected,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            deadline=deadline,
        )
    except Exception:  # the promise: None on any failure (a bad endpoint, an iterable that raises, ...)
        return None
    return aggregate(results)
