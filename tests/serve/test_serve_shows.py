"""What `rpcfleet serve` shows, with real engines (llama-server) over real local rpc-servers (issue 42,
item 6): each formation's time to first token and request duration histograms filled by real requests,
and an on-demand model's load and idle unload on the console, the live page's events and `/metrics`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.plugins.servers import LocalServer, free_port, write_local_inventory

KEY = "k3y-of-the-shows"


def _get(base: str, path: str) -> str:
    request = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return str(answer.read().decode())


def _post(base: str, body: dict[str, Any]) -> tuple[int, bytes]:
    request = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _samples(text: str, family: str) -> dict[str, float]:
    """`family`'s samples of the Prometheus text: their labels (as written) -> value."""
    out = {}
    for line in text.splitlines():
        if line.startswith(family + "{"):
            labels, _, value = line[len(family) :].rpartition(" ")
            out[labels] = float(value)
    return out


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., tuple[str, list[str]]]]:
    """Factory: `rpcfleet serve ARGV` (its API key KEY), once /health answers; its base URL and the
    lines of its stderr so far (a list that grows)."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*argv: str) -> tuple[str, list[str]]:
        port = free_port()
        command = [sys.executable, "-m", "orchestrator", "serve", *argv, "--port", str(port)]
        env = {**os.environ, "RPCFLEET_HOME": str(tmp_path / "home"), "RPCFLEET_API_KEY": KEY}
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        started.append(process)
        lines: list[str] = []

        def drain() -> None:
            assert process.stderr is not None
            for line in process.stderr:
                lines.append(line.decode(errors="replace"))

        threading.Thread(target=drain, daemon=True).start()
        base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while time.monotonic() < deadline:
            assert process.poll() is None, "".join(lines)
            try:
                health = json.loads(_get(base, "/health"))
                if health["status"] == "ready" and not health.get("loading"):
                    return base, lines
            except (urllib.error.URLError, ConnectionError, ValueError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"serve not ready in 120 s: {''.join(lines)}")

    yield start
    for process in started:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.llama
def test_each_formations_time_to_first_token_and_duration_histograms_hold_its_real_requests(
    start_rpc_server: Callable[..., LocalServer],
    serve: Callable[..., tuple[str, list[str]]],
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    nodes: dict[str, dict[str, object]] = {f"n{i}": {"rpc_port": start_rpc_server().port} for i in range(2)}
    inventory = write_local_inventory(tmp_path / "inv.yml", nodes)
    base, _ = serve(
        "-i", str(inventory), "-m", str(tiny_model), "--ctx", "512", "--replicas", "2", "--parallel", "1",
        "--routing", "least-loaded", "--observe-interval", "1",
    )  # fmt: skip
    formations = [f["name"] for f in json.loads(_get(base, "/health"))["formations"]]
    assert len(formations) == 2, formations
    texts = 0  # streams whose chunks carry text
    for i in range(6):  # ties between the two go in turns: 3 each, streams and whole answers
        code, body = _post(base, {"prompt": f"hello {i}", "max_tokens": 4, "stream": i % 2 == 0})
        assert code == 200, body
        texts += i % 2 == 0 and re.search(rb'"text":"[^"]', body) is not None
    text = _get(base, "/metrics")

    def by_formation(family: str) -> dict[str, float]:
        counts = _samples(text, family)
        return {name: sum(v for k, v in counts.items() if f'formation="{name}"' in k) for name in formations}

    durations_count = by_formation("rpcfleet_formation_request_duration_seconds_count")
    assert durations_count == dict.fromkeys(formations, 3.0), durations_count
    # A time to first token is taken at the first text: a stream of the random-weight model whose few
    # tokens decode to no text (a partial UTF-8 character) has none, so the streams with text are counted.
    ttft = by_formation("rpcfleet_formation_time_to_first_token_seconds_count")
    assert sum(ttft.values()) == 3 + texts and all(n >= 1 for n in ttft.values()), (ttft, texts)
    durations = _samples(text, "rpcfleet_formation_request_duration_seconds_sum")
    assert all(v > 0 for v in durations.values()) and len(durations) == 2, durations
    checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr + checked.stdout


@pytest.mark.llama
def test_an_on_demand_load_and_idle_unload_show_on_the_console_the_page_and_metrics(
    start_rpc_server: Callable[..., LocalServer],
    serve: Callable[..., tuple[str, list[str]]],
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    inventory = write_local_inventory(tmp_path / "inv.yml", {"n1": {"rpc_port": start_rpc_server().port}})
    models = tmp_path / "models.yml"
    models.write_text(
        f"- model: {tiny_model}\n  name: tiny\n  load: on-demand\n  idle_unload: 2\n  context: 512\n"
    )
    base, lines = serve("-i", str(inventory), "--models", str(models), "--observe-interval", "1")
    code, body = _post(base, {"model": "tiny", "prompt": "hello", "max_tokens": 4})
    assert code == 200, body
    deadline = time.monotonic() + 30
    while json.loads(_get(base, "/health"))["on_demand"]["tiny"]["state"] != "unloaded":
        assert time.monotonic() < deadline, _get(base, "/health")
        time.sleep(0.2)
    # The state says unloaded once the formation leaves the router; the unload is counted once its
    # engine has stopped, a moment later.
    deadline = time.monotonic() + 30
    while (unloads := _samples(text := _get(base, "/metrics"), "rpcfleet_model_unloads_total")).get(
        '{model="tiny",reason="idle"}'
    ) != 1:
        assert time.monotonic() < deadline, text
        time.sleep(0.2)
    assert _samples(text, "rpcfleet_model_loads_total") == {'{model="tiny"}': 1}
    assert unloads['{model="tiny",reason="idle"}'] == 1 and unloads['{model="tiny",reason="swap"}'] == 0
    assert _samples(text, "rpcfleet_model_state")['{model="tiny",state="unloaded"}'] == 1
    assert _samples(text, "rpcfleet_model_load_seconds")['{model="tiny"}'] > 0
    deadline = time.monotonic() + 10  # the page's events: at the exporter's next round
    kinds: list[str] = []
    while kinds[-3:] != ["load", "loaded", "unload"]:
        assert time.monotonic() < deadline, json.loads(_get(base, "/fleet.json"))["events"]
        time.sleep(0.2)
        kinds = [e["kind"] for e in json.loads(_get(base, "/fleet.json"))["events"] if e["host"] == "tiny#0"]
    console = "".join(lines)
    assert "load tiny#0 (tiny): loading on 127.0.0.1:" in console, console
    assert "unload tiny#0 (tiny): unloaded: idle past 2 s" in console, console


@pytest.mark.llama
def test_a_request_whose_node_is_lost_goes_on_and_shows_on_the_console_the_page_and_metrics(
    start_rpc_server: Callable[..., LocalServer],
    serve: Callable[..., tuple[str, list[str]]],
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """Two formations of one node each; the node under a stream is killed after its first text: the
    stream goes on on the other formation, and that is told on the console, the page's events and in
    /metrics, naming the formation lost and the one it went on on."""
    servers = {f"n{i}": start_rpc_server() for i in range(2)}
    inventory = write_local_inventory(
        tmp_path / "inv.yml", {n: {"rpc_port": s.port} for n, s in servers.items()}
    )
    base, lines = serve(
        "-i", str(inventory), "-m", str(tiny_model), "--ctx", "512", "--replicas", "2", "--parallel", "1",
        "--observe-interval", "1",
    )  # fmt: skip
    texted = threading.Event()
    events: list[str] = []

    def stream() -> None:
        body = {"prompt": "hello", "max_tokens": 400, "stream": True, "temperature": 0}
        request = urllib.request.Request(
            f"{base}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            for raw in answer:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    events.append(line[6:])
                    if re.search(r'"text":"[^"]', line):
                        texted.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert texted.wait(60), events
    formations = json.loads(_get(base, "/health"))["formations"]
    busy = next(f for f in formations if f["slots_busy"])
    port = int(busy["nodes"][0].rpartition(":")[2])
    next(s for s in servers.values() if s.port == port).stop()
    reader.join(120)
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
    went_on = next(f["name"] for f in formations if f["name"] != busy["name"])
    told = f"resumed {went_on} ({busy['model']}): a request (/v1/completions) lost on {busy['name']}: "
    told += "continued after"
    deadline = time.monotonic() + 10
    while not any(told in line for line in lines):
        assert time.monotonic() < deadline, "".join(lines)
        time.sleep(0.2)
    resumed = _samples(_get(base, "/metrics"), "rpcfleet_requests_resumed_total")
    assert resumed == {'{route="/v1/completions",how="continued"}': 1}, resumed
    deadline = time.monotonic() + 10  # the page's events: at the exporter's next round
    while not [e for e in json.loads(_get(base, "/fleet.json"))["events"] if e["kind"] == "resumed"]:
        assert time.monotonic() < deadline, json.loads(_get(base, "/fleet.json"))["events"]
        time.sleep(0.2)
    page = [e for e in json.loads(_get(base, "/fleet.json"))["events"] if e["kind"] == "resumed"]
    assert [e["host"] for e in page] == [went_on] and f"lost on {busy['name']}" in page[0]["message"], page
