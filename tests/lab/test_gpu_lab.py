"""Tier 2: a lab with GPU nodes. Nodes 1 and 2 run the Vulkan artifact on Mesa's software Vulkan device
(llvmpipe: `lab up --var N:rpc_backend=vulkan` adds GGML_VK_VISIBLE_DEVICES=0), nodes 3 and 4 the CPU
one. Deploy picks each node's artifact, probe reads each device's memory by its rule (the Vulkan heap
for the GPU nodes, MemAvailable shared for the CPU ones), and `run` serves the real Gemma 3 270M over the
four. The Vulkan nodes come first, so the output layer (262k-token vocabulary) lands on a CPU node:
llvmpipe computes it slowly. A node asked for a backend it cannot run is refused at deploy, at the
inventory's line, and nothing of it is switched.

llvmpipe's known abort: a Vulkan server that ran one client's graphs can corrupt its heap on the next
client's, and glibc aborts it (docs/gpu.md). Serve, after `run`, may meet it once; the test tolerates that
abort only, found in the lost Vulkan node's server log, and fails on any other crash."""

from __future__ import annotations

import json
import os
import re
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
import yaml

from orchestrator.lab.lifecycle import lab_down, lab_up
from orchestrator.lab.state import Lab, LabNode
from tests.plugins.lab import require_lab_privileges, session_lab_name
from tests.plugins.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30


def rpcfleet(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done


@pytest.fixture(scope="module")
def gpu_lab() -> Iterator[Lab]:
    require_lab_privileges()
    name = session_lab_name("gpu")
    vulkan = {"rpc_backend": "vulkan"}
    made = lab_up(4, name=name, owner_pid=os.getpid(), node_variables={"1": vulkan, "2": vulkan})
    try:
        done = rpcfleet("deploy", "-i", str(made.inventory))
        assert done.returncode == 0, done.stdout + done.stderr
        yield made
    finally:
        lab_down(name)


@pytest.mark.lab
def test_the_lab_writes_the_software_device_for_its_vulkan_nodes(gpu_lab: Lab) -> None:
    hosts = yaml.safe_load(gpu_lab.inventory.read_text())["hosts"]
    assert [h.get("rpc_backend", "cpu") for h in hosts.values()] == ["vulkan", "vulkan", "cpu", "cpu"]
    assert [h.get("rpc_env") for h in hosts.values()] == [{"GGML_VK_VISIBLE_DEVICES": "0"}] * 2 + [None] * 2


@pytest.mark.lab
def test_each_node_runs_its_backends_artifact_and_probe_reads_memory_by_its_rule(gpu_lab: Lab) -> None:
    done = rpcfleet("probe", "-i", str(gpu_lab.inventory), "--json")
    assert done.returncode == 0, done.stderr
    nodes = json.loads(done.stdout)["nodes"]
    devices = [node["devices"][0] for node in nodes]
    assert [d["backend"] for d in devices] == ["vulkan", "vulkan", "cpu", "cpu"]
    for gpu in devices[:2]:
        # llvmpipe's device-local heap, not the host's RAM: the device's own figure
        assert (gpu["kind"], gpu["memory_rule"], gpu["total"], gpu["free"]) == (
            "gpu",
            "device",
            2 * GiB,
            2 * GiB,
        )
        assert gpu["description"].startswith("llvmpipe") and gpu["alignment"] == 16
    for cpu in devices[2:]:
        assert (cpu["kind"], cpu["memory_rule"], cpu["alignment"]) == ("cpu", "meminfo", 32)
    # the two CPU servers share the machine's MemAvailable; the Vulkan devices take no share of it
    # (read a moment apart: MemAvailable moves a little)
    assert abs(devices[2]["free"] - devices[3]["free"]) < GiB // 16
    assert devices[2]["free"] <= devices[2]["total"] // 2
    again = rpcfleet("deploy", "-i", str(gpu_lab.inventory))
    assert again.returncode == 0 and "changed" not in again.stdout.split("recap")[0], again.stdout


@pytest.mark.lab
@pytest.mark.llama
def test_run_serves_real_text_over_cpu_and_vulkan_nodes(gpu_lab: Lab, gemma_model: Path) -> None:
    done = rpcfleet(
        "run", "-i", str(gpu_lab.inventory), "-m", str(gemma_model),
        "-p", "The capital of France is the city of", "-n", "2", "--ctx", "1024", "--temp", "0", "--json",
        "--flash-attn", "off",  # as serve below: an llvmpipe server switched between the two can crash
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["text"].startswith(" Paris"), result["text"]
    devices = result["placement"]["devices"]
    assert all(d["planned_layers"] == d["actual_layers"] for d in devices)
    gpus = {f"{node.address}:50052" for node in gpu_lab.nodes[:2]}
    on_gpus = [d for d in devices if d["endpoint"] in gpus]
    # both Vulkan devices hold layers, and llama.cpp allocated on each what the plan said (0.01 MiB log)
    assert len(on_gpus) == 2 and all(d["actual_layers"] for d in on_gpus)
    for d in on_gpus:
        assert abs(d["predicted"]["weights"] - d["actual"]["weights"]) <= 0.01 * (1 << 20), d
        assert abs(d["predicted"]["kv"] - d["actual"]["kv"]) <= 0.01 * (1 << 20), d


@pytest.mark.lab
def test_a_backend_the_node_cannot_run_is_refused_at_the_inventory_line(gpu_lab: Lab, tmp_path: Path) -> None:
    inventory = yaml.safe_load(gpu_lab.inventory.read_text())
    names = list(inventory["hosts"])
    inventory["hosts"][names[2]]["rpc_backend"] = "cuda"  # no NVIDIA driver in the lab
    inventory["hosts"][names[0]]["rpc_devices"] = ["Vulkan3"]  # llvmpipe is Vulkan0
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump(inventory, sort_keys=False))
    before = json.loads(rpcfleet("status", "-i", str(gpu_lab.inventory), "--json").stdout)
    done = rpcfleet("deploy", "-i", str(bad))
    assert done.returncode == 2, done.stdout + done.stderr
    text = " ".join((done.stdout + done.stderr).split())  # the table wraps its cells
    assert f"{bad}:" in text and "the cuda server cannot run: no /dev/nvidia* device" in text
    assert "install the NVIDIA driver, or set rpc_backend to vulkan or cpu" in text
    assert (
        "rpc_devices Vulkan3: no such device on this node for the vulkan backend (it offers Vulkan0, CPU)"
        in text
    )
    after = json.loads(rpcfleet("status", "-i", str(gpu_lab.inventory), "--json").stdout)
    assert after == before  # nothing switched, stopped or restarted


KEY = "gpu-lab"
# glibc's abort on a corrupted heap, as llvmpipe's Vulkan server dies after graphs of another client
# (measured: "malloc(): unsorted double linked list corrupted"; docs/gpu.md): the device's bug.
LLVMPIPE_ABORT = re.compile(
    r"\b(malloc|free|realloc|malloc_consolidate)\(\): [^\n]*corrupt|double free or corruption"
)


def _server_log(node: LabNode) -> Path:
    return node.home / "rpcfleet" / "log" / "rpc-server.log"  # the lab inventory's install_dir


def _known_llvmpipe_abort(lab: Lab, error: object, offsets: dict[str, int]) -> str | None:
    """None when every node the 503 names is a Vulkan node whose server log shows llvmpipe's known abort
    since `offsets` (bytes per node address); else what was lost instead."""
    lost = json.loads(error)["error"].get("lost", []) if isinstance(error, str) else []
    if not lost:
        return f"a node_lost answer that names no node: {error}"
    vulkan = {node.address for node in lab.nodes[:2]}
    for endpoint in lost:
        address = endpoint.rsplit(":", 1)[0]
        if address not in vulkan:
            return f"{endpoint} is a CPU node: not llvmpipe's abort"
        node = next(n for n in lab.nodes if n.address == address)
        with _server_log(node).open("rb") as f:
            f.seek(offsets[address])
            since = f.read().decode("utf-8", "replace")
        if not LLVMPIPE_ABORT.search(since):
            return f"{endpoint}'s server ended without llvmpipe's heap abort:\n{since[-3000:]}"
    return None


def get(base: str, path: str, body: object = None, timeout: float = 600) -> tuple[int, object]:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(
            urllib.request.Request(base + path, data, headers), timeout=timeout
        ) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _wait_all_ready(
    base: str, process: subprocess.Popen[bytes], log: Path, deadline: float
) -> dict[str, Any]:
    """serve's /health once every formation is ready (fails at `deadline`, or when serve exits)."""
    health: object = {}
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-4000:]
        try:
            _, health = get(base, "/health", timeout=10)
        except (urllib.error.URLError, ConnectionError):
            health = {}
        formations = health.get("formations", []) if isinstance(health, dict) else []
        if formations and all(f["state"] == "ready" for f in formations):
            assert isinstance(health, dict)
            return health
        time.sleep(1)
    raise AssertionError(f"formations not ready: {health}\n{log.read_text()[-4000:]}")


@pytest.mark.lab
@pytest.mark.llama
def test_serve_runs_formations_of_the_real_gemma_on_cpu_and_vulkan_nodes(
    gpu_lab: Lab, gemma_model: Path, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    command = [
        sys.executable, "-m", "orchestrator", "serve", "-i", str(gpu_lab.inventory), "-m", str(gemma_model),
        "--model-name", "gemma", "--port", str(port), "--ctx", "1024", "--parallel", "2",
        "--flash-attn", "off", "--replicas", "auto",
    ]  # fmt: skip
    env = {**os.environ, "RPCFLEET_HOME": str(tmp_path / "home"), "RPCFLEET_API_KEY": KEY}
    base = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        # llvmpipe compiles a fresh engine's shaders on its first graph
        health = _wait_all_ready(base, process, log, time.monotonic() + 600)
        nodes = {node for f in health["formations"] for node in f["nodes"]}
        gpus = {f"{n.address}:50052" for n in gpu_lab.nodes[:2]}
        assert gpus <= nodes, health  # the Vulkan nodes serve too
        body = {"model": "gemma", "prompt": "The capital of France is", "max_tokens": 4}
        offsets = {node.address: _server_log(node).stat().st_size for node in gpu_lab.nodes}
        answers, lost = [], []
        for _ in range(2 * len(health["formations"])):
            answer = get(base, "/v1/completions", body)
            if answer[0] == 503 and '"node_lost"' in str(answer[1]):
                # llvmpipe's known abort (module docstring): serve's contract is a 503 naming the node, then
                # the formation back. Only that abort, on a Vulkan node, and once: any other crash fails.
                why = _known_llvmpipe_abort(gpu_lab, answer[1], offsets)
                assert why is None and not lost, f"{why or 'a second crash'}\n{log.read_text()[-6000:]}"
                lost.append(answer)
                _wait_all_ready(base, process, log, time.monotonic() + 300)
                answer = get(base, "/v1/completions", body)
            answers.append(answer)
        refused = [answer for answer in answers if answer[0] != 200]
        assert not refused, f"{refused} {lost}\n{log.read_text()[-6000:]}"
        assert all(body["choices"][0]["text"] for _, body in answers)  # type: ignore[index]
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
