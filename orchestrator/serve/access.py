"""Who may call what on serve's front: the API key and the admin key, or the per-user keys (`serve.keys`)
with their scopes and models. The checks the routes depend on (`scoped`), the details a request may see
(`has_key`), the models its key may use (`model_refused`), the live page's sign-in with per-user keys
(`UserKeysPage`) and the count of each key's requests (`KeyCounter`). No route here: `serve.app` wires
these to its routes, and each can be tested alone on a request.

With the API key (`--api-key-file`) every route but `/health`'s state takes it; `/admin/*` always needs a
key: a server started without one refuses them (SIGHUP reloads). With an admin key (`--admin-key-file`) the
admin routes and `/slots` (every client's prompts) take only it; without one the API key may reload the
engines, never with a rolling restart of the fleet's servers (403).

Per-user keys (`--keys`) replace those: each key's scopes open its routes (`inference`: `/v1/*`, limited
to its models; `metrics`: `/metrics`, the live page, `/health`'s details; `admin`: `/admin/*`, `/slots`);
an unknown key is 401, a known one without the scope 403 naming the key's name. The name, never the key,
is logged and counted (`rpcfleet_key_requests_total`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import HTTPException, Request

from orchestrator.core.log import get_logger
from orchestrator.observe.web import PageGate
from orchestrator.serve.keys import KeyRing, UserKey
from orchestrator.serve.metrics import Metrics

Check = Callable[[Request], None]


def bearer_token(request: Request) -> str | None:
    """The request's `Authorization: Bearer` token (None: none)."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


class Access:
    """The front's keys: `api_key` and `admin_key`, or the per-user keys in force (`keys`, then neither);
    `served`: the models served now (a request that names none gets the one model)."""

    def __init__(
        self,
        *,
        api_key: str | None,
        admin_key: str | None = None,
        keys: KeyRing | None = None,
        served: Callable[[], Sequence[str]] = list,
    ) -> None:
        if keys is not None and (api_key is not None or admin_key is not None):
            raise ValueError("per-user keys replace the API key and the admin key")
        self.api_key, self.admin_key, self.keys, self.served = api_key, admin_key, keys, served

    def _bearer(self, request: Request, key: str) -> bool:
        presented = bearer_token(request)
        return presented is not None and hmac.compare_digest(presented.encode(), key.encode())

    def user(self, request: Request) -> UserKey | None:
        """The per-user key the request presents (None: none, or not one of the keys in force)."""
        presented = bearer_token(request)
        return self.keys.keys.find(presented) if self.keys is not None and presented else None

    def has_key(self, request: Request) -> bool:
        """The request may see the details (/health's, the live page): the configured key, or a per-user
        key with the metrics scope (always true when no key is configured)."""
        if self.keys is not None:
            found = self.user(request)
            return found is not None and "metrics" in found.scopes
        return self.api_key is None or self._bearer(request, self.api_key)

    def authorize(self, request: Request) -> None:
        if not self.has_key(request):
            raise HTTPException(401, "invalid API key")

    def authorize_admin(self, request: Request) -> None:
        # Without a key anyone who reaches the port could drain and reload the fleet: refused outright.
        if self.api_key is None and self.admin_key is None and self.keys is None:
            raise HTTPException(
                403,
                "the admin routes need an API key: start serve with --api-key-file or RPCFLEET_API_KEY "
                "(without one, reload with SIGHUP)",
            )
        if self.admin_key is None:
            self.authorize(request)
        elif not self._bearer(request, self.admin_key):
            if self.api_key is not None and self._bearer(request, self.api_key):
                raise HTTPException(403, "the API key may not use the admin routes: they take the admin key")
            raise HTTPException(401, "invalid admin key")

    def scoped(self, scope: str) -> Check:
        """The check of a route that needs `scope`: the per-user keys', else the API and admin keys'."""
        if self.keys is None:
            return self.authorize_admin if scope == "admin" else self.authorize

        def check(request: Request) -> None:
            found = self.user(request)
            if found is None:
                get_logger().warning("serve_key_unknown", route=request.url.path)
                raise HTTPException(401, "invalid API key")
            request.state.key_name = found.name  # counted with the answer's code (KeyCounter)
            # The key as checked, for the request's later questions (its models): a reload meanwhile
            # must not change who the request is
            request.state.user_key = found
            if scope not in found.scopes:
                get_logger().warning("serve_key_refused", key=found.name, route=request.url.path, scope=scope)
                raise HTTPException(403, f"the key {found.name!r} has no {scope} scope: {request.url.path}")

        return check

    def slots_check(self) -> Check:
        """`/slots` shows every user's prompts: the admin key's when there is one (the admin scope's with
        per-user keys), else the API key's."""
        return self.scoped("admin") if self.keys is not None or self.admin_key is not None else self.authorize

    @property
    def may_restart_fleet(self) -> bool:
        """An admin key (or an admin-scoped per-user key) may restart the fleet's servers: the API key
        may not."""
        return self.admin_key is not None or self.keys is not None

    @property
    def open_to_any_host(self) -> bool:
        """No key at all: the front checks the Host header (a page on another site must not reach it)."""
        return self.api_key is None and self.keys is None

    def model_refused(self, request: Request, model: str | None) -> str | None:
        """Why the request's key may not use `model` (None: it may). A request naming no model gets the
        one model served, or 404 from the router."""
        if self.keys is None:
            return None
        found: UserKey | None = getattr(request.state, "user_key", None)
        if found is None:  # fail closed: a request whose key was not checked uses no model
            return "the request's key was not checked"
        if found.models is None:
            return None
        served = self.served()
        wanted = model if model is not None or len(served) != 1 else served[0]
        if wanted is None or found.allows_model(wanted):
            return None  # no model named among several: the router's 404 says so
        get_logger().warning("serve_key_refused", key=found.name, route=request.url.path, model=wanted)
        return f"the key {found.name!r} may not use the model {wanted!r}"

    def lists_model(self, request: Request, model: str) -> bool:
        """Whether /v1/models lists `model` to the request (with per-user keys: only its key's models,
        fail closed)."""
        if self.keys is None:
            return True
        found: UserKey | None = getattr(request.state, "user_key", None)
        return found is not None and found.allows_model(model)


class UserKeysPage(PageGate):
    """The live page's sign-in with per-user keys: a key with the metrics scope opens it; its cookie is
    the key's name and an HMAC of its name and digest under a secret of this process, so it holds no key,
    and stops opening the page once the key is gone from the file or has lost the scope."""

    def __init__(self, keys: KeyRing) -> None:
        self.keys = keys
        self.secret = secrets.token_bytes(32)

    def _token(self, found: UserKey) -> str:
        mac = hmac.new(self.secret, found.name.encode() + b"\0" + found.digest, hashlib.sha256).hexdigest()
        return f"{found.name}:{mac}"

    @property
    def open(self) -> bool:
        return False

    def sign_in(self, key: str) -> str | None:
        found = self.keys.keys.find(key)
        return self._token(found) if found is not None and "metrics" in found.scopes else None

    def cookie_ok(self, cookie: str) -> bool:
        found = self.keys.keys.named(cookie.partition(":")[0])
        if found is None or "metrics" not in found.scopes:
            return False
        return hmac.compare_digest(cookie.encode(), self._token(found).encode())


class KeyCounter:
    """ASGI middleware: counts each answer under the name of the per-user key that made the request (set
    by the route's check in `request.state`), with its route and code; and logs it."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        code = 500
        scope.setdefault("state", {})  # the routes' request.state: one dict, read back here

        async def sent(message: Any) -> None:
            nonlocal code
            if message["type"] == "http.response.start":
                code = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            name = scope.get("state", {}).get("key_name")
            if name is not None:
                path = str(scope.get("path", ""))
                self.metrics.record_key_request(name, path, code)
                get_logger().info("serve_key_request", key=name, route=path, code=code)
