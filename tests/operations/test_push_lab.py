"""Tier 2: `model push` on a lab of 3 namespaced nodes (real sshd, real servers): this machine sends one copy
(the lab bridge's transmit counter: the controller's own link), the nodes forward it to each other, every
node ends with the source's bytes, and a load from the pushed copies (`model_path_on_nodes`) says the same
text as a load whose tensors all came from this machine. A push cut by Ctrl-C, then one killed outright,
leave no file under the final name, and the next push resumes (it sends less). A full disk on a node is
an error naming the host and the bytes needed. The race: a push while a load reads the caches.
"""

from __future__ import annotations

import contextlib
import fcntl
import filecmp
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.cli import main
from orchestrator.lab.state import Lab, LabNode
from orchestrator.models.synth import write_tiny_llama
from tests.plugins.lab import own_lab

pytestmark = [pytest.mark.lab, pytest.mark.llama]

MODEL: dict[str, Any] = {"n_layer": 2, "n_embd": 1024, "n_head": 8, "n_head_kv": 8, "n_ff": 5632, "seed": 13}
CHUNK = "2MiB"


class Rig:
    def __init__(self, lab: Lab, model: Path, inventory: Path, reference: str) -> None:
        self.lab, self.model, self.inventory, self.reference = lab, model, inventory, reference

    @property
    def inv(self) -> list[str]:
        return ["-i", str(self.inventory)]

    def push_argv(self) -> list[str]:
        return ["model", "push", *self.inv, "-m", str(self.model), "--chunk", CHUNK]

    def run_argv(self) -> list[str]:
        return [
            "run",
            *self.inv,
            "-m",
            str(self.model),
            "-p",
            "Once upon",
            "-n",
            "6",
            "--ctx",
            "256",
            "--json",
        ]

    def tx(self) -> int:
        """Bytes this machine has sent into the lab: the bridge's own transmit counter (node-to-node
        traffic is switched inside the bridge and never counted there)."""
        assert self.lab.bridge is not None
        return int(Path(f"/sys/class/net/{self.lab.bridge}/statistics/tx_bytes").read_text())

    def copy(self, node: LabNode) -> Path:
        return node.home / "models" / self.model.name

    def partial(self, node: LabNode) -> Path:
        return Path(f"{self.copy(node)}.partial")

    def forget(self) -> None:
        """Remove every node's copy, partial file and stamp."""
        for node in self.lab.nodes:
            for path in (
                self.copy(node),
                self.partial(node),
                node.home / "models" / f".{self.model.name}.pushed",
            ):
                path.unlink(missing_ok=True)

    def shape(self, rate: str | None) -> None:
        """The controller's link (what it sends into the bridge) shaped to `rate`, or not at all."""
        assert self.lab.bridge is not None
        if rate is None:
            subprocess.run(
                ["tc", "qdisc", "del", "dev", self.lab.bridge, "root"], check=False, capture_output=True
            )
            return
        tbf = ["root", "tbf", "rate", rate, "burst", "64kb", "latency", "200ms"]
        subprocess.run(["tc", "qdisc", "replace", "dev", self.lab.bridge, *tbf], check=True)


def _json(capsys: pytest.CaptureFixture[str], argv: list[str], status: int = 0) -> tuple[dict, str]:  # type: ignore[type-arg]
    assert main(argv) == status, capsys.readouterr().err
    captured = capsys.readouterr()
    out: dict = json.loads(captured.out)  # type: ignore[type-arg]
    return out, captured.err


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("push")
    model = write_tiny_llama(tmp / "pushed.gguf", **MODEL)
    with own_lab(3, "push") as lab:
        doc = yaml.safe_load(lab.inventory.read_text())
        doc["vars"] = {**doc.get("vars", {}), "rpc_cache": True, "model_path_on_nodes": "~/models"}
        inventory = tmp / "inventory.yml"
        inventory.write_text(yaml.safe_dump(doc))
        assert main(["deploy", "-i", str(inventory)]) == 0
        made = Rig(lab, model, inventory, "")
        yield made
        made.shape(None)


@pytest.fixture
def reference(rig: Rig, capsys: pytest.CaptureFixture[str]) -> str:
    """The text of a load on empty caches whose tensors all come from this machine (once per lab)."""
    if not rig.reference:
        _json(capsys, ["cache", "clear", *rig.inv, "--json"])
        cold, _ = _json(capsys, [*rig.run_argv(), "--warm", "never"])
        rig.reference = cold["text"]
    return rig.reference


def test_a_push_crosses_the_controller_link_once_and_the_copies_load_the_same_text(
    rig: Rig, reference: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rig.forget()
    size = rig.model.stat().st_size
    before = rig.tx()
    # As the README writes it (64 MiB chunks), with the lab's inventory.
    pushed, _ = _json(capsys, ["model", "push", *rig.inv, "-m", str(rig.model), "--json"])
    tx = rig.tx() - before
    with capsys.disabled():
        print(f"\npush of {size} bytes to 3 nodes: the controller sent {tx} bytes ({tx / size:.3f}x)")
    assert pushed["sent"] == size and [h["state"] for h in pushed["hosts"]] == ["pushed"] * 3
    # One copy, not three: the stream, SSH and the hash tool's one upload per node (about 0.8 MiB).
    assert size <= tx < 1.15 * size + (4 << 20), tx
    for node in rig.lab.nodes:
        assert filecmp.cmp(rig.copy(node), rig.model, shallow=False), node.name
        assert not rig.partial(node).exists()
    # A load from the pushed copies: each node warms its cache from its own file, nothing of the
    # weights crosses the controller's link, and the text is the text of the load through it.
    _json(capsys, ["cache", "clear", *rig.inv, "--json"])
    before = rig.tx()
    warmed, err = _json(capsys, rig.run_argv())
    tx = rig.tx() - before
    assert {w["via"] for w in warmed["cache"]["warm"].values()} == {"node-local copy"}, warmed["cache"]
    assert warmed["text"] == reference and "warning" not in err
    assert tx < size / 2, tx  # the load's small tensors and SSH only (measured: see the print)
    with capsys.disabled():
        print(f"load from the pushed copies: the controller sent {tx} bytes")
    # A formation re-formed after a loss (node 1 gone): nodes 2 and 3 take larger shares, again from
    # their own copies; the text is that of the same plan loaded through the controller.
    without = [*rig.run_argv(), "-l", f"!{rig.lab.nodes[0].name}"]
    _json(capsys, ["cache", "clear", *rig.inv, "--json"])
    through, _ = _json(capsys, [*without, "--warm", "never"])
    _json(capsys, ["cache", "clear", *rig.inv, "--json"])
    before = rig.tx()
    reformed, err = _json(capsys, without)
    tx = rig.tx() - before
    assert set(reformed["cache"]["warm"]) <= {n.name for n in rig.lab.nodes[1:]}
    assert {w["via"] for w in reformed["cache"]["warm"].values()} == {"node-local copy"}
    assert reformed["text"] == through["text"] and "warning" not in err and tx < size / 2, tx
    again, _ = _json(capsys, [*rig.push_argv(), "--json"])
    assert again["sent"] == 0 and [h["state"] for h in again["hosts"]] == ["present"] * 3


def _wait_free(path: Path, limit: float = 20.0) -> None:
    """Until no receiver holds `path`'s lock (a killed push's receivers end as their session closes)."""
    deadline = time.monotonic() + limit
    while True:
        with path.open("ab") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError:
                assert time.monotonic() < deadline, f"{path} still locked"
        time.sleep(0.1)


def _cut(rig: Rig, fraction: float, sig: signal.Signals) -> tuple[int, str]:
    """A push in a child process, cut by `sig` once every node's partial file holds `fraction` of the
    model; its exit status and stderr."""
    size = rig.model.stat().st_size
    argv = [sys.executable, "-m", "orchestrator", *rig.push_argv()]
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not all(
            rig.partial(n).exists() and rig.partial(n).stat().st_size >= fraction * size
            for n in rig.lab.nodes
        ):
            assert child.poll() is None, child.communicate()[1]
            assert time.monotonic() < deadline, "the push did not get that far"
            time.sleep(0.05)
        child.send_signal(sig)
        _, err = child.communicate(timeout=60)
        return child.returncode, err
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        child.wait()


def test_a_cut_push_leaves_no_final_file_and_the_next_one_resumes(
    rig: Rig, reference: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rig.forget()
    size = rig.model.stat().st_size
    rig.shape("40mbit")  # about 5 MB/s: time to cut it mid-way
    try:
        status, err = _cut(rig, 0.3, signal.SIGINT)  # Ctrl-C
        assert status == 130 and err.strip().endswith("interrupted") and "Traceback" not in err, err
        for node in rig.lab.nodes:
            _wait_free(rig.partial(node))
            assert not rig.copy(node).exists() and rig.partial(node).stat().st_size >= 0.3 * size
        # The resuming push, killed outright (no handler runs here: the nodes see their links end).
        assert _cut(rig, 0.6, signal.SIGKILL)[0] == -signal.SIGKILL
        for node in rig.lab.nodes:
            _wait_free(rig.partial(node))
            assert not rig.copy(node).exists()
        held = min(rig.partial(n).stat().st_size for n in rig.lab.nodes)
    finally:
        rig.shape(None)
    before = rig.tx()
    resumed, _ = _json(capsys, [*rig.push_argv(), "--json"])
    tx = rig.tx() - before
    with capsys.disabled():
        print(f"\nresumed push: {resumed['sent']} of {size} bytes sent (the bridge counted {tx})")
    assert resumed["stream_from"] > 0.5 * size and resumed["sent"] == size - resumed["stream_from"]
    assert resumed["stream_from"] >= held - (2 << 20)  # from the last whole checked chunk
    assert tx < 0.5 * size + (2 << 20), tx
    # each node resumes from its own last whole checked chunk, the stream from the smallest of them: a
    # node ahead in the chain may hold a chunk more than the next one when the push was cut
    for host in resumed["hosts"]:
        assert host["state"] == "pushed" and host["resumed_from"] >= resumed["stream_from"], host
    assert min(h["resumed_from"] for h in resumed["hosts"]) == resumed["stream_from"]
    for node in rig.lab.nodes:
        assert filecmp.cmp(rig.copy(node), rig.model, shallow=False), node.name
        assert not rig.partial(node).exists()


def test_a_full_disk_names_the_host_and_the_bytes_needed(
    rig: Rig, capsys: pytest.CaptureFixture[str]
) -> None:
    node = rig.lab.nodes[1]
    folder = node.home / "models"
    folder.mkdir(exist_ok=True)
    assert rig.lab.home_mount is not None
    inside = rig.lab.home_mount / folder.relative_to(node.home)
    owner = node.home.stat()
    options = f"size=8m,uid={owner.st_uid},gid={owner.st_gid},mode=0755"
    rig.lab.node_exec(node.name, ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(inside)])
    try:
        assert main(rig.push_argv()) == 1
        err = " ".join(capsys.readouterr().err.split())
        size = rig.model.stat().st_size
        assert (
            f"error: {node.name}: cannot push to ~/models/{rig.model.name}: the node's disk is full:" in err
        )
        assert f"({size} bytes) needed" in err, err
    finally:
        rig.lab.node_exec(node.name, ["umount", str(inside)])


@pytest.mark.soak
def test_a_push_while_a_load_reads_the_caches(
    rig: Rig, reference: str, rounds: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each round: no copies on the nodes; a push (a child process) while `run` checks its caches and
    loads: full caches every other round (the load reads them while the push writes), empty ones in the
    others (the warm copies from each node's own file where the push has renamed it, else the tensors
    come from this machine, with a warning), the load started at three moments of the push in turn. The
    text is the reference's, the copies are whole, no cache file is corrupt."""
    seen: list[str] = []
    for k in range(rounds):
        rig.forget()
        if k % 2 == 0:  # else the caches stay full: the load reads them while the push writes
            _json(capsys, ["cache", "clear", *rig.inv, "--json"])
        argv = [sys.executable, "-m", "orchestrator", *rig.push_argv()]
        child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            # The load starts at once, or once the push is under way (partial files), or once the
            # first node has renamed its copy (the others may be renaming theirs): each order in turn.
            if k % 2 == 0 and (k // 2) % 3:
                first = rig.copy(rig.lab.nodes[0])
                wait_for = Path(f"{first}.partial") if (k // 2) % 3 == 1 else first
                deadline = time.monotonic() + 60
                while not wait_for.exists() and child.poll() is None:
                    assert time.monotonic() < deadline, f"no {wait_for}"
                    time.sleep(0.02)
            loaded, _ = _json(capsys, rig.run_argv())
            assert child.wait(timeout=120) == 0, child.communicate()[1]
        finally:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            child.wait()
        assert loaded["text"] == reference
        warm = loaded["cache"].get("warm") or {}
        seen.append(",".join(sorted(str(w["via"]) for w in warm.values())) or "all hits")
        for node in rig.lab.nodes:
            assert filecmp.cmp(rig.copy(node), rig.model, shallow=False), node.name
        verified, _ = _json(capsys, ["cache", "verify", *rig.inv, "--json"])
        assert all(not h["corrupt"] for h in verified["hosts"])
    with capsys.disabled():  # which sources the race gave, round by round
        print(f"\nwhere each round's weights came from: {seen}")


PORT = 7399


def test_a_firewall_that_opens_one_port_takes_the_push_on_that_port(
    rig: Rig, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each node refuses new TCP connections but to SSH and PORT: a push on free ports fails at once,
    naming the first node and the flag, and leaves no final file; `--port PORT` goes through."""
    rig.forget()
    rule = ["INPUT", "-p", "tcp", "--syn", "-m", "multiport", "!", "--dports", f"22,{PORT}"]
    rule += ["-j", "REJECT", "--reject-with", "tcp-reset"]
    for node in rig.lab.nodes:
        rig.lab.node_exec(node.name, ["iptables", "-I", *rule])
    try:
        started = time.monotonic()
        assert main(rig.push_argv()) == 1
        seconds = time.monotonic() - started
        err = " ".join(capsys.readouterr().err.split())
        first, *others = rig.lab.nodes
        name = rig.model.name
        assert f"error: {first.name}: cannot stream to ~/models/{name} at {first.address}:" in err, err
        assert "(a firewall on the node must let the push's port through (--port picks one))" in err
        for node in others:
            assert (
                f"error: {node.name}: the push to ~/models/{name} stopped with the chain's first node" in err
            )
        assert seconds < 20, seconds  # refused at once: no receiver is waited for
        assert not any(rig.copy(node).exists() for node in rig.lab.nodes)
        pushed, _ = _json(capsys, [*rig.push_argv(), "--port", str(PORT), "--json"])
        assert [h["state"] for h in pushed["hosts"]] == ["pushed"] * 3
        for node in rig.lab.nodes:
            assert filecmp.cmp(rig.copy(node), rig.model, shallow=False), node.name
    finally:
        for node in rig.lab.nodes:
            rig.lab.node_exec(node.name, ["iptables", "-D", *rule], check=False)
