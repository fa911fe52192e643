"""Warm a node's cache from its own copy of the model (`model_path_on_nodes`): the controller sends a
command, not the bytes.

The node finds each GGUF file of the model under its own name in the folder `model_path_on_nodes` (an NFS
mount, or a copy on its disk). For each tensor it lacks, in order, the script copies the tensor's bytes
(offset and size from this machine's reading of the GGUF) under a temporary name, hashes them there with
the FNV-1a helper `cache verify` uses (`operations.cache.ensure_helper`), and renames the file to its hash
only when that hash is the one this machine computed for the same bytes of its own file (the memo's
manifest, `caches.plan`): a node's copy is checked tensor by tensor, at the cost of the copy it makes
anyway, never by a whole-file sha256 (minutes per node on a big model). The cache never holds a file
whose bytes are not the name's, so a differing copy loads nothing else.

The first tensor the node cannot copy (its file missing or unreadable, too short, or its bytes differing)
ends the script; the tensors left are then streamed from this machine as before (`cache_stream`), with a
warning naming the host and the path. A disk too small for the files is an error naming the bytes needed:
the controller's stream would fill the same disk.

The script runs as the cache folder's owner, as the stream does (`cache_stream.as_cache_owner`): the
server's user must be able to read the model's folder. It writes the warm's mark (`.warm-wait`) and says
`ready` before its first file, so a server with the `warm-wait` patch waits for the files being copied.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from orchestrator.artifacts.patches import WARM_WAIT_MARK
from orchestrator.connectors.base import Connection, HeldCommand, shell_path
from orchestrator.core.errors import HostError
from orchestrator.core.fnv import tools_dir
from orchestrator.core.units import format_size
from orchestrator.inventory.model import Host
from orchestrator.operations.cache_stream import TEMP_PREFIX, as_cache_owner
from orchestrator.operations.server.state import CACHE_DIR

if TYPE_CHECKING:
    from orchestrator.operations.cache import WarmItem

BLOCK = 1 << 20  # bytes per dd block
LINE_WAIT_S = 3600.0  # one tensor copied on a slow disk may take long


def node_path(host: Host, item: WarmItem) -> str:
    """Where `host` holds the GGUF file of `item` (for messages): its folder and the file's own name."""
    folder = (host.model_path_on_nodes or "").rstrip("/") or "/"
    return str(PurePosixPath(folder) / item.path.name)


def copy_script(host: Host, folder: str, helper: str, items: Sequence[WarmItem]) -> str:
    """The node's side: each item (named: the hash this machine computed) copied from the node's own
    GGUF file into the cache `folder` (a shell word), checked by its FNV-1a, renamed; one line per
    tensor: `ok NAME`, or the first that cannot be: `missing K`, `short K`, `failed K` (dd: its own error
    line before it), `nohelper K`, `differs K HASH`, ending the script. `full NEED AVAIL` (bytes) before
    anything when the disk lacks room for every file, `ready` once the folder is marked, `done` at the
    end. `helper` is the FNV-1a tool's path relative to the cache folder (the script works inside it)."""
    assert host.model_path_on_nodes is not None
    need = sum(int(i.size) for i in items)
    body = [
        'mkdir -p "$D" && cd "$D" || exit 1',
        f"F={shlex.quote(helper)}",
        f"M={WARM_WAIT_MARK}",
        "tmp=",
        'end() { [ -z "$tmp" ] || rm -f "$tmp"',
        '  [ "$(cat "$M" 2>/dev/null)" != $$ ] || rm -f "$M"; }',
        "trap end EXIT",
        "trap 'exit 1' HUP INT TERM PIPE",
        # Room first (a warm has made its room under rpc_cache_max before this): no file lands that
        # the rest could not follow.
        "avail=$(df -Pk . | awk 'NR==2 {print $4}')",
        f'if [ -n "$avail" ] && [ $((avail * 1024)) -lt {need} ]; then echo "full {need} $((avail * 1024))"; '
        "exit 0; fi",
        'rm -f "$M" && (set -C; echo $$ > "$M") || exit 1',
        "echo ready",
        "copy() {",
        '  [ -n "$S" ] && [ -f "$S/$2" ] && [ -r "$S/$2" ] || { echo "missing $1"; exit 0; }',
        f'  tmp="./{TEMP_PREFIX}$5.$$"',
        # A fresh file (noclobber), written as the folder's owner (as the stream does).
        '  rm -f "$tmp" || exit 1',
        '  ( set -C; exec > "$tmp" || exit 1',
        f'    dd if="$S/$2" bs={BLOCK} skip="$3" count="$4" iflag=skip_bytes,count_bytes status=none ) \\',
        '    || { echo "failed $1"; exit 0; }',
        '  [ "$(wc -c < "$tmp")" -eq "$4" ] || { echo "short $1"; exit 0; }',
        '  h=$("$F" "$tmp") || { echo "nohelper $1"; exit 0; }',
        "  h=${h%% *}",
        '  [ "$h" = "$5" ] || { echo "differs $1 $h"; exit 0; }',
        '  mv -f "$tmp" "$5" && tmp= && echo "ok $5"',
        "}",
    ]
    body += [
        f"copy {k} {shlex.quote(i.path.name)} {int(i.offset)} {int(i.size)} {i.name}"
        for k, i in enumerate(items)
    ]
    body.append("echo done")
    # The model's folder as this login's shell sees it (`~` is its home, a relative path is below it),
    # before the script changes user and folder.
    source = shell_path(host.model_path_on_nodes)
    prelude = f"exec 2>&1\nS=$(cd {source} 2>/dev/null && pwd) || S=\nexport S\n"
    return prelude + as_cache_owner(folder, body)


def helper_from_cache(host: Host) -> str:
    """The FNV-1a tool's path relative to the cache folder: the script runs inside the folder, which a
    server user reaches even below a 0700 home (its unit binds the install dir in)."""
    up = "/".join([".."] * (len(PurePosixPath(CACHE_DIR).parts) + 1))
    return f"{up}/tools/{tools_dir().name}/fnv1a"


@dataclass(frozen=True)
class CopyReport:
    """What the node's script said: the items copied (indexes, in order), and the first it could not
    copy with why (`stop`: None when all were), or a disk without room (`full`: bytes needed, free)."""

    copied: tuple[int, ...]
    stop: tuple[str, int, str] | None = None  # (word, item index, detail)
    full: tuple[int, int] | None = None
    ended: bool = False  # `done` was said: every item copied


def read_report(lines: Sequence[str], items: Sequence[WarmItem]) -> CopyReport:
    """Pure: the script's lines (`copy_script`) as a report; `ok NAME` counts only in order."""
    copied: list[int] = []
    for line in lines:
        word, _, rest = line.partition(" ")
        if word == "ok" and len(copied) < len(items) and items[len(copied)].name == rest:
            copied.append(len(copied))
        elif word == "full":
            need, _, avail = rest.partition(" ")
            with contextlib.suppress(ValueError):
                return CopyReport(tuple(copied), full=(int(need), int(avail)))
        elif word in ("missing", "short", "failed", "nohelper", "differs"):
            index, _, detail = rest.partition(" ")
            if index.isdigit():
                return CopyReport(tuple(copied), stop=(word, int(index), detail))
        elif word == "done":
            return CopyReport(tuple(copied), ended=len(copied) == len(items))
    return CopyReport(tuple(copied))


def why_not(host: Host, items: Sequence[WarmItem], report: CopyReport, said: Sequence[str]) -> str | None:
    """Pure: the warning for a node that falls back to this machine's stream (None: it need not)."""
    if report.ended:
        return None
    if report.stop is None:
        return (
            f"{host.name}: copying from the node-local model folder {host.model_path_on_nodes} stopped "
            f"({'; '.join(said[-2:]) or 'no answer'}); the rest is sent from this machine"
        )
    word, index, detail = report.stop
    item = items[min(index, len(items) - 1)]
    path = node_path(host, item)
    span = f"bytes {item.offset}..{item.offset + item.size}"
    reasons = {
        "missing": "is missing or unreadable (as the cache's owner)",
        "short": f"ends before {span}",
        "failed": f"could not be read at {span} ({'; '.join(said[-2:-1]) or 'dd failed'})",
        "nohelper": "could not be checked: the FNV-1a helper did not run on the node",
        "differs": f"differs from this machine's at {span} (hash {detail or '?'}, expected {item.name})",
    }
    return f"{host.name}: the node-local copy {path} {reasons[word]}; its tensors are sent from this machine"


async def copy_on_node(
    conn: Connection,
    host: Host,
    folder: str,
    items: Sequence[WarmItem],
    *,
    stopping: Callable[[], bool],
    on_file: Callable[[WarmItem], None],
    on_ready: Callable[[], None],
) -> tuple[list[WarmItem], str | None]:
    """Copy `items` (all named) into the node's cache `folder` from its own copy of the model; returns
    those now there, in order, and the warning when the node must get the others from this machine
    (None: all copied, or stopped by `stopping()`). A full disk is a HostError naming the bytes needed."""
    from orchestrator.operations.cache import ensure_helper  # here: cache.py imports this module

    await ensure_helper(conn, host)
    held: HeldCommand = await conn.hold(
        "exec sh -c " + shlex.quote(copy_script(host, folder, helper_from_cache(host), items))
    )
    lines: list[str] = []
    landed: list[WarmItem] = []
    try:
        while (line := await held.readline(LINE_WAIT_S)) is not None:
            line = line.strip()
            lines.append(line)
            if line == "ready":
                on_ready()
            report = read_report(lines, items)
            while len(landed) < len(report.copied):
                landed.append(items[len(landed)])
                on_file(landed[-1])
            if report.ended or report.stop or report.full:
                break
            if stopping():
                return landed, None
    finally:
        await held.release()
    report = read_report(lines, items)
    said = [x for x in lines if x.split(" ", 1)[0] not in ("ready", "ok", "done")]
    full = report.full is not None or any("No space left" in x for x in said)
    if full:
        need = sum(i.size for i in items[len(landed) :])
        free = f", {format_size(report.full[1])} free" if report.full is not None else ""
        where = f"{host.install_dir.rstrip('/')}/{CACHE_DIR}/rpc"
        raise HostError(
            f"warming the tensor cache from the node-local copy: the node's disk is full: "
            f"{format_size(need)} ({need} bytes) needed in {where}{free}",
            host=host.name,
            hint="free space, lower rpc_cache_max or run `rpcfleet cache prune`",
        )
    return landed, why_not(host, items, report, said)
