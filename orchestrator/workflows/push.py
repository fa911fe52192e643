"""`model push` as a use case: the model's chunk hashes computed here, once, then the file pushed to the
selected hosts' model folders through a chain of nodes (`operations.push`): this machine sends each byte
once. Several servers of one machine, or hosts sharing one folder on one address, are one destination."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrator.core.fnv import cache_name, hash_file_range
from orchestrator.engine.executor import Session
from orchestrator.engine.runtime import run_once
from orchestrator.engine.threads import thread_pool
from orchestrator.inventory.model import Host
from orchestrator.operations.push import PushRun, destination, push_chain
from orchestrator.operations.push_node import CHUNK, chunk_spans


@dataclass(frozen=True)
class PushReport:
    """The push, with the seconds spent hashing here and the chunk size used."""

    run: PushRun
    hash_seconds: float
    chunk: int
    skipped: dict[str, str]  # host -> the host whose push covers the same destination


def chunk_hashes(model: Path, chunk: int) -> list[str]:
    """The FNV-1a-64 of each chunk of `model`, natively, on a few threads (the hash releases the GIL)."""
    spans = chunk_spans(model.stat().st_size, chunk)
    with thread_pool(min(4, os.cpu_count() or 1), "push-hash") as pool:
        return list(pool.map(lambda s: cache_name(hash_file_range(model, s[0], s[1])), spans))


def destinations(hosts: Sequence[Host], model: Path) -> tuple[list[Host], dict[str, str]]:
    """Pure: one host per distinct (address, SSH port, destination path), in order; and each other host
    with the one it shares its destination with."""
    first: dict[tuple[str, int, str], Host] = {}
    skipped: dict[str, str] = {}
    for host in hosts:
        key = (host.address, host.ssh_port, destination(host, model))
        if key in first:
            skipped[host.name] = first[key].name
        else:
            first[key] = host
    return list(first.values()), skipped


def push_fleet(
    hosts: Sequence[Host],
    model: Path,
    *,
    chunk: int = CHUNK,
    port: int = 0,
    forks: int | None = None,
    on_sent: Callable[[int], None] = lambda n: None,
) -> PushReport:
    """Push `model` to the hosts' model folders (`model_path_on_nodes`, else `<install_dir>/models`)."""
    path = model
    started = time.monotonic()
    hashes = chunk_hashes(path, chunk)
    hash_seconds = time.monotonic() - started
    chosen, skipped = destinations(hosts, path)

    async def go() -> PushRun:
        async with Session(forks=forks or 16) as session:
            return await push_chain(
                session.connection, chosen, path, hashes, chunk=chunk, port=port, on_sent=on_sent
            )

    return PushReport(run_once(go()), hash_seconds, chunk, skipped)
