"""Loads that hash nothing twice: real loads (the worker's in-process llama.cpp, the binding rpcfleet builds)
through real rpc-servers on this machine, with `-c` (the cached CPU artifact's) or without a cache.

The patched client says, per weight tensor over HASH_THRESHOLD, whether its hash came from the manifest or
was hashed and why (`$GGML_RPC_HASH_LOG`): the tests count those lines.
- With the manifest: nothing is hashed, on a cold load (the servers name their files by the manifest's
  hashes, and each file's bytes hash to its name) and on a warm one; the text equals a load without a cache.
- One byte changed in the middle of a tensor, the mtime put back (`touch -r`): the manifest is ignored
  (the ctime differs), every tensor is hashed, the changed tensor misses and is sent, and the text equals
  a load of the changed file without a cache (not the one the old cached bytes would give).
- No manifest (an empty folder), or no folder at all: hashed as stock.
- serve's llama-server (the tools build), in serve's environment: every hash from the manifest.
- The servers' cache-read patch: every hit is answered from its file (none is sent and written again),
  a CPU server's straight into its buffer (no fresh copy: the warm load touches fresh memory for its
  buffers alone), a Vulkan server's from the file's mapping (llvmpipe, a software Vulkan device).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.artifacts.build import cached_tools, local_server_binary
from orchestrator.artifacts.patches import HASH_LOG_ENV, HASH_MANIFEST_ENV
from orchestrator.caches import manifest as hm
from orchestrator.caches.plan import RACY_NS, FileIdentity, plan_cache
from orchestrator.core import fnv
from orchestrator.llama.worker.parent import Worker
from orchestrator.llama.worker.wire import Done
from orchestrator.models.synth import write_tiny_llama
from orchestrator.planning.plan import Plan, PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan
from orchestrator.serve.engine import EngineOptions, engine_args, engine_env
from tests.plugins.cache import LARGE_TENSOR_MODEL, Node, plan_on_nodes
from tests.plugins.llama import plan_devices
from tests.plugins.servers import LocalServer
from tests.waits import wait_until

pytestmark = pytest.mark.llama

PROMPT = "Once upon a time"


def _settled(model: Path) -> None:
    """Wait out the memo's racy window after the file's last change (no memo is kept within it)."""
    changed = dict(FileIdentity.of(model).fields)["ctime_ns"] / 1e9
    time.sleep(max(0.0, changed + 2 * RACY_NS / 1e9 - time.time()))


def _load(
    plan: Plan,
    model: Path,
    log: Path,
    monkeypatch: pytest.MonkeyPatch,
    manifests: str | None = None,
    max_tokens: int = 12,
) -> tuple[str, Counter[str]]:
    """One load in a fresh worker and a greedy completion: its text, and the client's hash log counts."""
    log.unlink(missing_ok=True)
    with monkeypatch.context() as mp:
        mp.setenv(HASH_LOG_ENV, str(log))
        if manifests is not None:
            mp.setenv(HASH_MANIFEST_ENV, manifests)
        with Worker.start(plan, model, {"seed": 0}) as worker:
            events = list(worker.complete(PROMPT, max_tokens=max_tokens, temperature=0.0, seed=0))
    done = events[-1]
    assert isinstance(done, Done)
    return done.text, hm.hash_log_counts(log.read_text() if log.exists() else "")


def _no_cache(start: Callable[..., LocalServer], model: Path, log: Path, mp: pytest.MonkeyPatch) -> str:
    """The text of a load of `model` on two servers without a cache."""
    servers = [start(), start()]
    plan = make_plan(
        plan_devices([s.endpoint for s in servers]), profile_model(model), PlanOptions(n_ctx=256)
    )
    text, _counts = _load(plan, model, log, mp)
    for server in servers:
        server.stop()
    return text


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _folder(node: Node) -> Path:
    return node.install / "cache" / "rpc"


def test_a_load_with_the_manifest_hashes_nothing_and_says_the_same(
    nodes: list[Node],
    big_model: Path,
    start_rpc_server: Callable[..., LocalServer],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log = tmp_path / "hash.log"
    reference = _no_cache(start_rpc_server, big_model, log, monkeypatch)
    plan = plan_on_nodes(nodes, big_model)
    _settled(big_model)
    cached = plan_cache(plan, [big_model])  # the memo and the manifest, as `run`'s check leaves them
    count = len({(c.tensor.offset, c.tensor.size) for cs in cached.values() for c in cs})
    assert count >= 4 and hm.has_manifest(dict(FileIdentity.of(big_model).fields), {})

    cold_text, cold = _load(plan, big_model, log, monkeypatch)  # the servers write their files
    assert cold == {"manifest": count}
    for node in nodes:  # named by the manifest's hashes: each file's bytes hash to its name
        files = list(_folder(node).iterdir())
        assert files and all(fnv.hash_file_range(f, 0, f.stat().st_size) == int(f.name, 16) for f in files)
    warm_text, warm = _load(plan, big_model, log, monkeypatch)  # every tensor a hit
    assert warm == {"manifest": count}
    assert reference and cold_text == reference and warm_text == reference


def _fresh_bytes(node: Node) -> int:
    """The memory `node`'s server has touched for the first time so far (minor faults x page size)."""
    assert node.server is not None
    fields = Path(f"/proc/{node.server.process.pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[7]) * os.sysconf("SC_PAGE_SIZE")  # minflt, the 10th field of stat(5)


def _cache_files(nodes: list[Node]) -> dict[Path, int]:
    """Each node's cache files and their mtimes (a miss's tensor is sent, and its file written again)."""
    return {f: f.stat().st_mtime_ns for n in nodes for f in _folder(n).iterdir()}


def _cold_then_warm(
    nodes: list[Node], model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_tokens: int = 12
) -> tuple[list[int], list[int], dict[Path, int]]:
    """A cold load (the servers write their files) and a warm one with the manifest, the same greedy text
    of `max_tokens`: the fresh memory each server touched in each, and the cache files after the cold one
    (unchanged after the warm one: every hit answered from its file)."""
    for node in nodes:
        node.start()
    try:
        plan = plan_on_nodes(nodes, model)
        _settled(model)
        plan_cache(plan, [model])
        log = tmp_path / "hash.log"
        before = [_fresh_bytes(n) for n in nodes]
        cold_text, cold = _load(plan, model, log, monkeypatch, max_tokens=max_tokens)
        written = _cache_files(nodes)
        between = [_fresh_bytes(n) for n in nodes]
        warm_text, warm = _load(plan, model, log, monkeypatch, max_tokens=max_tokens)
        after = [_fresh_bytes(n) for n in nodes]
    finally:
        for node in nodes:
            node.stop()
    assert cold == warm == {"manifest": len(written)} and written
    assert _cache_files(nodes) == written
    assert cold_text and warm_text == cold_text
    return (
        [m - b for b, m in zip(before, between, strict=True)],
        [a - m for m, a in zip(between, after, strict=True)],
        written,
    )


def test_a_cpu_servers_hit_goes_from_its_file_straight_into_the_buffer(
    rpc_server_binary: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stock, a hit was read into a new zero-filled vector and copied from it: fresh memory as large as
    the tensor at each hit (over glibc's mmap threshold), as a received tensor takes on a cold load."""
    model = write_tiny_llama(tmp_path / "large.gguf", **LARGE_TENSOR_MODEL)
    nodes = [Node(rpc_server_binary, tmp_path, f"n{i}") for i in range(2)]
    cold, warm, written = _cold_then_warm(nodes, model, tmp_path, monkeypatch)
    for node, cold_fresh, warm_fresh in zip(nodes, cold, warm, strict=True):
        hit = sum(size for f, size in _sizes(written).items() if f.is_relative_to(node.install))
        assert hit > 0 and warm_fresh < cold_fresh - hit // 2, (node.name, cold_fresh, warm_fresh, hit)


def test_a_vulkan_servers_hit_is_set_from_the_files_mapping(
    gemma_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A buffer that is not host memory (llvmpipe's device memory) is set from the cache file's mapping:
    Gemma's tied output (its 178 MB token_embd, the one tensor over HASH_THRESHOLD) on the last server."""
    binary = local_server_binary(backend="vulkan")
    assert binary.exists(), f"no Vulkan ggml-rpc-server at {binary}: run `make setup`"
    env = {"GGML_VK_VISIBLE_DEVICES": "0"}  # ggml-vulkan skips a device of type CPU unless it is listed
    nodes = [Node(binary, tmp_path, f"v{i}", env=env) for i in range(2)]
    _cold_then_warm(nodes, gemma_model, tmp_path, monkeypatch, max_tokens=1)  # llvmpipe: 5 s a token


def _sizes(files: dict[Path, int]) -> dict[Path, int]:
    return {f: f.stat().st_size for f in files}


def test_a_byte_changed_under_a_kept_mtime_is_hashed_again(
    nodes: list[Node],
    big_model: Path,
    start_rpc_server: Callable[..., LocalServer],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log = tmp_path / "hash.log"
    model = tmp_path / "model.gguf"
    shutil.copyfile(big_model, model)
    plan = plan_on_nodes(nodes, model)
    _settled(model)
    cached = plan_cache(plan, [model])
    original, counts = _load(plan, model, log, monkeypatch)  # the caches hold every tensor as it was
    total = sum(counts.values())
    assert counts == {"manifest": total} and total >= 4

    # One byte in the middle of a cached tensor (the high byte of an f16 weight: a large value), the
    # mtime put back: path, size and mtime as before, only the ctime tells.
    tensor = next(iter(cached.values()))[0].tensor
    reference = tmp_path / "mtime"
    reference.touch()
    subprocess.run(["touch", "-r", str(model), str(reference)], check=True)
    middle = tensor.offset + (tensor.size // 2 | 1)
    with model.open("r+b") as fh:
        fh.seek(middle)
        old = fh.read(1)
        fh.seek(middle)
        fh.write(bytes([old[0] ^ 0x78]))
    subprocess.run(["touch", "-r", str(reference), str(model)], check=True)
    assert model.stat().st_mtime_ns == reference.stat().st_mtime_ns
    new_name = f"{fnv.hash_file_range(model, tensor.offset, tensor.size):016x}"

    changed, counts = _load(plan, model, log, monkeypatch)
    assert counts == {"hashed file-changed": total}  # the manifest is not the file's any more
    assert any((_folder(n) / new_name).is_file() for n in nodes)  # the changed tensor was sent
    assert changed == _no_cache(start_rpc_server, model, log, monkeypatch)
    assert changed != original  # what the old hash would have loaded (the cached old bytes) says otherwise


def test_without_a_manifest_the_client_hashes_as_stock(
    nodes: list[Node], big_model: Path, start_rpc_server: Callable[..., LocalServer], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    log = tmp_path / "hash.log"
    reference = _no_cache(start_rpc_server, big_model, log, monkeypatch)
    plan = plan_on_nodes(nodes, big_model)
    empty = tmp_path / "no-manifests"
    empty.mkdir()
    text, counts = _load(plan, big_model, log, monkeypatch, manifests=str(empty))
    total = sum(counts.values())
    assert counts == {"hashed no-manifest": total} and total >= 4 and text == reference
    text, counts = _load(plan, big_model, log, monkeypatch, manifests="")  # turned off
    assert counts == {"hashed no-manifests-dir": total} and text == reference


def test_llama_server_takes_its_hashes_from_the_manifest(
    nodes: list[Node], big_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """serve's engine, the llama-server rpcfleet builds, started with serve's environment (`engine_env`):
    every weight tensor's hash from the manifest, on a cold load and on a warm one."""
    tools = cached_tools()
    assert tools is not None, "run `make setup`"
    plan = plan_on_nodes(nodes, big_model)
    _settled(big_model)
    cached = plan_cache(plan, [big_model])
    count = len({(c.tensor.offset, c.tensor.size) for cs in cached.values() for c in cs})
    log = tmp_path / "hash.log"
    monkeypatch.setenv(HASH_LOG_ENV, str(log))
    monkeypatch.delenv(HASH_MANIFEST_ENV, raising=False)
    for round_ in ("cold", "warm"):
        log.unlink(missing_ok=True)
        port = free_port()
        options = EngineOptions(tools / "llama-server", str(big_model), "m", parallel=1)
        argv = [str(options.binary), *engine_args(plan, {}, options, port)]
        engine_log = tmp_path / f"engine-{round_}.log"
        with (
            engine_log.open("wb") as out,
            subprocess.Popen(argv, env=engine_env("k"), stderr=out, stdout=out) as p,
        ):
            try:
                wait_until(lambda: _healthy(port) or p.poll() is not None, 120, "llama-server to load")  # noqa: B023
                assert p.poll() is None, engine_log.read_text()[-2000:]
            finally:
                p.terminate()
                p.wait(30)
        assert hm.hash_log_counts(log.read_text()) == {"manifest": count}


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False
