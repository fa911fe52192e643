"""Tier 1 for serve's per-user keys (`--keys`, `orchestrator.serve.keys`): every bad line refused naming
the file and line and never the key, each scope's routes open to it and closed to the others (401 for no
key, 403 naming the key's name), a key's model list (its requests and `/v1/models`), hashed keys, the
live page's sign-in, the name (never the key) in the metrics and logs, and the re-read of the file (a bad
one keeps the keys in force; 20 rounds of requests while it is re-read never see a valid key refused).
The front runs over fake engines that speak HTTP (tests/plugins/serve_rig.py); the real serve, SIGHUP
included, is in test_serve.py."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from orchestrator.core.errors import UsageError
from orchestrator.core.target import Target
from orchestrator.planning.plan import Plan
from orchestrator.serve.formation import Formation
from orchestrator.serve.keys import KeyRing, hashed, parse_keys_file, read_keys_file
from orchestrator.serve.router import Router
from orchestrator.serve.states import ServeConfig
from orchestrator.workflows.serve import reload_keys
from tests.plugins.serve_rig import FakeFleet, HttpEngine
from tests.plugins.servers import free_port

ALICE = "sk-alice-0123456789abcdef"  # inference, model a only
BOB = "sk-bob-0123456789abcdefgh"  # inference, every model
OPS = "sk-ops-0123456789abcdefgh"  # admin and metrics, written hashed
GRAFANA = "sk-grafana-0123456789ab"  # metrics
SECRETS = (ALICE, BOB, OPS, GRAFANA)
KEYS = f"""# who  key  scopes  [models]
alice   {ALICE}   inference  a
bob     {BOB}     inference
ops     {hashed(OPS)}   admin,metrics   # hashed: the file holds no secret of ops'

grafana {GRAFANA} metrics
"""


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("alice", "expected NAME KEY SCOPES [MODELS], got 1 field"),
        (f"alice {ALICE}", "expected NAME KEY SCOPES [MODELS], got 2 fields"),
        (f"alice {ALICE} inference a b", "got 5 fields (a list has no spaces: a,b)"),
        (f"alice {ALICE} inferense", "alice: unknown scope 'inferense' (did you mean 'inference'?)"),
        (f"alice {ALICE} {BOB}", "alice: unknown scope (scopes: inference, metrics, admin)"),  # not quoted
        (f"alice {ALICE} inference,", "an empty item in the scopes list 'inference,'"),
        (f"alice {ALICE} ,", "an empty item in the scopes list ','"),
        ("alice sk-short inference", "the key is shorter than 16 characters"),
        ("alice sha256:abc inference", "a hashed key is sha256: and 64 hexadecimal digits"),
        (f"alice sha256:{'g' * 64} inference", "a hashed key is sha256: and 64 hexadecimal digits"),
        (f"al/ice {ALICE} inference", "the name 'al/ice' may hold only letters, digits"),
        (f"bob {ALICE} inference", "the name 'bob' is already the key's of line 2"),
        (f"carol {BOB} inference", "carol: the same key as line 2's"),
        (f"carol {hashed(BOB)} inference", "carol: the same key as line 2's"),  # hashed or not
        (f"carol {ALICE}x inference gemmma", "the model 'gemmma' (did you mean 'gemma'?) is not served"),
        (f"carol {ALICE}x metrics gemma", "carol: a model list limits the inference scope, which it lacks"),
    ],
)
def test_a_bad_line_is_refused_naming_the_file_and_line_and_never_the_key(
    tmp_path: Path, line: str, message: str
) -> None:
    path = tmp_path / "keys"
    text = f"# the users\nbob {BOB} inference\n\n{line}\n"
    with pytest.raises(UsageError) as refused:
        parse_keys_file(path, text, ["gemma", "tiny"])
    said = str(refused.value)
    assert said.startswith(f"{path}:4: ") and message in said, said
    assert not any(secret in said for secret in SECRETS), said


def test_an_empty_or_unreadable_keys_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    with pytest.raises(UsageError, match=f"{path}: the keys file holds no key"):
        parse_keys_file(path, "# nobody yet\n\n")
    with pytest.raises(UsageError, match=f"--keys {tmp_path / 'none'}: No such file"):
        read_keys_file(tmp_path / "none")


def _serve(*argv: str, home: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "serve", "--port", str(free_port()), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("RPCFLEET_")}
        | {"RPCFLEET_HOME": str(home), **(env or {})},
    )


def test_serve_refuses_a_bad_keys_file_or_a_key_beside_it_with_exit_2_and_no_traceback(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Every bad line (the cases above) stops `rpcfleet serve` before anything starts, exit status 2; so
    does another key given beside --keys (a flag or the environment), and --reload-rolling."""
    model = tiny_model.stem
    cases: list[tuple[list[str], dict[str, str], str]] = []
    for i, (line, message) in enumerate(
        [
            ("alice", "got 1 field"),
            (f"alice {ALICE} inferense", "unknown scope 'inferense' (did you mean 'inference'?)"),
            (f"alice {ALICE} ,", "an empty item in the scopes list"),
            ("alice sk-short inference", "shorter than 16 characters"),
            ("alice sha256:abc inference", "a hashed key is sha256:"),
            (f"bob {ALICE} inference", "the name 'bob' is already"),
            (f"carol {BOB} inference", "the same key as line 1's"),
            (f"carol {ALICE} inference nope", "the model 'nope' is not served"),
        ]
    ):
        path = tmp_path / f"keys{i}"
        path.write_text(f"bob {BOB} inference {model}\n{line}\n")
        cases.append((["--keys", str(path)], {}, f"{path}:2: "))
        cases.append((["--keys", str(path)], {}, message))
    good = tmp_path / "good"
    good.write_text(f"bob {BOB} inference\n")
    good.chmod(0o600)
    admin = tmp_path / "admin.key"
    admin.write_text("4dm1n-key-0123456789\n")
    cases += [
        (["--keys", str(good), "--api-key-file", str(admin)], {}, "not allowed with argument"),
        (["--keys", str(good), "--admin-key-file", str(admin)], {}, "--keys excludes --admin-key-file"),
        (["--keys", str(good), "--reload-rolling"], {}, "--keys excludes --reload-rolling"),
        (["--keys", str(good)], {"RPCFLEET_API_KEY": BOB}, "--keys replaces RPCFLEET_API_KEY"),
        (["--keys", str(tmp_path / "none")], {}, "No such file"),
    ]
    runs = [(_serve("-m", str(tiny_model), *argv, home=tmp_path, env=env), said) for argv, env, said in cases]
    for process, said in runs:
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 2 and said in stderr, (said, stderr)
        assert "Traceback" not in stderr and not any(secret in stderr for secret in SECRETS), stderr


def test_keys_need_no_loopback_host_and_exclude_the_other_keys() -> None:
    from orchestrator.cli import _inputs

    args = argparse.Namespace(host="0.0.0.0", keys=Path("keys"), admin_key_file=None, reload_rolling=False)
    assert _inputs.listen_key_of(args, "it") is None  # the keys file guards a public address
    assert _inputs.admin_key_of(args, None) is None
    with pytest.raises(UsageError, match="--keys excludes --admin-key-file"):
        _inputs.listen_key_of(argparse.Namespace(**{**vars(args), "admin_key_file": Path("a")}), "it")


@pytest.fixture
def keyed(tiny_model: Path, tmp_path: Path) -> Iterator[Callable[..., tuple[Any, KeyRing]]]:
    """Factory: serve's front with per-user keys (the file `KEYS` by default) over models a and b, one
    formation each on fake engines, ready; its live page on an exporter that never probes."""
    from fastapi.testclient import TestClient

    from orchestrator.observe.collect import Collector
    from orchestrator.observe.web import Exporter
    from orchestrator.serve.app import create_app

    made: list[tuple[Any, Router]] = []

    def make(text: str = KEYS) -> tuple[Any, KeyRing]:
        formations = []
        for model in ("a", "b"):
            fleet = FakeFleet(tiny_model)

            def factory(plan: Plan, targets: Mapping[str, Target], fleet: FakeFleet = fleet) -> HttpEngine:
                return HttpEngine(plan, fleet, 0)

            config = ServeConfig(retry_interval=0.005, rejoin_interval=0.0)
            formations.append(Formation(f"{model}#0", model, fleet, config, factory))
        router = Router(formations)
        path = tmp_path / "keys"
        path.write_text(text)
        ring = KeyRing(read_keys_file(path, router.models))
        exporter = Exporter(Collector([], interval=60.0, timeout=1.0, cache=False))
        client = TestClient(create_app(router, api_key=None, keys=ring, exporter=exporter))
        client.__enter__()  # one loop for the routes and the formations, as in serve
        made.append((client, router))
        client.portal.call(router.start)
        deadline = time.monotonic() + 10
        while router.state != "ready":
            assert time.monotonic() < deadline, router.state
            time.sleep(0.005)
        return client, ring

    yield make
    for client, router in made:
        client.portal.call(router.stop)
        client.__exit__(None, None, None)


def _as(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key is not None else {}


COMPLETION = {"model": "a", "prompt": "hi", "max_tokens": 2}


def test_each_scope_opens_its_routes_and_no_other(keyed: Callable[..., tuple[Any, KeyRing]]) -> None:
    client, _ = keyed()
    routes: dict[str, Callable[[str | None], Any]] = {
        "inference": lambda key: client.post("/v1/completions", json=COMPLETION, headers=_as(key)),
        "inference models": lambda key: client.get("/v1/models", headers=_as(key)),
        "metrics": lambda key: client.get("/metrics", headers=_as(key)),
        "admin": lambda key: client.post("/admin/reload", json={}, headers=_as(key)),
    }
    allowed = {"alice": {"inference"}, "bob": {"inference"}, "ops": {"admin", "metrics"}}
    allowed["grafana"] = {"metrics"}
    keys = {"alice": ALICE, "bob": BOB, "ops": OPS, "grafana": GRAFANA}
    for route, call in routes.items():
        scope = route.split()[0]
        for name, key in keys.items():
            answer = call(key)
            if scope in allowed[name]:
                assert answer.status_code in (200, 202), (route, name, answer.text)
            else:
                error = answer.json()["error"]
                assert answer.status_code == 403 and error["type"] == "permission_denied", (route, name)
                assert error["message"].startswith(f"the key {name!r} has no {scope} scope"), error
                assert key not in answer.text
        for key in (None, "sk-nobody-0123456789abc", f"{ALICE}x"):
            answer = call(key)
            assert answer.status_code == 401 and answer.json()["error"]["message"] == "invalid API key", route
    # /health: anyone its state; a metrics key its details; an inference key the state only
    assert set(client.get("/health", headers=_as(ALICE)).json()) == {"status"}
    assert "formations" in client.get("/health", headers=_as(GRAFANA)).json()
    # an admin-scoped key is the admin key: it may restart the fleet's servers too
    rolling = client.post("/admin/reload", json={"rolling_restart": True}, headers=_as(OPS))
    assert rolling.status_code == 202 and rolling.json()["rolling_restart"] is True, rolling.text
    # /slots holds every user's prompts: the admin scope's
    assert client.get("/slots", headers=_as(BOB)).status_code == 403
    assert client.get("/slots", headers=_as(OPS)).status_code == 200


def test_a_keys_model_list_limits_its_requests_and_its_models(
    keyed: Callable[..., tuple[Any, KeyRing]],
) -> None:
    client, _ = keyed()
    listed = client.get("/v1/models", headers=_as(ALICE)).json()["data"]
    assert [m["id"] for m in listed] == ["a"]
    assert [m["id"] for m in client.get("/v1/models", headers=_as(BOB)).json()["data"]] == ["a", "b"]
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings"):
        body: dict[str, Any] = {"model": "b", "prompt": "hi", "max_tokens": 2}
        if route == "/v1/chat/completions":
            body = {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        elif route == "/v1/embeddings":
            body = {"model": "b", "input": "hi"}
        refused = client.post(route, json=body, headers=_as(ALICE))
        error = refused.json()["error"]
        assert refused.status_code == 403 and error["message"] == "the key 'alice' may not use the model 'b'"
        assert error["param"] == "model" and ALICE not in refused.text
        # let through to the engine (the fake one answers no embeddings: 502)
        assert client.post(route, json=body, headers=_as(BOB)).status_code not in (401, 403), route
        allowed = client.post(route, json={**body, "model": "a"}, headers=_as(ALICE))
        assert allowed.status_code not in (401, 403), route
    # A request naming no model among two: the router's 404, whoever asks
    assert client.post("/v1/completions", json={"prompt": "hi"}, headers=_as(ALICE)).status_code == 404


def test_the_live_page_opens_to_a_metrics_key_until_the_key_is_gone(
    keyed: Callable[..., tuple[Any, KeyRing]],
) -> None:
    client, ring = keyed()
    assert client.get("/").status_code == 401  # the sign-in form
    wrong = client.post("/login", data={"key": ALICE}, follow_redirects=False)  # no metrics scope
    assert wrong.status_code == 401 and "wrong key" in wrong.text
    signed = client.post("/login", data={"key": GRAFANA}, follow_redirects=False)
    assert signed.status_code == 303
    cookie = signed.cookies["rpcfleet_page"]

    def with_cookie(path: str, value: str) -> int:
        client.cookies.clear()
        client.cookies.set("rpcfleet_page", value)
        return int(client.get(path).status_code)

    assert cookie.startswith("grafana:") and GRAFANA not in cookie
    assert with_cookie("/", cookie) == 200
    assert with_cookie("/fleet.json", cookie) == 200
    forged = "grafana:" + "0" * 64
    assert with_cookie("/fleet.json", forged) == 401
    client.cookies.clear()
    assert client.get("/fleet.json", headers=_as(GRAFANA)).status_code == 200
    ring.keys.path.write_text(KEYS.replace(f"grafana {GRAFANA} metrics", f"grafana {GRAFANA} inference"))
    assert client.portal.call(reload_keys, ring, ["a", "b"])
    assert with_cookie("/", cookie) == 401  # the scope is gone


def test_the_metrics_and_logs_name_the_key_never_the_key_itself(
    keyed: Callable[..., tuple[Any, KeyRing]],
) -> None:
    from orchestrator.core import log

    client, _ = keyed()
    err = io.StringIO()
    log.configure_logging("text", "info")
    try:
        with contextlib.redirect_stderr(err):
            assert client.post("/v1/completions", json=COMPLETION, headers=_as(ALICE)).status_code == 200
            assert client.post("/v1/completions", json={**COMPLETION, "model": "b"}, headers=_as(ALICE))
            assert client.get("/metrics", headers=_as(ALICE)).status_code == 403
            assert client.get("/metrics", headers=_as(f"{BOB}-not")).status_code == 401
            metrics = client.get("/metrics", headers=_as(OPS)).text
    finally:
        log.configure_logging("text", "warning")
    logged = err.getvalue()
    assert 'rpcfleet_key_requests_total{key="alice",route="/v1/completions",code="200"} 1' in metrics
    assert 'rpcfleet_key_requests_total{key="alice",route="/v1/completions",code="403"} 1' in metrics
    assert 'rpcfleet_key_requests_total{key="alice",route="/metrics",code="403"} 1' in metrics
    assert 'rpcfleet_requests_total{route="/v1/completions",code="200"} 1' in metrics  # as before
    assert "serve_key_request key=alice route=/v1/completions code=200" in logged, logged
    assert "serve_key_refused key=alice route=/v1/completions model=b" in logged, logged
    assert "serve_key_unknown route=/metrics" in logged, logged
    for secret in (*SECRETS, f"{BOB}-not", hashed(OPS)[7:]):
        assert secret not in metrics and secret not in logged, secret


def test_a_bad_keys_file_on_reload_keeps_the_keys_in_force(keyed: Callable[..., tuple[Any, KeyRing]]) -> None:
    client, ring = keyed()
    path = ring.keys.path
    path.write_text(KEYS + f"carol {ALICE} inference\n")  # alice's key again: refused, line 7
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert not client.portal.call(reload_keys, ring, ["a", "b"])
    assert f"{path}:7: carol: the same key as line 2's" in err.getvalue() and ALICE not in err.getvalue()
    assert client.get("/v1/models", headers=_as(ALICE)).status_code == 200  # the old keys stay
    path.write_text(f"carol {ALICE} inference\n")  # alice's key is carol's now, bob's is gone
    with contextlib.redirect_stderr(err):
        assert client.portal.call(reload_keys, ring, ["a", "b"])
    assert client.get("/v1/models", headers=_as(BOB)).status_code == 401
    assert client.get("/metrics", headers=_as(OPS)).status_code == 401
    assert [m["id"] for m in client.get("/v1/models", headers=_as(ALICE)).json()["data"]] == ["a", "b"]


def test_requests_while_the_keys_are_reread_never_refuse_a_valid_key(
    keyed: Callable[..., tuple[Any, KeyRing]],
) -> None:
    """20 rounds: four clients send requests with bob's key while the file is rewritten (renamed over,
    as an editor or a config manager does) and re-read, with and without the others' keys, or broken."""
    client, ring = keyed()
    path = ring.keys.path
    codes: list[int] = []
    stop = threading.Event()

    def ask() -> None:
        while not stop.is_set():
            codes.append(client.get("/v1/models", headers=_as(BOB)).status_code)

    clients = [threading.Thread(target=ask) for _ in range(4)]
    for thread in clients:
        thread.start()
    try:
        for round_ in range(20):
            text = KEYS if round_ % 3 == 0 else f"bob {BOB} inference\n"
            if round_ % 3 == 2:
                text += "broken\n"
            new = path.with_suffix(".new")
            new.write_text(text)
            new.replace(path)
            reloaded = client.portal.call(reload_keys, ring, ["a", "b"])
            assert reloaded == (round_ % 3 != 2), round_
            held = len(codes)
            deadline = time.monotonic() + 10
            while len(codes) < held + 4:  # requests of each round between two reloads
                assert time.monotonic() < deadline
                time.sleep(0.001)
            ok = client.get("/v1/models", headers=_as(ALICE)).status_code
            assert ok == (200 if round_ % 3 == 0 else 401), round_  # alice's key comes and goes
    finally:
        stop.set()
        for thread in clients:
            thread.join(10)
    assert len(codes) > 80 and set(codes) == {200}, sorted(set(codes))
