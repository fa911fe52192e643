"""orchestrator.facts: parsers from data files (tests/data/facts/<fact>/<case>.json), gathering, and a
real run of the gathered script with bash and sh on this machine."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import platform
import socket
import struct
import subprocess
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.facts.base import Fact, RawOutput, gather_command, new_token, parse_gathered, split_output
from orchestrator.facts.gpus import GpuReport, NvidiaGpuFact, RocmGpuFact
from orchestrator.facts.registry import FACT_MODULES, FACT_TYPES, fact_types
from orchestrator.facts.server import (
    CurrentLinkFact,
    HistoryFact,
    InstallDirFact,
    InstalledManifest,
    InstalledManifestFact,
    Listener,
    ListenersFact,
    LogMatchFact,
    LogTailFact,
    ProcessState,
    RpcClientsFact,
    ServerProcessFact,
    VersionsFact,
)
from orchestrator.facts.system import CpuCountFact, FreeSpaceFact, MemoryFact, OsFact, OsInfo, UserFact
from tests.plugins.servers import LocalServer

DATA = Path(__file__).parents[1] / "data" / "facts"
CASES = sorted(DATA.glob("*/*.json"))


def jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    return value


def test_every_fact_has_data_cases() -> None:
    assert {case.parent.name for case in CASES} == set(FACT_TYPES)


def test_the_registry_is_every_fact_class_of_the_fact_modules() -> None:
    """Derived, not listed: `user` was once defined and gathered but missing from a hand-kept list."""
    assert FACT_TYPES["user"] is UserFact
    defined = {
        cls
        for module in FACT_MODULES
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, Fact) and cls.__module__ == module.__name__ and not inspect.isabstract(cls)
    }
    assert set(FACT_TYPES.values()) == defined and all(FACT_TYPES[c.name] is c for c in defined)
    module = types.ModuleType("tests.two_facts")

    def fact(name: str) -> type:
        members = {"name": name, "command": lambda self: "true", "parse": lambda self, *_: None}
        return type(f"Fact_{name}", (Fact,), {**members, "__module__": module.__name__})

    kept = [fact("same"), fact("same")]  # referenced: __subclasses__ holds them weakly
    with pytest.raises(ValueError, match="share the name 'same'"):
        fact_types([module])
    assert kept


@pytest.mark.parametrize("case", CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_parser_data_case(case: Path) -> None:
    doc = json.loads(case.read_text())
    fact = FACT_TYPES[case.parent.name](**doc["args"])
    value = fact.parse(doc["stdout"], doc["stderr"], doc["exit_status"])
    assert jsonable(value) == doc["expected"]


def test_commands_quote_their_arguments() -> None:
    command = InstalledManifestFact("/x; rm -rf /").command()
    assert "'/x; rm -rf /" in command
    with pytest.raises(ValueError):
        RpcClientsFact("1; reboot").command()  # type: ignore[arg-type]


# --- gathering (pure) -------------------------------------------------------------------------------------


def fake_script_output(token: str, raws: list[RawOutput]) -> str:
    """What gather_command's script prints, built by hand."""
    out = ""
    for i, raw in enumerate(raws):
        out += f"\n@@rpcfleet-{token}-{i}-out@@\n{raw.stdout}"
        out += f"\n@@rpcfleet-{token}-{i}-err@@\n{raw.stderr}"
        out += f"\n@@rpcfleet-{token}-{i}-exit-{raw.exit_status}@@\n"
    return out


_TEXT = st.text(st.characters(blacklist_categories=["Cs"]), max_size=40)


@settings(database=None)
@given(st.lists(st.builds(RawOutput, _TEXT, _TEXT, st.integers(0, 255)), max_size=5))
def test_split_output_round_trips(raws: list[RawOutput]) -> None:
    token = "0123abcd"
    assert split_output(fake_script_output(token, raws), token, len(raws)) == raws


def test_split_output_ignores_other_tokens_and_marks_missing_facts() -> None:
    raws = [RawOutput("@@rpcfleet-ffff-0-out@@\nx", "", 0), RawOutput("out", "err", 3)]
    text = fake_script_output("abcd", raws)
    assert split_output(text, "abcd", 2) == raws
    cut = text[: text.index("@@rpcfleet-abcd-1-err@@") - 1]
    assert split_output(cut, "abcd", 3) == [raws[0], RawOutput("out", "", -1), RawOutput("", "", -1)]


def test_gather_command_rejects_odd_tokens() -> None:
    with pytest.raises(ValueError):
        gather_command([CpuCountFact()], "a'b")
    assert new_token() != new_token()


# --- running the gathered script for real -----------------------------------------------------------------


class ScriptFact(Fact[RawOutput]):
    """A fact that runs any command and returns its raw output (to test the gathering itself)."""

    def __init__(self, name: str, command: str) -> None:
        self.name = name  # type: ignore[misc]
        self._command = command

    def command(self) -> str:
        return self._command

    def parse(self, stdout: str, stderr: str, exit_status: int) -> RawOutput:
        return RawOutput(stdout, stderr, exit_status)


def run_gathered(shell: str, fact_list: list[Fact[Any]]) -> dict[str, Any]:
    token = new_token()
    done = subprocess.run(
        [shell, "-c", gather_command(fact_list, token)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return parse_gathered(fact_list, done.stdout, token)


@pytest.mark.parametrize("shell", ["bash", "sh"])
def test_gathered_raw_outputs_come_back_exactly(shell: str) -> None:
    values = run_gathered(
        shell,
        [
            ScriptFact("plain", "echo hello; echo oops >&2"),
            ScriptFact("no_newline", "printf 'a\\n\\nb'; printf 'e' >&2; exit 7"),
            ScriptFact("exits", "exit 3"),
            ScriptFact("missing", "no-such-tool-rpcfleet --version"),
            ScriptFact("stdin", "cat; echo done"),  # must not eat the script
            ScriptFact("comment", "echo x # a trailing comment"),
        ],
    )
    assert values["plain"] == RawOutput("hello\n", "oops\n", 0)
    assert values["no_newline"] == RawOutput("a\n\nb", "e", 7)
    assert values["exits"] == RawOutput("", "", 3)
    assert values["missing"].exit_status == 127 and "not found" in values["missing"].stderr
    assert values["stdin"] == RawOutput("done\n", "", 0)
    assert values["comment"] == RawOutput("x\n", "", 0)


@pytest.fixture
def processes() -> Iterator[Callable[[list[str]], subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str]) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(argv)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(5)


@pytest.mark.llama
@pytest.mark.parametrize("shell", ["bash", "sh"])
def test_gathered_facts_on_this_machine(
    shell: str,
    tmp_path: Path,
    start_rpc_server: Callable[..., LocalServer],
    processes: Callable[[list[str]], subprocess.Popen[bytes]],
) -> None:
    install = tmp_path / "it's installed"
    for version in ("v2", "v 1"):
        (install / "versions" / version).mkdir(parents=True)
    (install / "versions" / "not-a-folder").touch()
    (install / "current").symlink_to("versions/v2")
    (install / "history").write_text("v2\nv 1\nv2\n")
    manifest = {"protocol": "7.0.0", "backend": "cpu"}
    (install / "current" / "manifest.json").write_text(json.dumps(manifest))
    log = tmp_path / "server.log"
    marker, failure = "=== start", "Failed to create server socket"
    log.write_text(f"{marker} v1\n{failure}\n{marker} v2\nlistening\n")
    failed_log = tmp_path / "failed.log"
    failed_log.write_text(f"{marker} v1\nlistening\n{marker} v2\n{failure}.* (not a regex)\nbye\n")
    sleeper = processes(["sleep", "30"])
    zombie = processes(["true"])
    while not (Path(f"/proc/{zombie.pid}/stat").read_text().split(") ")[1].startswith("Z")):
        time.sleep(0.01)  # exited, not waited for: a zombie
    (tmp_path / "sleep.pid").write_text(f"{sleeper.pid}\n")
    (tmp_path / "zombie.pid").write_text(str(zombie.pid))
    server = start_rpc_server()
    idle = start_rpc_server()
    client = socket.create_connection((server.host, server.port), timeout=2)
    client.sendall(bytes([14]) + struct.pack("<Q", 24) + bytes(24))
    reply = b""
    while len(reply) < 36:  # read the whole HELLO reply, as any well-behaved client does
        chunk = client.recv(36 - len(reply))
        assert chunk
        reply += chunk
    client_address = f"127.0.0.1:{client.getsockname()[1]}"

    try:
        values = run_gathered(
            shell,
            [
                OsFact(),
                CpuCountFact(),
                MemoryFact(),
                NvidiaGpuFact(),
                RocmGpuFact(),
                RpcClientsFact(server.port),
                ListenersFact(server.port),
                InstallDirFact(str(install)),
                CurrentLinkFact(str(install)),
                VersionsFact(str(install)),
                HistoryFact(str(install)),
                FreeSpaceFact(str(install / "not" / "yet")),
                InstalledManifestFact(str(install)),
                ServerProcessFact(str(tmp_path / "sleep.pid")),
                LogMatchFact(str(log), marker, failure),
                LogTailFact(str(log), 2),
            ],
        )
        more = run_gathered(
            shell,
            [
                RpcClientsFact(idle.port),
                CurrentLinkFact(str(tmp_path / "nothing")),
                VersionsFact(str(tmp_path / "nothing")),
                HistoryFact(str(tmp_path / "nothing")),
                InstalledManifestFact(str(tmp_path / "nothing")),
                ServerProcessFact(str(tmp_path / "zombie.pid")),
                LogMatchFact(str(failed_log), marker, failure + ".* (not a regex)"),
                LogTailFact(str(tmp_path / "nothing.log")),
            ],
        )
        none = run_gathered(
            shell,
            [
                ServerProcessFact(str(tmp_path / "no.pid")),
                LogMatchFact(str(tmp_path / "no.log"), "a", "b"),
            ],
        )
    finally:
        client.close()

    os_release = platform.freedesktop_os_release()
    assert values["os"] == OsInfo(
        platform.system(),
        platform.machine(),
        os_release["ID"],
        os_release.get("VERSION_ID"),
        os_release.get("PRETTY_NAME"),
    )
    assert values["cpu_count"] == len(os.sched_getaffinity(0))
    memory = values["memory"]
    assert memory.total == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < memory.available <= memory.total
    # Neither GPU tool is installed here: a normal "none", not an error.
    assert values["nvidia_gpus"] == GpuReport("nvidia-smi", present=False)
    assert values["rocm_gpus"] == GpuReport("rocm-smi", present=False)
    assert values["rpc_clients"] == (client_address,)
    (listener,) = values["listeners"]
    assert listener == Listener(f"{server.host}:{server.port}", "ggml-rpc-server", server.process.pid)
    assert values["install_dir"] == str(install)
    assert values["current_link"] == "versions/v2"
    assert values["versions"] == ("v 1", "v2")
    assert values["history"] == ("v 1", "v2")
    stat = os.statvfs(tmp_path)
    assert abs(values["free_space"] - stat.f_bavail * stat.f_frsize) < 64 << 20  # others write too
    assert values["installed_manifest"] == InstalledManifest(manifest)
    assert values["server_process"] == ProcessState(sleeper.pid, values["server_process"].stat, "sleep")
    assert values["server_process"].stat[0] in "SR"
    assert values["log_match"] is False  # the failure was before the last start
    assert values["log_tail"] == f"{marker} v2\nlistening\n"
    assert more["rpc_clients"] == ()
    assert (more["current_link"], more["versions"], more["history"]) == (None, (), ())
    assert more["installed_manifest"] is None
    assert more["server_process"] == ProcessState(zombie.pid, "Z", None)
    assert more["log_match"] is True  # matched as text, not as a pattern
    assert more["log_tail"] is None
    assert none == {"server_process": ProcessState(None), "log_match": False}
    sleeper.kill()
    sleeper.wait(5)
    after = run_gathered(shell, [ServerProcessFact(str(tmp_path / "sleep.pid"))])
    assert after["server_process"] == ProcessState(sleeper.pid, "", None)
