"""Following the rpc-server's log on every host (`rpcfleet logs --follow`), and the probe's noise in it.

Each host's log is read from the byte where the last read stopped, every `interval` seconds, in one
round trip (its size, then what is new); a log that shrank was rotated and is read from its start.
`ggml-rpc-server` writes a line for every connection it accepts and closes: a probe (or a readiness
check) makes two lines each time, so they are left out unless asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from orchestrator.connectors.base import Connection, shell_path
from orchestrator.engine.executor import HostContext, StepOutcome
from orchestrator.operations.server.state import node_path, server_files

# What ggml-rpc-server 7.x prints per client connection (checked against its output).
CONNECTION_NOISE = ("Accepted client connection", "Client connection closed")


def is_noise(line: str) -> bool:
    """A per-connection line of the server: a probe's or a readiness check's visit."""
    return line.strip() in CONNECTION_NOISE


def without_noise(lines: Sequence[str]) -> list[str]:
    return [line for line in lines if not is_noise(line)]


# `is_noise` for grep -E on the node: a log's tail is filtered there before its last lines are taken
# (a server probed every few seconds writes nothing else, so filtering the tail would leave nothing).
NOISE_PATTERN = "^[[:space:]]*(" + "|".join(CONNECTION_NOISE) + ")[[:space:]]*$"


@dataclass(frozen=True)
class Chunk:
    """What was new in one read: the log's size now, the new text, and whether the log was rotated."""

    size: int
    text: str
    rotated: bool


def read_command(path: str, offset: int | None) -> str:
    """Print the size of `path`, a newline, then its bytes from `offset` up to that size (from 0 when
    it shrank; none when `offset` is None). Bytes written meanwhile are left for the next read."""
    f = shell_path(path)
    size = f"s=$(wc -c < {f} 2>/dev/null) || exit 3; echo $s"
    if offset is None:
        return size
    off = int(offset)
    return (
        f"{size}; if [ $s -lt {off} ]; then head -c $s {f}; "
        f"elif [ $s -gt {off} ]; then tail -c +{off + 1} {f} | head -c $((s - {off})); fi"
    )


def parse_chunk(stdout: str, offset: int) -> Chunk | None:
    """The output of `read_command` (None when the log is not there)."""
    head, _, text = stdout.partition("\n")
    if not head.strip().isdigit():
        return None
    size = int(head)
    return Chunk(size, text, rotated=size < offset)


async def read_new(conn: Connection, path: str, offset: int | None) -> Chunk | None:
    result = await conn.run(read_command(path, offset), timeout=15)
    return parse_chunk(result.stdout, offset or 0) if result.exit_status == 0 else None


def make_follow_step(
    on_lines: Callable[[str, list[str]], None],
    *,
    interval: float = 0.5,
    noise: bool = False,
    stop: asyncio.Event | None = None,
) -> Callable[[HostContext], Awaitable[StepOutcome[None]]]:
    """A step that follows one host's log until `stop` is set (or forever): `on_lines(host, lines)` for
    every complete new line, from the end of the log at the start; the connection noise is left out
    unless `noise`."""

    async def follow(ctx: HostContext) -> StepOutcome[None]:
        conn = await ctx.connection()
        path = node_path(ctx.host.install_dir, server_files(ctx.host.server).log)
        first = await read_new(conn, path, None)
        offset = first.size if first is not None else 0
        partial = ""
        while stop is None or not stop.is_set():
            if stop is None:
                await asyncio.sleep(interval)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), interval)
            chunk = await read_new(conn, path, offset)
            if chunk is None:
                continue
            if chunk.rotated:
                partial = ""
            offset = chunk.size
            *lines, partial = (partial + chunk.text).split("\n")
            kept = lines if noise else without_noise(lines)
            if kept:
                on_lines(ctx.host.name, kept)
        return StepOutcome(None, False, f"followed {shlex.quote(path)}")

    return follow
