"""Tier 1 for stale clients (`operations.stale`): the proof that a server's client is gone, rule by rule,
read from this machine's real sockets, and the parsers of `ss` and `nf_conntrack`. The lab tests
(tests/serve/test_serve_lab.py) make a real stale connection, which `status` names and nothing closes."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from orchestrator.operations.stale import (
    LocalView,
    ServerConnection,
    parse_connections,
    parse_conntrack,
    read_local_view,
    split_endpoint,
    stale_connections,
)

NODE = "10.77.0.12:50052"


def _view(
    sockets: set[tuple[str, int]] | None = None, translated: set[tuple[str, int]] | None = None
) -> LocalView:
    return LocalView(
        frozenset({"10.77.0.1", "fd00::1"}),
        frozenset(sockets or set()),
        frozenset(translated or set()),
    )


def test_ss_lines_give_both_ends() -> None:
    text = (
        "0      0      10.77.0.12:50052 10.77.0.1:42354 uid:1000 ino:46454 sk:1 cgroup:/ <->\n"
        "0      0      [::ffff:10.77.0.12]:50052 [::ffff:10.77.0.1]:42355 ino:7 sk:2 <->\n"
        "garbage line\n"
    )
    found = parse_connections(text)
    assert found == (
        ServerConnection("10.77.0.12:50052", "10.77.0.1:42354"),
        ServerConnection("[::ffff:10.77.0.12]:50052", "[::ffff:10.77.0.1]:42355"),
    )
    assert found[1].peer_address == "10.77.0.1" and found[1].peer_port == 42355  # v4-mapped is v4
    assert split_endpoint("[fd00::1]:80") == ("fd00::1", 80)


def test_only_positive_proof_makes_a_client_gone() -> None:
    gone = ServerConnection(NODE, "10.77.0.1:42354")
    assert _view().proof(gone) is None
    assert "loopback" in (_view().proof(ServerConnection(NODE, "127.0.0.1:42354")) or "")
    assert "not an address of this controller" in (_view().proof(ServerConnection(NODE, "10.77.0.9:1")) or "")
    assert "in use" in (_view({("10.77.0.1", 42354)}).proof(gone) or "")
    assert "in use" in (_view({("0.0.0.0", 42354)}).proof(gone) or "")  # bound to every address
    assert _view({("10.77.0.2", 42354), ("10.77.0.1", 42355)}).proof(gone) is None  # another socket
    assert "translated" in (_view(translated={("10.77.0.1", 42354)}).proof(gone) or "")
    unknown = LocalView(frozenset({"10.77.0.1"}), frozenset(), None, "the conntrack table is unreadable")
    assert unknown.proof(gone) == "the conntrack table is unreadable"
    unreadable = LocalView(frozenset({"10.77.0.1"}), None, frozenset(), "no /proc")
    assert unreadable.proof(gone) == "no /proc"
    live = ServerConnection(NODE, "10.77.0.1:42355")
    assert stale_connections([gone, live], _view({("10.77.0.1", 42355)})) == (gone,)


def test_a_translated_conntrack_entry_is_a_client_behind_this_machine() -> None:
    text = (
        # a container 172.17.0.2:5555 masqueraded as 10.77.0.1:42354 to the node
        "ipv4     2 tcp      6 431999 ESTABLISHED src=172.17.0.2 dst=10.77.0.12 sport=5555 dport=50052 "
        "src=10.77.0.12 dst=10.77.0.1 sport=50052 dport=42354 [ASSURED] mark=0 zone=0 use=2\n"
        # this machine's own connection: not translated
        "ipv4     2 tcp      6 431999 ESTABLISHED src=10.77.0.1 dst=10.77.0.13 sport=4000 dport=50052 "
        "src=10.77.0.13 dst=10.77.0.1 sport=50052 dport=4000 [ASSURED] mark=0 zone=0 use=2\n"
        "ipv4     2 udp      17 20 src=10.0.0.1 dst=10.0.0.2 sport=1 dport=2 src=10.0.0.3 dst=10.0.0.1 "
        "sport=2 dport=9\n"
    )
    assert parse_conntrack(text) == frozenset({("10.77.0.1", 42354)})


def test_this_machines_view_holds_its_real_sockets(tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        view = read_local_view(tmp_path / "no-table", tmp_path / "no-module")
        assert view.sockets is not None
        assert {client.getsockname(), listener.getsockname(), accepted.getsockname()} <= view.sockets
        assert view.translated == frozenset()  # no conntrack at all: no NAT
        assert "127.0.0.1" not in view.addresses  # loopback never proves anything
        client.close()
        accepted.close()
    with socket.socket(socket.AF_INET6) as listener:  # tcp6, and a v4-mapped address read as v4
        listener.bind(("::", 0))
        listener.listen()
        client = socket.socket(socket.AF_INET6)
        client.connect(("::ffff:127.0.0.1", listener.getsockname()[1]))
        sockets = read_local_view(tmp_path / "no-table", tmp_path / "no-module").sockets or frozenset()
        assert ("127.0.0.1", client.getsockname()[1]) in sockets and (
            "::",
            listener.getsockname()[1],
        ) in sockets
        client.close()
    table = tmp_path / "nf_conntrack"
    table.write_text("")
    assert read_local_view(table, tmp_path / "no-module").translated == frozenset()
    module = tmp_path / "module"
    module.mkdir()
    hidden = read_local_view(tmp_path / "no-table", module)  # conntrack in the kernel, its table hidden
    assert hidden.translated is None and "not readable" in hidden.why_unknown


def test_a_time_wait_socket_is_no_client(tmp_path: Path) -> None:
    """Closed both ways: whatever its destination, it proves nothing about the port's old client."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        mine = client.getsockname()
        client.close()  # the active close: this end waits in TIME_WAIT
        accepted.close()
        deadline = time.monotonic() + 5
        waiting = ""
        while f"{mine[0]}:{mine[1]}" not in waiting and time.monotonic() < deadline:
            ss = ["ss", "-Htn", "state", "time-wait"]
            waiting = subprocess.run(ss, capture_output=True, text=True).stdout
        assert f"{mine[0]}:{mine[1]}" in waiting
        sockets = read_local_view(tmp_path / "no-table", tmp_path / "no-module").sockets or frozenset()
        assert mine not in sockets and listener.getsockname() in sockets


def test_an_unreadable_conntrack_table_proves_nothing(tmp_path: Path) -> None:
    table = tmp_path / "nf_conntrack"
    table.mkdir()  # reading a directory fails as an unreadable table (not root) does
    view = read_local_view(table, tmp_path)
    assert view.translated is None and "the conntrack table is unreadable" in view.why_unknown
    mine = next(iter(view.addresses))
    assert view.proof(ServerConnection(NODE, f"{mine}:1")) == view.why_unknown
