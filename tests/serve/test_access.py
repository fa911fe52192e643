"""serve's access rules (`serve/access.py: Access`) alone, on requests made here, without an app: the API
and admin keys, the per-user keys' scopes and models, and what each refusal says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi import HTTPException, Request

from orchestrator.serve.access import Access, bearer_token
from orchestrator.serve.keys import KeyRing, read_keys_file

API, ADMIN = "sk-api-0123456789abcdef", "sk-admin-0123456789abcd"
ALICE = "sk-alice-0123456789abcdef"  # inference, model a only
OPS = "sk-ops-0123456789abcdefgh"  # admin and metrics


def _request(key: str | None = None, path: str = "/v1/completions", scheme: str = "Bearer") -> Request:
    headers = [] if key is None else [(b"authorization", f"{scheme} {key}".encode())]
    return Request({"type": "http", "method": "POST", "path": path, "headers": headers, "state": {}})


def _refused(check: Any, request: Request) -> tuple[int, str] | None:
    try:
        check(request)
    except HTTPException as exc:
        return exc.status_code, str(exc.detail)
    return None


def test_the_bearer_token_is_read_whatever_the_scheme_case() -> None:
    assert bearer_token(_request("k", scheme="bearer")) == "k"
    assert bearer_token(_request("k", scheme="Basic")) is None and bearer_token(_request()) is None


def test_the_api_key_and_the_admin_key_each_open_their_routes() -> None:
    both = Access(api_key=API, admin_key=ADMIN)
    assert both.has_key(_request(API)) and not both.has_key(_request(ADMIN + "x"))
    assert _refused(both.scoped("inference"), _request(API)) is None
    assert _refused(both.scoped("inference"), _request("nope")) == (401, "invalid API key")
    assert _refused(both.scoped("admin"), _request(ADMIN)) is None
    assert _refused(both.scoped("admin"), _request(API)) == (
        403,
        "the API key may not use the admin routes: they take the admin key",
    )
    assert _refused(both.scoped("admin"), _request("nope")) == (401, "invalid admin key")
    assert _refused(both.slots_check(), _request(API)) is not None  # every user's prompts: the admin's
    assert both.may_restart_fleet and not both.open_to_any_host
    api_only = Access(api_key=API)
    assert _refused(api_only.scoped("admin"), _request(API)) is None and not api_only.may_restart_fleet
    assert _refused(api_only.slots_check(), _request(API)) is None


def test_without_any_key_everything_but_the_admin_routes_is_open() -> None:
    open_ = Access(api_key=None)
    assert open_.has_key(_request()) and open_.open_to_any_host
    assert _refused(open_.scoped("inference"), _request()) is None
    status, message = _refused(open_.scoped("admin"), _request()) or (0, "")
    assert status == 403 and "need an API key" in message
    assert open_.model_refused(_request(), "any") is None and open_.lists_model(_request(), "any")


def test_per_user_keys_open_their_scopes_and_models_only(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"alice {ALICE} inference a\nops {OPS} admin,metrics\n")
    ring = KeyRing(read_keys_file(path, ["a", "b"]))
    served = ["a", "b"]
    access = Access(api_key=None, keys=ring, served=lambda: served)
    alice, ops = _request(ALICE), _request(OPS, "/admin/reload")
    assert _refused(access.scoped("inference"), alice) is None and alice.state.key_name == "alice"
    assert _refused(access.scoped("admin"), _request(ALICE, "/admin/reload")) == (
        403,
        "the key 'alice' has no admin scope: /admin/reload",
    )
    assert _refused(access.scoped("inference"), _request("sk-nobody-0123456789abcd")) == (
        401,
        "invalid API key",
    )
    assert _refused(access.scoped("admin"), ops) is None and access.has_key(ops) and not access.has_key(alice)
    assert access.model_refused(alice, "a") is None and access.lists_model(alice, "a")
    assert access.model_refused(alice, "b") == "the key 'alice' may not use the model 'b'"
    assert not access.lists_model(alice, "b")
    assert access.model_refused(alice, None) is None  # no model named among several: the router's 404
    served[:] = ["b"]
    assert access.model_refused(alice, None) == "the key 'alice' may not use the model 'b'"  # the one served
    unchecked = _request(ALICE)  # a request whose key no route checked uses no model (fail closed)
    assert access.model_refused(unchecked, "a") == "the request's key was not checked"
    assert not access.lists_model(unchecked, "a")
    assert access.may_restart_fleet and not access.open_to_any_host


def test_per_user_keys_replace_the_other_two(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"alice {ALICE} inference\n")
    with pytest.raises(ValueError, match="replace the API key"):
        Access(api_key=API, keys=KeyRing(read_keys_file(path)))
