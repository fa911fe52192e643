"""Per-user keys and on-demand models with real components: `rpcfleet serve` over real local rpc-servers,
real llama-server engines, the real Gemma 3 270M (issues 42 and 43).

- The README's team example (its models.yml and serve.keys, read from README.md, served as written): both
  models answer, the on-demand one loaded by its first request; a key limited to gemma gets a 403 for
  tiny, which stays unloaded.
- A key limited to one on-demand model gets a 403 for another that would need its node: the refused
  request neither loads it nor swaps the first out (another key's request for it then does both).
"""

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.plugins.models import TinyModelFactory
from tests.plugins.servers import LocalServer, free_port, write_local_inventory

pytestmark = pytest.mark.llama

ROOT = Path(__file__).resolve().parents[2]
READY = 300.0  # seconds for serve to start and load what it loads at start, on a busy 2-core machine


def readme_team_files() -> dict[str, str]:
    """The files of the README's "Serving a team", by the name each block's first line gives it
    (`# models.yml: ...`), as written."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n### Serving a team\n") :]
    section = section[: section.index("\n## ", 1)]
    files = {}
    for block in re.findall(r"```\w*\n(.*?)```", section, re.S):
        named = re.match(r"# ([\w.-]+): ", block)
        assert named is not None, f"a block of the team example names no file: {block[:60]!r}"
        files[named.group(1)] = block
    return files


def keys_of(keys_file: str) -> dict[str, str]:
    """Each name's key in a keys file (keys in clear)."""
    lines = [line.split() for line in keys_file.splitlines() if line.strip() and not line.startswith("#")]
    return {fields[0]: fields[1] for fields in lines}


@dataclass
class Served:
    process: subprocess.Popen[bytes]
    base: str
    log: Path

    def request(self, key: str | None, path: str, body: Any = None) -> tuple[int, Any]:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=READY) as answer:
                raw, status = answer.read(), answer.status
        except urllib.error.HTTPError as err:
            raw, status = err.read(), err.code
        return status, json.loads(raw)

    def complete(self, key: str, model: str) -> tuple[int, Any]:
        return self.request(key, "/v1/completions", {"model": model, "prompt": "The sky is", "max_tokens": 4})

    def states(self, key: str) -> dict[str, str]:
        """Each model's state as /v1/models lists it to `key`."""
        status, body = self.request(key, "/v1/models")
        assert status == 200, body
        return {model["id"]: model["state"] for model in body["data"]}

    def formations(self, key: str) -> list[tuple[str, tuple[str, ...], int]]:
        """Each formation's model, nodes and engine pid (/health's details, for a metrics-scoped key)."""
        status, body = self.request(key, "/health")
        assert status == 200, body
        return [(f["model"], tuple(f["nodes"]), f["engine_pid"]) for f in body["formations"]]

    def on_demand(self, key: str) -> dict[str, Any]:
        return dict(self.request(key, "/health")[1]["on_demand"])


@pytest.fixture
def serve_files(
    start_rpc_server: Callable[..., LocalServer], tmp_path: Path
) -> Iterator[Callable[..., Served]]:
    """Factory: `rpcfleet serve ARGV` in `workdir` over `nodes` real local rpc-servers, once /health says
    ready; interrupted at teardown."""
    started: list[Served] = []

    def start(workdir: Path, *argv: str, nodes: int) -> Served:
        hosts = {f"n{i}": {"rpc_port": start_rpc_server().port} for i in range(1, nodes + 1)}
        inventory = write_local_inventory(tmp_path / "inventory.yml", hosts)
        port = free_port()
        log = tmp_path / "serve.log"
        env = {k: v for k, v in os.environ.items() if k not in ("RPCFLEET_API_KEY", "RPCFLEET_ADMIN_KEY")}
        env |= {"RPCFLEET_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "orchestrator", "serve", *argv, "-i", str(inventory)]
        with log.open("wb") as out:
            process = subprocess.Popen(
                [*command, "--port", str(port)], cwd=workdir, stdout=out, stderr=subprocess.STDOUT, env=env
            )
        served = Served(process, f"http://127.0.0.1:{port}", log)
        started.append(served)
        deadline = time.monotonic() + READY
        while True:
            assert process.poll() is None, f"serve exited {process.returncode}:\n{log.read_text()[-6000:]}"
            assert time.monotonic() < deadline, f"serve not ready in {READY} s:\n{log.read_text()[-6000:]}"
            try:
                if served.request(None, "/health")[1].get("status") == "ready":
                    return served
            except (urllib.error.URLError, ConnectionError, ValueError):
                pass
            time.sleep(0.2)

    yield start
    for served in started:
        if served.process.poll() is None:
            served.process.send_signal(signal.SIGINT)
            try:
                served.process.wait(30)
            except subprocess.TimeoutExpired:
                served.process.kill()
                served.process.wait()


def test_the_readmes_team_example_answers_with_both_models_and_loads_the_on_demand_one_on_first_use(
    serve_files: Callable[..., Served], gemma_model: Path, tiny_model: Path, tmp_path: Path
) -> None:
    files = readme_team_files()
    assert set(files) == {"models.yml", "serve.keys"}
    workdir = tmp_path / "team"
    workdir.mkdir()
    for name, text in files.items():
        (workdir / name).write_text(text)
        (workdir / name).chmod(0o600)  # keys in clear: readable by their owner only
    (workdir / "gemma-3-270m.gguf").symlink_to(gemma_model)
    (workdir / "tiny.gguf").symlink_to(tiny_model)
    key = keys_of(files["serve.keys"])
    served = serve_files(workdir, "--models", "models.yml", "--keys", "serve.keys", nodes=2)

    assert served.states(key["alice"]) == {"gemma": "loaded", "tiny": "unloaded"}
    status, body = served.complete(key["bob"], "tiny")  # bob may use gemma only: refused, nothing loaded
    assert status == 403 and "'bob'" in body["error"]["message"], body
    assert served.states(key["alice"])["tiny"] == "unloaded"
    for model in ("gemma", "tiny"):  # tiny: loaded by this request, on the node gemma left free
        status, body = served.complete(key["alice"], model)
        assert status == 200 and body["choices"][0]["text"], (model, body)
    assert served.states(key["alice"]) == {"gemma": "loaded", "tiny": "loaded"}
    formations = served.formations(key["ops"])
    assert sorted(model for model, _, _ in formations) == ["gemma", "tiny"], formations
    assert len({node for _, nodes, _ in formations for node in nodes}) == 2, formations
    assert "Traceback" not in served.log.read_text()


def test_a_key_limited_to_one_model_is_refused_another_and_its_request_neither_loads_it_nor_swaps_out(
    serve_files: Callable[..., Served], tiny_model: Path, tiny_model_factory: TinyModelFactory, tmp_path: Path
) -> None:
    workdir = tmp_path / "limited"
    workdir.mkdir()
    other = tiny_model_factory(seed=1)
    (workdir / "models.yml").write_text(  # one node: loading either unloads the other
        f"- model: {tiny_model}\n  name: mine\n  load: on-demand\n"
        f"- model: {other}\n  name: theirs\n  load: on-demand\n"
    )
    alice, ops = "sk-alice-limited-0001", "sk-ops-everything-0002"
    (workdir / "serve.keys").write_text(f"alice {alice} inference mine\nops {ops} inference,metrics\n")
    (workdir / "serve.keys").chmod(0o600)
    # no residency nor swap cooldown: a load of the other unloads mine at once
    argv = ("--models", "models.yml", "--keys", "serve.keys", "--models-min-resident", "0")
    argv += ("--models-swap-cooldown", "0")
    served = serve_files(workdir, *argv, nodes=1)

    status, body = served.complete(alice, "mine")
    assert status == 200, body
    loaded = served.formations(ops)
    assert [model for model, _, _ in loaded] == ["mine"], loaded
    status, body = served.complete(alice, "theirs")
    assert status == 403, body
    assert body["error"]["message"] == "the key 'alice' may not use the model 'theirs'", body
    assert served.formations(ops) == loaded  # the same engine on the same node
    assert served.states(ops) == {"mine": "loaded", "theirs": "unloaded"}
    assert [served.on_demand(ops)[name]["unloads"] for name in ("mine", "theirs")] == [0, 0]
    status, body = served.complete(alice, "mine")
    assert status == 200 and served.formations(ops) == loaded, body

    # the check above could fail: a key that may use it loads the other model, swapping the first out
    status, body = served.complete(ops, "theirs")
    assert status == 200, body
    assert served.states(ops) == {"mine": "unloaded", "theirs": "loaded"}
    assert served.on_demand(ops)["mine"]["unloads"] == 1
