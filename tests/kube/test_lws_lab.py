"""Tier 2: a pseudo-LeaderWorkerSet run (issue 35, item 2). No Kubernetes cluster runs here: the
exported pods' containers are run as the kubelet would run them, each pod a lab node (a network
namespace), from the manifests `rpcfleet export lws` wrote:

- each container's `command` as written (`rpcfleet` is this checkout's `python -m orchestrator`), its
  `env`, and the variables the LWS controller adds (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE,
  LWS_WORKER_INDEX); the volumes are folders: the ConfigMap's `data` as files, an emptyDir per pod, the
  model's folder for the models claim; the image's programs (deploy/Containerfile's RPCFLEET_RPC_SERVER
  and RPCFLEET_LLAMA_SERVER) are this machine's builds of the same artifact and source;
- the cluster DNS names of the workers (`gemma-0-<i>.gemma.default`, the headless service's) come from a
  hosts file for the leader's namespace (`/etc/netns/<ns>/hosts`, which `ip netns exec` mounts over
  /etc/hosts): the leader derives and resolves them with the code it runs in a cluster;
- in the kubelet's order: the workers' rpc-server, the leader's rpc-server sidecar, the init step `plan`
  (run to its end: it must probe the three servers, find that the pods differ from the export's assumed
  64 GiB (a CPU pod's server reports the machine's RAM) and plan again), then llama-server.

Then every rpc-server holds part of the model (its resident memory grew by its planned weights); the
readiness and liveness probes the manifests declare (`lws alive` on every rpc-server, /health) pass three
rounds while llama-server holds every server as its client, and once more after a chat completion
through the leader's port returns text from the real Gemma 3 270M.
"""

from __future__ import annotations

import contextlib
import json
import os
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

from orchestrator.artifacts.build import cached_tools, local_server_binary
from orchestrator.lab.state import Lab
from tests.plugins.lab import own_lab

pytestmark = [pytest.mark.lab, pytest.mark.llama]

ROOT = Path(__file__).resolve().parents[2]
NAME, NAMESPACE, GROUP = "gemma", "default", 0
READY = 420.0  # seconds for llama-server to load Gemma over RPC on a busy 2-core machine
PROBE_ROUNDS = 3


class Pod:
    """One pod: a lab node's namespace, its volumes as folders, the LWS variables of its index."""

    def __init__(self, lab: Lab, index: int, size: int, volumes: dict[str, Path], logs: Path) -> None:
        self.node = lab.nodes[index]
        self.index = index
        self.size = size
        self.volumes = volumes
        self.logs = logs
        self.processes: list[subprocess.Popen[bytes]] = []

    def path(self, text: str) -> str:
        """A path of the container (`/run/rpcfleet/...`) as the folder its volume is here."""
        for mount, folder in self.volumes.items():
            if text == mount or text.startswith(mount + "/"):
                return str(folder) + text[len(mount) :]
        return text

    def argv(self, container: dict[str, Any]) -> list[str]:
        command = [self.path(word) for word in container["command"]]
        assert command[0] == "rpcfleet", command
        namespace = self.node.namespace
        assert namespace is not None
        return ["ip", "netns", "exec", namespace, sys.executable, "-m", "orchestrator", *command[1:]]

    def env(self, container: dict[str, Any]) -> dict[str, str]:
        tools = cached_tools()
        if tools is None:
            pytest.fail("llama-server is not built: run `make setup`", pytrace=False)
        return {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            # deploy/Containerfile's ENV: the image's programs
            "RPCFLEET_RPC_SERVER": str(local_server_binary()),
            "RPCFLEET_LLAMA_SERVER": str(tools / "llama-server"),
            **{e["name"]: self.path(e["value"]) for e in container.get("env", [])},
            # what the LWS controller adds to every container (pkg/utils/pod/pod_utils.go)
            "LWS_LEADER_ADDRESS": f"{NAME}-{GROUP}.{NAME}.{NAMESPACE}",
            "LWS_GROUP_SIZE": str(self.size),
            "LWS_WORKER_INDEX": str(self.index),
        }

    def start(self, container: dict[str, Any]) -> subprocess.Popen[bytes]:
        log = self.logs / f"pod{self.index}-{container['name']}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                self.argv(container), env=self.env(container), stdout=out, stderr=subprocess.STDOUT
            )
        self.processes.append(process)
        return process

    def run(self, container: dict[str, Any], timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(container), env=self.env(container), capture_output=True, text=True, timeout=timeout
        )

    def probe(self, probe: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        """A container's exec probe, run in the pod as the kubelet would."""
        return self.run({"name": "probe", "command": probe["exec"]["command"]}, timeout=30)

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextlib.contextmanager
def hosts_file(namespace: str, lines: list[str]) -> Iterator[None]:
    """/etc/netns/<namespace>/hosts (iproute2 mounts it over /etc/hosts in `ip netns exec`), removed after."""
    parent = Path("/etc/netns")
    made_parent = not parent.exists()
    folder = parent / namespace
    # a crashed run may have left the folder (its hosts file is overwritten below)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        (folder / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{line}\n" for line in lines))
        yield
    finally:
        (folder / "hosts").unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty: something else put a file there; leave it
            folder.rmdir()
        if made_parent:
            with contextlib.suppress(OSError):
                parent.rmdir()


def rss(pid_file: Path) -> int:
    """Resident bytes of the rpc-server a worker's pid file names (`rpcfleet lws worker --pid-file`)."""
    pid = json.loads(pid_file.read_text())["pid"]
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def probe_rounds(
    containers: list[tuple[Pod, dict[str, Any]]],
    engine: dict[str, Any],
    base: str,
    rounds: int = PROBE_ROUNDS,
) -> None:
    """Every probe the containers declare after start-up (readiness, liveness), `rounds` times, as the
    kubelet runs them for as long as the pod lives: each must pass every time. Quicker than their
    periods (a round every few seconds), which asks more of them, not less."""
    assert {"readinessProbe", "livenessProbe"} <= set(engine)
    for round_ in range(rounds):
        for pod, container in containers:
            for kind in ("readinessProbe", "livenessProbe"):
                done = pod.probe(container[kind])
                where = f"round {round_ + 1}: pod {pod.index}'s {container['name']} {kind}"
                assert done.returncode == 0, f"{where}: exit status {done.returncode}: {done.stderr}"
        for kind in ("readinessProbe", "livenessProbe"):
            assert engine[kind]["httpGet"]["path"] == "/health"
            assert get(base + "/health", timeout=engine[kind]["timeoutSeconds"])[0] == 200, (round_, kind)
        time.sleep(2)


def wait_healthy(url: str, engine: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY
    while time.monotonic() < deadline:
        assert engine.poll() is None, log.read_text()[-4000:]
        with contextlib.suppress(OSError):
            if get(url + "/health", timeout=5)[0] == 200:
                return
        time.sleep(1)
    raise AssertionError(f"llama-server not healthy in {READY} s:\n{log.read_text()[-4000:]}")


@pytest.mark.timeout(900)
def test_the_exported_pods_entry_points_serve_gemma_in_lab_namespaces(
    gemma_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "k8s"
    export = [sys.executable, "-m", "orchestrator", "export", "lws", "-m", str(gemma_model), "-o", str(out)]
    export += ["--name", NAME, "--node-memory", "64GiB", "--nodes-per-group", "3", "--ctx", "1024"]
    done = subprocess.run(
        [*export, "--parallel", "2"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    config_map = yaml.safe_load((out / "configmap.yaml").read_text())
    lws = yaml.safe_load((out / "leaderworkerset.yaml").read_text())
    service = yaml.safe_load((out / "service.yaml").read_text())
    template = lws["spec"]["leaderWorkerTemplate"]
    size = template["size"]
    assert size == 3
    leader_spec, worker_spec = template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]
    sidecar, init = leader_spec["initContainers"]
    (engine,) = leader_spec["containers"]
    (worker,) = worker_spec["containers"]
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar: it runs beside the init step

    config = tmp_path / "config"  # the ConfigMap volume: one file per key
    config.mkdir()
    for key, text in config_map["data"].items():
        (config / key).write_text(text)
    claim = {v["name"]: v for v in leader_spec["volumes"]}["models"]["persistentVolumeClaim"]["claimName"]
    assert claim == f"{NAME}-models"
    logs = tmp_path / "logs"
    logs.mkdir()

    with own_lab(size, "lws") as lab:
        pods = []
        for index in range(size):
            run = tmp_path / f"pod{index}-run"  # the pod's emptyDir
            run.mkdir()
            volumes = {"/etc/rpcfleet": config, "/run/rpcfleet": run, "/models": gemma_model.parent}
            pods.append(Pod(lab, index, size, volumes, logs))
        leader = pods[0]
        names = [f"{lab.nodes[i].address} {NAME}-{GROUP}-{i}.{NAME}.{NAMESPACE}" for i in range(1, size)]
        assert leader.node.namespace is not None
        try:
            with hosts_file(leader.node.namespace, names):
                for pod in pods[1:]:
                    pod.start(worker)
                leader.start(sidecar)
                planned = leader.run(init, timeout=300)
                assert planned.returncode == 0, planned.stdout + planned.stderr
                said = planned.stderr
                assert "waiting for 3 rpc-server(s)" in said, said
                for i in range(1, size):
                    host = f"{NAME}-{GROUP}-{i}.{NAME}.{NAMESPACE}"
                    assert f"pod {i}: {host} -> {lab.nodes[i].address}:50052: protocol" in said, said
                assert "the plan assumed 64.00 GiB" in said and "planned again" in said, said
                assert "chat uses gemma3's known template 'gemma'" in said, said
                written = json.loads((tmp_path / "pod0-run" / "llama-server.json").read_text())
                rpc = written["args"][written["args"].index("--rpc") + 1].split(",")
                assert rpc == ["127.0.0.1:50052"] + [f"{lab.nodes[i].address}:50052" for i in range(1, size)]
                assert (
                    written["replanned"] and written["args"][written["args"].index("--parallel") + 1] == "2"
                )
                split = written["args"][written["args"].index("--tensor-split") + 1].split(",")
                assert len(split) == size and all(float(share) > 0 for share in split), split
                assert all(device["layers"] for device in written["plan"]["devices"]), written["plan"]

                idle = {pod.index: rss(tmp_path / f"pod{pod.index}-run" / "rpc-server.pid") for pod in pods}
                served = leader.start(engine)
                port = engine["ports"][0]["containerPort"]
                assert service["spec"]["ports"][0]["targetPort"] == engine["ports"][0]["name"]
                base = f"http://{leader.node.address}:{port}"
                wait_healthy(base, served, logs / "pod0-llama-server.log")

                # every pod holds part of the model: each rpc-server's resident memory (found by the pid
                # file its worker wrote) has grown by at least the weights the plan puts on it
                for pod, device in zip(pods, written["plan"]["devices"], strict=True):
                    resident = rss(tmp_path / f"pod{pod.index}-run" / "rpc-server.pid")
                    weights = device["memory"]["weights"]
                    assert weights > 0 and resident - idle[pod.index] >= weights, (
                        pod.index,
                        resident,
                        device,
                    )

                # the probes of the manifests, repeatedly (the kubelet runs them every period for the pod's
                # life) while llama-server holds every rpc-server as its client
                containers = [(leader, sidecar)] + [(pod, worker) for pod in pods[1:]]
                probe_rounds(containers, engine, base)

                body = {
                    "model": NAME,
                    # the Gemma 3 270M of PyPI is the base model: one example exchange shows it the turns
                    # (as tests/serve/test_serve.py asks serve's llama-server)
                    "messages": [
                        {"role": "user", "content": "What is the capital of Germany?"},
                        {"role": "assistant", "content": "The capital of Germany is Berlin."},
                        {"role": "user", "content": "What is the capital of France?"},
                    ],
                    "max_tokens": 24,
                    "temperature": 0,
                }
                request = urllib.request.Request(
                    base + "/v1/chat/completions",
                    json.dumps(body).encode(),
                    {"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(request, timeout=300) as answer:
                    reply = json.loads(answer.read())
                text = reply["choices"][0]["message"]["content"]
                print(f"Gemma 3 270M through the pseudo-LWS leader: {text!r}")
                assert any(c.isalpha() for c in text), reply
                assert reply["usage"]["completion_tokens"] > 0
                assert text.startswith("The capital of France is Paris."), text
                probe_rounds(containers, engine, base, rounds=1)  # and after it served
        finally:
            for pod in pods:
                pod.stop()
