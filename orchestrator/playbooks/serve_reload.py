"""The `serve_reload` step: ask a running `rpcfleet serve` to reload, and wait until it serves again.

`POST {url}/admin/reload` with the admin key (`admin_key_file`, else `RPCFLEET_ADMIN_KEY`; without one
the API key, `api_key_file` else `RPCFLEET_API_KEY`, which serve lets reload but never restart the
fleet's servers) drains the requests in flight, unloads, restarts every node one at a time
when `rolling_restart` (the `restart` step of `restart --rolling`, run by serve itself: it holds the
nodes, so only it can restart them without killing a request), re-plans and loads.
Then `/health` is polled until it reports the new reload serving again, within `timeout`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx

from orchestrator.core.errors import ServiceError, UsageError
from orchestrator.core.poll import poll_async

_POLL = 0.25  # seconds between two /health reads


async def _http(
    client: httpx.AsyncClient, url: str, key: str | None, body: bytes | None = None
) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    try:
        answer = await client.request(
            "POST" if body is not None else "GET", url, content=body, headers=headers
        )
    except httpx.HTTPError as exc:
        raise ServiceError(f"serve at {url} does not answer: {exc}") from None
    try:
        return answer.status_code, json.loads(answer.content or b"null")
    except ValueError:
        return answer.status_code, None


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


async def serve_reload(
    url: str, key: str | None, *, rolling_restart: bool, limit: float, admin_key: str | None = None
) -> dict[str, Any]:
    """Reload serve at `url` (with `admin_key`, else `key`); returns its /health once it serves again
    (ServiceError past `limit` seconds)."""
    base = url.rstrip("/")
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        _, before = await _http(client, f"{base}/health", key)  # without the key, /health has no reloads
        reloads = int(before.get("reloads", 0)) if isinstance(before, dict) else 0
        body = json.dumps({"rolling_restart": rolling_restart}).encode()
        code, answer = await _http(client, f"{base}/admin/reload", admin_key or key, body)
        if code != 202:
            message = answer.get("error", {}).get("message") if isinstance(answer, dict) else None
            raise ServiceError(f"serve at {url} refused the reload: HTTP {code} {message or ''}".rstrip())
        last: dict[str, Any] = {}

        async def serving_again() -> dict[str, Any] | None:
            _, health = await _http(client, f"{base}/health", key)
            if not isinstance(health, dict):
                return None
            last.update(health)
            if health.get("status") == "failed":
                raise ServiceError(f"serve at {url} failed to reload: {health.get('reason')}")
            if health.get("reloads", 0) > reloads and health.get("status") in ("ready", "degraded"):
                return dict(health)
            return None

        health = await poll_async(serving_again, limit=limit, interval=_POLL)
    if health is None:
        raise ServiceError(
            f"serve at {url} is not serving again after {limit:g} s (status {last.get('status')})"
        )
    return health
