"""The `serve_reload` step: ask a running `rpcfleet serve` to reload, and wait until it serves again.

`POST {url}/admin/reload` with the admin key (`admin_key_file`, else `RPCFLEET_ADMIN_KEY`; without one
the API key, `api_key_file` else `RPCFLEET_API_KEY`, which serve lets reload but never restart the
fleet's servers) drains the requests in flight, unloads, restarts every node one at a time
when `rolling_restart` (the `restart` step of `restart --rolling`, run by serve itself: it holds the
nodes, so only it can restart them without killing a request), re-plans and loads.
Then `/health` is polled until it reports the new reload serving again, within `timeout`.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from orchestrator.core.errors import ServiceError, UsageError

_POLL = 0.25  # seconds between two /health reads


def _http(url: str, key: str | None, body: bytes | None = None, timeout: float = 10.0) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(
        url, data=body, headers=headers, method="POST" if body is not None else "GET"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as err:
        try:
            return err.code, json.loads(err.read() or b"null")
        except ValueError:
            return err.code, None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ServiceError(f"serve at {url} does not answer: {getattr(exc, 'reason', exc)}") from None


def read_key(path: str | None, variable: str = "RPCFLEET_API_KEY", what: str = "api_key_file") -> str | None:
    """The first line of `path` (the step's argument `what`); without a path, the environment's
    `variable` (serve's own), or None."""
    if not path:
        return os.environ.get(variable, "").strip() or None
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise UsageError(f"{what} {path}: {exc.strerror}") from None
    if not lines or not lines[0].strip():
        raise UsageError(f"{what} {path}:1: the first line is empty")
    return lines[0].strip()


def serve_reload(
    url: str, key: str | None, *, rolling_restart: bool, timeout: float, admin_key: str | None = None
) -> dict[str, Any]:
    """Reload serve at `url` (with `admin_key`, else `key`); returns its /health once it serves again
    (ServiceError past `timeout`)."""
    base = url.rstrip("/")
    started = time.monotonic()
    _, before = _http(f"{base}/health", key)  # without the key, /health has no reload count
    reloads = int(before.get("reloads", 0)) if isinstance(before, dict) else 0
    code, answer = _http(
        f"{base}/admin/reload", admin_key or key, json.dumps({"rolling_restart": rolling_restart}).encode()
    )
    if code != 202:
        message = answer.get("error", {}).get("message") if isinstance(answer, dict) else None
        raise ServiceError(f"serve at {url} refused the reload: HTTP {code} {message or ''}".rstrip())
    health: Any = None
    while time.monotonic() - started < timeout:
        _, health = _http(f"{base}/health", key)
        if isinstance(health, dict):
            if health.get("status") == "failed":
                raise ServiceError(f"serve at {url} failed to reload: {health.get('reason')}")
            if health.get("reloads", 0) > reloads and health.get("status") in ("ready", "degraded"):
                return dict(health)
        time.sleep(_POLL)
    status = health.get("status") if isinstance(health, dict) else None
    raise ServiceError(f"serve at {url} is not serving again after {timeout:g} s (status {status})")


async def serve_reload_async(
    url: str, key: str | None, *, rolling_restart: bool, limit: float, admin_key: str | None = None
) -> dict[str, Any]:
    return await asyncio.to_thread(
        serve_reload, url, key, rolling_restart=rolling_restart, timeout=limit, admin_key=admin_key
    )
