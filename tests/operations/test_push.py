"""`model push` over local connections: the same receivers an SSH node runs (Python, the chunk-hash tool),
chained through real TCP on this machine. The lab test (tests/operations/test_push_lab.py) runs them on
namespaced nodes over SSH, with the bridge's counters and interrupts.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.core import fnv
from orchestrator.inventory.model import Host
from orchestrator.operations.push import Pushed
from orchestrator.operations.push_node import Said, chunk_spans, read_said, tool_name
from orchestrator.workflows.push import chunk_hashes, destinations, push_fleet
from tests.plugins.cache import local_host

CHUNK = 1 << 20


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "m.gguf"
    path.parent.mkdir()
    path.write_bytes(os.urandom(5 * CHUNK + 12345))
    return path


def _hosts(tmp_path: Path, count: int) -> list[Host]:
    return [
        local_host(f"n{k}", tmp_path / f"n{k}", model_path_on_nodes=str(tmp_path / f"n{k}" / "models"))
        for k in range(1, count + 1)
    ]


def _file(host: Host, model: Path) -> Path:
    return Path(str(host.model_path_on_nodes)) / model.name


def test_chunks_and_lines_are_read_as_the_receiver_writes_them() -> None:
    assert chunk_spans(10, 4) == [(0, 4), (4, 4), (8, 2)] and chunk_spans(8, 4) == [(0, 4), (4, 4)]
    assert read_said("resume 4096") == Said("resume", ("4096",))
    assert read_said("full 100 20") == Said("full", ("100", "20"))
    assert read_said("cut 77 the stream ended") == Said("cut", ("77", "the stream ended"))
    assert read_said("error cannot listen on port 9: Address in use") == Said(
        "error", ("cannot listen on port 9: Address in use",)
    )
    assert read_said("Traceback (most recent call last):").word == "error"


def test_hosts_sharing_a_folder_on_one_address_are_one_destination(tmp_path: Path) -> None:
    a, b = _hosts(tmp_path, 2)
    same = local_host("n1/second", tmp_path / "n1", model_path_on_nodes=a.model_path_on_nodes)
    chosen, skipped = destinations([a, same, b], Path("/x/m.gguf"))
    assert [h.name for h in chosen] == ["n1", "n2"] and skipped == {"n1/second": "n1"}


def test_a_push_reaches_every_node_through_the_chain_and_a_second_sends_nothing(
    model: Path, tmp_path: Path
) -> None:
    hosts = _hosts(tmp_path, 3)
    sent: list[int] = []
    report = push_fleet(hosts, model, chunk=CHUNK, on_sent=sent.append)
    size = model.stat().st_size
    assert report.run.sent == size and sent[-1] == size  # once, whatever the number of nodes
    for host in hosts:
        outcome = report.run.outcomes[host.name]
        assert outcome == Pushed(host.name, str(_file(host, model)), "pushed", 0, size)
        assert _file(host, model).read_bytes() == model.read_bytes()
        assert not Path(f"{_file(host, model)}.partial").exists()
    again = push_fleet(hosts, model, chunk=CHUNK)
    assert again.run.sent == 0 and {o.state for o in again.run.outcomes.values()} == {"present"}  # type: ignore[union-attr]


def test_a_partial_file_resumes_after_its_last_matching_chunk(model: Path, tmp_path: Path) -> None:
    """Node 1 holds 3 whole chunks and part of a fourth; node 2 holds 3 chunks, the second with a byte
    changed: the stream starts at node 2's second chunk, node 1 writes from its fourth."""
    one, two = _hosts(tmp_path, 2)
    data = model.read_bytes()
    changed = bytearray(data[: 3 * CHUNK])
    changed[CHUNK + 7] ^= 0xFF
    for host, body in ((one, data[: 3 * CHUNK + 500]), (two, bytes(changed))):
        Path(str(host.model_path_on_nodes)).mkdir(parents=True)
        Path(f"{_file(host, model)}.partial").write_bytes(body)
    report = push_fleet([one, two], model, chunk=CHUNK)
    size = len(data)
    assert report.run.started_at == CHUNK and report.run.sent == size - CHUNK
    assert report.run.outcomes["n1"] == Pushed(
        "n1", str(_file(one, model)), "pushed", 3 * CHUNK, size - 3 * CHUNK
    )
    assert report.run.outcomes["n2"] == Pushed("n2", str(_file(two, model)), "pushed", CHUNK, size - CHUNK)
    for host in (one, two):
        assert _file(host, model).read_bytes() == data


def test_a_final_file_that_differs_is_replaced_and_one_that_matches_is_kept(
    model: Path, tmp_path: Path
) -> None:
    (host,) = _hosts(tmp_path, 1)
    push_fleet([host], model, chunk=CHUNK)
    final = _file(host, model)
    data = bytearray(final.read_bytes())
    data[4 * CHUNK + 3] ^= 0x01
    final.write_bytes(bytes(data))  # same size, new mtime: the stamp no longer matches, the hashes differ
    report = push_fleet([host], model, chunk=CHUNK)
    assert report.run.outcomes["n1"].state == "pushed"  # type: ignore[union-attr]
    assert final.read_bytes() == model.read_bytes()
    assert fnv.hash_file_range(final, 0, final.stat().st_size) == fnv.hash_file_range(
        model, 0, model.stat().st_size
    )


def test_two_pushes_of_one_file_at_once_the_second_is_refused(model: Path, tmp_path: Path) -> None:
    one, two = _hosts(tmp_path, 2)
    Path(str(one.model_path_on_nodes)).mkdir(parents=True)
    with Path(f"{_file(one, model)}.partial").open("ab") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # what a push in flight holds
        report = push_fleet([one, two], model, chunk=CHUNK)
    error = report.run.outcomes["n1"]
    assert not isinstance(error, Pushed) and error.host == "n1"
    assert f"another push is writing {_file(one, model)}.partial" in error.message
    assert _file(two, model).read_bytes() == model.read_bytes()  # the others go on
    assert not _file(one, model).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_names_the_host_and_the_bytes_needed_before_any_byte(model: Path, tmp_path: Path) -> None:
    (host,) = _hosts(tmp_path, 1)
    folder = Path(str(host.model_path_on_nodes))
    folder.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)], check=True)
    try:
        report = push_fleet([host], model, chunk=CHUNK)
        error = report.run.outcomes["n1"]
        size = model.stat().st_size
        assert not isinstance(error, Pushed) and error.host == "n1"
        assert f"the node's disk is full: 5.01 MiB ({size} bytes) needed" in error.message
        assert report.run.sent == 0 and not _file(host, model).exists()
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--chunk", "4096"], "--chunk must be at least 1MiB, got 4096 bytes"),
        (["--chunk", "lots"], "--chunk"),
        (["--port", "70000"], "--port"),
        (["-m", "/nonexistent/m.gguf"], "model /nonexistent/m.gguf does not exist"),
    ],
)
def test_bad_flags_exit_2_with_one_clear_line(
    argv: list[str], says: str, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    given = argv if "-m" in argv else ["-m", str(model), *argv]
    assert main(["model", "push", *given]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_no_model_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "push"]) == 2
    assert "--model" in capsys.readouterr().err


def test_chunk_hashes_are_the_fnv_of_each_chunk(model: Path) -> None:
    data = model.read_bytes()
    expected = [f"{fnv.fnv1a64(data[o : o + n]):016x}" for o, n in chunk_spans(len(data), CHUNK)]
    assert chunk_hashes(model, CHUNK) == expected


def test_a_file_changed_during_the_push_is_never_renamed_and_the_next_push_resumes(
    model: Path, tmp_path: Path
) -> None:
    """A byte of chunk 3 changed here after the hashes were taken, before its bytes go: every node finds
    chunk 3 differing, keeps NAME.partial cut there, and no NAME; the next push (hashing the file as it
    is now) resumes at chunk 3."""
    one, two = _hosts(tmp_path, 2)
    changed = False

    def change(sent: int) -> None:
        nonlocal changed
        if not changed and sent >= CHUNK:
            changed = True
            with model.open("r+b") as fh:
                fh.seek(3 * CHUNK + 99)
                byte = fh.read(1)
                fh.seek(3 * CHUNK + 99)
                fh.write(bytes([byte[0] ^ 0x5A]))

    report = push_fleet([one, two], model, chunk=CHUNK, on_sent=change)
    for host in (one, two):
        error = report.run.outcomes[host.name]
        assert not isinstance(error, Pushed) and error.host == host.name
        assert f"chunk 3 of {_file(host, model)} did not match this machine's hash" in error.message
        assert not _file(host, model).exists()
        assert Path(f"{_file(host, model)}.partial").stat().st_size == 3 * CHUNK
    again = push_fleet([one, two], model, chunk=CHUNK)
    assert again.run.started_at == 3 * CHUNK and again.run.sent == model.stat().st_size - 3 * CHUNK
    for host in (one, two):
        assert _file(host, model).read_bytes() == model.read_bytes()


def test_a_hash_tool_that_cannot_run_on_the_node_is_said_not_taken_for_other_bytes(
    model: Path, tmp_path: Path
) -> None:
    """A node where the uploaded tool does not run (another architecture, a noexec mount): an error
    naming the tool, and no file under the final name."""
    (host,) = _hosts(tmp_path, 1)
    tool = Path(host.install_dir) / "tools" / tool_name() / "fnvchunks"
    tool.parent.mkdir(parents=True)
    tool.write_bytes(b"\x7fELF-not-this-machine")
    tool.chmod(0o755)
    report = push_fleet([host], model, chunk=CHUNK)
    error = report.run.outcomes["n1"]
    assert not isinstance(error, Pushed) and error.host == "n1"
    assert f"the chunk-hash tool {tool} did not run: Exec format error" in error.message
    assert not _file(host, model).exists()
