"""Tier 2: nodes that hold the model (`model_path_on_nodes`) warm their caches from it, on the node, over a
lab (network namespaces, real sshd and servers): no weight bytes cross the controller's link (the host
side of each node's veth counts them), the text equals a load whose tensors all came from the controller,
and every cache file's bytes hash to the controller's name for them. A copy with one byte changed in the
middle of a tensor on one node: that node falls back to the controller with a warning naming the host
and the path, and the text is still the same.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.caches.plan import HASH_THRESHOLD, gguf_tensors, hash_tensors
from orchestrator.cli import main
from orchestrator.core import fnv
from orchestrator.lab.state import Lab, LabNode
from orchestrator.models.synth import write_tiny_llama
from tests.plugins.lab import own_lab

pytestmark = [pytest.mark.lab, pytest.mark.llama]

MODEL: dict[str, Any] = {"n_layer": 2, "n_embd": 1024, "n_head": 8, "n_head_kv": 8, "n_ff": 5632, "seed": 9}


def _folder(node: LabNode) -> Path:
    return node.home / "rpcfleet" / "cache" / "rpc"


def _sent_to(node: LabNode) -> int:
    """Bytes this machine has sent toward `node`: the transmit counter of the host side of its veth."""
    assert node.veth is not None
    return int(Path(f"/sys/class/net/{node.veth}/statistics/tx_bytes").read_text())


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[dict, str]:  # type: ignore[type-arg]
    assert main(argv) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    out: dict = json.loads(captured.out)  # type: ignore[type-arg]
    return out, captured.err


def test_nodes_warm_from_their_own_copy_and_fall_back_when_it_differs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = write_tiny_llama(tmp_path / "m.gguf", **MODEL)
    with own_lab(2, "cl") as lab:
        _check(lab, model, tmp_path, capsys)


def _check(lab: Lab, model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = yaml.safe_load(lab.inventory.read_text())
    doc["vars"] = {**doc.get("vars", {}), "rpc_cache": True, "model_path_on_nodes": "~/models"}
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump(doc))
    copies = []
    for node in lab.nodes:  # each node's own copy, in its own home (its mount namespace's /home/<user>)
        (node.home / "models").mkdir(mode=0o755)
        copies.append(Path(shutil.copyfile(model, node.home / "models" / model.name)))
        copies[-1].chmod(0o644)
    inv = ["-i", str(inventory)]
    assert main(["deploy", *inv]) == 0, capsys.readouterr().err
    capsys.readouterr()
    run = ["run", *inv, "-m", str(model), "-p", "Once upon", "-n", "6", "--ctx", "256", "--json"]

    # The reference: a load on empty caches whose tensors all come from this machine (llama.cpp's own).
    cold, _ = _json(capsys, [*run, "--warm", "never"])
    assert cold["cache"]["misses"] == 6 and "warm" not in cold["phases"]
    _json(capsys, ["cache", "clear", *inv, "--json"])

    before = [_sent_to(node) for node in lab.nodes]
    warm, err = _json(capsys, ["cache", "warm", *inv, "-m", str(model), "--ctx", "256", "--json"])
    sent = [_sent_to(node) - b for node, b in zip(lab.nodes, before, strict=True)]
    rows = {row["host"]: row for row in warm["hosts"]}
    for node in lab.nodes:
        row = rows[node.name]
        assert (row["via"], row["bytes_sent"], row["warnings"]) == ("node-local copy", 0, []), row
        assert len(row["added"]) == 3 and row["bytes_local"] == 3 * 11 * 2**20
    # The warm's own figures aside, the link: under 2 MiB toward each node against the 33 MiB of its
    # tensors (measured: 0.8 MiB, most of it the FNV helper's one upload; SSH and the probe the rest).
    with capsys.disabled():
        print(f"\nbytes toward each node during the node-local warm: {sent}")
    assert all(s < 2 * 2**20 for s in sent), sent
    assert "warning" not in err
    names = {
        c.tensor.offset: c.file
        for c in hash_tensors(t for t in gguf_tensors([model]) if t.size > HASH_THRESHOLD)
    }
    for node in lab.nodes:  # every file's bytes are the controller's bytes for its name
        files = sorted(_folder(node).iterdir())
        assert {f.name for f in files} == set(rows[node.name]["added"]) and set(
            rows[node.name]["added"]
        ) <= set(names.values())
        for f in files:
            assert fnv.hash_file_range(f, 0, f.stat().st_size) == int(f.name, 16)
    warmed, _ = _json(capsys, run)
    assert warmed["text"] == cold["text"]
    assert (warmed["cache"]["hits"], warmed["cache"]["misses"]) == (6, 0)

    # One byte changed in the middle of one of node 2's tensors, in node 2's copy: `run` (whose warm
    # fills both caches) copies node 1's share on node 1 and sends node 2's from here, with a warning.
    _json(capsys, ["cache", "clear", *inv, "--json"])
    node = lab.nodes[1]
    offset = min(off for off, name in names.items() if name in rows[node.name]["added"])
    data = bytearray(copies[1].read_bytes())
    data[offset + 11 * 2**20 // 2] ^= 0xFF
    copies[1].write_bytes(bytes(data))
    before = [_sent_to(n) for n in lab.nodes]
    fallback, err = _json(capsys, run)
    sent = [_sent_to(n) - b for n, b in zip(lab.nodes, before, strict=True)]
    with capsys.disabled():
        print(f"bytes toward each node during run with node 2's copy differing: {sent}")
    assert fallback["text"] == cold["text"]
    vias = {host: w["via"] for host, w in fallback["cache"]["warm"].items()}
    assert vias[lab.nodes[0].name] == "node-local copy"
    assert vias[node.name] in ("plain tcp", "ssh"), vias  # its first tensor differs: all from here
    assert fallback["cache"]["warm"][node.name]["bytes_sent"] == 3 * 11 * 2**20
    assert f"warning: {node.name}: the node-local copy ~/models/{model.name} differs" in " ".join(err.split())
    assert sent[1] > 3 * 11 * 2**20, sent  # node 2's tensors crossed its link (and the load's small ones)
    verified, _ = _json(capsys, ["cache", "verify", *inv, "--json"])
    assert all(not h["corrupt"] for h in verified["hosts"])

    # The table says where each node's files came from; the warning goes to stderr.
    _json(capsys, ["cache", "clear", *inv, "--json"])
    assert main(["cache", "warm", *inv, "-m", str(model), "--ctx", "256"]) == 0
    table = capsys.readouterr()
    rows_text = {n.name: next(x for x in table.out.splitlines() if n.name in x) for n in lab.nodes}
    assert "via node-local copy" in rows_text[lab.nodes[0].name]
    assert "via plain tcp" in rows_text[node.name] or "via ssh" in rows_text[node.name], table.out
    assert f"{node.name}: the node-local copy ~/models/{model.name} differs" in " ".join(table.err.split())
