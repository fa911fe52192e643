"""Tier 1 for `rpcfleet serve`: the Prometheus text, the refusals made before anything is served, and
the API key (from a file or the environment) guarding /health's details and the admin routes, on a real
serve over a real local rpc-server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.serve.metrics import Metrics, Recovery
from tests.plugins.servers import LocalServer, free_port, write_local_inventory

KEY = "k3y-from-elsewhere"


def _serve(*argv: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "serve", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RPCFLEET_HOME": str(home)},
    )


def test_the_metrics_are_prometheus_text_with_every_family() -> None:
    metrics = Metrics()
    metrics.record_request("/v1/completions", 200)
    metrics.record_request("/v1/completions", 200)
    metrics.record_request("/v1/completions", 429)
    metrics.record_done(5, 16, 42.5, 0.25)
    metrics.record_recovery(Recovery(("10.0.0.2:50052",), 0.1, 0.3, 1.5, 1.9, 0.0))
    text = metrics.render({"10.0.0.1:50052": True, '10.0.0.2:50052"': False}, "degraded")
    assert 'rpcfleet_requests_total{route="/v1/completions",code="200"} 2' in text
    assert 'rpcfleet_requests_total{route="/v1/completions",code="429"} 1' in text
    assert 'rpcfleet_tokens_total{kind="completion"} 16' in text
    assert (
        "rpcfleet_time_to_first_token_seconds_sum 0.25\nrpcfleet_time_to_first_token_seconds_count 1" in text
    )
    assert 'rpcfleet_endpoint_up{endpoint="10.0.0.2:50052\\""} 0' in text  # a quote in a label is escaped
    assert 'rpcfleet_state{state="degraded"} 1' in text and 'rpcfleet_state{state="ready"} 0' in text
    assert 'rpcfleet_recovery_seconds{phase="total"} 1.9' in text
    for line in text.splitlines():  # every sample line: name{labels} value
        assert line.startswith("#") or (len(line.rsplit(" ", 1)) == 2 and float(line.rsplit(" ", 1)[1]) >= 0)


def test_a_public_bind_without_a_key_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    done = _serve("-m", str(tiny_model), "--host", "0.0.0.0", home=tmp_path)
    assert done.returncode == 2 and "without an API key is refused" in done.stderr, done.stderr
    key = tmp_path / "empty.key"
    key.write_text("\n")
    done = _serve("-m", str(tiny_model), "--api-key-file", str(key), home=tmp_path)
    assert done.returncode == 2 and f"{key}:1: the first line is empty" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_fleet_that_cannot_hold_the_model_is_an_error_at_start(tiny_model: Path, tmp_path: Path) -> None:
    inventory = write_local_inventory(tmp_path / "inv.yml", {"gone": {"rpc_port": free_port()}})
    done = _serve("-i", str(inventory), "-m", str(tiny_model), "--port", str(free_port()), home=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "cannot serve" in done.stderr and "no node answers" in done.stderr and "refused" in done.stderr
    assert "Traceback" not in done.stderr


def _http(url: str, key: str | None = None, body: bytes | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(url, data=body, headers=headers, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture
def local_serve(
    start_rpc_server: Callable[..., LocalServer], tiny_model: Path, tmp_path: Path
) -> Iterator[Callable[..., tuple[subprocess.Popen[bytes], str]]]:
    """Factory: `rpcfleet serve` (extra argv, extra environment) on one real local rpc-server, ready."""
    server = start_rpc_server()
    inventory = write_local_inventory(tmp_path / "inv.yml", {"n1": {"rpc_port": server.port}})
    started: list[subprocess.Popen[bytes]] = []

    def start(*extra: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
        for process in started:  # one client at a time on the server: the previous serve goes first
            process.send_signal(signal.SIGINT)
            process.wait(20)
        port = free_port()
        argv = [sys.executable, "-m", "orchestrator", "serve", "-i", str(inventory), "-m", str(tiny_model)]
        argv += ["--ctx", "512", "--port", str(port), *extra]
        log = tmp_path / f"serve-{port}.log"
        environment = {k: v for k, v in os.environ.items() if k != "RPCFLEET_API_KEY"}
        environment |= {"RPCFLEET_HOME": str(tmp_path), **(env or {})}
        with log.open("wb") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=environment)
        started.append(process)
        base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 90
        while time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()
            try:
                if _http(f"{base}/health")[1]["status"] == "ready":
                    return process, base
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"serve not ready in 90 s: {log.read_text()}")

    yield start
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_a_key_from_the_environment_guards_the_health_details_and_the_admin_routes(
    local_serve: Callable[..., tuple[subprocess.Popen[bytes], str]],
) -> None:
    process, base = local_serve(env={"RPCFLEET_API_KEY": f"  {KEY}  "})
    assert KEY not in Path(f"/proc/{process.pid}/cmdline").read_text()  # not on argv, where `ps` shows it
    for key in (None, "wrong"):
        code, health = _http(f"{base}/health", key)
        assert code == 200 and health == {"status": "ready"}, health  # no model path, pid, endpoint
    code, health = _http(f"{base}/health", KEY)
    assert code == 200 and health["pid"] == process.pid and health["model"].endswith(".gguf"), health
    assert health["plan"]["endpoints"] and health["worker_pid"], health
    assert _http(f"{base}/v1/models", KEY)[0] == 200 and _http(f"{base}/v1/models")[0] == 401
    assert _http(f"{base}/metrics")[0] == 401
    code, answer = _http(f"{base}/admin/reload", None, b"{}")
    assert code == 401 and answer["error"]["message"] == "invalid API key", answer
    code, answer = _http(f"{base}/admin/reload", KEY, b"{}")
    assert code == 202 and answer["status"] == "draining", answer
    deadline = time.monotonic() + 60
    while _http(f"{base}/health", KEY)[1]["reloads"] != 1 or _http(f"{base}/health")[1]["status"] != "ready":
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.1)


def test_a_key_from_a_file_is_the_one_clients_send(
    local_serve: Callable[..., tuple[subprocess.Popen[bytes], str]], tmp_path: Path
) -> None:
    key_file = tmp_path / "serve.key"
    key_file.write_text(f"{KEY}\nthe second line is not read\n")
    _, base = local_serve("--api-key-file", str(key_file), env={"RPCFLEET_API_KEY": "not-this-one"})
    assert _http(f"{base}/v1/models", KEY)[0] == 200
    assert _http(f"{base}/v1/models", "not-this-one")[0] == 401  # the file wins over the environment
    assert set(_http(f"{base}/health")[1]) == {"status"} and "plan" in _http(f"{base}/health", KEY)[1]


def test_without_a_key_the_admin_routes_are_refused_and_sighup_reloads(
    local_serve: Callable[..., tuple[subprocess.Popen[bytes], str]],
) -> None:
    process, base = local_serve()
    code, answer = _http(f"{base}/admin/reload", "anything", b"{}")
    assert code == 403 and "need an API key" in answer["error"]["message"], answer
    assert "SIGHUP" in answer["error"]["message"]
    assert _http(f"{base}/health")[1]["reloads"] == 0  # refused: nothing drained
    process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    while (health := _http(f"{base}/health")[1])["reloads"] != 1 or health["status"] != "ready":
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.1)


def test_an_empty_key_in_the_environment_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "serve", "-m", str(tiny_model), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RPCFLEET_HOME": str(tmp_path), "RPCFLEET_API_KEY": " "},
    )
    assert done.returncode == 2 and "RPCFLEET_API_KEY is set but empty" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    done = _serve("-m", str(tiny_model), "--api-key", " ", home=tmp_path)
    assert done.returncode == 2 and "--api-key is empty" in done.stderr, done.stderr
