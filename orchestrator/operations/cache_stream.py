"""Warm a node's cache in one stream: every missing file back to back through one OpenSSH session.

asyncssh encrypts in this process, on one event loop for every node (about 170 MB/s in all on 2 cores,
BENCHMARKS.md); the `ssh` binary encrypts in its own process, one per node, so the nodes' links fill in
parallel. One session per node carries all its files: the remote script takes exactly each file's size from
stdin (`dd iflag=fullblock`, whole blocks and then the remainder, never reading past the file), writes it
under a temporary name, checks its size, then reads the file's name (a line after its bytes: the FNV-1a
this process computed as it sent them, so a load need not hash a tensor before it is sent), renames it
and says `ok NAME`. A file is never visible under its
hash name before it is whole; a session cut mid-file leaves only a temporary name (removed by its trap, or
as a stray by the next warm). A `connection: local` host runs the same script in a local shell.

For an `rpc_transport: tcp` host, whose weights cross the RPC link unencrypted anyway, the bytes take a
plain TCP connection instead (`PlainLink`): encrypting them costs this machine and the node's sshd
several CPU seconds per GB, which a load beside the warm needs. The node connects back to a listener
opened for this warm alone, on this machine's address facing the node, and must first present a one-time
token that went to it over the SSH session's stdin (never in a command line); the listener sends nothing
before that and closes once the node is connected. A node that cannot connect back within
PLAIN_ACCEPT_S (a firewall, NAT, no bash) is warmed over the SSH session as before.

Before the first byte the script writes `.warm-wait` in the folder (holding its pid) and says `ready`;
its trap removes the mark at the end. A server built with the `warm-wait` patch (`artifacts.patches`)
asked for a file it lacks waits while the mark's warm lives, so a load may start at `ready` and trail the
warm tensor by tensor.

Connected as root, the script runs as the cache folder's owner (`as_cache_owner`): the server's user, the
system unit's `rpcfleet` or `rpc_run_as`'s. The server must see the mark's process: the hardened unit's
`ProtectProc=invisible` hides every process of another user, root's warm included, and a server that
cannot see it takes the warm for dead and sends each tensor itself. And root never writes in a folder
that user controls: noclobber refuses an existing regular file only, so a link planted there to a device
would be opened and written through by root.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import os
import secrets
import shlex
import shutil
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from orchestrator.artifacts.patches import WARM_WAIT_MARK
from orchestrator.connectors.base import Connection, HeldCommand
from orchestrator.connectors.local import LocalConnection
from orchestrator.connectors.tunnel import ssh_options
from orchestrator.core.errors import HostError
from orchestrator.core.fnv import OFFSET_BASIS, cache_name, fnv1a64
from orchestrator.engine.children import start_child
from orchestrator.inventory.model import Host

if TYPE_CHECKING:
    from orchestrator.operations.cache import WarmItem

BLOCK = 1 << 20  # bytes per dd block and per write into the session
TEMP_PREFIX = ".warm-"
PLAIN_ACCEPT_S = 10.0  # how long a node has to connect back and present its token


@dataclass(frozen=True)
class StreamCommand:
    """How to run the remote script so that this process feeds its stdin: an `ssh` client of its own
    (an SSH host), or a local shell in the connection's home (a `connection: local` host)."""

    argv: tuple[str, ...]
    cwd: Path | None = None
    env: dict[str, str] | None = None


def stream_command(host: Host, conn: Connection, script: str) -> StreamCommand | None:
    """The command for `script` on `conn`'s host; None for an SSH host without the `ssh` binary here."""
    if isinstance(conn, LocalConnection):
        env = None if conn.home == Path.home() else {**os.environ, "HOME": str(conn.home)}
        return StreamCommand(("/bin/bash", "-c", script), conn.home, env)
    if host.connection == "ssh" and shutil.which("ssh") is not None:
        argv = ["ssh", *ssh_options(host, host.ssh_connect_timeout), "--", host.address]
        return StreamCommand((*argv, "exec sh -c " + shlex.quote(script)))
    return None


def plain_link_wanted(host: Host, conn: Connection) -> bool:
    """Whether a warm of `host` tries a plain TCP link: its weights cross the RPC link unencrypted anyway
    (`rpc_transport: tcp`), and its stream would otherwise be an OpenSSH session."""
    return host.rpc_transport == "tcp" and not isinstance(conn, LocalConnection) and host.connection == "ssh"


class PlainLinkRefused(Exception):
    """The node did not connect back with its token in time (or its script ended first)."""


class PlainLink:
    """A listener for one node's warm: the first connection that presents `token` (within
    PLAIN_ACCEPT_S of the start) is the link; any other is closed without a byte sent."""

    def __init__(self, server: asyncio.Server, address: str, port: int, token: str) -> None:
        self.address, self.port, self.token = address, port, token
        self._server = server
        self.accepted: asyncio.Future[asyncio.StreamWriter] = asyncio.get_running_loop().create_future()

    @classmethod
    async def open(cls, toward: str) -> PlainLink:
        """Listen on this machine's address facing `toward` (the route's source address), any port."""
        local = await _local_address_toward(toward)
        token = secrets.token_hex(16)
        holder: list[PlainLink] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            link = holder[0]
            try:
                line = await asyncio.wait_for(reader.readline(), PLAIN_ACCEPT_S)
            except (TimeoutError, OSError, ValueError):
                line = b""
            if not link.accepted.done() and hmac.compare_digest(line.strip(), token.encode()):
                link.accepted.set_result(writer)
                link._server.close()  # one node, one connection: nobody else may connect now
            else:
                writer.close()

        server = await asyncio.start_server(handle, host=local, port=0)
        port = server.sockets[0].getsockname()[1]
        holder.append(cls(server, local, port, token))
        return holder[0]

    def close(self) -> None:
        """Stop listening and drop the connection at once: a stream that ended has flushed and closed
        it already; one cut short must not wait for its buffer (the node then reads an end, and its
        trap removes the partial file)."""
        self._server.close()
        if self.accepted.done() and not self.accepted.cancelled() and self.accepted.exception() is None:
            transport = self.accepted.result().transport
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.fileno() != -1:  # not closed yet (else abort fails in 3.11)
                transport.abort()
        else:
            self.accepted.cancel()


async def _local_address_toward(address: str) -> str:
    """This machine's source address toward `address` (a UDP socket's connect sends nothing)."""
    infos = await asyncio.get_running_loop().getaddrinfo(address, 9, type=socket.SOCK_DGRAM)
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return str(probe.getsockname()[0])


def as_cache_owner(folder: str, body: Sequence[str], shell: str = "sh") -> str:
    """A script that runs `body` (shell lines, the folder in `$1`) in `shell` as the owner of `folder` (a
    shell word; before it exists, of the folder above it, made when missing) when it is started as root,
    else as is. It execs, so the body keeps the pid, stdin and stdout. The body starts in that folder and
    names it relatively: a server user cannot pass a 0700 home above an install dir there (its unit binds
    the install dir in), but works in a folder it owns once inside it. Exit status 1 with a line on
    stderr when the owner cannot be taken on (neither setpriv nor runuser, both util-linux)."""
    inner = "\n".join(['D="$1"', *body])
    return "\n".join(
        [
            f"D={folder}",
            'if [ -d "$D" ]; then o="$D"; r=.; else o="${D%/*}"; r="${D##*/}"; mkdir -p "$o" || exit 1; fi',
            'cd "$o" || exit 1',
            "as=",
            "u=$(stat -c %u .) || exit 1",
            'if [ "$(id -u)" = 0 ] && [ "$u" != 0 ]; then',
            "  if command -v setpriv >/dev/null 2>&1; then",
            '    as="setpriv --reuid=$u --regid=$(stat -c %g .) --clear-groups"',
            "  elif command -v runuser >/dev/null 2>&1; then",
            '    as="runuser -u $(stat -c %U .) --"',
            "  else",
            '    echo "cannot write as the owner of $o (uid $u): no setpriv or runuser (util-linux)" >&2',
            "    exit 1",
            "  fi",
            "fi",
            f'exec $as {shell} -c {shlex.quote(inner)} warm "$r"',
        ]
    )


def stream_script(folder: str, items: Sequence[WarmItem], plain: PlainLink | None = None) -> str:
    """The remote side: for each item in order, exactly its size from stdin into `folder` (a shell word),
    then its name (a line), as the folder's owner (`as_cache_owner`). With `plain`: stdin's first line
    is the token; the rest comes over a connection back to the link (exit status 3 before the mark when
    it cannot be made)."""
    lines = [
        'mkdir -p "$D" || exit 1',
    ]
    if plain is not None:
        lines += [
            "IFS= read -r T || exit 3",
            f"exec 3<>/dev/tcp/{plain.address}/{plain.port} || exit 3",
            """printf '%s\\n' "$T" >&3 || exit 3""",
            "exec 0<&3 3<&-",
        ]
    lines += [
        "tmp=",
        f"M={WARM_WAIT_MARK}",
        # At the end: the partial file, and the mark if it is still this warm's.
        'end() { [ -z "$tmp" ] || rm -f "$tmp"',
        '  [ "$(cat "$D/$M" 2>/dev/null)" != $$ ] || rm -f "$D/$M"; }',
        "trap end EXIT",
        "trap 'exit 1' HUP INT TERM PIPE",
        # The mark, a fresh file (noclobber), then `ready`: a load may start now.
        'rm -f "$D/$M" && (set -C; echo $$ > "$D/$M") || exit 1',
        "echo ready",
        "take() {",
        f'  tmp="$D/{TEMP_PREFIX}$1.$$"; n=$(($2 / {BLOCK})); r=$(($2 % {BLOCK}))',
        # A fresh file (noclobber), written as the folder's owner: a link planted there leads
        # nowhere that user could not write anyway (noclobber alone opens a link to a device).
        '  rm -f "$tmp" || exit 1',
        '  ( set -C; exec > "$tmp" || exit 1',
        f'    [ "$n" -eq 0 ] || dd bs={BLOCK} count="$n" iflag=fullblock status=none || exit 1',
        '    [ "$r" -eq 0 ] || dd bs="$r" count=1 iflag=fullblock status=none ) \\',
        '    || { df -k "$D" >&2; exit 1; }',
        '  [ "$(wc -c < "$tmp")" -eq "$2" ] || { echo "short input for file $1" >&2; exit 1; }',
        '  IFS= read -r name || { echo "no name for file $1" >&2; exit 1; }',
        '  case "$name" in ????????????????) ;; *) echo "bad name for file $1" >&2; exit 1;; esac',
        '  case "$name" in *[!0-9a-f]*) echo "bad name for file $1" >&2; exit 1;; esac',
        '  mv -f "$tmp" "$D/$name" && tmp= && echo "ok $name"',
        "}",
    ]
    lines += [f"take {k} {int(i.size)}" for k, i in enumerate(items)]
    return as_cache_owner(folder, lines, "bash" if plain is not None else "sh")


class Remote(Protocol):
    """The script's side of a stream: a child process here (`ssh`, or a local shell), or a command held
    on the connection already open (its stderr joined to its stdout: the plain link carries the bytes)."""

    def input(self) -> asyncio.StreamWriter | None:
        """Where the bytes go without a plain link (None: this remote needs one)."""
        ...

    async def readline(self) -> str | None:
        """The script's next line of output; None once it has ended."""
        ...

    async def finish(self) -> tuple[int | None, str]:
        """Its exit status (None: not known) and what it said on stderr."""
        ...

    async def stop(self) -> None: ...


class ChildRemote:
    """A child process here: `ssh` to the node, or a local shell (`stream_command`)."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdin is not None and process.stdout is not None and process.stderr is not None
        self.process, self.stdin, self.stdout = process, process.stdin, process.stdout
        self.errors = asyncio.ensure_future(process.stderr.read())

    @classmethod
    async def start(cls, command: StreamCommand) -> ChildRemote:
        process = await start_child(
            command.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=command.cwd,
            env=command.env,
            start_new_session=True,  # a Ctrl-C at the terminal reaches rpcfleet, which stops between files
        )
        return cls(process)

    def input(self) -> asyncio.StreamWriter | None:
        return self.stdin

    async def readline(self) -> str | None:
        line = await self.stdout.readline()
        return line.decode(errors="replace").strip() if line else None

    async def finish(self) -> tuple[int | None, str]:
        status = await self.process.wait()
        return status, (await self.errors).decode(errors="replace")

    async def stop(self) -> None:
        self.errors.cancel()
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        await self.process.wait()


class HeldRemote:
    """A command held on the connection already open (`Connection.hold`)."""

    LINE_WAIT_S = 3600.0  # one file over a slow link may take long: the plain link's own end stops it

    def __init__(self, held: HeldCommand) -> None:
        self.held = held

    def input(self) -> asyncio.StreamWriter | None:
        return None

    async def give_token(self, token: str) -> None:
        await self.held.send(token + "\n")

    async def readline(self) -> str | None:
        line = await self.held.readline(self.LINE_WAIT_S)
        return None if line is None else line.strip()

    async def finish(self) -> tuple[int | None, str]:
        return None, ""

    async def stop(self) -> None:
        await self.held.release()


async def stream_items(
    host: Host,
    remote: Remote,
    items: Sequence[WarmItem],
    *,
    stopping: Callable[[], bool],
    on_file: Callable[[WarmItem], None],
    on_ready: Callable[[], None] = lambda: None,
    plain: PlainLink | None = None,
) -> list[WarmItem]:
    """Send `items` to the node's cache through `remote` (running `stream_script` for them, with
    `plain` if given: then the bytes go over it, and PlainLinkRefused says the node did not connect
    back); returns the items now there, in order, each with its name (an item without one is named by
    the FNV-1a of its bytes, computed as they are sent); `on_ready` once the folder is marked.
    Between files, `stopping()` ends the stream early (the files done stay). A failure is a HostError
    naming the file (a full disk says so); cancelling kills the session (no partial file keeps a hash
    name). The bytes go through in blocks: no tensor is held in memory."""
    done: list[WarmItem] = []
    sent: list[WarmItem] = []
    said: list[str] = []  # what the script printed besides its progress (a held command's stderr)
    stopped = False
    ended = asyncio.Event()

    async def sink() -> asyncio.StreamWriter:
        """Where the bytes go: the session's stdin, or the plain link once the node has connected."""
        if plain is None:
            out = remote.input()
            assert out is not None, "a held command takes its bytes over a plain link"
            return out
        assert isinstance(remote, HeldRemote), "a plain link's token goes over the open connection"
        await remote.give_token(plain.token)
        end: asyncio.Future[Any] = asyncio.ensure_future(ended.wait())
        accepted: asyncio.Future[Any] = plain.accepted
        try:
            await asyncio.wait({accepted, end}, timeout=PLAIN_ACCEPT_S, return_when="FIRST_COMPLETED")
        finally:
            end.cancel()
        if not plain.accepted.done():
            raise PlainLinkRefused(host.name)
        return plain.accepted.result()

    async def feed() -> None:
        nonlocal stopped
        out = await sink()
        try:
            for item in items:
                if stopping():
                    stopped = True  # the remote side then finds its input ended: not a failure
                    break
                h = OFFSET_BASIS
                with item.path.open("rb") as fh:
                    fh.seek(item.offset)
                    left = item.size
                    while left > 0:
                        chunk = fh.read(min(BLOCK, left))
                        if not chunk:
                            raise HostError(f"{item.path} ends inside a tensor", host=host.name)
                        out.write(chunk)
                        if item.name is None:
                            h = fnv1a64(chunk, h)
                        await out.drain()
                        left -= len(chunk)
                named = item if item.name is not None else dataclasses.replace(item, name=cache_name(h))
                out.write(f"{named.name}\n".encode())
                sent.append(named)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the remote side stopped: its exit status and stderr say why
        finally:
            out.close()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                await out.wait_closed()

    async def collect() -> None:
        while (line := await remote.readline()) is not None:
            word, _, name = line.partition(" ")
            if word == "ready":
                on_ready()
            elif word == "ok" and len(done) < len(sent) and sent[len(done)].name == name:
                done.append(sent[len(done)])
                on_file(done[-1])
            elif line:
                said.append(line)
        ended.set()

    tasks: list[asyncio.Future[Any]] = [asyncio.ensure_future(feed()), asyncio.ensure_future(collect())]
    try:
        await asyncio.gather(*tasks)
        status, stderr = await remote.finish()
    except BaseException as exc:
        for task in tasks:
            task.cancel()
        if plain is not None:
            plain.close()  # the node then reads an end at once, and its trap removes the partial file
        await remote.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        if isinstance(exc, OSError):  # the model file here could not be read
            raise HostError(f"cannot read the tensors to warm: {exc}", host=host.name) from None
        raise
    else:
        if status is None:
            await remote.stop()
    if plain is not None and not plain.accepted.done():  # the script ended before connecting back
        raise PlainLinkRefused(host.name)
    stderr = "\n".join([*said, stderr]).strip()
    if (status not in (0, None) or len(done) < len(items)) and not (stopped and len(done) == len(sent)):
        failed = items[min(len(done), len(items) - 1)]
        full = "No space left" in stderr
        why = "the node's disk is full" if full else (f"exit status {status}" if status else "it stopped")
        raise HostError(
            f"warming the tensor cache failed at {failed.name or 'a file'} ({failed.size} bytes): {why}",
            host=host.name,
            stderr=stderr,
            hint="free space, lower rpc_cache_max or run `rpcfleet cache prune`" if full else None,
        )
    return done


async def stream_to_cache(
    host: Host,
    conn: Connection,
    folder: str,
    items: Sequence[WarmItem],
    *,
    stopping: Callable[[], bool],
    on_file: Callable[[WarmItem], None],
    on_ready: Callable[[], None] = lambda: None,
) -> str | None:
    """`items` into the node's cache `folder` in one stream: over a plain TCP link where
    `plain_link_wanted` (and the node connects back), else over the session itself. Returns how the
    bytes went ("plain tcp", "ssh", "local shell"); None: no stream can be made here (an SSH host
    without the `ssh` binary), nothing was sent."""
    if plain_link_wanted(host, conn):
        link = await PlainLink.open(host.address)
        try:
            # On the connection already open: the session carries only the token and the progress.
            script = "exec 2>&1\n" + stream_script(folder, items, link)
            held = HeldRemote(await conn.hold("exec bash -c " + shlex.quote(script)))
            await stream_items(
                host, held, items, stopping=stopping, on_file=on_file, on_ready=on_ready, plain=link
            )
            return "plain tcp"
        except PlainLinkRefused:
            pass  # a firewall, NAT or no bash on the node: the session carries the bytes
        finally:
            link.close()
    command = stream_command(host, conn, stream_script(folder, items))
    if command is None:
        return None
    child = await ChildRemote.start(command)
    await stream_items(host, child, items, stopping=stopping, on_file=on_file, on_ready=on_ready)
    return "local shell" if isinstance(conn, LocalConnection) else "ssh"
