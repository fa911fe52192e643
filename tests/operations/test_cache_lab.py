"""Tier 2: the tensor cache end to end through the CLI on a lab (network namespaces, real sshd and servers).

`deploy` with `rpc_cache: true`, `cache warm` (exactly the plan's tensors on each node, all nodes at once),
`run` (every cached tensor a hit, the phases printed), a truncated file refused by `run`, removed by
`cache verify` and by `deploy`, the text then identical; `cache status`, `prune` under `rpc_cache_max`,
`clear`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.cli import main
from orchestrator.lab.state import Lab
from orchestrator.models.synth import write_tiny_llama
from tests.plugins.lab import own_lab
from tests.plugins.playbooks import PLAYBOOKS

pytestmark = [pytest.mark.lab, pytest.mark.llama]

MODEL = {"n_layer": 2, "n_embd": 1024, "n_head": 8, "n_head_kv": 8, "n_ff": 5632, "seed": 5}


@pytest.fixture(scope="module")
def cache_lab() -> Iterator[Lab]:
    with own_lab(2, "ca") as made:
        yield made


@pytest.fixture(scope="module")
def inventory(cache_lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Path:
    doc = yaml.safe_load(cache_lab.inventory.read_text())
    doc["vars"] = {**doc.get("vars", {}), "rpc_cache": True, "rpc_debug": True}  # debug: hits in the log
    path = tmp_path_factory.mktemp("cache-inv") / "inventory.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("cache-lab-model") / "m.gguf", **MODEL)


def _folder(lab: Lab, node: int) -> Path:
    return lab.nodes[node].home / "rpcfleet" / "cache" / "rpc"


def _json(capsys: pytest.CaptureFixture[str], argv: list[str], status: int = 0) -> dict:  # type: ignore[type-arg]
    assert main(argv) == status, capsys.readouterr().err
    out: dict = json.loads(capsys.readouterr().out)  # type: ignore[type-arg]
    return out


def test_warm_run_verify_deploy_prune_clear(
    cache_lab: Lab, inventory: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inv = ["-i", str(inventory)]
    assert main(["deploy", *inv]) == 0, capsys.readouterr().err
    capsys.readouterr()
    warm = _json(capsys, ["cache", "warm", *inv, "-m", str(model), "--ctx", "256", "--json"])
    added = {h["host"]: set(h["added"]) for h in warm["hosts"]}
    for i, node in enumerate(cache_lab.nodes):
        assert {p.name for p in _folder(cache_lab, i).iterdir()} == added[node.name]
        assert len(added[node.name]) == 3  # one layer's 3 FFN matrices of 11 MiB each
    again = _json(capsys, ["cache", "warm", *inv, "-m", str(model), "--ctx", "256", "--json"])
    assert all(not h["added"] and len(h["hits"]) == 3 for h in again["hosts"])

    mtimes = {p.name: p.stat().st_mtime_ns for i in range(2) for p in _folder(cache_lab, i).iterdir()}
    run = ["run", *inv, "-m", str(model), "-p", "Once upon", "-n", "6", "--ctx", "256", "--json"]
    first = _json(capsys, run)
    assert {k: first["cache"][k] for k in ("hits", "misses", "miss_bytes")} == {
        "hits": 6,
        "misses": 0,
        "miss_bytes": 0,
    }
    sizes = {h["host"]: h["bytes"] for h in again["hosts"]}
    assert sorted(first["cache"]["hit_bytes"].values()) == sorted(sizes.values())  # per endpoint
    assert set(first["phases"]) == {"probe", "plan", "cache check", "load"}
    after = {p.name: p.stat().st_mtime_ns for i in range(2) for p in _folder(cache_lab, i).iterdir()}
    assert after == mtimes  # the first load after warming wrote nothing: all hits

    # A truncated file: `run` refuses to load it, `cache verify` removes it, then the text is the same.
    victim = sorted(_folder(cache_lab, 0).iterdir())[0]
    victim.write_bytes(victim.read_bytes()[:4096])
    assert main(run) == 1
    err = capsys.readouterr().err
    assert "truncated or corrupt" in err and victim.name in err and "cache verify" in err
    verify = _json(capsys, ["cache", "verify", *inv, "--json"])
    assert [h["corrupt"] for h in verify["hosts"]] == [[victim.name], []]
    second = _json(capsys, run)
    assert second["text"] == first["text"] and second["cache"]["misses"] == 1

    # Same size, one byte flipped: only a re-hash finds it; deploy does (and says so).
    victim = sorted(_folder(cache_lab, 1).iterdir())[0]
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert main([*run[:-1], "--verify-cache", "--json"]) == 1
    assert victim.name in capsys.readouterr().err
    assert main(["deploy", *inv]) == 0
    assert "removed 1 truncated or corrupt" in capsys.readouterr().err
    assert not victim.exists()
    assert _json(capsys, run)["text"] == first["text"]

    status = _json(capsys, ["cache", "status", *inv, "--json"])
    assert [h["files"] for h in status["hosts"]] == [3, 3]
    # Hits since the server started (one start: deploy changed nothing later), from its debug log:
    # 3 (first run) + 2 and 3 (after verify removed n1's file) + 3 and 2 (after deploy removed n2's).
    assert [h["hits_since_start"] for h in status["hosts"]] == [8, 8]
    assert all(
        h["bytes"] == sum(p.stat().st_size for p in _folder(cache_lab, i).iterdir())
        for i, h in enumerate(status["hosts"])
    )
    assert {p.name for i in range(2) for p in _folder(cache_lab, i).iterdir()} == set(mtimes)

    cleared = _json(capsys, ["cache", "clear", *inv, "--json"])
    assert [len(h["removed"]) for h in cleared["hosts"]] == [3, 3]
    assert [list(_folder(cache_lab, i).iterdir()) for i in range(2)] == [[], []]

    # preload.yml warms each node's share before its load check: afterwards the caches hold the warm set.
    preload = ["run-playbook", str(PLAYBOOKS / "preload.yml"), *inv, "-e", f"model={model}", "-e", "ctx=256"]
    assert main(preload) == 0, capsys.readouterr()
    capsys.readouterr()
    assert {p.name for i in range(2) for p in _folder(cache_lab, i).iterdir()} == set(mtimes)

    # `run` on empty caches of both nodes warms them (in parallel, over SSH); the servers rpcfleet builds
    # wait for the files being warmed, so the load runs beside the warm and every tensor is a hit.
    def hits_so_far() -> int:  # the servers' own count of cache hits (their debug log)
        return sum(h["hits_since_start"] for h in _json(capsys, ["cache", "status", *inv, "--json"])["hosts"])

    _json(capsys, ["cache", "clear", *inv, "--json"])
    before = hits_so_far()
    warmed = _json(capsys, run)
    assert set(warmed["phases"]) == {"probe", "plan", "cache check", "warm", "load"}
    assert {k: warmed["cache"][k] for k in ("hits", "misses")} == {"hits": 6, "misses": 0}
    assert warmed["cache"]["load_beside_warm"] is True
    assert warmed["text"] == first["text"]
    assert hits_so_far() - before == 6  # every cached tensor of the load was a hit on its server
    assert {p.name for i in range(2) for p in _folder(cache_lab, i).iterdir()} == set(mtimes)
    _json(capsys, ["cache", "clear", *inv, "--json"])
    before = hits_so_far()
    cold = _json(capsys, [*run, "--warm", "never"])  # the load writes the files itself
    assert "warm" not in cold["phases"] and cold["cache"]["misses"] == 6 and cold["text"] == first["text"]
    assert hits_so_far() == before
    assert {p.name for i in range(2) for p in _folder(cache_lab, i).iterdir()} == set(mtimes)

    # A quota of 1 byte: prune with the model keeps what its plan needs (over the quota, said so);
    # without it, LRU removes everything over the quota.
    doc = yaml.safe_load(inventory.read_text())
    doc["vars"]["rpc_cache_max"] = 1
    tight = inventory.with_name("tight.yml")
    tight.write_text(yaml.safe_dump(doc))
    kept = _json(capsys, ["cache", "prune", "-i", str(tight), "-m", str(model), "--ctx", "256", "--json"])
    assert all(not h["removed"] and h["kept_over_quota"] > 0 for h in kept["hosts"])
    pruned = _json(capsys, ["cache", "prune", "-i", str(tight), "--json"])
    assert [len(h["removed"]) for h in pruned["hosts"]] == [3, 3]


def test_run_connects_once_per_node(
    cache_lab: Lab,
    inventory: Path,
    model: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One loop and one session for the whole command: the probe's SSH connection to each node serves
    the cache check and the warm too (was: two per node, the probe's session and the check's); the
    warm's host lock has its own, one per node."""
    from orchestrator.engine import executor

    opened: list[str] = []
    locks: list[str] = []
    real = executor.connect

    async def counted(host: Any, options: Any = None) -> Any:
        opened.append(host.name)
        return await real(host, options)

    async def lock_connection(self: Any, host: Any) -> Any:
        locks.append(host.name)
        return await real(host, self.options)

    inv = ["-i", str(inventory)]
    assert main(["deploy", *inv]) == 0, capsys.readouterr().err
    capsys.readouterr()
    monkeypatch.setattr(executor, "connect", counted)
    monkeypatch.setattr(executor.Session, "unshared_connection", lock_connection)
    done = _json(capsys, ["run", *inv, "-m", str(model), "-p", "Once", "-n", "2", "--ctx", "256", "--json"])
    assert "cache check" in done["phases"]  # the check ran, over SSH
    names = sorted(node.name for node in cache_lab.nodes)
    assert sorted(opened) == names, opened
    assert done["cache"]["load_beside_warm"] and sorted(locks) == names, (locks, done["cache"])
