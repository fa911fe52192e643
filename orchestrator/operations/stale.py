"""Stale clients: a server connection whose client is proven gone, and closing exactly that connection.

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

Closing it (`close_stale`) needs no rights on the node: a SYN from the same address and port to the
server hits its established connection, which answers with a challenge ACK (RFC 5961); this
controller, having no socket for that ACK, answers with a reset carrying exactly the sequence number the
node expects, and the node drops the connection: the server's read fails and it serves the next client.
The bind itself is a last guard: it fails if any socket took that port since the proof. A TIME_WAIT
socket of another connection on that port makes it fail too: then the same SYN goes out through a raw
socket (root), and the kernel answers the challenge ACK with the reset as before (a live socket with the
connection's own 4-tuple would take that ACK instead, so a live client is never reset). Should the node
keep the connection (a middlebox eats the SYN), `ss -K` on the node for that 4-tuple and inode (root and
CONFIG_INET_DIAG_DESTROY) is tried. Either way, the node is read again to say what was closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import os
import shlex
import socket
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from orchestrator.connectors.base import Connection
from orchestrator.connectors.nodescript import NodeScript, run_script
from orchestrator.core.errors import ServiceScriptError
from orchestrator.engine.executor import DEFAULT_FORKS, HostContext, Session, StepOutcome
from orchestrator.facts.base import NOT_FOUND, Fact
from orchestrator.inventory.model import Host

_CONNTRACK = Path("/proc/net/nf_conntrack")
_CONNTRACK_MODULE = Path("/sys/module/nf_conntrack")
_RESET_WAIT = 0.5  # seconds for the SYN, the challenge ACK and our reset to cross


@dataclass(frozen=True)
class ServerConnection:
    """One established connection to the server's port, as the node sees it."""

    local: str  # the server's end, address:port
    peer: str  # the client's end, address:port
    inode: int | None = None  # the node's socket inode: the same connection, not a reused 4-tuple

    @property
    def peer_address(self) -> str:
        return split_endpoint(self.peer)[0]

    @property
    def peer_port(self) -> int:
        return split_endpoint(self.peer)[1]

    def ss_filter(self) -> str:
        """The `ss` filter for exactly this 4-tuple."""
        local, lport = split_endpoint(self.local)
        peer, pport = split_endpoint(self.peer)
        return f"( src {local} and sport = :{lport} and dst {peer} and dport = :{pport} )"


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
    """Established connections to local port `port`, with both ends and the socket inode (None: no `ss`)."""

    port: int
    name: ClassVar[str] = "rpc_connections"

    def command(self) -> str:
        port = int(self.port)  # an int, so nothing else can reach the shell
        return (
            f"command -v ss >/dev/null 2>&1 || exit {NOT_FOUND}; "
            f"ss -Htne state established '( sport = :{port} )'"
        )

    def parse(self, stdout: str, stderr: str, exit_status: int) -> tuple[ServerConnection, ...] | None:
        if exit_status != 0:
            return None
        return parse_connections(stdout)


def parse_connections(text: str) -> tuple[ServerConnection, ...]:
    """Lines of `ss -Htne state established` (Recv-Q Send-Q Local Peer ... ino:N ...)."""
    found = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 4 or not fields[0].isdigit() or not fields[1].isdigit():
            continue
        inode = next((int(f[4:]) for f in fields[4:] if f.startswith("ino:") and f[4:].isdigit()), None)
        try:
            split_endpoint(fields[2]), split_endpoint(fields[3])
        except ValueError:
            continue
        found.append(ServerConnection(fields[2], fields[3], inode))
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


def _reset_from_here(connection: ServerConnection, target: tuple[str, int]) -> str:
    """Send one SYN from the stale connection's own address and port to `target` (the server's
    endpoint); see the module's docstring. Returns "" or why it was not sent."""
    address, port = connection.peer_address, connection.peer_port
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # No SO_REUSEADDR: the bind fails if any socket of this machine took the port since the proof.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        try:
            sock.bind((address, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or holds_port(_local_sockets(), address, port):
                raise
            return _raw_syn((address, port), target)  # only a TIME_WAIT socket holds the port
        sock.setblocking(False)
        code = sock.connect_ex(target)
        if code not in (0, errno.EINPROGRESS):
            return f"connect: {os.strerror(code)}"
        time.sleep(_RESET_WAIT)
        return ""
    except OSError as exc:
        return f"{address}:{port}: {exc.strerror}"
    finally:
        # The kernel retries the SYN at once after its reset, so the server (free again) may have
        # accepted us: SO_LINGER 0 resets that connection too, as abandoned probes are.
        sock.close()


def _raw_syn(source: tuple[str, int], target: tuple[str, int]) -> str:
    """`_reset_from_here`'s SYN built by hand and sent through a raw socket (needs CAP_NET_RAW)."""
    (address, port), (server, server_port) = source, target
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    seq = int.from_bytes(os.urandom(4), "big")
    # TCP header: ports, seq, ack 0, data offset 5 words, SYN, window, checksum (filled below), urgent 0
    segment = struct.pack("!HHIIBBHHH", port, server_port, seq, 0, 5 << 4, 0x02, 64240, 0, 0)
    ends = socket.inet_pton(family, address) + socket.inet_pton(family, server)
    pseudo = (
        ends + struct.pack("!BBH", 0, socket.IPPROTO_TCP, len(segment))
        if family == socket.AF_INET
        else ends + struct.pack("!I3xB", len(segment), socket.IPPROTO_TCP)
    )
    segment = segment[:16] + struct.pack("!H", internet_checksum(pseudo + segment)) + segment[18:]
    try:
        with socket.socket(family, socket.SOCK_RAW, socket.IPPROTO_TCP) as raw:
            raw.bind((address, 0))  # the IP header's source: the stale connection's address
            raw.sendto(segment, (server, 0))
    except OSError as exc:
        return f"{address}:{port}: a TIME_WAIT socket holds the port and a raw SYN failed: {exc.strerror}"
    time.sleep(_RESET_WAIT)
    return ""


def internet_checksum(data: bytes) -> int:
    """RFC 1071: the ones' complement of the ones' complement sum of the 16-bit words."""
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _still_there_script(port: int, connections: Sequence[ServerConnection], kill: bool) -> str:
    """Print the connections still on the node (`@left <peer>`); with `kill`, `ss -K` each first, only
    while its inode is the one seen (never a new connection on a reused 4-tuple)."""
    lines = []
    for c in connections:
        filt = shlex.quote(f"sport = :{int(port)} and {c.ss_filter()}")
        inode = f"ino:{int(c.inode)} " if c.inode is not None else ""
        seen = f"ss -Htne state established {filt} 2>/dev/null | grep -q -- {shlex.quote(inode or ' ')}"
        if kill and inode:
            lines.append(f"if {seen}; then ss -K -Htn state established {filt} >/dev/null 2>&1; fi")
        lines.append(f"if {seen}; then echo {shlex.quote('@left ' + c.peer)}; fi")
    return "\n".join(lines) or ":"


@dataclass(frozen=True)
class Closed:
    """What `close_stale` did: the peers closed and those left (with why)."""

    closed: tuple[str, ...]
    left: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()


async def close_stale(conn: Connection, host: Host, stale: Sequence[ServerConnection]) -> Closed:
    """Close the server's connections in `stale` (proven gone by `find_stale`): a reset from here, then
    `ss -K` on the node for those it keeps; the node is read again for the result."""
    if not stale:
        return Closed(())
    target_host, _, target_port = host.endpoint.rpartition(":")
    problems = []
    for c in stale:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                target_host.strip("[]"), int(target_port), type=socket.SOCK_STREAM
            )
            target = infos[0][4][:2]
        except (OSError, ValueError) as exc:
            problems.append(f"{host.endpoint}: {exc}")
            continue
        why = await asyncio.to_thread(_reset_from_here, c, (str(target[0]), int(target[1])))
        if why:
            problems.append(why)
    left = await _left(conn, host, stale, kill=False)
    if left:
        left = await _left(conn, host, [c for c in stale if c.peer in left], kill=True)
        if left:
            problems.append("ss -K did not close it (needs root and CONFIG_INET_DIAG_DESTROY on the node)")
    return Closed(tuple(c.peer for c in stale if c.peer not in left), left, tuple(problems))


async def _left(
    conn: Connection, host: Host, connections: Sequence[ServerConnection], *, kill: bool
) -> tuple[str, ...]:
    text = _still_there_script(host.rpc_port, connections, kill)
    script = NodeScript(
        "stale-close" if kill else "stale-left",
        text,
        15,
        "closing stale connections" if kill else "reading the server's connections",
        ServiceScriptError,
        ok_exits=None,  # only its `@left` lines say anything
    )
    return (await run_script(conn, script)).values("left")


async def release_stale(conn: Connection, host: Host) -> Closed:
    """Find the host's stale connections and close them (nothing when none is proven stale)."""
    return await close_stale(conn, host, await find_stale(conn, host))


async def release_stale_step(ctx: HostContext) -> StepOutcome[Closed]:
    """The executor step of `release_stale` (no node lock: it closes only a connection of nobody's)."""
    closed = await release_stale(await ctx.connection(), ctx.host)
    summary = f"closed the stale connection of {', '.join(closed.closed)}" if closed.closed else "none stale"
    if closed.left:
        summary += f"; still held: {', '.join(closed.left)} ({'; '.join(closed.problems)})"
    return StepOutcome(closed, bool(closed.closed), summary)


async def release_stale_on(
    hosts: Sequence[Host], *, forks: int | None = None, session: Session | None = None
) -> list[str]:
    """`release_stale` on every host (an unreachable one is skipped: nothing is proven there); returns
    `host peer` for each connection closed. `session`: the command's (its connections), else one here."""
    if session is not None:
        run = await session.run(hosts, release_stale_step, name="release_stale")
    else:
        async with Session(forks=forks or DEFAULT_FORKS) as own:
            run = await own.run(hosts, release_stale_step, name="release_stale")
    return [f"{r.host.name} {peer}" for r in run.results if r.value is not None for peer in r.value.closed]
