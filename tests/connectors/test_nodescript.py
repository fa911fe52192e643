"""Node-side scripts (connectors.nodescript): the one `@key value` parser, the one runner and its one
typed error, and check mode's list of the exact commands (`--check --diff`) that changes nothing."""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from orchestrator.artifacts.manifest import Artifact
from orchestrator.cli import main
from orchestrator.connectors.connect import connect
from orchestrator.connectors.nodescript import (
    NodeScript,
    Planned,
    ScriptOutput,
    parse_key_line,
    parse_key_lines,
    recording,
    run_script,
    would_run,
)
from orchestrator.core.errors import (
    HostError,
    InstallError,
    InstallScriptError,
    NodeScriptError,
    ServiceError,
    ServiceScriptError,
)
from orchestrator.inventory.model import Host
from tests.plugins.servers import free_port

# ---------------------------------------------------------------- the parser (pure)


@pytest.mark.parametrize(
    ("line", "pair"),
    [
        ("@started 4242", ("started", "4242")),
        ("@none", ("none", "")),
        ("@ok   ", ("ok", "")),
        ("@busy  10.0.0.2:5 10.0.0.3:6  ", ("busy", "10.0.0.2:5 10.0.0.3:6")),
        ("@error cannot create $D/run: No space left", ("error", "cannot create $D/run: No space left")),
        ("@file bin/x 10 755 abc", ("file", "bin/x 10 755 abc")),
    ],
)
def test_a_key_line_is_its_key_and_stripped_value(line: str, pair: tuple[str, str]) -> None:
    assert parse_key_line(line) == pair


@pytest.mark.parametrize(
    "line",
    [
        "",
        "started 4242",  # no mark
        " @started 4242",  # not at the start: output of some tool, not the script's word
        "@",  # a bare mark
        "@ 4242",  # no key
        "@@rpcfleet-abc-0-exit-0@@",  # the markers of gathered facts are not key lines
        "x@started 1",
    ],
)
def test_other_lines_are_not_key_lines(line: str) -> None:
    assert parse_key_line(line) is None


def test_key_lines_keep_their_order_and_skip_the_rest() -> None:
    text = "tar: noise\n@orphan 12 /a\n@orphan 13 /b\n\n@stopped 11 12 13\nbye\n"
    out = ScriptOutput.parse("n1", "stop", 0, text)
    assert (
        parse_key_lines(text)
        == out.keys
        == (
            ("orphan", "12 /a"),
            ("orphan", "13 /b"),
            ("stopped", "11 12 13"),
        )
    )
    assert out.values("orphan") == ("12 /a", "13 /b") and out.get("orphan") == "12 /a"
    assert "stopped" in out and "busy" not in out and out.get("busy") is None and out.get("busy", "-") == "-"
    assert out.last == ("stopped", "11 12 13") and out.error is None
    assert ScriptOutput.parse("n1", "x", 0, "no keys\n").last is None


# ---------------------------------------------------------------- the error (pure)


def _script(**kw: Any) -> NodeScript:
    fields: dict[str, Any] = {
        "name": "start",
        "text": "true",
        "timeout": 5.0,
        "what": "starting the rpc-server",
    }
    return NodeScript(**(fields | kw))


def test_an_error_line_is_the_one_typed_error_with_host_script_and_text() -> None:
    out = ScriptOutput.parse(
        "n1", "start", 0, "@created rpcfleet\n@error no such user x\n@error later\n", "warn\n"
    )
    with pytest.raises(NodeScriptError) as caught:
        _script(error=ServiceScriptError, consequence="nothing was started").check(out)
    error = caught.value
    assert isinstance(error, ServiceError) and isinstance(error, HostError)
    assert (error.host, error.script, error.reported) == ("n1", "start", "no such user x")
    assert error.message == "starting the rpc-server: no such user x; nothing was started"
    assert error.stderr_tail == "warn"
    # whatever the exit status: the script said it failed
    assert isinstance(_raised(_script(), ScriptOutput.parse("n1", "start", 3, "@error x\n")), NodeScriptError)


def _raised(script: NodeScript, out: ScriptOutput) -> NodeScriptError:
    with pytest.raises(NodeScriptError) as caught:
        script.check(out)
    return caught.value


def test_an_unexpected_exit_status_is_the_error_with_the_status_and_stderr() -> None:
    error = _raised(
        _script(hint="look at the log"), ScriptOutput.parse("n1", "start", 2, "@pid 0\n", "sh: boom\n")
    )
    assert error.message == "starting the rpc-server: exit status 2"
    assert (error.exit_status, error.stderr_tail, error.reported, error.hint) == (
        2,
        "sh: boom",
        None,
        "look at the log",
    )
    # no stderr: stdout is what there is to show
    assert _raised(_script(), ScriptOutput.parse("n1", "s", 1, "half\n")).stderr_tail == "half"
    # statuses the script expects, or any (`ok_exits=None`), are no failure
    assert (
        _script(ok_exits=frozenset({0, 3})).check(ScriptOutput.parse("n1", "s", 3, "@ok\n")).get("ok") == ""
    )
    assert _script(ok_exits=None).check(ScriptOutput.parse("n1", "s", 1, "@left a\n")).values("left") == (
        "a",
    )


def test_an_install_script_error_is_an_install_error_in_its_own_words() -> None:
    script = _script(
        name="install", error=InstallScriptError, error_is_message=True, consequence="old stays installed"
    )
    error = _raised(
        script, ScriptOutput.parse("n1", "install", 3, "@error checksum failed while installing v2: bad\n")
    )
    assert isinstance(error, InstallError) and not isinstance(error, ServiceError)
    assert error.message == "checksum failed while installing v2: bad; old stays installed"


# ---------------------------------------------------------------- running (a real shell)


@pytest.fixture
async def local(tmp_path: Path) -> Any:
    conn = await connect(
        Host(name="n1", address="127.0.0.1", connection="local", vars={"home": str(tmp_path)})
    )
    try:
        yield conn
    finally:
        await conn.close()


async def test_run_script_runs_the_text_and_returns_its_keys(local: Any, tmp_path: Path) -> None:
    text = "echo noise\necho \"@pid $$\"\necho '@orphan 1 /x'\necho '@orphan 2 /y'\necho err >&2"
    out = await run_script(local, _script(text=text))
    assert out.host == "n1" and out.script == "start" and out.exit_status == 0 and out.stderr == "err\n"
    assert (out.get("pid") or "").isdigit() and out.values("orphan") == ("1 /x", "2 /y")
    # A command of its own, the text on its stdin.
    (tmp_path / "d").mkdir()
    fed = _script(
        command=f"cat > {shlex.quote(str(tmp_path / 'd' / 'b.sh'))} && echo @have", text="echo hi\n"
    )
    assert "have" in await run_script(local, fed)
    assert (tmp_path / "d" / "b.sh").read_text() == "echo hi\n"


async def test_run_script_raises_on_error_line_non_zero_exit_and_timeout(local: Any) -> None:
    with pytest.raises(ServiceScriptError) as caught:
        await run_script(
            local, _script(text='echo "@error port 5 is $((2+3))"; exit 0', error=ServiceScriptError)
        )
    assert caught.value.reported == "port 5 is 5" and caught.value.host == "n1"
    with pytest.raises(NodeScriptError) as caught:
        await run_script(local, _script(text="echo half; echo oops >&2; exit 4"))
    assert (
        caught.value.exit_status == 4 and caught.value.stderr_tail == "oops" and caught.value.reported is None
    )
    with pytest.raises(
        NodeScriptError, match=r"starting the rpc-server did not finish within 0\.5 s"
    ) as caught:
        await run_script(local, _script(text="echo '@pid 1'; sleep 30", timeout=0.5))
    assert caught.value.script == "start" and caught.value.stderr_tail == "@pid 1"  # what it said so far


# ---------------------------------------------------------------- check mode's record


def test_would_run_notes_only_inside_a_recording() -> None:
    would_run("n1", [_script()])  # outside: nothing to note, nothing raised
    with recording() as notes:
        would_run("n1", [_script(text="echo '@ok'"), Planned("n1", "upload", "# upload a to b")])
        would_run("n2", [_script(name="stop", text="kill 1")])
        would_run("n1", [_script(name="fed", command="cat > f", text="x\ny\n")])
    assert [p.name for p in notes.by_host()["n1"]] == ["start", "upload", "fed"]
    assert notes.by_host()["n1"][0].command == "sh -c " + shlex.quote("echo '@ok'")
    assert notes.by_host()["n1"][2].command == "cat > f <<'RPCFLEET_EOF'\nx\ny\nRPCFLEET_EOF"
    assert notes.by_host()["n2"][0].command == "sh -c 'kill 1'"
    with recording() as again:
        pass
    assert again.planned == []


def _tree(root: Path) -> dict[str, str]:
    """Every file, link and folder under `root` with its content's hash (what a change would touch)."""
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            found[rel] = "-> " + str(path.readlink())
        elif path.is_file():
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            found[rel] = "dir"
    return found


def test_deploy_check_diff_prints_each_hosts_exact_commands_and_changes_nothing(
    fake_hosts: Callable[..., list[Any]],
    cpu_artifact: Artifact,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fakes = fake_hosts(2)
    lines = ["hosts:"]
    for fake in fakes:
        host = fake.host
        lines += [
            f"  {fake.name}:",
            f"    address: {host.address}",
            f"    ssh_port: {host.ssh_port}",
            f"    ssh_user: {host.ssh_user}",
            f"    ssh_key: {host.ssh_key}",
            f"    ssh_known_hosts: {host.ssh_known_hosts}",
            f"    rpc_host: {host.rpc_host}",
            f"    rpc_port: {free_port(host.rpc_host)}",
            f"    rpc_artifact: {cpu_artifact.id}",
        ]
    inventory = tmp_path / "inventory.yml"
    inventory.write_text("\n".join(lines) + "\n")
    before = {fake.name: _tree(fake.home) for fake in fakes}

    assert main(["deploy", "-i", str(inventory), "--check", "--diff"]) == 0
    out = capsys.readouterr().out
    assert "would change" in out
    for fake in fakes:
        assert f"{fake.name}: 4 command(s) would run" in out, out
        assert _tree(fake.home) == before[fake.name]  # nothing changed on the node
    # The exact scripts: the install checks the archive's sha256 and switches `current`; the start launches
    # the supervisor loop on the rpc-server of the version it would install.
    for name in ("# install-prepare", "# install-upload", "# install", "# start"):
        assert out.count(name + "\n") == 2, name
    assert out.count(f'[ "$got" = {cpu_artifact.archive_sha256} ]') == 2
    assert "# upload " + str(cpu_artifact.archive) in out
    assert out.count("setsid nohup") == 2 and out.count(f"versions/{cpu_artifact.id}/bin/") >= 2

    # --json: the document on stdout alone, the commands on stderr; still nothing changed.
    assert main(["deploy", "-i", str(inventory), "--check", "--diff", "--json"]) == 0
    captured = capsys.readouterr()
    assert [r["result"]["install"]["action"] for r in json.loads(captured.out)] == ["install", "install"]
    assert "# install-prepare" in captured.err
    assert {fake.name: _tree(fake.home) for fake in fakes} == before

    # Without --diff, no command is listed; --diff alone is a usage error (exit 2, no traceback).
    assert main(["deploy", "-i", str(inventory), "--check"]) == 0
    assert "command(s) would run" not in capsys.readouterr().out
    assert main(["deploy", "-i", str(inventory), "--diff"]) == 2
    err = capsys.readouterr().err
    assert "--diff goes with --check" in err and "Traceback" not in err
    assert {fake.name: _tree(fake.home) for fake in fakes} == before


def _fake_inventory(path: Path, fakes: list[Any], artifact: Artifact) -> Path:
    lines = ["hosts:"]
    for fake in fakes:
        host = fake.host
        lines += [
            f"  {fake.name}:",
            f"    address: {host.address}",
            f"    ssh_port: {host.ssh_port}",
            f"    ssh_user: {host.ssh_user}",
            f"    ssh_key: {host.ssh_key}",
            f"    ssh_known_hosts: {host.ssh_known_hosts}",
            f"    rpc_host: {host.rpc_host}",
            f"    rpc_port: {free_port(host.rpc_host)}",
            f"    rpc_artifact: {artifact.id}",
            "    rpc_run_as: root",  # as the test user: no dedicated user is made on this machine
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_check_diff_of_a_running_server_lists_the_stop_and_start_and_leaves_it_running(
    fake_hosts: Callable[..., list[Any]],
    cpu_artifact: Artifact,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake = fake_hosts(1)[0]
    inventory = str(_fake_inventory(tmp_path / "inventory.yml", [fake], cpu_artifact))
    assert main(["deploy", "-i", inventory]) == 0
    capsys.readouterr()
    pid_file = fake.home / ".local/lib/rpcfleet/run/rpc-server.pid"
    pid = pid_file.read_text().split()[0]
    try:
        before = {k: v for k, v in _tree(fake.home).items() if "/log/" not in k}
        assert main(["restart", "-i", inventory, "--check", "--diff"]) == 0
        out = capsys.readouterr().out
        assert f"{fake.name}: 2 command(s) would run" in out and "# stop\n" in out and "# start\n" in out
        assert out.index("kill -TERM $targets") < out.index("setsid nohup")  # the stop first, then the start
        assert main(["restart", "--rolling", "-i", inventory, "--check", "--diff"]) == 0
        assert f"{fake.name}: 2 command(s) would run" in capsys.readouterr().out
        assert main(["stop", "-i", inventory, "--check", "--diff"]) == 0
        out = capsys.readouterr().out
        # the stop, then the removal of this server's firewall rules (looked for even without rpc_allow_from)
        assert f"{fake.name}: 2 command(s) would run" in out and "# start" not in out
        assert out.index("# stop\n") < out.index("# firewall\n") < out.index('-D INPUT "$N"')
        # Nothing to do: no command (no rpc_allow_from, so not even the firewall's).
        assert main(["start", "-i", inventory, "--check", "--diff"]) == 0
        assert f"{fake.name}: 0 command(s) would run" in capsys.readouterr().out
        assert pid_file.read_text().split()[0] == pid and Path(f"/proc/{pid}").exists()
        assert {k: v for k, v in _tree(fake.home).items() if "/log/" not in k} == before
    finally:
        assert main(["stop", "-i", inventory]) == 0
