"""Tier 1: the fleet exporter's text (promtool), its alerting rules (promtool), the page's key rules and
a scrape that never waits on the fleet (a host whose SSH never answers)."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import uvicorn
from fastapi import FastAPI

from orchestrator.inventory.model import Host
from orchestrator.observe.collect import CacheUsageFact, Collector
from orchestrator.observe.prometheus import TTFT_BUCKETS, Histogram, render
from orchestrator.observe.snapshot import (
    CacheView,
    DeviceView,
    FormationDevice,
    FormationView,
    NodeView,
    Snapshot,
    changes,
    formation_changes,
    with_held,
)
from orchestrator.observe.web import COOKIE, Exporter, is_loopback_name, mount, page_token
from orchestrator.serve.metrics import Metrics, Recovery
from tests.plugins.servers import free_port
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None and os.geteuid() != 0, reason="promtool (Debian prometheus) not installed"
)
KEY = "k3y"


def _nodes() -> tuple[NodeView, ...]:
    gib = 1 << 30
    return (
        NodeView(
            host="n1",
            endpoint="10.0.0.1:50052",
            ssh=True,
            state="busy",
            probe="skipped",
            message='serving 10.0.0.9:4242 "quoted"',
            version="rpc-server-7.0.0-cpu",
            protocol="7.0.0",
            restarts=2,
            pid=42,
            devices=(DeviceView(0, "10.0.0.1:50052#0", "cpu", "cpu", 8 * gib, 5 * gib, 4 * gib, 0, 1.5e9),),
            cache=CacheView(3 * gib, 12),
            probed_at=1.7e9,
        ),
        NodeView(host="n2", endpoint="10.0.0.2:50052", ssh=False, state="unknown", probe="refused"),
    )


def _formation(
    state: str = "ready", recoveries: tuple[float, ...] = (4.2,), reloads: int = 1
) -> FormationView:
    return FormationView(
        name="tiny",
        model="tiny",
        state=state,
        nodes=("10.0.0.1:50052",),
        slots_busy=1,
        requests={("/v1/completions", 200): 7, ("/v1/completions", 503): 1},
        prompt_tokens=30,
        completion_tokens=90,
        recoveries=recoveries,
        reloads=reloads,
        devices=(FormationDevice("10.0.0.1:50052", 0, 13, "12 + output", 1 << 30),),
    )


def _text() -> str:
    ttft = Histogram(TTFT_BUCKETS)
    for v in (0.01, 0.3, 7.0, 100.0):
        ttft.observe(v)
    formations = (_formation(),)
    snap = Snapshot(1.7e9, 15.0, nodes=with_held(_nodes(), formations), formations=formations, rounds=3)
    return render(snap, formations, {("tiny", "ttft"): ttft})


def test_the_text_has_every_family_with_prometheus_names_and_the_held_bytes() -> None:
    text = _text()
    assert 'rpcfleet_node_up{host="n1",endpoint="10.0.0.1:50052"} 1' in text
    assert 'rpcfleet_node_up{host="n2",endpoint="10.0.0.2:50052"} 0' in text  # no SSH, RPC refused
    assert 'rpcfleet_node_server_state{host="n1",endpoint="10.0.0.1:50052",state="busy"} 1' in text
    assert 'rpcfleet_node_restarts_total{host="n1",endpoint="10.0.0.1:50052"} 2' in text
    held = (
        'rpcfleet_device_held_bytes{host="n1",endpoint="10.0.0.1:50052",device="10.0.0.1:50052#0",kind="cpu"}'
    )
    assert f"{held} {1 << 30}" in text
    assert 'rpcfleet_cache_files{host="n1",install_dir=""} 12' in text
    assert 'rpcfleet_formation_state{formation="tiny",model="tiny",state="ready"} 1' in text
    bucket = 'rpcfleet_formation_time_to_first_token_seconds_bucket{formation="tiny",model="tiny",le='
    assert f'{bucket}"0.05"}} 1' in text and f'{bucket}"10"}} 3' in text and f'{bucket}"+Inf"}} 4' in text
    assert (
        'rpcfleet_formation_recovery_duration_seconds_bucket{formation="tiny",model="tiny",le="5"} 1' in text
    )
    assert "rpcfleet_exporter_last_round_timestamp_seconds 1700000000" in text
    # the HELP says what the figures are: a CPU server's share of MemAvailable; layers with the output one
    assert "divided among its CPU servers" in text and "the output layer counted as one" in text


@needs_promtool
def test_promtool_accepts_the_exporter_text_and_serve_s_whole_metrics() -> None:
    assert PROMTOOL is not None
    serve = Metrics()
    serve.record_request("/v1/completions", 200)
    serve.record_done(3, 9, 12.5, 0.2)
    serve.record_recovery(Recovery(("10.0.0.2:50052",), 0.1, 1.0, 2.0, 3.1, 1.7e9))
    for text in (_text(), serve.render({"10.0.0.1:50052": True}, "ready") + _text()):
        done = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
    # promtool does fail on a broken name: the check above can fail
    bad = "# HELP x_bytes_total a\n# TYPE x_bytes_total gauge\nx_bytes_total 1\n"
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=bad, capture_output=True, text=True)
    assert done.returncode != 0


@needs_promtool
def test_promtool_checks_the_rules_and_their_cases() -> None:
    assert PROMTOOL is not None
    check = subprocess.run(
        [PROMTOOL, "check", "rules", str(RULES / "rules.yml")], capture_output=True, text=True
    )
    assert check.returncode == 0 and "6 rules found" in check.stdout, check.stdout + check.stderr
    cases = subprocess.run(
        [PROMTOOL, "test", "rules", str(RULES / "rules_test.yml")], capture_output=True, text=True, cwd=RULES
    )
    assert cases.returncode == 0, cases.stdout + cases.stderr


@needs_promtool
def test_promtool_rule_cases_fail_when_a_rule_is_wrong(tmp_path: Path) -> None:
    """The cases can fail: node down alerting after 5 min instead of 1 breaks them."""
    assert PROMTOOL is not None
    rules = (
        (RULES / "rules.yml")
        .read_text()
        .replace(
            "for: 1m\n        labels:\n          severity: critical\n"
            '        annotations:\n          summary: "rpc-server on',
            "for: 5m\n        labels:\n          severity: critical\n"
            '        annotations:\n          summary: "rpc-server on',
            1,
        )
    )
    assert "for: 5m" in rules
    (tmp_path / "rules.yml").write_text(rules)
    shutil.copy(RULES / "rules_test.yml", tmp_path / "rules_test.yml")
    cases = subprocess.run(
        [PROMTOOL, "test", "rules", "rules_test.yml"], capture_output=True, text=True, cwd=tmp_path
    )
    assert cases.returncode != 0 and "RpcfleetNodeDown" in cases.stdout + cases.stderr


def test_events_name_downs_restarts_recoveries_and_reloads() -> None:
    before = _nodes()
    n1 = before[0]
    after = (
        NodeView(**{**n1.__dict__, "state": "crashed", "restarts": 3, "pid": None}),
        NodeView(**{**before[1].__dict__, "probe": "ok"}),
    )
    kinds = [(e.kind, e.host) for e in changes(before, after, 1.0)]
    assert kinds == [("down", "n1"), ("restart", "n1"), ("up", "n2")]
    f0, f1 = _formation(), _formation("degraded", (4.2, 1.0), 2)
    assert [e.kind for e in formation_changes([f0], [f1], 2.0)] == ["recovery", "reload", "state"]


# -- the HTTP side: a real uvicorn on loopback


@pytest.fixture
def exporter_http() -> Iterator[Callable[[Exporter, str | None], int]]:
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(exporter: Exporter, api_key: str | None) -> int:
        app = FastAPI()
        mount(app, exporter, api_key=api_key, metrics=True)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return port

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)


def _get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        answer = conn.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read().decode()
    finally:
        conn.close()


def _post(
    port: int, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        form = {"Content-Type": "application/x-www-form-urlencoded", **(headers or {})}
        conn.request("POST", path, body=body, headers=form)
        answer = conn.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read().decode()
    finally:
        conn.close()


def test_a_scrape_never_waits_on_the_fleet(
    silent_host: Callable[[], Host], exporter_http: Callable[[Exporter, str | None], int]
) -> None:
    """A host whose SSH accepts and never speaks holds the round for its whole timeout; 20 scrapes and
    page reads during it each answer at once, from the snapshot as it was."""
    host = silent_host()
    collector = Collector([host], interval=60.0, timeout=8.0, cache=False)
    port = exporter_http(Exporter(collector), None)
    collector.start()
    try:
        # The round has connected to the silent host (and waits there for its SSH banner).
        wait_until(
            lambda: any(
                c.raddr and (c.raddr.ip, c.raddr.port) == (host.address, host.ssh_port)
                for c in psutil.net_connections("tcp")
            ),
            what="the round's connection to the silent host",
        )
        for _ in range(20):
            for path in ("/metrics", "/fleet.json"):
                started = time.monotonic()
                code, _, body = _get(port, path)
                took = time.monotonic() - started
                assert code == 200 and took < 4.0, (path, took)  # the round holds for 8 s: not waited on
            assert "rpcfleet_exporter_rounds_total 0" in _get(port, "/metrics")[2]
        assert not collector.first_round.is_set()  # every scrape above happened while the round ran
        assert collector.first_round.wait(30)
        code, _, body = _get(port, "/fleet.json")
        node = json.loads(body)["nodes"][0]
        assert (node["ssh"], node["up"], node["state"]) == (False, False, "unknown"), node
    finally:
        collector.stop()


def _exporter_argv(host: Host, tmp_path: Path, port: int) -> list[str]:
    """`rpcfleet exporter` on an inventory of `host` alone, rounds of 60 s."""
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(
        f"hosts:\n  {host.name}:\n    address: {host.address}\n    ssh_port: {host.ssh_port}\n"
        f"    ssh_user: {host.ssh_user}\n    ssh_known_hosts: {host.ssh_known_hosts}\n"
    )
    argv = [sys.executable, "-m", "orchestrator", "exporter", "-i", str(inventory), "--port", str(port)]
    return [*argv, "--interval", "60", "--timeout", "60", "--no-cache"]


def test_the_exporter_command_serves_and_probes_on_one_loop_and_stops_at_once(
    silent_host: Callable[[], Host], tmp_path: Path
) -> None:
    """`rpcfleet exporter` runs its HTTP server and its rounds on the command's one loop (no thread of
    their own): scrapes during a round held by a silent host still answer at once (the round awaits, it
    never blocks the loop), and Ctrl-C ends the command, the round in progress cancelled, silently."""
    host = silent_host()
    port = free_port()
    argv = _exporter_argv(host, tmp_path, port)
    env = {**os.environ, "RPCFLEET_HOME": str(tmp_path / "home")}
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        wait_until(
            lambda: any(
                c.raddr and (c.raddr.ip, c.raddr.port) == (host.address, host.ssh_port)
                for c in psutil.Process(process.pid).net_connections("tcp")
            ),
            what="the round's connection to the silent host",
            limit=60,
        )
        for _ in range(20):
            started = time.monotonic()
            code, _, body = _get(port, "/metrics")
            took = time.monotonic() - started
            assert code == 200 and took < 4.0, took  # the round holds for 60 s: not waited on
            assert "rpcfleet_exporter_rounds_total 0" in body  # the round is still held
        process.send_signal(signal.SIGINT)
        started = time.monotonic()
        _, err = process.communicate(timeout=60)
        assert process.returncode == 130, err
        assert time.monotonic() - started < 30  # the round's connect was cancelled, not waited out
        assert b"Traceback" not in err and b"Task was destroyed" not in err, err
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_page_and_its_json_follow_the_key_rules(
    silent_host: Callable[[], Host], exporter_http: Callable[[Exporter, str | None], int]
) -> None:
    collector = Collector([silent_host()], interval=60.0, timeout=1.0, cache=False)
    port = exporter_http(Exporter(collector), KEY)
    code, _, body = _get(port, "/")
    assert code == 401 and 'name="key"' in body and "rpcfleet_node_up" not in body  # the login form
    assert _get(port, "/fleet.json")[0] == 401
    assert _get(port, "/metrics")[0] == 401
    code, headers, body = _get(port, f"/?key={KEY}")  # a key in an address opens nothing
    assert code == 401 and 'name="key"' in body and "set-cookie" not in headers
    assert _post(port, "/login", b"key=wrong")[0] == 401
    code, headers, _ = _post(port, "/login", f"key={KEY}".encode())  # the form: the only way in
    assert code == 303 and headers["location"].endswith("/")
    cookie = headers["set-cookie"]
    assert (
        cookie.startswith(f"{COOKIE}={page_token(KEY)}") and "HttpOnly" in cookie and KEY + ";" not in cookie
    )
    jar = {"Cookie": f"{COOKIE}={page_token(KEY)}"}
    code, _, body = _get(port, "/", jar)
    assert code == 200 and "fleet.json" in body and "<script>" in body
    assert "<script src" not in body and "<link" not in body and "@import" not in body  # no CDN, no build
    assert _get(port, "/fleet.json", jar)[0] == 200
    assert _get(port, "/fleet.json", {"Cookie": f"{COOKIE}=forged"})[0] == 401
    assert _get(port, "/metrics", {"Authorization": f"Bearer {KEY}"})[0] == 200


def test_the_cache_usage_fact_reads_counts_and_an_absent_folder() -> None:
    fact = CacheUsageFact("/x")
    assert fact.parse("3 1024\n", "", 0) == CacheView(1024, 3)
    assert fact.parse("", "", 3) == CacheView(0, 0)  # never used: empty
    assert fact.parse("", "find: permission denied", 1) is None
    assert fact.parse("garbage", "", 0) is None


@needs_promtool
def test_the_memory_alert_compares_a_cpu_servers_free_share_with_its_share_of_the_ram(tmp_path: Path) -> None:
    """20 CPU servers on one machine of 32 GiB with 20 GiB available: each one's free is a twentieth of
    MemAvailable (1 GiB), 3% of the whole RAM, which fired the alert; against its share of the RAM
    (1.6 GiB) it is 62% free. The exporter's own figures, through the shipped rule, fire nothing."""
    assert PROMTOOL is not None
    from orchestrator.observe.collect import device_view
    from orchestrator.probe.capacity import fleet_capacity
    from orchestrator.probe.host import HostFacts, MemInfo
    from orchestrator.rpc.records import DeviceMemory, Outcome, ProbeResult, ProtocolVersion

    gib = 1 << 30
    facts = HostFacts(memory=MemInfo(total=32 * gib, available=20 * gib), machine_id="m1")
    probed = []
    for i in range(20):
        host = Host(name=f"n{i}", address="10.0.0.1", rpc_host="10.0.0.1", rpc_port=50052 + i)
        result = ProbeResult(
            host.endpoint,
            Outcome.OK,
            ProtocolVersion(7, 0, 0),
            (DeviceMemory(0, 32 * gib, 32 * gib),),
            "",
            0.0,
        )
        probed.append((host, result, facts))
    nodes = tuple(
        NodeView(
            host.name,
            host.endpoint,
            True,
            "running",
            "ok",
            devices=tuple(device_view(d, 1.7e9) for d in devs),
        )
        for (host, _, _), devs in zip(probed, fleet_capacity(probed), strict=True)
    )
    text = render(Snapshot(1.7e9, 15.0, nodes=nodes, rounds=1))
    samples = {
        line.split("{")[0]: line.rsplit(" ", 1)[1]
        for line in text.splitlines()
        if line.startswith("rpcfleet_device_") and 'host="n7"' in line
    }
    free, total, share = (
        int(samples[f"rpcfleet_device_{k}_bytes"]) for k in ("free", "total", "total_share")
    )
    assert (free, total, share) == (20 * gib // 20, 32 * gib, 32 * gib // 20)
    assert free / total < 0.05 < free / share
    labels = 'host="n7",endpoint="10.0.0.1:50059",device="10.0.0.1:50059#0",kind="cpu"'
    series = "".join(
        f"      - series: 'rpcfleet_device_{k}_bytes{{{labels}}}'\n        values: \"{v}x10\"\n"
        for k, v in (("free", free), ("total", total), ("total_share", share))
    )
    (tmp_path / "rules.yml").write_text((RULES / "rules.yml").read_text())
    (tmp_path / "case.yml").write_text(
        "rule_files: [rules.yml]\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n"
        f"{series}    alert_rule_test:\n      - eval_time: 8m\n"
        "        alertname: RpcfleetDeviceMemoryNearlyFull\n        exp_alerts: []\n"
    )
    cases = subprocess.run(
        [PROMTOOL, "test", "rules", "case.yml"], capture_output=True, text=True, cwd=tmp_path
    )
    assert cases.returncode == 0, cases.stdout + cases.stderr


def test_a_cache_shared_by_the_servers_of_one_install_counts_once() -> None:
    """The servers of one host (`rpc_servers`) share its install's cache folder: each server's read of it
    is the same folder, one sample per install, named by its machine (was one per server: 2 x the bytes)."""
    from orchestrator.inventory.model import servers_of
    from orchestrator.inventory.variables import RpcServer
    from orchestrator.observe.collect import cache_view

    gib = 1 << 30
    two = Host(name="h1", address="10.0.0.1", rpc_servers=(RpcServer(50052, "a"), RpcServer(50053, "b")))
    one = Host(name="h2", address="10.0.0.2", install_dir="/opt/rpcfleet")
    reads = {"10.0.0.1": CacheView(3 * gib, 12), "10.0.0.2": CacheView(gib, 4)}
    nodes = tuple(
        NodeView(s.name, s.endpoint, True, "running", "ok", cache=cache_view(s, reads[s.address]))
        for s in [*servers_of(two), one]
    )
    assert [n.host for n in nodes] == ["h1/a", "h1/b", "h2"]
    text = render(Snapshot(1.7e9, 15.0, nodes=nodes, rounds=1))
    lines = [line for line in text.splitlines() if line.startswith("rpcfleet_cache_")]
    assert lines == [
        f'rpcfleet_cache_bytes{{host="h1",install_dir="~/.local/lib/rpcfleet"}} {3 * gib}',
        f'rpcfleet_cache_bytes{{host="h2",install_dir="/opt/rpcfleet"}} {gib}',
        'rpcfleet_cache_files{host="h1",install_dir="~/.local/lib/rpcfleet"} 12',
        'rpcfleet_cache_files{host="h2",install_dir="/opt/rpcfleet"} 4',
    ]


def test_only_loopback_names_pass_the_host_check() -> None:
    for host in ("localhost", "localhost:9464", "LOCALHOST.", "app.localhost", "127.0.0.1:80", "127.9.9.9"):
        assert is_loopback_name(host), host
    for host in ("[::1]:9464", "::1"):
        assert is_loopback_name(host), host
    for host in ("", "evil.example", "evil.example:9464", "127.0.0.1.evil.example", "10.0.0.1", "[fd00::1]"):
        assert not is_loopback_name(host), host


def test_the_keyless_exporter_refuses_a_foreign_host_and_bounds_the_login_body(
    silent_host: Callable[[], Host], tmp_path: Path
) -> None:
    """The real `rpcfleet exporter` command (the guard is in front of its app, not in a test's)."""
    host = silent_host()
    port = free_port()
    argv = _exporter_argv(host, tmp_path, port)
    env = {k: v for k, v in os.environ.items() if k != "RPCFLEET_API_KEY"}
    env["RPCFLEET_HOME"] = str(tmp_path / "home")
    process = subprocess.Popen(argv, env=env, cwd=ROOT)
    try:
        wait_until(lambda: _is_listening(port), what="the exporter's port", limit=60)
        code, _, body = _get(port, "/metrics", {"Host": "rebound.example"})
        assert code == 403 and "not a loopback name" in body, body
        assert _get(port, "/metrics", {"Host": f"localhost:{port}"})[0] == 200
        code, _, body = _post(port, "/login", b"key=" + b"x" * 5000)
        assert code == 413 and "over 4096 bytes" in body, body
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(60)


def _is_listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0
