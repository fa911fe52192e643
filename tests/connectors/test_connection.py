"""Connections, tier 1: in-process SSH servers (tests/plugins/fakehosts.py) and local subprocesses."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from orchestrator.connectors.base import CommandResult, ConnectOptions, shell_path
from orchestrator.connectors.connect import connect
from orchestrator.connectors.local import LocalConnection
from orchestrator.connectors.ssh import SSHConnection
from orchestrator.core.errors import (
    AuthenticationError,
    CommandError,
    CommandTimeoutError,
    HostKeyError,
    TransferError,
    UnreachableError,
)
from orchestrator.inventory.model import Host
from tests.plugins.fakehosts import FakeHost, ServerLoop
from tests.procs import gone
from tests.waits import until

FakeHosts = Callable[..., list[FakeHost]]
FAST = ConnectOptions(connect_timeout=5.0, command_timeout=10.0)


def test_shell_path_expands_home_and_quotes_the_rest() -> None:
    assert shell_path("~/.local/lib/rpcfleet") == '"$HOME"/.local/lib/rpcfleet'
    assert shell_path("~") == '"$HOME"'
    assert shell_path("~/my dir") == "\"$HOME\"/'my dir'"
    assert shell_path("/opt/it's here") == "'/opt/it'\"'\"'s here'"
    assert shell_path("/opt/rpc fleet/") == "'/opt/rpc fleet'"
    assert shell_path("~/a;rm -rf x") == "\"$HOME\"/'a;rm -rf x'"


async def wait_gone(pid: int, within: float = 3.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        await asyncio.sleep(0.02)
    return False


@pytest.fixture
def one(fake_hosts: FakeHosts) -> FakeHost:
    return fake_hosts(1)[0]


@pytest.fixture
def local_host(tmp_path: Path) -> Host:
    return Host(name="here", address="127.0.0.1", connection="local")


# --- SSH: commands --------------------------------------------------------------------------------


async def test_run_returns_output_and_exit_status(one: FakeHost) -> None:
    async with await connect(one.host, FAST) as conn:
        assert isinstance(conn, SSHConnection)
        result = await conn.run("echo out; echo err >&2; exit 3")
        where = await conn.run('pwd; echo "$HOME"; echo ~')
    assert isinstance(result, CommandResult)
    assert (result.host, result.command) == ("fake1", "echo out; echo err >&2; exit 3")
    assert (result.exit_status, result.stdout, result.stderr, result.ok) == (3, "out\n", "err\n", False)
    assert 0 < result.duration < 5
    # Like an SSH login: commands run in the user's home.
    assert where.ok
    assert where.stdout.split() == [str(one.home)] * 3


async def test_run_feeds_input_and_closes_stdin(one: FakeHost) -> None:
    async with await connect(one.host, FAST) as conn:
        upper = await conn.run("tr a-z A-Z", input="hello\n")
        raw = await conn.run("wc -c", input=b"\x00\xff" * 1000)
        # No input: stdin is at EOF at once, so a reader of stdin does not wait for the timeout.
        started = time.monotonic()
        empty = await conn.run("cat; echo done", timeout=30)
    assert upper.stdout == "HELLO\n"
    assert raw.stdout.strip() == "2000"
    assert empty.stdout == "done\n"
    assert time.monotonic() - started < 10  # milliseconds; headroom for a busy machine, not the 30 s


async def test_run_decodes_bad_utf8_and_reports_signals(one: FakeHost) -> None:
    async with await connect(one.host, FAST) as conn:
        text = await conn.run(r"printf 'caf\xc3\xa9 \xff\n'")
        killed = await conn.run("kill -9 $$")
    assert text.stdout == "café \ufffd\n"
    assert killed.exit_status == 137  # 128 + SIGKILL, as a shell reports it


async def test_check_raises_command_error_with_stderr_tail(one: FakeHost) -> None:
    command = "for i in $(seq 1 20); do echo line$i >&2; done; exit 2"
    async with await connect(one.host, FAST) as conn:
        with pytest.raises(CommandError) as info:
            await conn.run(command, check=True)
        assert (await conn.run("true", check=True)).ok
    error = info.value
    assert (error.host, error.command, error.exit_status) == ("fake1", command, 2)
    assert error.stderr_tail is not None
    assert error.stderr_tail.splitlines()[-1] == "line20"
    assert "line1\n" not in error.stderr_tail + "\n"  # only the tail
    assert "exit status 2" in str(error) and "line20" in str(error)


async def test_timeout_keeps_partial_output_and_drops_the_command(one: FakeHost) -> None:
    async with await connect(one.host, FAST) as conn:
        started = time.monotonic()
        with pytest.raises(CommandTimeoutError) as info:
            await conn.run("echo $$; echo partial; echo oops >&2; exec sleep 30", timeout=0.5)
        elapsed = time.monotonic() - started
        # The connection stays usable after a timed-out command.
        after = await conn.run("echo still here")
    error = info.value
    assert 0.5 <= elapsed < 5  # the 0.5 s timeout (headroom for a busy machine), not the 30 s sleep
    assert "timed out after 0.5 s" in str(error)
    pid, partial = error.stdout.split()
    assert partial == "partial"
    assert error.stderr_tail == "oops"
    assert after.stdout == "still here\n"
    assert int(pid) > 0  # that the command itself is gone is proven on real sshd (test_connection_lab.py)


async def test_default_command_timeout_comes_from_options(one: FakeHost) -> None:
    async with await connect(one.host, ConnectOptions(command_timeout=0.3)) as conn:
        started = time.monotonic()
        with pytest.raises(CommandTimeoutError):
            await conn.run("sleep 10")
    assert time.monotonic() - started < 5  # the 0.3 s timeout (headroom for a busy machine), not the sleep


async def test_detached_background_process_returns_promptly(one: FakeHost) -> None:
    async with await connect(one.host, FAST) as conn:
        started = time.monotonic()
        result = await conn.run(
            "cd ~; setsid nohup sleep 30 >/dev/null 2>&1 </dev/null & echo $!", timeout=20
        )
        elapsed = time.monotonic() - started
        pid = int(result.stdout)
        try:
            assert elapsed < 10  # milliseconds; headroom for a busy machine, not the 30 s of the process
            await conn.close()
            assert not gone(pid), "the detached process must outlive the command and the connection"
        finally:
            os.kill(pid, 9)


async def test_concurrent_commands_on_one_connection(one: FakeHost) -> None:
    # Each command waits until all five have started: commands run one after another would never finish
    # (the first one times out), whatever the machine's load.
    barrier = "touch started.{i}; until [ $(ls started.* | wc -l) -ge 5 ]; do sleep 0.01; done; echo {i}"
    async with await connect(one.host, FAST) as conn:
        results = await asyncio.gather(*(conn.run(barrier.format(i=i), timeout=8) for i in range(5)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(5)]


async def test_connection_lost_while_running_is_unreachable(one: FakeHost) -> None:
    conn = await connect(one.host, FAST)
    try:
        running = asyncio.create_task(conn.run("sleep 10", timeout=8))
        await until(lambda: one.processes, what="the command running on the host")
        started = time.monotonic()
        one.abort_connections()
        with pytest.raises(UnreachableError) as info:
            await running
        assert time.monotonic() - started < 5  # at once (headroom for a busy machine), not the 8 s timeout
        assert "lost" in str(info.value)
        assert info.value.host == "fake1"
        with pytest.raises(UnreachableError):
            await conn.run("true")
        with pytest.raises(UnreachableError):
            await conn.put(Path(__file__), "~/x")
    finally:
        await conn.close()


async def test_keepalive_detects_a_silent_peer(one: FakeHost, fake_host_loop: ServerLoop) -> None:
    # Without keepalive this would wait for the command timeout (here 8 s) or, on a cut link, forever.
    options = ConnectOptions(connect_timeout=5, keepalive_interval=0.2, keepalive_count_max=2)
    async with await connect(one.host, options) as conn:
        running = asyncio.create_task(conn.run("sleep 5", timeout=8))
        await until(lambda: one.processes, what="the command running on the host")
        started = time.monotonic()
        fake_host_loop.freeze(6.0)
        with pytest.raises(UnreachableError) as info:
            await running
        # About 0.6 s (3 keepalives of 0.2 s); within the freeze, with headroom for a busy machine.
        assert time.monotonic() - started < 5.5
    assert "lost while running the command" in str(info.value)


# --- SSH: connecting ------------------------------------------------------------------------------


async def test_refused_host_fails_fast_while_others_succeed(fake_hosts: FakeHosts) -> None:
    hosts = fake_hosts(3)
    hosts[1].stop_listening()

    async def hostname_of(host: Host) -> str:
        async with await connect(host, FAST) as conn:
            return (await conn.run("echo $HOME", check=True)).stdout.strip()

    started = time.monotonic()
    results = await asyncio.gather(*(hostname_of(h.host) for h in hosts), return_exceptions=True)
    assert time.monotonic() - started < 4  # headroom for a busy machine; still under the 5 s connect timeout
    assert results[0] == str(hosts[0].home)
    assert results[2] == str(hosts[2].home)
    refused = results[1]
    assert isinstance(refused, UnreachableError)
    assert refused.host == "fake2"
    assert "connection refused" in str(refused)
    started = time.monotonic()
    with pytest.raises(UnreachableError):
        await connect(hosts[1].host, FAST)
    assert time.monotonic() - started < 2.5  # a refusal is at once, not the 5 s connect timeout
    assert f"{hosts[1].address}:{hosts[1].port}" in str(refused)


async def test_silent_listener_times_out_at_connect_timeout(silent_host: Callable[[], Host]) -> None:
    host = silent_host()
    started = time.monotonic()
    with pytest.raises(UnreachableError) as info:
        await connect(host, ConnectOptions(connect_timeout=0.5))
    elapsed = time.monotonic() - started
    assert 0.4 <= elapsed < 3  # the 0.5 s timeout with headroom for a busy machine; a silent peer: forever
    assert "timed out after 0.5 s" in str(info.value)
    assert not isinstance(info.value, (AuthenticationError, HostKeyError))


async def test_connect_timeout_defaults_to_the_hosts_setting(silent_host: Callable[[], Host]) -> None:
    host = silent_host()
    quick = dataclasses.replace(host, ssh_connect_timeout=0.3)
    assert ConnectOptions().connect_timeout_for(quick) == 0.3
    assert ConnectOptions(connect_timeout=2.0).connect_timeout_for(quick) == 2.0  # explicit wins
    assert ConnectOptions().connect_timeout_for(Host(name="h", address="x")) == 10.0
    started = time.monotonic()
    with pytest.raises(UnreachableError, match=r"timed out after 0\.3 s"):
        await connect(quick)
    assert time.monotonic() - started < 3  # the host's 0.3 s (headroom for load), not the 10 s default


async def test_wrong_host_key_is_a_host_key_error(one: FakeHost) -> None:
    with pytest.raises(HostKeyError) as info:
        await connect(one.host_with_known_hosts("wrong"), FAST)
    message = str(info.value)
    assert "does not match" in message
    assert "ssh-keygen" in message and f"[{one.address}]:{one.port}" in message


async def test_unknown_host_key_is_a_host_key_error(one: FakeHost, tmp_path: Path) -> None:
    with pytest.raises(HostKeyError) as info:
        await connect(one.host_with_known_hosts("unknown"), FAST)
    assert "unknown" in str(info.value)
    assert "ssh-keyscan" in str(info.value) and "ssh_host_key_checking" in str(info.value)
    missing = tmp_path / "no-such-known-hosts"
    with pytest.raises(HostKeyError, match="does not exist"):
        await connect(one.host_with(ssh_known_hosts=str(missing)), FAST)


async def test_disabled_host_key_checking_connects_and_warns_once(one: FakeHost) -> None:
    unchecked = dataclasses.replace(one.host_with_known_hosts("wrong"), ssh_host_key_checking=False)
    with capture_logs() as logs:
        for _ in range(2):
            async with await connect(unchecked, FAST) as conn:
                assert (await conn.run("echo hi")).stdout == "hi\n"
    warnings = [e for e in logs if e["event"] == "host_key_checking_disabled"]
    assert len(warnings) == 1
    assert warnings[0]["log_level"] == "warning"
    assert warnings[0]["host"] == "fake1"


async def test_wrong_client_key_is_an_authentication_error(
    one: FakeHost, other_client_key_path: Path
) -> None:
    with pytest.raises(AuthenticationError) as info:
        await connect(one.host_with(ssh_key=str(other_client_key_path)), FAST)
    error = info.value
    assert error.host == "fake1"
    assert "authentication failed" in str(error)
    assert error.hint is not None
    assert f"user {one.host.ssh_user}" in error.hint and str(other_client_key_path) in error.hint


async def test_unreadable_client_key_is_an_authentication_error(one: FakeHost, tmp_path: Path) -> None:
    with pytest.raises(AuthenticationError, match="cannot read ssh_key"):
        await connect(one.host_with(ssh_key=str(tmp_path / "missing")), FAST)
    garbage = tmp_path / "garbage"
    garbage.write_text("not a key\n")
    with pytest.raises(AuthenticationError, match="cannot load ssh_key"):
        await connect(one.host_with(ssh_key=str(garbage)), FAST)


# --- SSH: files -----------------------------------------------------------------------------------


async def test_put_and_get_round_trip_with_progress(one: FakeHost, tmp_path: Path) -> None:
    local = tmp_path / "blob.bin"
    payload = os.urandom(3 * 1024 * 1024 + 17)
    local.write_bytes(payload)
    local.chmod(0o750)
    calls: list[tuple[int, int]] = []
    async with await connect(one.host, FAST) as conn:
        await conn.put(local, "~/blob.bin", progress=lambda done, total: calls.append((done, total)))
        listing = await conn.run("stat -c %a ~/blob.bin && sha256sum < ~/blob.bin")
        back = tmp_path / "back.bin"
        await conn.get("~/blob.bin", back)
        absolute = tmp_path / "abs.bin"
        await conn.put(local, str(absolute))
    assert (one.home / "blob.bin").read_bytes() == payload
    assert back.read_bytes() == payload
    assert absolute.read_bytes() == payload
    mode, digest = listing.stdout.split()[:2]
    assert mode == "750"
    assert len(digest) == 64
    assert calls[-1] == (len(payload), len(payload))
    dones = [done for done, _ in calls]
    assert dones == sorted(dones) and len(calls) > 1


async def test_put_into_a_missing_directory_is_a_transfer_error(one: FakeHost, tmp_path: Path) -> None:
    local = tmp_path / "small"
    local.write_text("x")
    async with await connect(one.host, FAST) as conn:
        with pytest.raises(TransferError) as info:
            await conn.put(local, "~/no/such/dir/small")
        with pytest.raises(TransferError) as missing:
            await conn.get("~/not-there", tmp_path / "out")
        with pytest.raises(TransferError, match="cannot upload"):
            await conn.put(tmp_path / "no-local-file", "~/x")
        # The connection still works after failed transfers.
        assert (await conn.run("echo ok")).ok
    assert info.value.host == "fake1"
    assert "~/no/such/dir/small" in str(info.value)
    assert "No such file" in str(info.value)
    assert "~/not-there" in str(missing.value)


# --- local ----------------------------------------------------------------------------------------


async def test_local_connection_runs_through_bash(local_host: Host, tmp_path: Path) -> None:
    conn = await connect(local_host, FAST)
    assert isinstance(conn, LocalConnection)
    async with LocalConnection(local_host, FAST, home=tmp_path) as here:
        result = await here.run("echo out; echo err >&2; [[ -n $BASH_VERSION ]] && pwd; exit 4")
        upper = await here.run("tr a-z A-Z", input=b"abc")
        no_input = await here.run("cat; echo done", timeout=5)
        home = await here.run("echo ~")
        killed = await here.run("kill -9 $$")
        with pytest.raises(CommandError) as info:
            await here.run("echo bad >&2; exit 5", check=True)
    assert (result.exit_status, result.stdout, result.stderr) == (4, f"out\n{tmp_path}\n", "err\n")
    assert upper.stdout == "ABC"
    assert no_input.stdout == "done\n"
    assert home.stdout.strip() == str(tmp_path)
    assert killed.exit_status == 137
    assert (info.value.exit_status, info.value.stderr_tail, info.value.host) == (5, "bad", "here")


async def test_local_timeout_kills_the_process_group(local_host: Host, tmp_path: Path) -> None:
    conn = LocalConnection(local_host, FAST, home=tmp_path)
    started = time.monotonic()
    with pytest.raises(CommandTimeoutError) as info:
        await conn.run("sleep 30 & echo $!; echo partial; echo oops >&2; wait", timeout=0.5)
    assert 0.5 <= time.monotonic() - started < 5  # the 0.5 s timeout (headroom), not the 30 s sleep
    child, partial = info.value.stdout.split()
    assert partial == "partial"
    assert info.value.stderr_tail == "oops"
    assert await wait_gone(int(child)), "the command's background child survived the timeout"


async def test_local_detached_process_returns_promptly(local_host: Host, tmp_path: Path) -> None:
    conn = LocalConnection(local_host, FAST, home=tmp_path)
    started = time.monotonic()
    result = await conn.run("setsid nohup sleep 30 >/dev/null 2>&1 </dev/null & echo $!", timeout=20)
    pid = int(result.stdout)
    try:
        assert time.monotonic() - started < 10  # milliseconds; headroom, not the 30 s of the process
        assert not gone(pid)
    finally:
        os.kill(pid, 9)


async def test_local_put_and_get(local_host: Host, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    local = tmp_path / "blob.bin"
    payload = os.urandom(2 * 1024 * 1024 + 5)
    local.write_bytes(payload)
    local.chmod(0o755)
    calls: list[tuple[int, int]] = []
    async with LocalConnection(local_host, FAST, home=home) as conn:
        await conn.put(local, "~/blob.bin", progress=lambda d, t: calls.append((d, t)))
        await conn.get("blob.bin", tmp_path / "back.bin")
        with pytest.raises(TransferError) as info:
            await conn.put(local, "~/missing/dir/blob.bin")
    assert (home / "blob.bin").read_bytes() == payload
    assert (home / "blob.bin").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "back.bin").read_bytes() == payload
    assert calls[0] == (0, len(payload)) and calls[-1] == (len(payload), len(payload))
    assert "~/missing/dir/blob.bin" in str(info.value) and "No such file" in str(info.value)
