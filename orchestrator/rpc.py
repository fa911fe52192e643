"""A pure-Python client for the ggml RPC protocol: enough to probe a `ggml-rpc-server`.

It speaks HELLO, DEVICE_COUNT and GET_DEVICE_MEMORY (wire format in `docs/llama-rpc.md` §2) and turns
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
  that does not ignore SIGPIPE (exit 141; measured against the real server, see tests/test_rpc_server.py).
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
import functools
import ipaddress
import re
import socket
import struct
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import ClassVar

from orchestrator.errors import ProbeError
from orchestrator.log import get_logger

log = get_logger()

# --- wire constants (ggml/src/ggml-rpc/ggml-rpc.cpp) ------------------------------------------------------

CMD_GET_DEVICE_MEMORY = 11
CMD_HELLO = 14  # fixed forever by the protocol
CMD_DEVICE_COUNT = 15

CONN_CAPS_SIZE = 24
HELLO_REQUEST_SIZE = CONN_CAPS_SIZE
HELLO_REPLY_SIZE = 4 + CONN_CAPS_SIZE  # major, minor, patch, pad, conn_caps
DEVICE_COUNT_REPLY_SIZE = 4
DEVICE_MEMORY_REQUEST_SIZE = 4
DEVICE_MEMORY_REPLY_SIZE = 16
SIZE_HEADER = 8

# No real server has anywhere near this many devices; a larger count is garbage, not a fleet.
MAX_DEVICES = 256

DEFAULT_RPC_PORT = 50052
# The RPC protocol of the llama.cpp vendored by llama-cpp-python 0.3.36 (ggml/include/ggml-rpc.h).
LLAMA_CPP_PYTHON_0_3_36_PROTOCOL = "7.0.0"

_HEADER_VERSION_RE = re.compile(r"#\s*define\s+RPC_PROTO_(MAJOR|MINOR|PATCH)_VERSION\s+(\d+)")


# --- data -------------------------------------------------------------------------------------------------


class Outcome(StrEnum):
    """What a probe found. Only `ok` carries a version and devices you can rely on."""

    OK = "ok"
    REFUSED = "refused"  # nothing listens, the name does not resolve, or the host is unreachable
    TIMEOUT = "timeout"  # connect did not complete, a reply stalled, or the overall deadline passed
    BUSY = "busy"  # connected, but no byte of the HELLO reply: the server serves another client
    CLOSED = "closed"  # the server closed the connection before a reply was complete
    VERSION_MISMATCH = "version_mismatch"  # the server speaks a protocol this client cannot use
    PROTOCOL_ERROR = "protocol_error"  # the reply does not follow the protocol (not a ggml-rpc-server?)


@dataclass(frozen=True, order=True)
class ProtocolVersion:
    major: int
    minor: int
    patch: int

    def __post_init__(self) -> None:
        for part in (self.major, self.minor, self.patch):
            if not 0 <= part <= 255:
                raise ValueError(
                    f"protocol version parts are bytes (0-255), got {self.major}.{self.minor}.{self.patch}"
                )

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"

    @classmethod
    def parse(cls, text: str) -> ProtocolVersion:
        """'7.0.0' (a leading 'v' and a missing patch are accepted) -> ProtocolVersion."""
        match = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
        if match is None:
            raise ValueError(f"not a protocol version: {text!r} (expected MAJOR.MINOR.PATCH)")
        major, minor, patch = match.groups()
        return cls(int(major), int(minor), int(patch or 0))

    def accepts(self, server: ProtocolVersion) -> bool:
        """llama.cpp's rule, self being the client: same major, server minor not newer than ours."""
        return server.major == self.major and server.minor <= self.minor


@dataclass(frozen=True)
class DeviceMemory:
    index: int
    free: int
    total: int


@dataclass(frozen=True)
class Endpoint:
    """A validated `host:port`. `str()` gives the canonical form (IPv6 in brackets)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class ProbeResult:
    endpoint: str
    outcome: Outcome
    version: ProtocolVersion | None
    devices: tuple[DeviceMemory, ...]
    message: str
    elapsed: float
    # This probe's own address ("host:port", "[v6]:port") as the server sees the peer (no NAT between):
    # `ss` on the server lists it among the clients while the probe runs. None: never connected.
    local_address: str | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    @property
    def free(self) -> int:
        return sum(d.free for d in self.devices)

    @property
    def total(self) -> int:
        return sum(d.total for d in self.devices)


@dataclass(frozen=True)
class AggregateMemory:
    """Memory summed over distinct servers (RpcMemoryQuery.RpcMemoryInfo of llamaj.cpp, plus devices)."""

    free: int
    total: int
    server_count: int
    device_count: int


# --- errors (the raising API) -----------------------------------------------------------------------------


class EndpointError(ProbeError):
    """An endpoint string is not `host:port` (not a network outcome: raised by both APIs)."""


class ProbeOutcomeError(ProbeError):
    """A probe ended with a non-ok outcome; `result` holds everything the probe learned."""

    outcome: ClassVar[Outcome]

    def __init__(self, result: ProbeResult) -> None:
        super().__init__(result.message, host=result.endpoint)
        self.result = result


class RefusedError(ProbeOutcomeError):
    outcome = Outcome.REFUSED


class ProbeTimeoutError(ProbeOutcomeError):
    outcome = Outcome.TIMEOUT


class BusyError(ProbeOutcomeError):
    outcome = Outcome.BUSY


class ClosedError(ProbeOutcomeError):
    outcome = Outcome.CLOSED


class VersionMismatchError(ProbeOutcomeError):
    outcome = Outcome.VERSION_MISMATCH


class ProtocolError(ProbeOutcomeError):
    outcome = Outcome.PROTOCOL_ERROR


ERROR_FOR_OUTCOME: Mapping[Outcome, type[ProbeOutcomeError]] = {
    cls.outcome: cls
    for cls in (RefusedError, ProbeTimeoutError, BusyError, ClosedError, VersionMismatchError, ProtocolError)
}


def error_for(result: ProbeResult) -> ProbeOutcomeError:
    """The typed error for a non-ok result."""
    if result.ok:
        raise ValueError("an ok probe result has no error")
    return ERROR_FOR_OUTCOME[result.outcome](result)


# --- endpoints and versions (pure) ------------------------------------------------------------------------


def parse_endpoint(text: str, *, default_port: int | None = None) -> Endpoint:
    """`host:port`, `[v6]:port` (or a bare host when `default_port` is given) -> Endpoint."""
    raw = text.strip()
    if not raw or any(c.isspace() for c in raw):
        raise EndpointError(f"invalid endpoint {text!r}: expected host:port")
    host: str
    port_text: str | None
    if raw.startswith("["):
        close = raw.find("]")
        if close < 0:
            raise EndpointError(f"invalid endpoint {text!r}: missing ']' after the IPv6 address")
        host, rest = raw[1:close], raw[close + 1 :]
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            raise EndpointError(f"invalid endpoint {text!r}: {host!r} is not an IPv6 address") from None
        if rest and not rest.startswith(":"):
            raise EndpointError(f"invalid endpoint {text!r}: expected ':port' after ']'")
        port_text = rest[1:] if rest else None
    else:
        if raw.count(":") > 1:
            raise EndpointError(f"invalid endpoint {text!r}: write IPv6 addresses as [addr]:port")
        host, sep, after = raw.partition(":")
        port_text = after if sep else None
        if not re.fullmatch(r"[A-Za-z0-9._-]+", host):
            raise EndpointError(f"invalid endpoint {text!r}: bad host {host!r}")
    if port_text is None:
        if default_port is None:
            raise EndpointError(f"invalid endpoint {text!r}: missing ':port'")
        port = default_port
    else:
        if not port_text.isdigit():
            raise EndpointError(f"invalid endpoint {text!r}: port {port_text!r} is not a number")
        port = int(port_text)
    if not 1 <= port <= 65535:
        raise EndpointError(f"invalid endpoint {text!r}: port {port} is out of range 1-65535")
    return Endpoint(host.lower(), port)


def check_version(server: ProtocolVersion, expected: ProtocolVersion) -> str | None:
    """None when `expected` (the client) can use `server`, else why not, naming both versions."""
    if expected.accepts(server):
        return None
    if server.major != expected.major:
        why = "the major versions differ"
    else:
        why = "the server's minor version is newer than the client's"
    return (
        f"RPC protocol mismatch: server {server}, client {expected} ({why}; the client needs "
        f"{expected.major}.x with minor <= {expected.minor}): install a server built from the same llama.cpp"
    )


def parse_header_version(text: str) -> ProtocolVersion:
    """The RPC_PROTO_*_VERSION defines of `ggml-rpc.h` -> ProtocolVersion."""
    found = {name: int(value) for name, value in _HEADER_VERSION_RE.findall(text)}
    if set(found) != {"MAJOR", "MINOR", "PATCH"}:
        raise ValueError("ggml-rpc.h defines no complete RPC_PROTO_{MAJOR,MINOR,PATCH}_VERSION")
    return ProtocolVersion(found["MAJOR"], found["MINOR"], found["PATCH"])


def _version_from_manifest() -> ProtocolVersion | None:
    """The protocol recorded in the manifest of the locally built CPU artifact, or None without one.

    Only the cheap lookup (`cached_build`): probing must never trigger a build.
    """
    from orchestrator.artifacts import cached_build  # lazily: artifacts is the heavier module
    from orchestrator.errors import ArtifactError

    try:
        artifact = cached_build("cpu")
        return ProtocolVersion.parse(artifact.manifest.protocol) if artifact is not None else None
    except (ArtifactError, ValueError) as exc:  # a broken manifest must not stop a probe
        log.debug("rpc_manifest_version_unreadable", error=str(exc))
        return None


@functools.cache
def cached_local_protocol_version() -> ProtocolVersion:
    """`local_protocol_version()`, read once per process (the manifest costs about a millisecond)."""
    return local_protocol_version()


def local_protocol_version(header: Path | None = None) -> ProtocolVersion:
    """The RPC protocol of the local llama.cpp build.

    From the artifact manifest when `orchestrator.artifacts` provides one, else from `header`
    (a llama.cpp `ggml/include/ggml-rpc.h`) when given, else 7.0.0 (llama-cpp-python 0.3.36).
    """
    manifest = _version_from_manifest()
    if manifest is not None:
        return manifest
    if header is not None:
        return parse_header_version(header.read_text(encoding="utf-8", errors="replace"))
    return ProtocolVersion.parse(LLAMA_CPP_PYTHON_0_3_36_PROTOCOL)


# --- wire encoding and decoding (pure) --------------------------------------------------------------------


class ReplyError(ValueError):
    """A reply that cannot be used; `outcome` is CLOSED (cut short) or PROTOCOL_ERROR (malformed)."""

    def __init__(self, outcome: Outcome, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome


def encode_request(cmd: int, payload: bytes = b"") -> bytes:
    """`cmd: u8 | size: u64 | payload`, little-endian."""
    return struct.pack("<BQ", cmd, len(payload)) + payload


def hello_request() -> bytes:
    return encode_request(CMD_HELLO, bytes(HELLO_REQUEST_SIZE))  # all-zero caps: plain TCP


def device_count_request() -> bytes:
    return encode_request(CMD_DEVICE_COUNT)


def device_memory_request(index: int) -> bytes:
    return encode_request(CMD_GET_DEVICE_MEMORY, struct.pack("<I", index))


def check_reply_header(header: bytes, expected: int, what: str) -> None:
    """The 8-byte size header of a reply must announce exactly `expected` bytes."""
    if len(header) < SIZE_HEADER:
        raise ReplyError(
            Outcome.CLOSED, f"{what} reply cut short after {len(header)} of {SIZE_HEADER} header bytes"
        )
    (size,) = struct.unpack_from("<Q", header)
    if size != expected:
        raise ReplyError(
            Outcome.PROTOCOL_ERROR,
            f"{what} reply announces {size} bytes where the protocol says {expected}: "
            "not a ggml-rpc-server of this protocol?",
        )


def _payload(reply: bytes, expected: int, what: str) -> bytes:
    check_reply_header(reply[:SIZE_HEADER], expected, what)
    payload = reply[SIZE_HEADER:]
    if len(payload) < expected:
        raise ReplyError(Outcome.CLOSED, f"{what} reply cut short after {len(payload)} of {expected} bytes")
    if len(payload) > expected:
        raise ReplyError(Outcome.PROTOCOL_ERROR, f"{what} reply has {len(payload) - expected} trailing bytes")
    return payload


def decode_hello(reply: bytes) -> ProtocolVersion:
    """A whole HELLO reply (size header + 28 bytes) -> the server's protocol version."""
    payload = _payload(reply, HELLO_REPLY_SIZE, "HELLO")
    return ProtocolVersion(payload[0], payload[1], payload[2])


def decode_device_count(reply: bytes) -> int:
    """A whole DEVICE_COUNT reply (size header + u32) -> the number of devices."""
    (count,) = struct.unpack("<I", _payload(reply, DEVICE_COUNT_REPLY_SIZE, "DEVICE_COUNT"))
    if count > MAX_DEVICES:
        raise ReplyError(
            Outcome.PROTOCOL_ERROR, f"server claims {count} devices (at most {MAX_DEVICES} are plausible)"
        )
    return int(count)


def decode_device_memory(reply: bytes, index: int) -> DeviceMemory:
    """A whole GET_DEVICE_MEMORY reply (size header + u64 free + u64 total) -> DeviceMemory."""
    free, total = struct.unpack("<QQ", _payload(reply, DEVICE_MEMORY_REPLY_SIZE, "GET_DEVICE_MEMORY"))
    return DeviceMemory(index, int(free), int(total))


# --- the conversation (I/O) -------------------------------------------------------------------------------


class _Stop(Exception):
    """Ends a conversation early with an outcome (internal)."""

    def __init__(self, outcome: Outcome, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message


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
            raise _Stop(exc.outcome, str(exc)) from None
        except (ConnectionError, OSError) as exc:
            raise _Stop(Outcome.CLOSED, f"connection lost during {what}: {exc}") from None
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


async def probe_endpoint(
    endpoint: str,
    *,
    expected: ProtocolVersion | None = None,
    connect_timeout: float = 2.0,
    read_timeout: float = 2.0,
    deadline: float = 5.0,
    hello_only: bool = False,
) -> ProbeResult:
    """Probe one server: HELLO, then (unless `hello_only`) DEVICE_COUNT and each device's memory.

    Never raises for a network outcome; the outcome is in the result. Raises EndpointError for a
    malformed endpoint. `expected` is the client's protocol (default: `local_protocol_version()`).
    `read_timeout` bounds each reply, `deadline` the whole probe, connect included.
    """
    parsed = parse_endpoint(endpoint)
    client = expected if expected is not None else cached_local_protocol_version()
    started = time.monotonic()
    loop = asyncio.get_running_loop()
    deadline_at = loop.time() + deadline
    name = str(parsed)
    version: ProtocolVersion | None = None
    devices: list[DeviceMemory] = []
    local: str | None = None

    def result(outcome: Outcome, message: str) -> ProbeResult:
        elapsed = time.monotonic() - started
        res = ProbeResult(name, outcome, version, tuple(devices), message, elapsed, local)
        log.debug("rpc_probe", endpoint=name, outcome=str(outcome), elapsed=round(res.elapsed, 4))
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
                devices.append(decode_device_memory(reply, index))
        graceful = True
        if hello_only:
            return result(Outcome.OK, f"protocol {version}")
        if not devices:
            return result(Outcome.OK, f"protocol {version}, the server reports no devices")
        return result(Outcome.OK, f"protocol {version}, {len(devices)} device(s)")
    except _Stop as stop:
        return result(stop.outcome, stop.message)
    except ReplyError as exc:
        return result(exc.outcome, str(exc))
    finally:
        if graceful:
            await _close(writer)
        else:
            _abort(writer)
            await asyncio.sleep(0)  # let the transport close the socket before we return


async def probe_endpoint_or_raise(
    endpoint: str,
    *,
    expected: ProtocolVersion | None = None,
    connect_timeout: float = 2.0,
    read_timeout: float = 2.0,
    deadline: float = 5.0,
    hello_only: bool = False,
) -> ProbeResult:
    """Like `probe_endpoint`, but a non-ok outcome raises its `ProbeOutcomeError` subclass."""
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
    endpoints: Iterable[str],
    *,
    expected: ProtocolVersion | None = None,
    connect_timeout: float = 2.0,
    read_timeout: float = 2.0,
    deadline: float = 5.0,
    hello_only: bool = False,
) -> list[ProbeResult]:
    """Probe distinct endpoints concurrently; one result per distinct endpoint, first-seen order.

    Duplicates are probed once: two probes of one server at once would make one of them `busy`.
    """
    unique = unique_endpoints(endpoints)
    return list(
        await asyncio.gather(
            *(
                probe_endpoint(
                    str(ep),
                    expected=expected,
                    connect_timeout=connect_timeout,
                    read_timeout=read_timeout,
                    deadline=deadline,
                    hello_only=hello_only,
                )
                for ep in unique
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


async def query_memory(
    endpoints: Iterable[str],
    *,
    expected: ProtocolVersion | None = None,
    connect_timeout: float = 2.0,
    read_timeout: float = 2.0,
    deadline: float = 5.0,
) -> AggregateMemory | None:
    """Free/total memory summed over distinct servers, or None if any endpoint fails or is malformed.

    Never raises (llamaj.cpp's `RpcMemoryQuery.queryAll`). No endpoints: zeros and a server count of 0.
    """
    try:
        results = await probe_endpoints(
            endpoints,
            expected=expected,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            deadline=deadline,
        )
    except EndpointError:
        return None
    return aggregate(results)
