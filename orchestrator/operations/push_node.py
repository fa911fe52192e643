"""The node's side of `model push`: a receiver that writes a GGUF under NAME.partial and forwards the same
bytes to the next node of the chain, and the static tool that hashes the file by chunks there.

The receiver is a Python 3 program (`python3 -c`, standard library only) started over SSH by the controller
(`operations.push`). Its protocol, one line each on stdin (the SSH session: never in a command line):
  the token it must be shown, then the controller's FNV-1a-64 of every chunk (`hashes H0 H1 ...`);
it takes the folder's lock (flock on NAME.partial: one push at a time per file), then says one of
  `present` (NAME is there, checked: its stamp, else every chunk hashed), `busy`, `nopython`,
  `full NEED AVAIL` (bytes: checked before any byte is sent), `error TEXT`,
or `resume OFFSET` (the bytes of NAME.partial it keeps: whole chunks whose hashes match, the rest cut off)
and `port P` (its listener, bound before it says so). Then stdin gives `next ADDRESS PORT TOKEN` (the node
to forward to) or `next -` (the chain's end). The upstream (the controller, or the node before it) connects,
sends the token and `START` (the stream's first offset: the lowest resume point of the chain) as lines;
each byte at or past OFFSET is written, every byte is forwarded. At the stream's end the new chunks are
hashed with the tool and compared; all equal: NAME.partial is renamed to NAME, a stamp written
(`.NAME.pushed`: the file's stat and the hashes' digest, so the next push need not hash it), `done`.
Otherwise `bad K` (the partial file cut at chunk K, for the next push to resume), or `cut POS` (the stream
ended early: the partial file stays, for the next push to resume). The partial file is never removed and
never under the final name. Stdin's end (the controller's session gone) ends the receiver at once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrator.core.errors import RpcfleetError
from orchestrator.core.paths import rpcfleet_home
from orchestrator.engine.children import run_child

CHUNK = 64 << 20  # bytes per verified chunk (a cut push resumes at a chunk boundary)
PARTIAL = ".partial"
ACCEPT_S = 30  # how long a receiver waits for its upstream to connect with the right token
IDLE_S = 60  # a stream silent this long is a cut link: the receiver ends, keeping its partial file

CHUNKS_SOURCE = r"""
#include <fcntl.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* fnvchunks FILE CHUNK FIRST COUNT: the FNV-1a-64 of chunks FIRST..FIRST+COUNT-1 of FILE (the last one
   may be short), one `INDEX HASH` line each; exit 1 when FILE is shorter than a chunk asked for. */
int main(int argc, char **argv) {
    if (argc != 5) { fprintf(stderr, "usage: fnvchunks FILE CHUNK FIRST COUNT\n"); return 2; }
    uint64_t chunk = strtoull(argv[2], 0, 10), first = strtoull(argv[3], 0, 10);
    uint64_t count = strtoull(argv[4], 0, 10);
    int fd = open(argv[1], O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || chunk == 0) { perror(argv[1]); return 1; }
    uint64_t size = (uint64_t)st.st_size;
    for (uint64_t i = first; i < first + count; i++) {
        uint64_t off = i * chunk;
        if (off >= size) return 1;
        uint64_t n = size - off < chunk ? size - off : chunk;
        unsigned char *m = mmap(NULL, n, PROT_READ, MAP_PRIVATE, fd, (off_t)off);
        if (m == MAP_FAILED) { perror("mmap"); return 1; }
        madvise(m, n, MADV_SEQUENTIAL);
        uint64_t h = 0xcbf29ce484222325ULL;
        for (uint64_t j = 0; j < n; j++) { h ^= m[j]; h *= 0x100000001b3ULL; }
        munmap(m, n);
        printf("%" PRIu64 " %016" PRIx64 "\n", i, h);
        fflush(stdout);
    }
    return 0;
}
"""

_DIGEST = hashlib.sha256(CHUNKS_SOURCE.encode()).hexdigest()[:12]


class ToolBuildError(RpcfleetError):
    """The chunk-hash tool cannot be built here."""


def chunks_tool() -> Path:
    """The static `fnvchunks` tool for nodes, built here with the system `cc` on first use."""
    out = rpcfleet_home() / "tools" / f"fnvchunks-{_DIGEST}" / "fnvchunks"
    if out.exists():
        return out
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise ToolBuildError("no C compiler (cc) to build the push's hash tool", hint="apt-get install gcc")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "fnvchunks.c"
        src.write_text(CHUNKS_SOURCE)
        target = Path(tmp) / out.name
        for flags in (["-static"], []):  # static where the toolchain can, for any node's libc
            done = run_child(
                [compiler, "-O2", *flags, "-o", str(target), str(src)], capture_output=True, text=True
            )
            if done.returncode == 0:
                break
        else:
            raise ToolBuildError("building fnvchunks failed", command=compiler, stderr=done.stderr)
        target.replace(out)  # atomic: a concurrent builder sees no half a tool
    return out


def tool_name() -> str:
    """The tool's folder name on the node (versioned by its source)."""
    return f"fnvchunks-{_DIGEST}"


def chunk_spans(size: int, chunk: int) -> list[tuple[int, int]]:
    """Pure: (offset, length) of each chunk of a file of `size` bytes, the last one maybe short."""
    return [(off, min(chunk, size - off)) for off in range(0, size, chunk)]


RECEIVER = r"""
import fcntl, hashlib, hmac, os, socket, subprocess, sys, threading
final, tool = sys.argv[1], sys.argv[4]
size, chunk, port, accept_s, idle_s = [int(x) for x in sys.argv[2:4] + sys.argv[5:8]]
partial = final + ".partial"
stamp_path = os.path.join(os.path.dirname(final) or ".", "." + os.path.basename(final) + ".pushed")
def say(*words):
    sys.stdout.write(" ".join(str(w) for w in words) + "\n"); sys.stdout.flush()
token = sys.stdin.readline().strip().encode()
line = sys.stdin.readline().split()
if not token or not line or line[0] != "hashes":
    say("error", "no token or hashes on stdin"); sys.exit(1)
expected = line[1:]
n_chunks = len(expected)
def hashes(path, first, count):
    if count <= 0:
        return []
    try:
        done = subprocess.run([tool, path, str(chunk), str(first), str(count)], stdout=subprocess.PIPE)
    except OSError as e:  # noexec, another architecture: say so, never take it for differing bytes
        say("error", "the chunk-hash tool %s did not run: %s" % (tool, e.strerror)); sys.exit(1)
    if done.returncode not in (0, 1):
        say("error", "the chunk-hash tool %s failed (exit status %d)" % (tool, done.returncode)); sys.exit(1)
    return [x.split()[1] for x in done.stdout.decode().splitlines()]
def stamp_of(path):
    st = os.stat(path)
    digest = hashlib.sha256(" ".join(expected).encode()).hexdigest()
    fields = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, chunk, digest)
    return "%d %d %d %d %d %d %s" % fields
def stamp(path):
    tmp = stamp_path + ".tmp"
    with open(tmp, "w") as f:
        f.write(stamp_of(path) + "\n")
    os.replace(tmp, stamp_path)
folder = os.path.dirname(final) or "."
try:
    os.makedirs(folder, exist_ok=True)
    fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
except OSError as e:
    say("error", "cannot write %s: %s" % (partial, e.strerror)); sys.exit(1)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except OSError:
    say("busy"); sys.exit(1)
# What is there: the final file (its stamp, else every chunk hashed), then the partial one's whole chunks.
try:
    if os.path.isfile(final) and os.path.getsize(final) == size:
        try:
            with open(stamp_path) as f:
                known = f.read().strip() == stamp_of(final)
        except OSError:
            known = False
        if known or hashes(final, 0, n_chunks) == expected:
            if not known:
                stamp(final)
            if os.fstat(fd).st_size == 0:
                os.unlink(partial)  # made by this check alone
            say("present"); sys.exit(0)
    have = min(os.fstat(fd).st_size, size) // chunk
    got = hashes(partial, 0, have)
    keep = 0
    while keep < len(got) and got[keep] == expected[keep]:
        keep += 1
    resume = keep * chunk
    os.ftruncate(fd, resume)
    need = size - resume
    vfs = os.statvfs(folder)
    avail = vfs.f_bavail * vfs.f_frsize
    if avail < need:
        say("full", need, avail); sys.exit(0)
except OSError as e:
    say("error", "%s: %s" % (e.filename or final, e.strerror)); sys.exit(1)
listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    listener.bind(("0.0.0.0", port))
except OSError as e:
    say("error", "cannot listen on port %d: %s" % (port, e.strerror)); sys.exit(1)
listener.listen(4)
say("resume", resume)
say("port", listener.getsockname()[1])
nxt = sys.stdin.readline().split()
if not nxt or nxt[0] != "next":
    sys.exit(1)
# From now on stdin's end is the controller gone: stop at once (the partial file stays for a resume).
threading.Thread(target=lambda: (sys.stdin.read(), os._exit(3)), daemon=True).start()
listener.settimeout(accept_s)
up = None
while up is None:
    try:
        conn, _ = listener.accept()
    except socket.timeout:
        say("error", "no upstream connected with the token within %d s" % accept_s); sys.exit(1)
    conn.settimeout(10)
    try:
        head = b""
        while head.count(b"\n") < 2 and len(head) < 256:
            got = conn.recv(256 - len(head))
            if not got:
                break
            head += got
    except OSError:
        head = b""
    parts = head.split(b"\n", 2)
    if len(parts) == 3 and hmac.compare_digest(parts[0], token) and parts[1].isdigit():
        up, start, rest = conn, int(parts[1]), parts[2]
    else:
        conn.close()  # a wrong token: this connection only; the listener waits for the right one
listener.close()
if start > resume:
    say("error", "the stream starts at %d, past this node's %d" % (start, resume)); sys.exit(1)
down = None
if nxt[1] != "-":
    try:
        down = socket.create_connection((nxt[1], int(nxt[2])), timeout=10)
        down.sendall(nxt[3].encode() + b"\n" + str(start).encode() + b"\n")
    except OSError as e:
        say("downstream", "cannot connect to %s:%s: %s" % (nxt[1], nxt[2], e.strerror or e)); down = None
up.settimeout(idle_s)
buf = bytearray(1 << 20)
view = memoryview(buf)
pos = start
def take(data):
    global pos, down
    n = len(data)
    if down is not None:
        try:
            down.sendall(data)
        except OSError as e:
            say("downstream", "lost: %s" % (e.strerror or e)); down = None
    if pos + n > resume:
        skip = max(0, resume - pos)
        os.pwrite(fd, data[skip:], pos + skip)
    pos += n
try:
    if rest:
        take(memoryview(rest))
    while pos < size:
        n = up.recv_into(buf, min(len(buf), size - pos))
        if n == 0:
            break
        take(view[:n])
except (OSError, socket.timeout) as e:
    say("cut", pos, getattr(e, "strerror", None) or "idle %d s" % idle_s); sys.exit(0)
if down is not None:
    down.shutdown(socket.SHUT_WR)
if pos < size:
    say("cut", pos, "the stream ended"); sys.exit(0)
os.fsync(fd)
first = resume // chunk
got = hashes(partial, first, n_chunks - first)
for k, h in enumerate(got + [None] * (n_chunks - first - len(got))):
    if h != expected[first + k]:
        os.ftruncate(fd, (first + k) * chunk)
        say("bad", first + k, h or "-"); sys.exit(0)
os.rename(partial, final)
dfd = os.open(folder, os.O_RDONLY)
os.fsync(dfd)
os.close(dfd)
stamp(final)
say("done", size - resume)
"""


@dataclass(frozen=True)
class Said:
    """What a receiver said, read from its lines (pure: `read_said`)."""

    word: str  # present, busy, full, error, resume, port, done, bad, cut, downstream, nopython, ended
    args: tuple[str, ...] = ()


def read_said(line: str) -> Said:
    """Pure: one line of a receiver as a word and its arguments (`error` keeps its text whole)."""
    word, _, rest = line.strip().partition(" ")
    if word in ("error", "downstream"):
        return Said(word, (rest,))
    if word == "cut":
        pos, _, why = rest.partition(" ")
        return Said(word, (pos, why))
    known = ("present", "busy", "full", "resume", "port", "done", "bad", "nopython")
    return Said(word, tuple(rest.split())) if word in known else Said("error", (line.strip(),))


def receiver_command(path: str, size: int, chunk: int, tool: str, port: int) -> str:
    """The shell command that starts a receiver for `path` (a shell word: the folder's `~` expands) on
    the node; `nopython` when the node has no python3."""
    import shlex

    args = " ".join([path, str(size), str(chunk), tool, str(port), str(ACCEPT_S), str(IDLE_S)])
    return (
        "exec 2>&1; command -v python3 >/dev/null 2>&1 || { echo nopython; exit 0; }; "
        f"exec python3 -u -c {shlex.quote(RECEIVER)} {args}"
    )


def hashes_line(hashes: Sequence[str]) -> str:
    return "hashes " + " ".join(hashes) + "\n"
