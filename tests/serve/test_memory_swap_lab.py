"""Tier 2: an on-demand swap decided by memory, not by pinning models to hosts (issue 43): a lab of two
nodes whose memory cgroups (`lab up --memory`) make each too small for one model, real rpc-servers, real
llama-server engines, two synthetic models of the same shape on no `hosts:`.

Without the limit each model fits on one node, so both would be loaded at once, one per node; with it
each needs both nodes, so a request for the second swaps the first out. The probe's figures decide it:
each node counts what its cgroup leaves (memory_rule `cgroup`), checked here with the swap's own fit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.artifacts.manifest import Artifact
from orchestrator.inventory.load import load_inventory
from orchestrator.planning.formations import ServedModel
from orchestrator.planning.profile import profile_model
from orchestrator.serve.swap import fits_on
from orchestrator.workflows.options import plan_options
from tests.plugins.lab import own_lab
from tests.plugins.llama import plan_devices
from tests.plugins.models import TinyModelFactory
from tests.plugins.servers import free_port

pytestmark = [pytest.mark.lab, pytest.mark.llama]

MiB = 1 << 20
# Each model: 16 layers of f32 (about 180 MiB of weights); planned alone on one device about 205 MiB,
# split over two about 112 MiB each. A node of 200 MiB holds a half, never a whole one: what it leaves
# is its limit less the margin below and its own processes, 20 to 45 MiB (sshd, an idle rpc-server,
# each SSH session of serve's about 15 MiB).
MEMORY = 200 * MiB
MARGIN = 16 * MiB
SHAPE = {"n_layer": 16, "n_embd": 512, "n_ff": 1408, "weight_type": "f32"}
READY = 300.0  # seconds for serve and each load on a busy 2-core machine
KEY = "mem0ry-swap"


def _request(base: str, path: str, body: Any = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=READY) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _run(*argv: str, timeout: float = 600) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.fixture
def serve_proc(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_a_request_for_a_second_unpinned_model_swaps_the_first_out_when_memory_holds_one(
    cpu_artifact: Artifact,
    tiny_model_factory: TinyModelFactory,
    serve_proc: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    first, second = (tiny_model_factory(**SHAPE, seed=seed) for seed in (1, 2))
    with own_lab(2, "mem", memory=MEMORY) as lab:
        _run("deploy", "-i", str(lab.inventory))
        probed = json.loads(_run("probe", "-i", str(lab.inventory), "--json"))
        devices = [(n["endpoint"], d) for n in probed["nodes"] for d in n["devices"]]
        assert [d["memory_rule"] for _, d in devices] == ["cgroup", "cgroup"], devices
        assert all(d["usable"] <= MEMORY for _, d in devices), devices

        # The swap's own fit on these figures: one node holds no model, two hold one; with each node's
        # share of MemAvailable instead (no limit), one node holds a model: both would be loaded at once.
        hosts = load_inventory(lab.inventory).hosts
        options = plan_options({"ctx": 512, "parallel": 1, "margin": MARGIN})
        model = ServedModel(str(first), "first", profile_model(first), options)
        limited = plan_devices([ep for ep, _ in devices], [d["usable"] for _, d in devices])
        assert fits_on(model, hosts[:1], limited) is None
        assert fits_on(model, hosts, limited) is not None
        text = Path("/proc/meminfo").read_text().split()
        share = int(text[text.index("MemAvailable:") + 1]) * 1024 // 2
        assert fits_on(model, hosts[:1], plan_devices([devices[0][0]], [share])) is not None

        models = tmp_path / "models.yml"
        models.write_text(
            f"- model: {first}\n  name: first\n  load: on-demand\n"
            f"- model: {second}\n  name: second\n  load: on-demand\n"
        )
        port = free_port()
        log = tmp_path / "serve.log"
        command = ["serve", "-i", str(lab.inventory), "--models", str(models), "--port", str(port)]
        command += ["--ctx", "512", "--parallel", "1", "--margin", f"{MARGIN // MiB}MiB"]
        command += ["--models-min-resident", "0", "--models-swap-cooldown", "0"]
        env = {**os.environ, "RPCFLEET_HOME": str(tmp_path / "home"), "RPCFLEET_API_KEY": KEY}
        env.pop("RPCFLEET_ADMIN_KEY", None)
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "orchestrator", *command],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        serve_proc.append(process)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + READY
        while True:
            assert process.poll() is None, log.read_text()[-6000:]
            assert time.monotonic() < deadline, log.read_text()[-6000:]
            try:
                if _request(base, "/health")[1].get("status") == "ready":
                    break
            except (urllib.error.URLError, ConnectionError, ValueError):
                pass
            time.sleep(0.2)

        def held() -> list[tuple[str, list[str]]]:
            return [(f["model"], sorted(f["nodes"])) for f in _request(base, "/health")[1]["formations"]]

        both = sorted(ep for ep, _ in devices)
        prompt = {"prompt": "The sky is", "max_tokens": 4}
        status, body = _request(base, "/v1/completions", {"model": "first", **prompt})
        assert status == 200 and body["choices"][0]["text"], body
        assert held() == [("first", both)]  # split over both nodes: neither holds it alone
        status, body = _request(base, "/v1/completions", {"model": "second", **prompt})
        assert status == 200 and body["choices"][0]["text"], (body, log.read_text()[-4000:])
        assert held() == [("second", both)]  # the first swapped out for it
        on_demand = _request(base, "/health")[1]["on_demand"]
        assert (on_demand["first"]["unloads"], on_demand["second"]["unloads"]) == (1, 0), on_demand
        status, body = _request(base, "/v1/completions", {"model": "first", **prompt})
        assert status == 200 and body["choices"][0]["text"], body  # and back
        assert held() == [("first", both)]
        assert "Traceback" not in log.read_text()
