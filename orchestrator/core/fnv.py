"""FNV-1a-64 at native speed: the hash llama.cpp's RPC tensor cache names its files by.

`ggml-rpc.cpp` (0.3.36) `fnv_hash`: offset basis 0xcbf29ce484222325, prime 0x100000001b3, one byte at a
time; a cache file is `<LLAMA_CACHE>/rpc/<hash as %016x>`. The hash is sequential per byte, so numpy cannot
vectorise it and pure Python runs at about 10 MB/s: a small C source (below) is compiled with the system's
`cc` on first use, once per machine, under `$RPCFLEET_HOME/tools/fnv1a-<digest>/`, as
- `libfnv1a.so`, loaded here through ctypes (`hash_file_range` maps the file in C: no copy in Python);
- `fnv1a`, a static command-line tool uploaded to nodes by `operations.cache` to verify their caches on the
  node (`fnv1a FILE...` prints `<hash> <size> <path>` per file, `-` for a file it cannot read).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from orchestrator.core.errors import RpcfleetError
from orchestrator.core.paths import rpcfleet_home

OFFSET_BASIS = 0xCBF29CE484222325
PRIME = 0x100000001B3
MASK = (1 << 64) - 1

C_SOURCE = r"""
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

uint64_t rf_fnv1a(const unsigned char *p, uint64_t n, uint64_t h) {
    for (uint64_t i = 0; i < n; i++) { h ^= p[i]; h *= 0x100000001b3ULL; }
    return h;
}

/* Hash `size` bytes of `path` from `offset`; returns 0 and sets *out, or an errno (EIO: file too short). */
int rf_fnv1a_file(const char *path, uint64_t offset, uint64_t size, uint64_t *out) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return errno;
    struct stat st;
    if (fstat(fd, &st) != 0) { int e = errno; close(fd); return e; }
    if ((uint64_t)st.st_size < offset + size) { close(fd); return EIO; }
    uint64_t h = 0xcbf29ce484222325ULL;
    if (size == 0) { close(fd); *out = h; return 0; }
    long page = sysconf(_SC_PAGESIZE);
    uint64_t start = offset - offset % (uint64_t)page;
    uint64_t span = size + (offset - start);
    unsigned char *m = mmap(NULL, span, PROT_READ, MAP_PRIVATE, fd, (off_t)start);
    if (m == MAP_FAILED) { int e = errno; close(fd); return e; }
    madvise(m, span, MADV_SEQUENTIAL);
    *out = rf_fnv1a(m + (offset - start), size, h);
    munmap(m, span);
    close(fd);
    return 0;
}

#ifdef RF_MAIN
int main(int argc, char **argv) {
    int status = 0;
    for (int i = 1; i < argc; i++) {
        struct stat st;
        uint64_t h;
        if (stat(argv[i], &st) != 0 || rf_fnv1a_file(argv[i], 0, (uint64_t)st.st_size, &h) != 0) {
            printf("- 0 %s\n", argv[i]);
            status = 1;
            continue;
        }
        printf("%016" PRIx64 " %" PRIu64 " %s\n", h, (uint64_t)st.st_size, argv[i]);
    }
    return status;
}
#endif
"""

_DIGEST = hashlib.sha256(C_SOURCE.encode()).hexdigest()[:12]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


class NativeHashError(RpcfleetError):
    """The native hash helper cannot be built or cannot read a file."""


def tools_dir() -> Path:
    return rpcfleet_home() / "tools" / f"fnv1a-{_DIGEST}"


def _compile(out: Path, *flags: str) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NativeHashError(
            "no C compiler (cc) to build the FNV-1a helper", hint="install gcc (apt-get install gcc)"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "fnv1a.c"
        src.write_text(C_SOURCE)
        target = Path(tmp) / out.name
        done = subprocess.run(
            [compiler, "-O2", *flags, "-o", str(target), str(src)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise NativeHashError(f"building {out.name} failed", command=compiler, stderr=done.stderr)
        target.replace(out)  # atomic: a concurrent builder sees the old file or the whole new one


def library_path() -> Path:
    path = tools_dir() / "libfnv1a.so"
    if not path.exists():
        _compile(path, "-shared", "-fPIC")
    return path


def helper_binary() -> Path:
    """The static `fnv1a` command-line tool for nodes (built on first use; dynamic when static fails)."""
    path = tools_dir() / "fnv1a"
    if not path.exists():
        try:
            _compile(path, "-DRF_MAIN", "-static")
        except NativeHashError:
            _compile(path, "-DRF_MAIN")
    return path


def _library() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL(str(library_path()))
            lib.rf_fnv1a.argtypes = [ctypes.c_char_p, ctypes.c_uint64, ctypes.c_uint64]
            lib.rf_fnv1a.restype = ctypes.c_uint64
            lib.rf_fnv1a_file.argtypes = [
                ctypes.c_char_p,
                ctypes.c_uint64,
                ctypes.c_uint64,
                ctypes.POINTER(ctypes.c_uint64),
            ]
            lib.rf_fnv1a_file.restype = ctypes.c_int
            _lib = lib
        return _lib


def fnv1a64_py(data: bytes, h: int = OFFSET_BASIS) -> int:
    """The reference definition, in pure Python (slow: for tests of the native path)."""
    for byte in data:
        h = ((h ^ byte) * PRIME) & MASK
    return h


def fnv1a64(data: bytes, h: int = OFFSET_BASIS) -> int:
    """FNV-1a-64 of `data`, natively; `h`: the hash of the bytes before it (a stream hashed as it goes)."""
    return int(_library().rf_fnv1a(data, len(data), h))


def hash_file_range(path: Path | str, offset: int, size: int) -> int:
    """FNV-1a-64 of `size` bytes of `path` from `offset` (the file is mapped, never read into Python).
    Releases the GIL (ctypes does), so several ranges hash in parallel threads."""
    out = ctypes.c_uint64()
    code = _library().rf_fnv1a_file(os.fsencode(path), offset, size, ctypes.byref(out))
    if code != 0:
        reason = "file too short" if code == 5 else os.strerror(code)
        raise NativeHashError(f"cannot hash {path} bytes {offset}..{offset + size}: {reason}")
    return int(out.value)


def cache_name(h: int) -> str:
    """The file name llama.cpp gives a tensor with hash `h` (`%016" PRIx64`)."""
    return f"{h:016x}"
