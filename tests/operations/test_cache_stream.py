"""Warming over one OpenSSH session per node: the remote script takes exactly each file's bytes, and on a
lab node (real sshd) a full disk is a clear error and an interrupted stream leaves no partial file.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.connectors.connect import connect
from orchestrator.connectors.local import LocalConnection
from orchestrator.core import fnv
from orchestrator.core.errors import HostError
from orchestrator.inventory.model import Host
from orchestrator.lab.state import Lab
from orchestrator.operations.cache import WarmItem, warm
from orchestrator.operations.cache_stream import (
    BLOCK,
    TEMP_PREFIX,
    ChildRemote,
    PlainLink,
    stream_command,
    stream_items,
    stream_script,
)
from tests.plugins.cache import warm_items
from tests.plugins.lab import lab_hosts_of, own_lab


def _source(tmp_path: Path, sizes: list[int]) -> list[WarmItem]:
    """Items back to back in one file, named by their hash (as a model's tensors are)."""
    data = os.urandom(sum(sizes) + 7)
    path = tmp_path / "source.bin"
    path.write_bytes(data)
    items, offset = [], 3
    for size in sizes:
        name = f"{fnv.hash_file_range(path, offset, size):016x}"
        items.append(WarmItem(name, path, offset, size))
        offset += size
    return items


def _stdin(items: list[WarmItem]) -> bytes:
    """What the stream sends: each file's bytes, then its name on a line."""
    out = b""
    for item in items:
        with item.path.open("rb") as fh:
            fh.seek(item.offset)
            out += fh.read(item.size) + f"{item.name}\n".encode()
    return out


def test_the_script_takes_exactly_each_files_bytes(tmp_path: Path) -> None:
    # Under a block, exactly one block, blocks and a remainder: each file gets its bytes and no more.
    items = _source(tmp_path, [1000, BLOCK, 2 * BLOCK + 12345, 1])
    folder = tmp_path / "cache"
    script = stream_script(str(folder), items)
    done = subprocess.run(["sh", "-c", script], input=_stdin(items), capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # `ready` once the folder is marked; the mark goes at the end (none is left).
    assert done.stdout.decode().split() == ["ready", *(w for i in items for w in ("ok", str(i.name)))]
    for item in items:
        path = folder / item.name
        assert path.stat().st_size == item.size
        assert fnv.hash_file_range(path, 0, item.size) == int(item.name, 16)
    assert sorted(p.name for p in folder.iterdir()) == sorted(i.name for i in items)


def test_a_stream_that_ends_early_leaves_only_whole_files(tmp_path: Path) -> None:
    items = _source(tmp_path, [BLOCK + 5, 3 * BLOCK])
    folder = tmp_path / "cache"
    cut = _stdin(items)[: items[0].size + 17 + BLOCK]  # the second file is cut short
    done = subprocess.run(["sh", "-c", stream_script(str(folder), items)], input=cut, capture_output=True)
    assert done.returncode == 1 and b"short input for file 1" in done.stderr
    assert [p.name for p in folder.iterdir()] == [items[0].name]  # the trap removed the mark too


def test_a_file_without_a_name_is_named_by_its_bytes_and_a_bad_name_is_refused(tmp_path: Path) -> None:
    items = _source(tmp_path, [BLOCK + 3, 5000])
    folder = tmp_path / "cache"

    async def stream(sent: list[WarmItem]) -> list[WarmItem]:
        host = Host(name="l", address="127.0.0.1", connection="local")
        command = stream_command(host, LocalConnection(host, home=tmp_path), stream_script(str(folder), sent))
        assert command is not None
        child = await ChildRemote.start(command)
        return await stream_items(host, child, sent, stopping=lambda: False, on_file=lambda _i: None)

    landed = asyncio.run(stream([dataclasses.replace(i, name=None) for i in items]))
    assert [i.name for i in landed] == [i.name for i in items]  # FNV-1a of the bytes, computed as sent
    _whole(folder)
    bad = _stdin(items[:1]).replace(str(items[0].name).encode(), b"../../etc/passwd")
    done = subprocess.run(
        ["sh", "-c", stream_script(str(folder / "b"), items[:1])], input=bad, capture_output=True
    )
    assert done.returncode == 1 and b"bad name for file 0" in done.stderr
    assert list((folder / "b").iterdir()) == []


def test_the_stream_runs_over_ssh_or_a_local_shell_else_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestrator.connectors.local import LocalConnection
    from orchestrator.connectors.ssh import SSHConnection
    from orchestrator.operations import cache_stream

    local = Host(name="l", address="127.0.0.1", connection="local")
    command = stream_command(local, LocalConnection(local, home=tmp_path), "echo hi")
    assert command is not None and command.argv == ("/bin/bash", "-c", "echo hi") and command.cwd == tmp_path
    assert command.env is not None and command.env["HOME"] == str(tmp_path)
    remote = Host(name="s", address="10.0.0.1", ssh_port=2222, ssh_user="u")
    conn = SSHConnection.__new__(SSHConnection)  # never connected: only its type matters
    monkeypatch.setattr(cache_stream.shutil, "which", lambda name: f"/usr/bin/{name}")
    command = stream_command(remote, conn, "echo hi")
    assert command is not None and command.argv[0] == "ssh" and command.argv[-2] == "10.0.0.1"
    assert command.argv[-1] == "exec sh -c 'echo hi'" and "2222" in command.argv and "u" in command.argv
    monkeypatch.setattr(cache_stream.shutil, "which", lambda name: None)
    assert stream_command(remote, conn, "echo hi") is None  # asyncssh's `cat` per file then


def test_warm_without_the_ssh_binary_sends_a_file_at_a_time(
    big_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from orchestrator.operations import cache_stream

    monkeypatch.setattr(cache_stream, "stream_command", lambda *args: None)
    items = warm_items(big_model)
    host = Host(name="f", address="127.0.0.1", connection="local", install_dir=str(tmp_path / "f"))

    async def go() -> object:
        async with await connect(host) as conn:
            return await warm(conn, host, items)

    change = asyncio.run(go())
    assert set(change.added) == {i.name for i in items}  # type: ignore[attr-defined]
    assert change.via == "a file at a time"  # type: ignore[attr-defined]
    _whole(tmp_path / "f" / "cache" / "rpc")


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[Lab, Host]]:
    with own_lab(1, "cs") as lab:
        yield lab, lab_hosts_of(lab)[0]


def _folder(lab: Lab) -> Path:
    return lab.nodes[0].home / "rpcfleet" / "cache" / "rpc"


async def _warm(host: Host, items: list[WarmItem]):  # type: ignore[no-untyped-def]
    async with await connect(host) as conn:
        return await warm(conn, host, items)


def _whole(folder: Path) -> None:
    for path in folder.iterdir():
        assert not path.name.startswith(TEMP_PREFIX), path
        assert fnv.hash_file_range(path, 0, path.stat().st_size) == int(path.name, 16)


@pytest.mark.lab
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_on_a_node_is_clear_and_leaves_whole_files(
    node: tuple[Lab, Host],
    big_model: Path,
) -> None:
    lab, host = node
    items = warm_items(big_model)
    folder = _folder(lab)
    home = lab.nodes[0].home
    owner = home.stat()
    folder.mkdir(parents=True, exist_ok=True)
    for path in (home / "rpcfleet", home / "rpcfleet" / "cache", folder):  # the node's user owns them
        os.chown(path, owner.st_uid, owner.st_gid)
    # The tmpfs is mounted in the node's own mount namespace, over its view of the cache folder.
    assert lab.home_mount is not None
    inside = lab.home_mount / folder.relative_to(home)
    holder = lab.nodes[0].holder_pid()
    seen = Path(f"/proc/{holder}/root") / inside.relative_to("/")
    mb = (items[0].size * 2 + (4 << 20)) >> 20  # room for two files, not three
    options = f"size={mb}m,uid={owner.st_uid},gid={owner.st_gid},mode=0755"
    lab.node_exec(1, ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(inside)])
    try:
        with pytest.raises(HostError, match="disk is full") as caught:
            asyncio.run(_warm(host, items))
        assert caught.value.host == host.name
        _whole(seen)
        assert 1 <= len(list(seen.iterdir())) <= 2
    finally:
        lab.node_exec(1, ["umount", str(inside)])


@pytest.mark.lab
@pytest.mark.soak
def test_an_interrupted_stream_leaves_no_partial_file(
    node: tuple[Lab, Host],
    big_model: Path,
    rounds: int,
) -> None:
    """Cancelled at 20 moments (soak; the first and the last in the suite), from the first file under way
    to 95 ms later: whatever is there is whole."""
    lab, host = node
    items = warm_items(big_model)
    folder = _folder(lab)

    async def interrupted(extra: float) -> None:
        task = asyncio.ensure_future(_warm(host, items))
        for _ in range(20000):  # until a file is under way
            if folder.exists() and any(p.name.startswith(TEMP_PREFIX) for p in folder.iterdir()):
                break
            await asyncio.sleep(0.001)
        else:
            raise AssertionError("no upload started")
        await asyncio.sleep(extra)
        task.cancel()  # a late round may find the warm finished: then there is nothing to cancel
        with contextlib.suppress(asyncio.CancelledError):
            await task

    for round_ in range(rounds):
        for path in folder.glob("*") if folder.exists() else ():
            path.unlink()
        asyncio.run(interrupted(0.095 * round_ / max(rounds - 1, 1)))
        for _ in range(100):  # sshd hangs up on the script: its trap removes the temporary file
            if not any(p.name.startswith(TEMP_PREFIX) for p in folder.iterdir()):
                break
            time.sleep(0.05)
        _whole(folder)
    # The next warm completes the set, and replaces a file truncated under its own name.
    change = asyncio.run(_warm(host, items))
    assert set(change.added) | set(change.hits) == {i.name for i in items}
    _whole(folder)
    short = folder / items[1].name
    short.write_bytes(short.read_bytes()[:1000])
    change = asyncio.run(_warm(host, items))
    assert change.corrupt == (items[1].name,) and set(change.added) == {items[1].name}
    _whole(folder)
    assert short.stat().st_size == items[1].size


def test_a_plain_link_takes_only_the_node_with_its_token_and_then_no_one() -> None:
    async def scenario() -> None:
        link = await PlainLink.open("127.0.0.1")
        assert link.address == "127.0.0.1" and len(link.token) == 32
        reader, writer = await asyncio.open_connection(link.address, link.port)
        writer.write(b"not-the-token\n")
        await writer.drain()
        assert await reader.read() == b""  # closed without a byte
        assert not link.accepted.done()
        reader, writer = await asyncio.open_connection(link.address, link.port)
        writer.write(link.token.encode() + b"\n")
        await writer.drain()
        accepted = await asyncio.wait_for(link.accepted, 5)
        accepted.write(b"weights")
        await accepted.drain()
        assert await reader.readexactly(7) == b"weights"
        with pytest.raises(OSError):  # the listener closed once the node was connected
            await asyncio.open_connection(link.address, link.port)
        link.close()
        assert await reader.read() == b""
        writer.close()

    asyncio.run(scenario())


@pytest.mark.lab
def test_a_tcp_host_is_warmed_over_a_plain_link_else_over_ssh(
    node: tuple[Lab, Host],
    big_model: Path,
) -> None:
    """`rpc_transport: tcp`: the bytes take a plain TCP link the node opened back with its token; a node
    that cannot connect back (its new outbound connections refused) and an `rpc_transport: ssh` host
    are warmed over the SSH session. Every time the files are whole and no mark is left."""
    lab, host = node
    items = warm_items(big_model)
    folder = _folder(lab)

    def warmed(target: Host) -> str | None:
        for path in folder.glob("*") if folder.exists() else ():
            path.unlink()
        change = asyncio.run(_warm(target, items))
        assert set(change.added) == {i.name for i in items}
        _whole(folder)
        return change.via  # type: ignore[no-any-return]

    assert host.rpc_transport == "tcp"
    assert warmed(host) == "plain tcp"
    assert warmed(dataclasses.replace(host, rpc_transport="ssh")) == "ssh"
    refuse = ["iptables", "-I", "OUTPUT", "-p", "tcp", "--syn", "-j", "REJECT", "--reject-with", "tcp-reset"]
    lab.node_exec(1, refuse)
    try:
        assert warmed(host) == "ssh"
    finally:
        lab.node_exec(1, ["iptables", "-D", *refuse[2:]])
