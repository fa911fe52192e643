"""The RPC client's records: endpoints, protocol versions, probe outcomes and results, device memory, and
their errors (pure; the wire format is rpc/wire.py)."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from enum import StrEnum

from orchestrator.core.errors import InputError, ProbeError
from orchestrator.core.log import get_logger
from orchestrator.core.target import Target

log = get_logger()


DEFAULT_RPC_PORT = 50052


# The RPC protocol of the llama.cpp vendored by llama-cpp-python 0.3.36 (ggml/include/ggml-rpc.h).
LLAMA_CPP_PYTHON_0_3_36_PROTOCOL = "7.0.0"


_HEADER_VERSION_RE = re.compile(r"#\s*define\s+RPC_PROTO_(MAJOR|MINOR|PATCH)_VERSION\s+(\d+)")


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
    """What a server reports for one device (GET_DEVICE_MEMORY); the planner's view is `PlannedMemory`."""

    index: int
    free: int
    total: int
    # The device's buffer alignment and largest single buffer (GET_ALIGNMENT, GET_MAX_SIZE): tensors are
    # padded to the one, and ggml splits a weight buffer above the other. None: not asked.
    alignment: int | None = None
    max_size: int | None = None

    # The names of the Java binding's RpcDeviceMemory (freeBytes, totalBytes, usedBytes()).
    @property
    def free_bytes(self) -> int:
        return self.free

    @property
    def total_bytes(self) -> int:
        return self.total

    @property
    def used_bytes(self) -> int:
        return max(0, self.total - self.free)


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
    # The address dialed for `endpoint` when it differs (an SSH forward); None: the endpoint itself.
    dial: str | None = None

    @property
    def target(self) -> Target:
        return Target(self.endpoint, self.dial or self.endpoint)

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

    # The names of the Java binding's RpcMemoryInfo (freeBytes, totalBytes, serverCount).
    @property
    def free_bytes(self) -> int:
        return self.free

    @property
    def total_bytes(self) -> int:
        return self.total


# The drop-in API's names (`orchestrator.query_rpc_memory`, `orchestrator.query_all`) for the same records.
RpcDeviceMemory = DeviceMemory
RpcMemoryInfo = AggregateMemory


class EndpointError(InputError, ProbeError):
    """An endpoint string is not `host:port` (not a network outcome: raised by both APIs); bad input
    wherever it came from (a flag, an inventory, a plan)."""


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


def needed_version(client: ProtocolVersion) -> str:
    """The servers `client` accepts, for messages: `7.0.x`, or `7.x (minor <= 2)`."""
    return f"{client.major}.0.x" if client.minor == 0 else f"{client.major}.x (minor <= {client.minor})"


def check_version(server: ProtocolVersion, expected: ProtocolVersion) -> str | None:
    """None when `expected` (the client) can use `server`, else why not, naming both versions."""
    if expected.accepts(server):
        return None
    return (
        f"the server speaks {server}, this client needs {needed_version(expected)}: "
        "deploy the pinned artifact (rpcfleet deploy)"
    )


def parse_header_version(text: str) -> ProtocolVersion:
    """The RPC_PROTO_*_VERSION defines of `ggml-rpc.h` -> ProtocolVersion."""
    found = {name: int(value) for name, value in _HEADER_VERSION_RE.findall(text)}
    if set(found) != {"MAJOR", "MINOR", "PATCH"}:
        raise ValueError("ggml-rpc.h defines no complete RPC_PROTO_{MAJOR,MINOR,PATCH}_VERSION")
    return ProtocolVersion(found["MAJOR"], found["MINOR"], found["PATCH"])


# The protocol of the pinned binding: what the native client in this process speaks.
CLIENT_PROTOCOL = ProtocolVersion.parse(LLAMA_CPP_PYTHON_0_3_36_PROTOCOL)
