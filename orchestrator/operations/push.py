"""`model push`, the controller's side: a GGUF copied to every node's model folder through a chain of nodes.

The controller sends each byte once, to the chain's first node; each node writes the bytes it lacks under
NAME.partial and forwards every byte to the next (`operations.push_node`'s receiver). Nodes hold no
credentials for each other: over the SSH session it already has to each node, the controller starts that
node's receiver and gives it a one-time token (stdin, never a command line); the receiver listens on a
port of its own (ephemeral unless `port` is given) and takes only the connection that shows its token
within ACCEPT_S, then closes its listener. The controller tells each node its successor's address, port
and token, then connects to the first one.

Before any byte: each node says what it has (the final file, checked; or how much of NAME.partial checks
against the controller's chunk hashes) and whether its disk has room for the rest; the stream starts at
the lowest resume point among the nodes that need bytes, and each node writes only past its own. After
it: each node hashes its new chunks (the static `fnvchunks` tool), renames NAME.partial to NAME only when
every chunk matches, and says `done`. A cut stream leaves NAME.partial for the next push to resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from orchestrator.connectors.base import Connection, HeldCommand, shell_path
from orchestrator.core.errors import HostError
from orchestrator.core.units import format_size
from orchestrator.inventory.model import Host
from orchestrator.operations.push_node import (
    ACCEPT_S,
    IDLE_S,
    chunks_tool,
    hashes_line,
    read_said,
    receiver_command,
    tool_name,
)

BLOCK = 1 << 20  # bytes per write toward the first node
CHECK_WAIT_S = 3600.0  # a node hashing what it has of a big file may take long
STREAM_WAIT_S = 3600.0  # one line of a receiver during the stream (its own idle limit ends a cut link)


def model_folder(host: Host) -> str:
    """Where `host` keeps pushed models: `model_path_on_nodes` (where a warm reads them), else `models`
    under its install dir."""
    return host.model_path_on_nodes or f"{host.install_dir.rstrip('/')}/models"


def destination(host: Host, model: Path) -> str:
    """The pushed file's path on the node, as the inventory writes it (for messages)."""
    return str(PurePosixPath(model_folder(host).rstrip("/") or "/") / model.name)


@dataclass(frozen=True)
class Pushed:
    """One node's outcome: `present` (nothing sent: the file was there, checked) or `pushed`."""

    host: str
    path: str
    state: str
    resumed_from: int = 0  # bytes of NAME.partial kept from an earlier push
    written: int = 0  # bytes written by this push


@dataclass(frozen=True)
class PushRun:
    """Every node's outcome (a Pushed, or the HostError that stopped it) and what this machine sent."""

    outcomes: dict[str, Pushed | HostError]
    sent: int  # bytes this machine sent (the stream's bytes, once)
    started_at: int  # the stream's first offset (0: nothing of it was on any node)
    seconds: float


class _Node:
    """One receiver while it runs: its host, its held command, what it said."""

    def __init__(self, host: Host, path: str, held: HeldCommand) -> None:
        self.host, self.path, self.held = host, path, held
        self.token = secrets.token_hex(16)
        self.resume = 0
        self.port: int | None = None
        self.said: list[str] = []

    async def line(self, wait: float) -> str | None:
        line = await self.held.readline(wait)
        if line is not None:
            self.said.append(line)
        return line


async def ensure_tool(conn: Connection, host: Host) -> str:
    """Upload the static chunk-hash tool to the node once (per version); its path there (a shell word)."""
    folder = f"{host.install_dir.rstrip('/')}/tools/{tool_name()}"
    remote = f"{shell_path(folder)}/fnvchunks"
    if (await conn.run(f"test -x {remote}", timeout=30)).ok:
        return remote
    await conn.run(f"mkdir -p {shell_path(folder)}", timeout=30, check=True)
    local = await asyncio.to_thread(chunks_tool)
    await conn.put(local, f"{folder}/.fnvchunks.tmp")
    tmp = f"{shell_path(folder)}/.fnvchunks.tmp"
    await conn.run(
        f"chmod 755 {tmp} && mv -f {tmp} {remote}",
        timeout=30,
        check=True,
    )
    return remote


def _failure(node: _Node, word: str, args: Sequence[str]) -> HostError:
    """Pure: the error for a receiver's word that ends its part before the stream."""
    if word == "full":
        need, avail = int(args[0]), int(args[1])
        return HostError(
            f"cannot push to {node.path}: the node's disk is full: {format_size(need)} ({need} bytes) "
            f"needed, {format_size(avail)} ({avail} bytes) free",
            host=node.host.name,
            hint="free space on the node, or set model_path_on_nodes to a folder on a larger disk",
        )
    if word == "busy":
        return HostError(f"another push is writing {node.path}.partial", host=node.host.name)
    if word == "nopython":
        return HostError(
            "model push needs python3 on the node (its receiver is a Python program)",
            host=node.host.name,
            hint="install python3 there (apt-get install python3-minimal)",
        )
    text = " ".join(args) or "; ".join(node.said[-3:]) or "the receiver ended without a word"
    return HostError(f"cannot push to {node.path}: {text}", host=node.host.name)


async def _start(conn: Connection, host: Host, model: Path, size: int, chunk: int, port: int) -> _Node:
    tool = await ensure_tool(conn, host)
    path = destination(host, model)
    held = await conn.hold(receiver_command(shell_path(path), size, chunk, tool, port))
    return _Node(host, path, held)


async def _check(node: _Node, hashes: Sequence[str]) -> Pushed | HostError | None:
    """Token and hashes in; the node's answer out: Pushed (present), an error, or None (it waits)."""
    try:
        return await _checked(node, hashes)
    except HostError as exc:  # the session lost, or no answer in time
        return exc


async def _checked(node: _Node, hashes: Sequence[str]) -> Pushed | HostError | None:
    await node.held.send(node.token + "\n")
    await node.held.send(hashes_line(hashes))
    while (line := await node.line(CHECK_WAIT_S)) is not None:
        said = read_said(line)
        if said.word == "present":
            return Pushed(node.host.name, node.path, "present")
        if said.word == "resume":
            node.resume = int(said.args[0])
        elif said.word == "port":
            node.port = int(said.args[0])
            return None
        else:
            return _failure(node, said.word, said.args)
    return _failure(node, "error", ())


async def _finish(node: _Node) -> Pushed | HostError:
    """The node's last word once the stream is under way."""
    try:
        return await _finished(node)
    except HostError as exc:
        return exc


async def _finished(node: _Node) -> Pushed | HostError:
    notes: list[str] = []
    while (line := await node.line(STREAM_WAIT_S)) is not None:
        said = read_said(line)
        if said.word == "done":
            return Pushed(node.host.name, node.path, "pushed", node.resume, int(said.args[0]))
        if said.word == "downstream":
            notes.append(f"forwarding to the next node failed: {said.args[0]}")
        elif said.word == "cut":
            pos, why = int(said.args[0]), said.args[1]
            return HostError(
                f"the push to {node.path} was cut at byte {pos} ({why}); {node.path}.partial stays and the "
                "next push resumes it",
                host=node.host.name,
            )
        elif said.word == "bad":
            return HostError(
                f"chunk {said.args[0]} of {node.path} did not match this machine's hash after the push "
                f"({said.args[1]}); {node.path}.partial is cut there and the next push sends it again",
                host=node.host.name,
            )
        elif said.word == "error":
            return HostError(f"cannot push to {node.path}: {said.args[0]}", host=node.host.name)
    return HostError(
        f"the push to {node.path} ended without a word ({'; '.join(notes) or 'receiver gone'}); "
        "the next push resumes it",
        host=node.host.name,
    )


async def push_chain(
    connect: Callable[[Host], Awaitable[Connection]],
    hosts: Sequence[Host],
    model: Path,
    hashes: Sequence[str],
    *,
    chunk: int,
    port: int = 0,
    on_sent: Callable[[int], None] = lambda n: None,
) -> PushRun:
    """Push `model` (chunk hashes `hashes`, computed here) to `hosts` (one per destination, in chain
    order) through a chain of receivers; `connect(host)` awaits the host's connection."""
    size = (await asyncio.to_thread(model.stat)).st_size
    outcomes: dict[str, Pushed | HostError] = {}
    started = time.monotonic()

    async def start(host: Host) -> _Node | HostError:
        try:
            conn = await connect(host)
            return await _start(conn, host, model, size, chunk, port)
        except HostError as exc:
            return exc

    begun = await asyncio.gather(*(start(h) for h in hosts))
    nodes = [n for n in begun if isinstance(n, _Node)]
    for host, got in zip(hosts, begun, strict=True):
        if isinstance(got, HostError):
            outcomes[host.name] = got
    sent = 0
    stream_from = 0
    finishing: list[asyncio.Future[Pushed | HostError]] = []
    try:
        checked = await asyncio.gather(*(_check(n, hashes) for n in nodes))
        chain: list[_Node] = []
        for node, answer in zip(nodes, checked, strict=True):
            if answer is None:
                chain.append(node)
            else:
                outcomes[node.host.name] = answer
        if chain:
            stream_from = min(n.resume for n in chain)
            for node, after in zip(chain, [*chain[1:], None], strict=True):
                hop = "-" if after is None else f"{after.host.address} {after.port} {after.token}"
                await node.held.send(f"next {hop}\n")
            finishing += [asyncio.ensure_future(_finish(n)) for n in chain]
            progress = [0]

            def counted(n: int) -> None:
                progress[0] = n
                on_sent(n)

            try:
                sent = await _stream(chain[0], model, stream_from, size, counted)
            except OSError as exc:
                head = chain[0]
                outcomes[head.host.name] = HostError(
                    f"cannot stream to {head.path} at {head.host.address}:{head.port}: {exc}; "
                    f"{head.path}.partial stays and the next push resumes it",
                    host=head.host.name,
                    hint="a firewall on the node must let the push's port through (--port picks one)",
                )
                sent = progress[0]
                if sent < size - stream_from:  # the chain is cut: no node after the first gets more
                    for node in chain[1:]:
                        outcomes[node.host.name] = HostError(
                            f"the push to {node.path} stopped with the chain's first node, "
                            f"{head.host.name}; {node.path}.partial stays and the next push resumes it",
                            host=node.host.name,
                        )
            for node, fut in zip(chain, finishing, strict=True):
                if node.host.name not in outcomes:
                    outcomes[node.host.name] = await fut
    finally:  # cut short (Ctrl-C) too: each receiver ends as its stdin does, keeping NAME.partial
        for fut in finishing:
            fut.cancel()
        for node in nodes:
            with contextlib.suppress(Exception):
                await node.held.release()
    ordered = {h.name: outcomes[h.name] for h in hosts}
    return PushRun(ordered, sent, stream_from, time.monotonic() - started)


async def _stream(first: _Node, model: Path, start: int, size: int, on_sent: Callable[[int], None]) -> int:
    """The model's bytes from `start` to the chain's first node, after its token; the bytes sent."""
    assert first.port is not None
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(first.host.address, first.port), timeout=ACCEPT_S
    )
    sent = 0
    try:
        writer.write(f"{first.token}\n{start}\n".encode())
        with model.open("rb") as fh:
            fh.seek(start)
            while sent < size - start:
                block = await asyncio.to_thread(fh.read, min(BLOCK, size - start - sent))
                if not block:
                    raise OSError(f"{model} ended at byte {start + sent}, before its {size} bytes")
                writer.write(block)
                try:  # a link that takes nothing for this long is cut (TCP alone retries for minutes)
                    await asyncio.wait_for(writer.drain(), IDLE_S)
                except TimeoutError:
                    raise OSError(f"the link took nothing for {IDLE_S} s") from None
                sent += len(block)
                on_sent(sent)
        writer.write_eof()
        await reader.read()  # the first node closes once it has read everything
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    return sent
