"""The RPC wire format: command numbers, request encoders, reply decoders (pure)."""

from __future__ import annotations

import struct

from orchestrator.rpc.records import DeviceMemory, Outcome, ProtocolVersion

CMD_GET_ALIGNMENT = 1


CMD_GET_MAX_SIZE = 2


# GET_ALIGNMENT / GET_MAX_SIZE reply: one u64 (the device's buffer alignment, its largest buffer)
BUFFER_LIMIT_REPLY_SIZE = 8


CMD_GET_DEVICE_MEMORY = 11


CMD_HELLO = 14  # fixed forever by the protocol


CMD_DEVICE_COUNT = 15


CONN_CAPS_SIZE = 24


HELLO_REQUEST_SIZE = CONN_CAPS_SIZE


HELLO_REPLY_SIZE = 4 + CONN_CAPS_SIZE  # major, minor, patch, pad, conn_caps


# Servers before the transport capabilities (protocol < 3) take an empty HELLO and answer 3 bytes; they
# close the connection on the current one.
LEGACY_HELLO_REPLY_SIZE = 3


DEVICE_COUNT_REPLY_SIZE = 4


DEVICE_MEMORY_REQUEST_SIZE = 4


DEVICE_MEMORY_REPLY_SIZE = 16


SIZE_HEADER = 8


# No real server has anywhere near this many devices; a larger count is garbage, not a fleet.
MAX_DEVICES = 256


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


def legacy_hello_request() -> bytes:
    return encode_request(CMD_HELLO)


def device_count_request() -> bytes:
    return encode_request(CMD_DEVICE_COUNT)


def device_memory_request(index: int) -> bytes:
    return encode_request(CMD_GET_DEVICE_MEMORY, struct.pack("<I", index))


def alignment_request(index: int) -> bytes:
    return encode_request(CMD_GET_ALIGNMENT, struct.pack("<I", index))


def max_size_request(index: int) -> bytes:
    return encode_request(CMD_GET_MAX_SIZE, struct.pack("<I", index))


def decode_buffer_limit(reply: bytes, what: str) -> int:
    """A whole GET_ALIGNMENT or GET_MAX_SIZE reply (size header + u64) -> the value."""
    (value,) = struct.unpack("<Q", _payload(reply, BUFFER_LIMIT_REPLY_SIZE, what))
    return int(value)


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


def decode_legacy_hello(reply: bytes) -> ProtocolVersion:
    """A whole legacy HELLO reply (size header + major, minor, patch) -> the server's protocol version."""
    payload = _payload(reply, LEGACY_HELLO_REPLY_SIZE, "HELLO")
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
