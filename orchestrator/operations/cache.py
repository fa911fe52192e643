"""The servers' tensor cache on each node: status, verify, prune (LRU under `rpc_cache_max`), clear, warm.

The cache folder is `<install_dir>/cache/rpc` (`LLAMA_CACHE=<install_dir>/cache`, and `ggml-rpc-server -c`
adds `rpc/`), outside `versions/`, so upgrades and rollbacks keep it. A file is named by the FNV-1a-64 of its
bytes (`core.fnv`), so a file whose hash is not its name is truncated or corrupt: llama.cpp would read it back
as weights with no check, so `verify` removes it. "Last use" is the newer of a file's mtime and atime; warming
and loads through rpcfleet touch the files they use, so LRU order does not depend on the mount's atime policy.
Files are only ever created under a temporary name (`.warm-*`) and renamed once complete; leftovers of an
interrupted warm are removed by the next operation on the cache.

Every change runs as `operations.layer.node_operation` (the host lock, check mode); `status` only reads.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.artifacts.patches import WARM_WAIT
from orchestrator.connectors.base import Connection, shell_path
from orchestrator.core.errors import CommandError, HostError
from orchestrator.core.fnv import cache_name, fnv1a64, helper_binary, tools_dir
from orchestrator.engine.executor import HostContext, Step, StepOutcome
from orchestrator.inventory.model import Host
from orchestrator.operations.cache_local import copy_on_node
from orchestrator.operations.cache_stream import TEMP_PREFIX, as_cache_owner, stream_to_cache
from orchestrator.operations.layer import OperationOptions, node_operation
from orchestrator.operations.server.state import CACHE_DIR, LOG_MARKER, server_files

NAME = re.compile(r"^[0-9a-f]{16}$")


@dataclass(frozen=True)
class CacheFile:
    name: str
    size: int
    last_use: float  # epoch seconds: max(mtime, atime)


@dataclass(frozen=True)
class CacheState:
    files: tuple[CacheFile, ...]
    max_bytes: int | None
    hits: int | None = None  # cache hits since the server started (its log, with rpc_debug); None: unknown

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class CacheChange:
    """What an operation did on one node's cache (names of files), and the state after it."""

    removed: tuple[str, ...] = ()
    corrupt: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    hits: tuple[str, ...] = ()
    bytes_sent: int = 0
    seconds: float = 0.0
    # how a warm's bytes went: "node-local copy" (from `model_path_on_nodes`, on the node), then or else
    # from this machine: "plain tcp", "ssh", "local shell", "a file at a time"
    via: str | None = None
    bytes_local: int = 0  # bytes a warm copied on the node from its own copy of the model (not sent)
    warnings: tuple[str, ...] = ()  # each naming the host: a node-local copy not used, and why
    landed: tuple[WarmItem, ...] = ()  # a warm's files now there, each with its name
    kept_over_quota: int = 0  # bytes over rpc_cache_max kept because the current plan needs them
    after: CacheState | None = field(default=None)


def cache_path(host: Host) -> str:
    """The node's cache folder as a shell word."""
    return f"{shell_path(host.install_dir)}/{CACHE_DIR}/rpc"


def helper_path(host: Host) -> str:
    return f"{shell_path(host.install_dir)}/tools/{tools_dir().name}/fnv1a"


def list_script(host: Host) -> str:
    """Lists the cache; creates nothing (a folder made here as root would not be the server user's)."""
    return (
        f'D={cache_path(host)}; if [ -d "$D" ]; then cd "$D" && '
        "find . -maxdepth 1 -type f -printf '%f\\t%s\\t%T@\\t%A@\\n'; fi"
    )


def parse_listing(text: str) -> tuple[list[CacheFile], list[str]]:
    """Pure: cache files and other names (temporaries, strays) from `list_script`'s output."""
    files: list[CacheFile] = []
    others: list[str] = []
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) != 4:
            continue
        name, size, mtime, atime = parts
        if NAME.match(name):
            files.append(CacheFile(name, int(size), max(float(mtime), float(atime))))
        else:
            others.append(name)
    return files, others


def choose_evictions(
    files: Sequence[CacheFile], max_bytes: int | None, keep: Iterable[str] = ()
) -> tuple[list[CacheFile], int]:
    """Pure LRU: the least recently used files to remove until the cache fits `max_bytes`, never one in
    `keep` (what the current plan needs). Returns (to remove, bytes still over the quota)."""
    if max_bytes is None:
        return [], 0
    kept = set(keep)
    total = sum(f.size for f in files)
    out: list[CacheFile] = []
    for f in sorted(files, key=lambda f: (f.last_use, f.name)):
        if total <= max_bytes:
            break
        if f.name in kept:
            continue
        out.append(f)
        total -= f.size
    return out, max(0, total - max_bytes)


WAITS_WORD = "server-waits-for-warm"


def waits_script(host: Host) -> str:
    """Says WAITS_WORD when the node's installed server has the `warm-wait` patch (its manifest lists it)."""
    manifest = f"{shell_path(host.install_dir)}/current/manifest.json"
    return f"grep -qs '\"{WARM_WAIT}@' {manifest} && echo {WAITS_WORD}; true"


async def read_cache(
    conn: Connection, host: Host, *, waits: list[bool] | None = None
) -> tuple[list[CacheFile], list[str]]:
    """The cache's files and other names; `waits` (in the same script) gets whether the node's server
    waits for files being warmed."""
    script = list_script(host) if waits is None else f"{waits_script(host)}; {list_script(host)}"
    done = await conn.run(script, timeout=60)
    if waits is not None:
        waits.append(WAITS_WORD in done.stdout.splitlines())
    if not done.ok:
        raise CommandError(
            "cannot list the tensor cache",
            host=host.name,
            command="find",
            exit_status=done.exit_status,
            stderr=done.stderr,
        )
    return parse_listing(done.stdout)


async def _remove(conn: Connection, host: Host, names: Iterable[str]) -> None:
    names = list(names)
    for i in range(0, len(names), 200):
        chunk = " ".join(shlex.quote(n) for n in names[i : i + 200])
        done = await conn.run(f"cd {cache_path(host)} && rm -f -- {chunk}", timeout=60)
        if not done.ok:
            raise CommandError(
                "cannot remove cache files", host=host.name, exit_status=done.exit_status, stderr=done.stderr
            )


async def ensure_helper(conn: Connection, host: Host) -> str:
    """Upload the static `fnv1a` tool to the node once (per helper version); its path there."""
    remote = helper_path(host)
    done = await conn.run(f"test -x {remote}", timeout=30)
    if done.ok:
        return remote
    local = helper_binary()
    folder = remote.rsplit("/", 1)[0]
    await conn.run(f"mkdir -p {folder}", timeout=30, check=True)
    tmp_rel = f"{host.install_dir.rstrip('/')}/tools/{tools_dir().name}/.fnv1a.tmp"
    await conn.put(local, tmp_rel)
    await conn.run(
        f"chmod 755 {folder}/.fnv1a.tmp && mv -f {folder}/.fnv1a.tmp {remote}", timeout=30, check=True
    )
    return remote


async def hash_on_node(conn: Connection, host: Host, names: Sequence[str]) -> dict[str, str | None]:
    """The FNV-1a hash of each named cache file, computed on the node (None: unreadable)."""
    if not names:
        return {}
    helper = await ensure_helper(conn, host)
    out: dict[str, str | None] = {}
    for i in range(0, len(names), 200):
        chunk = " ".join(shlex.quote(n) for n in names[i : i + 200])
        done = await conn.run(f"cd {cache_path(host)} && {helper} {chunk}", timeout=3600)
        for line in done.stdout.splitlines():
            parts = line.split(" ", 2)
            if len(parts) == 3:
                out[parts[2]] = None if parts[0] == "-" else parts[0]
        if done.exit_status not in (0, 1) or any(n not in out for n in names[i : i + 200]):
            # A helper that cannot run there (another architecture, noexec) proves nothing: never
            # treat its silence as corruption, or every file would be removed.
            raise HostError(
                "the FNV-1a helper did not hash the cache files on this node",
                host=host.name,
                command=helper,
                exit_status=done.exit_status,
                stderr=done.stderr,
                hint="the helper is built for this machine's architecture; verify needs the same on the node",
            )
    return out


async def verify(
    conn: Connection, host: Host, *, names: Sequence[str] | None = None, check: bool = False
) -> CacheChange:
    """Re-hash every file (or `names`), remove those whose hash is not their name and any temporaries."""
    files, others = await read_cache(conn, host)
    chosen = (
        [f.name for f in files] if names is None else [n for n in names if any(f.name == n for f in files)]
    )
    hashes = await hash_on_node(conn, host, chosen)
    corrupt = tuple(n for n in chosen if hashes.get(n) != n)
    strays = tuple(o for o in others if o.startswith(TEMP_PREFIX))
    if not check:
        await _remove(conn, host, [*corrupt, *strays])
    after_files, _ = await read_cache(conn, host) if not check else (files, others)
    return CacheChange(
        removed=(*corrupt, *strays), corrupt=corrupt, after=CacheState(tuple(after_files), host.rpc_cache_max)
    )


async def prune(
    conn: Connection, host: Host, *, keep: Iterable[str] = (), check: bool = False
) -> CacheChange:
    files, others = await read_cache(conn, host)
    evict, over = choose_evictions(files, host.rpc_cache_max, keep)
    strays = [o for o in others if o.startswith(TEMP_PREFIX)]
    names = [f.name for f in evict]
    if not check:
        await _remove(conn, host, [*names, *strays])
    gone = set(names)
    left = tuple(f for f in files if f.name not in gone)
    return CacheChange(removed=tuple(names), kept_over_quota=over, after=CacheState(left, host.rpc_cache_max))


async def clear(conn: Connection, host: Host, *, check: bool = False) -> CacheChange:
    files, others = await read_cache(conn, host)
    names = [f.name for f in files] + [o for o in others if o.startswith(TEMP_PREFIX)]
    if not check:
        await _remove(conn, host, names)
    return CacheChange(removed=tuple(names), after=CacheState((), host.rpc_cache_max))


def upload_script(host: Host, name: str, size: int) -> str:
    """Write stdin to a temporary name, check its size, rename: the cache never holds a partial file. As
    the cache's owner (`cache_stream.as_cache_owner`: the server's user when connected as root)."""
    tmp = f'"$D"/{TEMP_PREFIX}{name}.$$'
    return as_cache_owner(
        cache_path(host),
        [
            'mkdir -p "$D" || exit 1',
            f"trap 'rm -f {tmp}' HUP INT TERM",
            # A fresh file (noclobber), written as the folder's owner: a link planted there leads
            # nowhere that user could not write anyway (noclobber alone opens a link to a device).
            f"rm -f {tmp} || exit 1",
            f'if (set -C; exec > {tmp} && cat) && [ "$(wc -c < {tmp})" -eq {int(size)} ]; '
            f'then mv -f {tmp} "$D"/{name}; else rm -f {tmp}; df -k "$D" >&2; exit 1; fi',
        ],
    )


@dataclass(frozen=True)
class WarmItem:
    """One file to put into a node's cache: its name (hash) and where its bytes are on this machine.
    No name: a file no cache can hold yet (the load's check found none it could be), named by the
    warm's stream as it sends it (`cache_stream`), so nothing is hashed before the warm starts."""

    name: str | None
    path: Path
    offset: int
    size: int


async def warm(
    conn: Connection,
    host: Host,
    items: Sequence[WarmItem],
    *,
    ctx: HostContext | None = None,
    check: bool = False,
    on_ready: Callable[[], None] | None = None,
) -> CacheChange:
    """Put the items the node's cache lacks there: with `model_path_on_nodes`, the named ones copied on
    the node from its own copy of the model (`cache_local`: each checked by its hash; a copy missing or
    differing leaves the rest to this machine, with a warning); the rest uploaded (one stream for all,
    `cache_stream`: an OpenSSH session,
    or a local shell; without the `ssh` binary, a `cat` per file over the connection; always a temp
    name, then a rename), touch those it has (their last use), then prune to `rpc_cache_max` keeping
    every item. `on_ready` is called once: when the stream has marked the files it will send (a server
    with the `warm-wait` patch then waits for them), else when the warm ends, however it ends."""
    called = False

    def ready() -> None:
        nonlocal called
        if not called and on_ready is not None:
            called = True
            on_ready()

    try:
        return await _warm(conn, host, items, ctx=ctx, check=check, on_ready=ready)
    finally:
        ready()


async def _warm(
    conn: Connection,
    host: Host,
    items: Sequence[WarmItem],
    *,
    ctx: HostContext | None,
    check: bool,
    on_ready: Callable[[], None],
) -> CacheChange:
    import time

    started = time.monotonic()
    files, others = await read_cache(conn, host)
    have = {f.name: f.size for f in files}
    strays = [o for o in others if o.startswith(TEMP_PREFIX)]
    wanted: dict[str, WarmItem] = {}
    for item in items:
        if item.name is not None:
            wanted.setdefault(item.name, item)
    unnamed = [item for item in items if item.name is None]
    hits = tuple(n for n, i in wanted.items() if have.get(n) == i.size)
    # A file of the wrong size (llama.cpp writes its files in place: a crash truncates one) is uploaded
    # again: the rename replaces it.
    truncated = tuple(n for n, i in wanted.items() if n in have and have[n] != i.size)
    missing = [item for n, item in wanted.items() if n not in hits] + unnamed
    if check:
        return CacheChange(added=tuple(i.name for i in missing if i.name), hits=hits, corrupt=truncated)
    # Room first: the cache as it will be once warm, pruned to rpc_cache_max now (never a wanted file),
    # so the files land in the room made and nothing is left to do after the last one (a load beside
    # the warm waits for it). A file still without a name stands in under a name no file has.
    now = time.time()
    coming = [CacheFile(i.name or f"?{k}", i.size, now) for k, i in enumerate(missing)]
    keep = set(wanted) | {f.name for f in coming}
    will_be = [f for f in files if f.name not in wanted] + [f for f in files if f.name in hits] + coming
    evict, over = choose_evictions(will_be, host.rpc_cache_max, keep)
    if strays or evict:
        await _remove(conn, host, [*strays, *(f.name for f in evict)])
    if hits:
        await conn.run(f"cd {cache_path(host)} && touch -c -- {' '.join(hits)}", timeout=60)
    landed: list[WarmItem] = []
    local: list[WarmItem] = []
    warnings: list[str] = []

    def uploaded(item: WarmItem) -> None:  # structured progress: one event per file, bytes so far, rate
        landed.append(item)
        if ctx is not None:
            elapsed = time.monotonic() - started
            sent = sum(i.size for i in landed)
            ctx.log.info(
                "cache_warm_progress",
                file=item.name,
                done=len(landed),
                of=len(missing),
                bytes=sent,
                mb_per_s=round(sent / elapsed / 1e6, 1) if elapsed > 0 else None,
            )

    def stopping() -> bool:
        return ctx is not None and ctx.session.interrupted is not None

    named = [i for i in missing if i.name is not None]
    if host.model_path_on_nodes is not None and named:
        # The node's own copy first (a command, not the bytes); what it cannot give comes from here.
        local, warning = await copy_on_node(
            conn, host, cache_path(host), named, stopping=stopping, on_file=uploaded, on_ready=on_ready
        )
        warnings += [warning] if warning is not None else []
        if warning is not None and ctx is not None:
            ctx.log.warning("cache_warm_local_copy_not_used", reason=warning)
    rest = [i for i in missing if i not in local] if not stopping() else []
    streamed = (
        await stream_to_cache(
            host, conn, cache_path(host), rest, stopping=stopping, on_file=uploaded, on_ready=on_ready
        )
        if rest
        else None
    )
    if rest and streamed is None:
        streamed = "a file at a time"
    via = " + ".join(v for v in ("node-local copy" if local else None, streamed) if v) or None
    for item in rest if streamed == "a file at a time" else ():  # asyncssh only: a `cat` per file
        if stopping():
            break
        with item.path.open("rb") as fh:
            fh.seek(item.offset)
            data = fh.read(item.size)
        if item.name is None:
            item = dataclasses.replace(item, name=cache_name(fnv1a64(data)))
        assert item.name is not None
        done = await conn.run(upload_script(host, item.name, item.size), input=data, timeout=3600)
        if not done.ok:
            full = "No space left" in done.stderr
            raise HostError(
                f"warming the tensor cache failed at {item.name} ({item.size} bytes): "
                + ("the node's disk is full" if full else f"exit status {done.exit_status}"),
                host=host.name,
                stderr=done.stderr,
                hint="free space, lower rpc_cache_max or run `rpcfleet cache prune`" if full else None,
            )
        uploaded(item)
    gone = {f.name for f in evict}
    after = [f for f in will_be if f.name not in gone and f.name not in {c.name for c in coming}]
    after += [CacheFile(str(i.name), i.size, now) for i in landed]
    return CacheChange(
        added=tuple(str(i.name) for i in landed),
        hits=hits,
        corrupt=truncated,
        removed=tuple(f.name for f in evict),
        bytes_sent=sum(i.size for i in landed) - sum(i.size for i in local),
        seconds=time.monotonic() - started,
        via=via,
        bytes_local=sum(i.size for i in local),
        warnings=tuple(warnings),
        kept_over_quota=over,
        after=CacheState(tuple(after), host.rpc_cache_max),
        landed=tuple(landed),
    )


def cache_step(action: str, options: OperationOptions, **kwargs: object) -> Step[CacheChange]:
    """An executor step for `verify`, `prune`, `clear` (changes: under the operations layer)."""

    async def body(ctx: HostContext, conn: Connection) -> StepOutcome[CacheChange]:
        host = ctx.host
        if action == "verify":
            change = await verify(conn, host, check=options.check)
        elif action == "prune":
            keep = kwargs.get("keep", {})
            change = await prune(
                conn,
                host,
                keep=keep.get(host.name, ()) if isinstance(keep, dict) else (),
                check=options.check,
            )
        elif action == "clear":
            change = await clear(conn, host, check=options.check)
        else:
            raise ValueError(action)
        n = len(change.removed)
        return StepOutcome(change, changed=bool(n) and not options.check, message=f"{n} file(s) removed")

    return node_operation(f"cache-{action}", body, options)


def warm_step(
    items: Mapping[str, Sequence[WarmItem]],
    options: OperationOptions,
    on_ready: Callable[[Host], None] | None = None,
) -> Step[CacheChange]:
    """Warm each host's cache with `items[host.name]` (hosts run in parallel in the executor);
    `on_ready(host)` as `warm` says."""

    async def body(ctx: HostContext, conn: Connection) -> StepOutcome[CacheChange]:
        ready = None if on_ready is None else (lambda: on_ready(ctx.host))
        change = await warm(
            conn, ctx.host, items.get(ctx.host.name, ()), ctx=ctx, check=options.check, on_ready=ready
        )
        return StepOutcome(
            change,
            changed=bool(change.added or change.removed),
            message=f"{len(change.added)} added, {len(change.hits)} already there",
        )

    return node_operation("cache-warm", body, options)


def hits_script(host: Host) -> str:
    """Count `[set_tensor_hash]` lines (logged on a hit with GGML_RPC_DEBUG) since the last start marker."""
    log = f"{shell_path(host.install_dir)}/{server_files(host.server).log}"
    marker = shlex.quote(LOG_MARKER)
    return f"test -f {log} && tac {log} | sed '/^'{marker}'/q' | grep -c '\\[set_tensor_hash\\]'; true"


async def status_step(ctx: HostContext) -> StepOutcome[CacheState]:
    """Read-only: the node's cache files and quota, and its hits since start when the log says so."""
    conn = await ctx.connection()
    files, _ = await read_cache(conn, ctx.host)
    hits = None
    if ctx.host.rpc_debug:
        done = await conn.run(hits_script(ctx.host), timeout=60)
        text = done.stdout.strip()
        hits = int(text) if text.isdigit() else None
    return StepOutcome(CacheState(tuple(files), ctx.host.rpc_cache_max, hits))


@dataclass(frozen=True)
class CacheListing:
    """A node's cache as a load sees it: its files (name -> size) and whether its server waits for the
    files being warmed (`warm-wait`: a load may run beside the warm)."""

    files: dict[str, int]
    waits: bool


def listing_step() -> Step[CacheListing]:
    """Read-only: each host's cache files and whether its installed server waits for a warm (one
    script per node, on the connection already open)."""

    async def step(ctx: HostContext) -> StepOutcome[CacheListing]:
        conn = await ctx.connection()
        waits: list[bool] = []
        files, _ = await read_cache(conn, ctx.host, waits=waits)
        return StepOutcome(
            CacheListing({f.name: f.size for f in files}, waits[0]), message=f"{len(files)} files"
        )

    return step


def rehash_step(names: Mapping[str, Sequence[str]]) -> Step[tuple[str, ...]]:
    """Read-only: re-hash `names[host.name]` on each node (as `verify` does); the value is those whose
    hash is not their name (corrupt)."""

    async def step(ctx: HostContext) -> StepOutcome[tuple[str, ...]]:
        conn = await ctx.connection()
        chosen = list(names.get(ctx.host.name, ()))
        hashes = await hash_on_node(conn, ctx.host, chosen)
        bad = tuple(n for n in chosen if hashes.get(n) != n)
        return StepOutcome(bad, message=f"{len(bad)} corrupt")

    return step
