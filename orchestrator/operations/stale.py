"""Stale clients: a server connection whose client is proven gone (a read-only hint for `status`).

A server whose client vanished without a FIN (its link was cut, the client process died meanwhile, then
the link came back) keeps the dead connection while it waits for the next command, and serves nobody
else: `ss` on the node shows an established client, so it looks busy forever. Nothing is ever guessed
here: a connection is *stale* only on positive proof that its client is gone, every condition read on
this controller after the node's connections were read (a live client's socket exists before the node
sees its connection and until it closes):

1. the peer address is one of this controller's own addresses (in its network namespace), not loopback
   (a loopback peer is a process on the node, or sshd's forward of `rpc_transport: ssh`);
2. no TCP socket of this controller has the peer address and port as its own (`/proc/net/tcp`, `tcp6`;
   one bound to the wildcard address with that port counts too): a socket there, whatever its
   destination, counts as a live client, except in TIME_WAIT, which has closed both ways (a busy
   controller's many short connections leave those on any port, to any destination);
3. no address translation could hide the client behind this machine: conntrack is not in the kernel, or
   its table is readable and has no translated entry whose reply goes to that address and port (a
   container behind this machine's NAT connects from its own namespace, invisible to 2).

Anything unreadable (not root for the conntrack table, no /proc) proves nothing: the server stays busy.

This is a read-only hint (`status` shows `stale`): nothing here closes a connection, and a stale peer
still counts as a client to every busy check (only `--force` overrides one). The servers rpcfleet builds
free themselves: the `keepalive` patch (`artifacts.patches`) has the node's kernel end a connection whose
peer stopped answering within about 30 s, whichever controller, laptop or NAT the client was behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from orchestrator.connectors.base import Connection
from orchestrator.facts.base import NOT_FOUND, Fact
from orchestrator.inventory.model import Host

_CONNTRACK = Path("/proc/net/nf_conntrack")
_CONNTRACK_MODULE = Path("/sys/module/nf_conntrack")


@dataclass(frozen=True)
class ServerConnection:
    """One established connection to the server's port, as the node sees it."""

    local: str  # the server's end, address:port
    peer: str  # the client's end, address:port

    @property
    def peer_address(self) -> str:
        return split_endpoint(self.peer)[0]

    @property
    def peer_port(self) -> int:
        return split_endpoint(self.peer)[1]


def split_endpoint(text: str) -> tuple[str, int]:
    """`10.0.0.1:42`, `[::1]:42`, `[::ffff:10.0.0.1]:42` -> (address, port); a v4-mapped address is v4."""
    address, _, port = text.rpartition(":")
    address = address.strip("[]").split("%", 1)[0]
    with contextlib.suppress(ValueError):
        parsed = ipaddress.ip_address(address)
        if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
            address = str(parsed.ipv4_mapped)
    return address, int(port)


@dataclass(frozen=True)
class ServerConnectionsFact(Fact[tuple[ServerConnection, ...] | None]):
    """Established connections to local port `port`, with both ends (None: no `ss`)."""

    port: int
    name: ClassVar[str] = "rpc_connections"

    def command(self) -> str:
        port = int(self.port)  # an int, so nothing else can reach the shell
        return (
            f"command -v ss >/dev/null 2>&1 || exit {NOT_FOUND}; "
            f"ss -Htn state established '( sport = :{port} )'"
        )

    def parse(self, stdout: str, stderr: str, exit_status: int) -> tuple[ServerConnection, ...] | None:
        if exit_status != 0:
            return None
        return parse_connections(stdout)


def parse_connections(text: str) -> tuple[ServerConnection, ...]:
    """Lines of `ss -Htn state established` (Recv-Q Send-Q Local Peer ...)."""
    found = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 4 or not fields[0].isdigit() or not fields[1].isdigit():
            continue
        try:
            split_endpoint(fields[2]), split_endpoint(fields[3])
        except ValueError:
            continue
        found.append(ServerConnection(fields[2], fields[3]))
    return tuple(found)


@dataclass(frozen=True)
class LocalView:
    """What this controller knows about its own sockets, read once (`read_local_view`)."""

    addresses: frozenset[str]  # every address of this network namespace, loopback excluded
    sockets: frozenset[tuple[str, int]] | None  # (address, port) of every TCP socket here (None: unreadable)
    translated: frozenset[tuple[str, int]] | None  # (address, port) replies of NAT entries (None: unknown)
    why_unknown: str = ""  # why `sockets` or `translated` could not be read

    def proof(self, connection: ServerConnection) -> str | None:
        """None when the client of `connection` is proven gone, else why it is not (the proof's rule)."""
        try:
            address, port = connection.peer_address, connection.peer_port
            parsed = ipaddress.ip_address(address)
        except ValueError:
            return f"peer {connection.peer} is not an address"
        if parsed.is_loopback:
            return "a loopback peer is on the node itself"
        if address not in self.addresses:
            return f"{address} is not an address of this controller"
        if self.sockets is None or self.translated is None:
            return self.why_unknown or "this controller's sockets could not be read"
        if holds_port(self.sockets, address, port):
            return f"{address}:{port} is in use on this controller"
        if (address, port) in self.translated:
            return f"{address}:{port} is translated (NAT) for another client"
        return None


def holds_port(sockets: frozenset[tuple[str, int]], address: str, port: int) -> bool:
    """Whether one of `sockets` has `address` and `port`, or that port on the wildcard address."""
    return bool({(address, port), ("0.0.0.0", port), ("::", port)} & sockets)


def _local_addresses() -> frozenset[str]:
    import psutil

    found = set()
    for addresses in psutil.net_if_addrs().values():
        for entry in addresses:
            if entry.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            text = entry.address.split("%", 1)[0]
            with contextlib.suppress(ValueError):
                if not ipaddress.ip_address(text).is_loopback:
                    found.add(text)
    return frozenset(found)


def _proc_address(text: str) -> str:
    """An address of /proc/net/tcp{,6}: 32-bit words in host order (little endian here), as hex."""
    words = b"".join(struct.pack("<I", int(text[i : i + 8], 16)) for i in range(0, len(text), 8))
    address = ipaddress.ip_address(words)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


_TIME_WAIT = "06"  # the `st` column of /proc/net/tcp (include/net/tcp_states.h)


def _local_sockets(proc: Path = Path("/proc/net")) -> frozenset[tuple[str, int]]:
    """(address, port) of every TCP socket of this network namespace that may still be a client (v4 and
    v6, any user, any state but TIME_WAIT)."""
    found = set()
    for name in ("tcp", "tcp6"):
        path = proc / name
        if not path.exists() and name == "tcp6":  # a kernel without IPv6
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) > 3 and fields[3] != _TIME_WAIT:
                address, port = fields[1].rsplit(":", 1)
                found.add((_proc_address(address), int(port, 16)))
    return frozenset(found)


def parse_conntrack(text: str) -> frozenset[tuple[str, int]]:
    """(address, port) of the reply destination of every translated TCP entry of `nf_conntrack`: a
    client behind this machine's NAT, seen by the node as that address and port."""
    found = set()
    for line in text.splitlines():
        fields = line.split()
        if "tcp" not in fields[:4]:
            continue
        tuples: list[dict[str, str]] = [{}, {}]
        which = -1
        for f in fields:
            key, _, value = f.partition("=")
            if key == "src":
                which += 1
            if 0 <= which < 2 and key in ("src", "dst", "sport", "dport"):
                tuples[which][key] = value
        original, reply = tuples
        if len(original) < 4 or len(reply) < 4:
            continue
        untranslated = (
            original["src"] == reply["dst"]
            and original["sport"] == reply["dport"]
            and original["dst"] == reply["src"]
            and original["dport"] == reply["sport"]
        )
        if not untranslated:
            found.add((split_endpoint(f"{reply['dst']}:{reply['dport']}")[0], int(reply["dport"])))
    return frozenset(found)


def read_local_view(
    conntrack: Path = _CONNTRACK, module: Path = _CONNTRACK_MODULE, proc: Path = Path("/proc/net")
) -> LocalView:
    """This controller's addresses, TCP sockets and NAT replies, read now (after the node's)."""
    addresses = _local_addresses()
    try:
        sockets: frozenset[tuple[str, int]] | None = _local_sockets(proc)
        why = ""
    except (OSError, ValueError, IndexError) as exc:
        sockets, why = None, f"this controller's sockets are unreadable: {exc}"
    translated: frozenset[tuple[str, int]] | None
    try:
        translated = parse_conntrack(conntrack.read_text())
    except FileNotFoundError:
        if module.exists():  # conntrack is in the kernel, its table is not in procfs: NAT unknown
            translated, why = None, why or "conntrack is loaded but its table is not readable"
        else:
            translated = frozenset()  # no conntrack: no NAT on this machine
    except OSError as exc:
        translated, why = None, why or f"the conntrack table is unreadable ({exc.strerror}; needs root)"
    return LocalView(addresses, sockets, translated, why)


def stale_connections(
    connections: Iterable[ServerConnection], view: LocalView
) -> tuple[ServerConnection, ...]:
    """Pure: the connections whose client is proven gone (`LocalView.proof`)."""
    return tuple(c for c in connections if view.proof(c) is None)


async def read_connections(conn: Connection, host: Host) -> tuple[ServerConnection, ...]:
    """The established connections to the host's server, read on the node (empty when unreadable)."""
    fact = ServerConnectionsFact(host.rpc_port)
    result = await conn.run(fact.command(), timeout=15)
    return fact.parse(result.stdout, result.stderr, result.exit_status) or ()


async def find_stale(conn: Connection, host: Host) -> tuple[ServerConnection, ...]:
    """The host's server connections whose client is proven gone: the node is read first, then this
    controller (a live client's socket outlives the node's read)."""
    connections = await read_connections(conn, host)
    if not connections:
        return ()
    return stale_connections(connections, await asyncio.to_thread(read_local_view))
