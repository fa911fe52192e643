"""The tensor cache's shared rig: a model big enough that some tensors are cached, local nodes that run
real rpc-servers with `-c`, and the items a warm sends (used by the cache, cache stream and load progress
tests)."""

from __future__ import annotations

import getpass
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from orchestrator.caches.plan import HASH_THRESHOLD
from orchestrator.inventory.model import Host
from orchestrator.models.synth import write_tiny_llama
from orchestrator.operations.cache import WarmItem
from orchestrator.planning.plan import Plan, PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan
from tests.plugins.llama import plan_devices
from tests.plugins.servers import LocalServer, launch_rpc_server

# 2 layers, n_embd 1024, n_ff 5632: each FFN matrix is 11 MiB (cached), attention matrices 2 MiB (not).
BIG_MODEL = {"n_layer": 2, "n_embd": 1024, "n_head": 8, "n_head_kv": 8, "n_ff": 5632, "seed": 3}
# The same with FFN matrices of 34 MiB: over glibc's largest mmap threshold (32 MiB), so a copy of one
# in a vector is new memory each time (a smaller one reuses the heap a freed one left).
LARGE_TENSOR_MODEL = {**BIG_MODEL, "n_ff": 17408}


@pytest.fixture(scope="module")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("cache-model") / "m.gguf", **BIG_MODEL)


def local_host(name: str, install: Path, **kw: object) -> Host:
    kw.setdefault("rpc_run_as", getpass.getuser())  # this machine's own account: no dedicated user here
    return Host(name=name, address="127.0.0.1", connection="local", install_dir=str(install), **kw)  # type: ignore[arg-type]


class Node:
    def __init__(self, binary: Path, root: Path, name: str, env: Mapping[str, str] | None = None) -> None:
        self.install = root / name
        (self.install / "cache").mkdir(parents=True, exist_ok=True)
        self.binary, self.root, self.name, self.env = binary, root, name, dict(env or {})
        self.server: LocalServer | None = None
        self.host = local_host(name, self.install)

    def start(self) -> LocalServer:
        env = {**os.environ, **self.env, "LLAMA_CACHE": str(self.install / "cache")}
        self.server = launch_rpc_server(self.binary, self.root, "-c", env=env, log_prefix=self.name)
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def cache_hosts(nodes: list[Node]) -> list[Host]:
    """The running nodes as `rpc_cache` hosts of an inventory: a local connection, their server's port."""
    return [
        Host(
            name=n.name,
            address="127.0.0.1",
            connection="local",
            install_dir=str(n.install),
            rpc_host="127.0.0.1",
            rpc_port=n.server.port,
            rpc_cache=True,
        )
        for n in nodes
        if n.server is not None
    ]


@pytest.fixture
def nodes(rpc_server_binary: Path, tmp_path: Path) -> Iterator[list[Node]]:
    made = [Node(rpc_server_binary, tmp_path, f"n{i}") for i in range(2)]
    for n in made:
        n.start()
    yield made
    for n in made:
        n.stop()


def plan_on_nodes(nodes: list[Node], model: Path) -> Plan:
    assert all(n.server is not None for n in nodes)
    devices = plan_devices([n.server.endpoint for n in nodes if n.server])
    return make_plan(devices, profile_model(model), PlanOptions(n_ctx=256))


def warm_items(model: Path) -> list[WarmItem]:
    from orchestrator.caches.plan import gguf_tensors, hash_tensors

    big = [t for t in gguf_tensors([model]) if t.size > HASH_THRESHOLD]
    return [WarmItem(c.file, c.tensor.path, c.tensor.offset, c.tensor.size) for c in hash_tensors(big)]
