"""`engine.children.socket_access_denied`: serve's link timeout needs a duplicate of its engine's sockets
(pidfd_getfd). Where a seccomp filter (Docker's default profile) or Yama's ptrace_scope denies it, that
is found at start-up, with the reason, instead of the timeout silently doing nothing."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from orchestrator.engine.children import socket_access_denied

# A seccomp filter that answers pidfd_getfd (438) with EPERM and allows everything else, installed in a
# child Python (no new privileges first, as an unprivileged process must), which then asks.
DENY_PIDFD_GETFD = """
import ctypes, struct
from orchestrator.engine.children import socket_access_denied
libc = ctypes.CDLL(None, use_errno=True)
def op(code, jt, jf, k): return struct.pack("HBBI", code, jt, jf, k)
program = b"".join([
    op(0x20, 0, 0, 0),                 # load the syscall number (seccomp_data.nr)
    op(0x15, 0, 1, 438),               # pidfd_getfd?
    op(0x06, 0, 0, 0x00050000 | 1),    # yes: errno EPERM
    op(0x06, 0, 0, 0x7FFF0000),        # no: allow
])
buffer = ctypes.create_string_buffer(program)
fprog = struct.pack("HxxxxxxQ", len(program) // 8, ctypes.addressof(buffer))
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0, ctypes.get_errno()  # SECCOMP_MODE_FILTER
print(socket_access_denied())
"""


def test_this_process_may_take_its_childrens_sockets() -> None:
    assert socket_access_denied() is None


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the filter is written for x86_64")
def test_a_seccomp_filter_that_denies_pidfd_getfd_is_found_and_named() -> None:
    argv = [sys.executable, "-c", DENY_PIDFD_GETFD]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("pidfd_getfd: Operation not permitted (a seccomp filter"), done.stdout
