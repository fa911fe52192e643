"""A headless Chromium (Debian's /usr/bin/chromium) driven over the DevTools protocol on a pipe.

`--remote-debugging-pipe` reads commands on fd 3 and writes answers on fd 4, each a JSON object ended
by a NUL byte: no websocket library, no browser download. One page stays open, so a test sees the page
update itself (its own polling), never a reload.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


class Browser:
    def __init__(self, process: subprocess.Popen[bytes], write_fd: int, read_fd: int) -> None:
        self.process = process
        self._w, self._r = write_fd, read_fd
        self._buffer = b""
        self._next = 0
        self.session: str | None = None

    def call(self, method: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        self._next += 1
        ident = self._next
        message: dict[str, Any] = {"id": ident, "method": method, "params": params}
        if self.session is not None and not method.startswith("Target."):
            message["sessionId"] = self.session
        os.write(self._w, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._r], [], [], left)[0]:
                    raise TimeoutError(f"chromium did not answer {method} in {timeout} s")
                chunk = os.read(self._r, 1 << 16)
                if not chunk:
                    raise RuntimeError("chromium closed its DevTools pipe")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            answer = json.loads(raw)
            if answer.get("id") == ident:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                result: dict[str, Any] = answer.get("result", {})
                return result

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

    def sign_in(self, base: str, key: str) -> None:
        """Open `base`'s page and send its login form with `key` (a key never goes in an address)."""
        self.open(f"{base}/")
        self.wait_for("document.querySelector('input[name=key]')", 30)
        self.evaluate(
            f"document.querySelector('input[name=key]').value = {json.dumps(key)};"
            "document.querySelector('form').submit()"
        )

    def evaluate(self, expression: str) -> Any:
        answer = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in answer:
            raise RuntimeError(f"{expression}: {answer['exceptionDetails']}")
        return answer["result"].get("value")

    def wait_for(self, expression: str, timeout: float, every: float = 0.1) -> tuple[Any, float]:
        """Evaluate `expression` until it is truthy; returns its value (an element: True) and the seconds
        it took."""
        started = time.monotonic()
        while True:
            value = self.evaluate(
                f"(() => {{ const v = ({expression}); return v instanceof Node ? true : v; }})()"
            )
            if value:
                return value, time.monotonic() - started
            if time.monotonic() - started > timeout:
                raise AssertionError(f"never true within {timeout} s: {expression}")
            time.sleep(every)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path


@contextlib.contextmanager
def chromium(profile: Path, width: int = 1500, height: int = 1100) -> Iterator[Browser]:
    """A headless Chromium with its own profile folder, ended on exit."""
    to_browser_r, to_browser_w = os.pipe()
    from_browser_r, from_browser_w = os.pipe()
    # The child's ends above fd 100: a low number (3, 4) would be overwritten by the redirections below.
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in (to_browser_r, from_browser_w)]
    os.close(to_browser_r)
    os.close(from_browser_w)
    to_browser_r, from_browser_w = high
    argv = [
        CHROMIUM,
        "--headless=new",
        "--no-sandbox",  # root in a container: the sandbox cannot start
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--remote-debugging-pipe",
        f"--user-data-dir={profile}",
        f"--window-size={width},{height}",
        "about:blank",
    ]
    # bash (dash takes no fd above 9) puts the pipes on fds 3 and 4, where the DevTools pipe expects them.
    script = f'exec "$@" 3<&{to_browser_r} 4>&{from_browser_w} {to_browser_r}<&- {from_browser_w}>&-'
    process = subprocess.Popen(
        ["bash", "-c", script, "bash", *argv],
        pass_fds=(to_browser_r, from_browser_w),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(to_browser_r)
    os.close(from_browser_w)
    browser = Browser(process, to_browser_w, from_browser_r)
    try:
        yield browser
    finally:
        with contextlib.suppress(OSError):
            os.close(to_browser_w)
        os.close(from_browser_r)
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
