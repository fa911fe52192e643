"""Tier 1: the HTTP server of serve, the exporter and the live page (`observe.server`, `HttpGuard`) under
clients that lie about their bodies or hold their connections, on a real uvicorn in a process of its own
(its memory measured from /proc), reached with raw sockets on 127.0.0.1."""

from __future__ import annotations

import json
import re
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

MiB = 1024 * 1024

# The exporter's app (its page, /login, /fleet.json, /metrics) behind HttpGuard, on `http_server` with the
# limits given as JSON; the port it bound goes to stdout.
SERVER = """
import asyncio, json, socket, sys
from fastapi import FastAPI
from orchestrator.observe.collect import Collector
from orchestrator.observe.server import http_server
from orchestrator.observe.web import Exporter, HttpGuard, HttpLimits, mount

limits = HttpLimits(**json.loads(sys.argv[1]))
app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
mount(app, Exporter(Collector([], interval=60.0, timeout=1.0, cache=False)), api_key=None, metrics=True)
app.add_middleware(HttpGuard, check_host=True, body_timeout=limits.body_timeout)
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
server = http_server(app, "127.0.0.1", sock.getsockname()[1], limits=limits)
print(sock.getsockname()[1], flush=True)
asyncio.run(server.serve(sockets=[sock]))
"""


@pytest.fixture
def http_limits_server() -> Iterator[Callable[..., tuple[int, int]]]:
    """Factory: the server with these limits (HttpLimits' fields): (its port, its pid)."""
    started: list[subprocess.Popen[str]] = []

    def start(**limits: float) -> tuple[int, int]:
        process = subprocess.Popen(
            [sys.executable, "-c", SERVER, json.dumps(limits)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        started.append(process)
        assert process.stdout is not None
        port = int(process.stdout.readline())
        deadline = time.monotonic() + 20
        while True:  # serving: a request answered
            try:
                code, _ = _exchange(port, b"GET /fleet.json HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                if code == 200:
                    return port, process.pid
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)

    yield start
    for process in started:
        process.terminate()
        process.wait(10)


def _peak_kib(pid: int) -> int:
    """The process's peak resident memory (VmHWM), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _exchange(port: int, request: bytes) -> tuple[int, bytes]:
    """`request` sent whole, its answer read to the connection's end: (status, the answer as read)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while data := sock.recv(65536):
            answer += data
            if b"\r\n\r\n" in answer and b"connection: close" not in answer.lower():
                break  # a kept-alive answer: its head is enough
    return int(answer.split(b" ", 2)[1]), answer


def _push(port: int, head: bytes, piece: bytes, total: int) -> tuple[int, bytes]:
    """`head`, then `piece` again and again up to `total` bytes, reading the answer meanwhile, until the
    server closes the connection: (bytes of body sent by then, the answer read)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    sock.sendall(head)
    sent, answer, pending = 0, b"", memoryview(b"")
    deadline = time.monotonic() + 120
    try:
        while sent < total and time.monotonic() < deadline:
            readable, writable, _ = select.select([sock], [sock], [], 1.0)
            if readable:
                data = sock.recv(65536)
                if not data:
                    break  # closed
                answer += data
            if writable:
                if not pending:
                    pending = memoryview(piece)
                n = sock.send(pending)
                pending, sent = pending[n:], sent + n
    except OSError:
        pass  # reset: closed with the body unread
    finally:
        sock.close()
    return sent, answer


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


LOGIN = b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\n"


def test_a_body_is_counted_as_it_arrives_whatever_its_headers_say(
    http_limits_server: Callable[..., tuple[int, int]],
) -> None:
    """F2: a Content-Length beside a chunked body is refused (400); a chunked body past /login's 4 KiB is
    413; either way the connection closes and the process does not grow by the body it was sent."""
    port, pid = http_limits_server()
    # Both framings: h11 reads the chunks, the guard used to trust the (small) length
    both = (
        LOGIN + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunk(b"key=x") + b"0\r\n\r\n"
    )
    code, answer = _exchange(port, both)
    assert code == 400 and b"not both" in answer, answer
    chunked = LOGIN + b"Transfer-Encoding: chunked\r\n\r\n" + _chunk(b"key=" + b"x" * 8000) + b"0\r\n\r\n"
    code, answer = _exchange(port, chunked)
    assert code == 413 and b"over 4096 bytes" in answer, answer

    piece = _chunk(b"x" * (64 * 1024 - 16))
    before = _peak_kib(pid)
    lies = {
        "a Content-Length beside chunks": LOGIN
        + b"Content-Length: 100\r\nTransfer-Encoding: chunked\r\n\r\n",
        "chunks past the bound": LOGIN + b"Transfer-Encoding: chunked\r\n\r\n",
        "a Content-Length smaller than what follows": LOGIN + b"Content-Length: 100\r\n\r\n",
    }
    for lie, head in lies.items():
        started = time.monotonic()
        sent, answer = _push(port, head, piece, 64 * MiB)
        # cut off early: what the sockets' buffers took before the close, not the 64 MiB
        assert sent < 16 * MiB, (lie, sent, answer[:200])
        assert time.monotonic() - started < 30, lie
        if answer:  # read before the close's reset, when it was: the last answer refuses the rest
            # (a lying length: its 100 bytes answered first, then what follows is no request)
            assert re.findall(rb"HTTP/1.1 (\d{3})", answer)[-1] in (b"400", b"413"), (lie, answer[:400])
        print(f"{lie}: {sent / MiB:.1f} MiB sent before the close")
    grown = _peak_kib(pid) - before
    print(f"peak memory grew by {grown / 1024:.1f} MiB")
    assert grown < 16 * 1024, grown  # KiB: 64 MiB were offered three times
    assert _exchange(port, b"GET /fleet.json HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")[0] == 200


def test_half_sent_requests_are_closed_by_their_deadline_and_connections_past_the_limit_refused(
    http_limits_server: Callable[..., tuple[int, int]],
) -> None:
    """F3: five connections that send part of a request (a head never ended, or a body never whole) are
    closed within the head's or the body's deadline (2 s here; 408 for a body); a sixth connection past
    the limit of five is answered 503 and closed at once; then the server serves again."""
    port, _ = http_limits_server(header_timeout=2.0, body_timeout=2.0, max_connections=5, keep_alive=1.0)
    halves = [
        b"GET /fleet.json HTTP/1.1\r\nHost: 127.0.0.1\r\n",  # the head's end never comes
        b"GET /fleet.json HTTP/1.1\r\nHo",
        b"P",
        LOGIN + b"Content-Length: 100\r\n\r\nkey=",  # a body of 100 bytes, 4 sent
        LOGIN + b"Transfer-Encoding: chunked\r\n\r\n" + _chunk(b"key="),  # its last chunk never comes
    ]
    socks = []
    started = time.monotonic()
    for half in halves:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(half)
        socks.append(sock)
    time.sleep(0.3)  # each accepted and read
    extra = socket.create_connection(("127.0.0.1", port), timeout=10)
    refused = extra.recv(65536)
    assert refused.startswith(b"HTTP/1.1 503") and b"5 connections open" in refused, refused
    assert extra.recv(65536) == b""  # and closed
    assert time.monotonic() - started < 1.5  # at once, not at a deadline
    extra.close()
    answers, closed_after = [], []
    for sock in socks:
        answer = b""
        try:
            while data := sock.recv(65536):
                answer += data
        except OSError:
            pass
        closed_after.append(time.monotonic() - started)
        answers.append(answer)
        sock.close()
    print("closed after", [f"{t:.2f} s" for t in closed_after])
    assert max(closed_after) < 2.0 + 1.5, closed_after  # the 2 s deadline, with slack for a loaded machine
    assert min(closed_after) > 1.5, closed_after  # by the deadline, not before
    assert answers[:3] == [b"", b"", b""], answers  # a head cut short: no answer
    for answer in answers[3:]:
        assert answer.startswith(b"HTTP/1.1 408") and b"within 2 s" in answer, answer
    assert _exchange(port, b"GET /fleet.json HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")[0] == 200
