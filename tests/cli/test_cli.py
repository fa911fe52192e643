"""The command line itself: start-up cost, options where users put them, usage errors, interrupts, and
the pure pieces behind the messages (placement table, token count, hints, log lines)."""

from __future__ import annotations

import ast
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.cli import _parser, main, parse_args
from orchestrator.core import fields
from orchestrator.core.errors import ServiceError
from orchestrator.core.log import render_text
from orchestrator.facts.server import Listener
from orchestrator.llama.observed_placement import DevicePlacement, HostPlacement, MemoryBytes, Placement
from orchestrator.operations.server.process import taken_hint

ROOT = Path(__file__).resolve().parents[2]
FLEET = str(ROOT / "tests" / "data" / "inventory" / "fleet_ansible.yml")
MiB = 1 << 20


def _child_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, " ".join(err.split())


# --- start-up: each command imports only what it needs ------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "absent"),
    [
        (["--version"], ["asyncssh", "numpy", "gguf", "structlog", "rich", "asyncio", "yaml"]),
        (["--help"], ["asyncssh", "numpy", "gguf", "structlog", "rich", "asyncio", "yaml"]),
        (["inventory", "list", "-i", FLEET], ["asyncssh", "numpy", "gguf", "structlog", "asyncio"]),
        (["probe", "--help"], ["asyncssh", "numpy", "gguf", "structlog", "asyncio"]),
    ],
)
def test_commands_import_only_what_they_need(argv: list[str], absent: list[str]) -> None:
    code = (
        "import sys, runpy\n"
        f"sys.argv = ['rpcfleet', *{argv!r}]\n"
        "try:\n    runpy.run_module('orchestrator', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print(sorted({m.split('.')[0] for m in sys.modules}), file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=_child_env(), capture_output=True, text=True, timeout=60
    )
    loaded = ast.literal_eval(done.stderr.strip().splitlines()[-1])
    assert [m for m in absent if m in loaded] == []


# --- options before or after the command, usage errors -----------------------------------------------------


def test_options_before_and_after_the_command_are_the_same() -> None:
    before = parse_args(["-i", FLEET, "-l", "gpu", "--json", "-f", "3", "-v", "ping"])
    after = parse_args(["ping", "-i", FLEET, "-l", "gpu", "--json", "-f", "3", "-v"])
    for name in ("inventory", "limit", "json", "forks", "verbose", "log_format"):
        assert getattr(before, name) == getattr(after, name), name
    assert str(before.inventory) == FLEET and before.verbose == 1
    # after the command wins; -v counts on both sides
    both = parse_args(["-i", "first.yml", "-v", "ping", "-i", "second.yml", "-vv"])
    assert str(both.inventory) == "second.yml" and both.verbose == 3


def test_rpcfleet_i_inventory_ping_style(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "-i", FLEET, "--json", "inventory", "list", "-l", "mi*")
    assert status == 0 and [h["name"] for h in json.loads(out)] == ["mia", "mib"]


@pytest.mark.parametrize(
    ("argv", "usage", "message"),
    [
        (["pign"], "usage: rpcfleet [-h]", "unknown command 'pign'; did you mean 'ping'?"),
        (["inventory", "lsit"], "usage: rpcfleet inventory", "did you mean 'list'?"),
        (["probe", "--jsn"], "usage: rpcfleet probe", "unrecognized arguments: --jsn; did you mean --json?"),
        # the fewest typos win (difflib's ratio alone ties --forks with --force and picks --forks)
        (
            ["deploy", "--forse"],
            "usage: rpcfleet deploy",
            "unrecognized arguments: --forse; did you mean --force?",
        ),
        # the hint after the arguments, not between a flag and its value
        (
            ["plan", "-m", "x.gguf", "--context", "8k"],
            "usage: rpcfleet plan",
            "error: unrecognized arguments: --context 8k; did you mean --ctx?",
        ),
        (
            ["probe", "--jsn", "--timout", "3"],
            "usage: rpcfleet probe",
            "unrecognized arguments: --jsn --timout 3; "
            "did you mean --json for --jsn, --timeout for --timout?",
        ),
        (["ping", "-n", "3"], "usage: rpcfleet ping", "unrecognized arguments: -n 3"),
        (["logs", "-n", "0"], "usage: rpcfleet logs", "expected an integer >= 1, got 0"),
        (["status", "--serial", "1"], "usage: rpcfleet status", "unrecognized arguments: --serial 1"),
        (["inventory", "list", "-f", "3"], "usage: rpcfleet inventory list", "unrecognized arguments: -f 3"),
        (["-i", FLEET, "lab", "up"], "usage: rpcfleet lab up", "-i does not apply to `rpcfleet lab up`"),
        (["plan", "-m", "x.gguf", "--format", "tabel"], "usage: rpcfleet plan", "did you mean 'table'?"),
        (
            ["plan", "-m", "x.gguf", "--ctx", "lots"],
            "usage: rpcfleet plan",
            "context size such as 4096 or 32k",
        ),
        (["ping", "--forks", "0"], "usage: rpcfleet ping", "expected an integer >= 1, got 0"),
        (
            ["probe", "--timeout", "0"],
            "usage: rpcfleet probe",
            "expected a positive number of seconds, got '0'",
        ),
        (["plan", "-m", "x.gguf", "--type-k", "q9"], "usage: rpcfleet plan", "unknown choice 'q9'"),
        (
            ["model", "synth"],
            "usage: rpcfleet model synth",
            "one of the arguments OUT.gguf -o/--output is required",
        ),
    ],
)
def test_bad_input_prints_the_commands_usage_and_exits_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], usage: str, message: str
) -> None:
    status, out, err = run(capsys, *argv)
    assert status == 2 and out == ""
    assert err.startswith(usage) and message in err
    assert "Traceback" not in err and "[red]" not in err


# --- bad input: one rule for every command -----------------------------------------------------------------

# (command, argv, what the message must say). {tmp} is the test's folder, where not.gguf is a file that is
# not a GGUF, `file` a plain file (no folder can be made under it), and nothing else exists; no lab is up.
BAD_INPUT: list[tuple[str, list[str], str]] = [
    *(
        (name, [*name.split(), "-i", "{tmp}/missing.yml", *extra], "{tmp}/missing.yml")
        for name, extra in [
            ("ping", []),
            ("deploy", []),
            ("start", []),
            ("stop", []),
            ("restart", []),
            ("status", []),
            ("logs", []),
            ("rollback", []),
            ("probe", []),
            ("inventory list", []),
            ("inventory graph", []),
            ("inventory show", ["h1"]),
            ("cache status", []),
            ("cache verify", []),
            ("cache prune", []),
            ("cache clear", []),
            ("cache warm", ["-m", "{tmp}/not.gguf"]),
        ]
    ),
    ("run-playbook", ["run-playbook", "{tmp}/not.gguf"], "{tmp}/not.gguf:1:1: missing required key 'name'"),
    ("ping", ["ping"], "no inventory given and no lab is up"),
    ("status", ["status", "-l", "h1"], "no inventory given and no lab is up"),
    *(
        (name, [*argv, "-m", "{tmp}/not.gguf"], "{tmp}/not.gguf: not a GGUF file")
        for name, argv in [
            ("plan", ["plan", "-i", "{tmp}/missing.yml"]),
            ("run", ["run", "-i", "{tmp}/missing.yml", "-p", "x"]),
            ("report", ["report", "-i", "{tmp}/missing.yml"]),
            ("serve", ["serve", "-i", "{tmp}/missing.yml"]),
            ("demo", ["demo"]),
        ]
    ),
    ("model info", ["model", "info", "{tmp}/not.gguf"], "{tmp}/not.gguf: not a GGUF file"),
    ("exporter", ["exporter", "--host", "10.1.2.3"], "--host 10.1.2.3 is not a loopback address"),
    # a host:port where an address is asked: refused as it is parsed, naming it (was: a failure to bind)
    ("exporter", ["exporter", "--host", "127.0.0.1:9100"], "--host: invalid address '127.0.0.1:9100'"),
    ("serve", ["serve", "-m", "m.gguf", "--host", "[::1]:8080"], "--host: invalid address '[::1]:8080'"),
    ("exporter", ["exporter", "-i", "{tmp}/missing.yml"], "{tmp}/missing.yml"),
    ("exporter", ["exporter", "--api-key-file", "{tmp}/missing-key"], "--api-key-file {tmp}/missing-key"),
    # a missing model: one message from every command that reads one
    *(
        (name, [*argv, "-m", "{tmp}/missing.gguf"], "error: model {tmp}/missing.gguf does not exist")
        for name, argv in [
            ("plan", ["plan", "-i", "{tmp}/missing.yml"]),
            ("run", ["run", "-i", "{tmp}/missing.yml", "-p", "x"]),
            ("report", ["report", "-i", "{tmp}/missing.yml"]),
            ("serve", ["serve", "-i", "{tmp}/missing.yml"]),
            ("demo", ["demo"]),
        ]
    ),
    ("model info", ["model", "info", "{tmp}/missing.gguf"], "error: model {tmp}/missing.gguf does not exist"),
    (
        "run",
        ["run", "-m", "{tmp}/not.gguf", "-p", "x", "--plan", "{tmp}/file"],
        "{tmp}/file: plan is not valid JSON",
    ),
    ("run", ["run", "-m", "m.gguf", "-p", "x", "--endpoint", "nonsense"], "invalid endpoint 'nonsense'"),
    ("run", ["run", "-m", "m.gguf", "-p", "x", "--endpoint", "h:99999"], "invalid endpoint 'h:99999'"),
    ("model synth", ["model", "synth", "{tmp}/file/x.gguf"], "cannot write {tmp}/file/x.gguf"),
    ("lab up", ["lab", "up", "--nodes", "0"], "--nodes: expected an integer >= 1, got 0"),
    ("lab up", ["lab", "up", "--local", "--init", "systemd"], "--init systemd needs a network-namespace lab"),
    ("lab down", ["lab", "down", "--name", "Bad_Name"], "invalid lab name 'Bad_Name'"),
    ("lab status", ["lab", "status", "--name", "nosuch"], "no lab named 'nosuch' is up"),
    ("lab repair", ["lab", "repair", "--name", "nosuch"], "no lab named 'nosuch' is up"),
    ("model fetch", ["model", "fetch", "gemma3"], "unknown choice 'gemma3'; did you mean 'gemma3-270m'?"),
    ("model list", ["model", "list", "--jsn"], "--jsn; did you mean --json?"),
    ("model push", ["model", "push", "-m", "{tmp}/file", "--chunk", "1k"], "--chunk must be at least 1MiB"),
    ("artifact build", ["artifact", "build", "--backend", "tpu"], "unknown backend 'tpu'"),
    ("artifact list", ["artifact", "list", "--jsn"], "--jsn; did you mean --json?"),
    ("artifact show", ["artifact", "show", "nosuch"], "no artifact 'nosuch'"),
    ("artifact verify", ["artifact", "verify", "nosuch"], "no artifact 'nosuch'"),
    ("artifact add", ["artifact", "add", "{tmp}/missing-spec.yml"], "{tmp}/missing-spec.yml"),
    (
        "export lws",
        ["export", "lws", "-m", "{tmp}/not.gguf", "--node-memory", "1GiB", "-o", "{tmp}/k8s"],
        "not a GGUF file",
    ),
    ("lws worker", ["lws", "worker", "--port", "99999"], "port 99999 is out of range"),
    (
        "lws plan",
        ["lws", "plan", "--config", "{tmp}/nosuch", "--out", "{tmp}/a.json"],
        "nosuch/settings.json",
    ),
    ("lws serve", ["lws", "serve", "--args", "{tmp}/file"], "{tmp}/file: not JSON"),
    ("lws hello", ["lws", "hello", "--port", "0"], "port 0 is out of range"),
    ("lws alive", ["lws", "alive", "--pid-file"], "argument --pid-file: expected one argument"),
]


def test_every_command_has_a_bad_input_case() -> None:
    from orchestrator.cli import build_parser, command_parsers

    commands = {p.prog.removeprefix("rpcfleet ") for p in command_parsers(build_parser())}
    assert commands == {name for name, _, _ in BAD_INPUT}


@pytest.mark.parametrize(("command", "argv", "message"), BAD_INPUT, ids=[" ".join(c[1]) for c in BAD_INPUT])
def test_bad_input_exits_2_naming_it_without_a_traceback(
    command: str,
    argv: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)  # no ./inventory.yml
    monkeypatch.delenv("RPCFLEET_INVENTORY", raising=False)
    monkeypatch.setenv("RPCFLEET_HOME", str(tmp_path / "home"))  # no lab, no artifacts
    (tmp_path / "not.gguf").write_text("hosts: {}\n")
    (tmp_path / "file").write_text("")
    before = sorted(tmp_path.rglob("*"))
    # in-process: an exception that escaped would fail this test, as a traceback would show
    status, out, err = run(capsys, *(arg.format(tmp=tmp_path) for arg in argv))
    assert status == 2 and out == "", err
    assert message.format(tmp=tmp_path) in err
    assert "Traceback" not in err and "[red]" not in err
    assert sorted(tmp_path.rglob("*")) == before  # nothing half made


@pytest.mark.parametrize("command", ["exporter", "serve"])
def test_a_port_in_use_is_said_before_anything_is_announced_or_loaded(
    command: str, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: "exporter on http://127.0.0.1:PORT/" (serve: "serving ..." and the model loading), then
    # uvicorn's own "ERROR: [Errno 98]" and exit status 3, this CLI's status for a held lock.
    inventory = tmp_path / "inventory.yml"
    inventory.write_text("hosts:\n  h1:\n    address: 127.0.0.1\n    rpc_port: 1\n")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        argv = [command, "-i", str(inventory), "--port", port]
        status, out, err = run(capsys, *argv, *(["-m", str(tiny_model)] if command == "serve" else []))
    assert status == 2 and out == "", err
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in err
    assert " on http://" not in err and "Traceback" not in err


# --- help --------------------------------------------------------------------------------------------------


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(_parser.UsageExit):
        parse_args([*argv, "--help"])
    return capsys.readouterr().out


def test_every_command_has_a_description(capsys: pytest.CaptureFixture[str]) -> None:
    from orchestrator.cli import build_parser, command_parsers

    for parser in command_parsers(build_parser()):
        assert parser.description, parser.prog
        argv = parser.prog.split()[1:]
        # the line between the usage and the options
        assert _help(capsys, *argv).split("\n\n")[1].strip().startswith(parser.description.split()[0]), argv


def test_flags_say_what_they_do_where_they_are(capsys: pytest.CaptureFixture[str]) -> None:
    start = " ".join(_help(capsys, "start").split())
    assert "--force restart a server that must be restarted" in start and "--force stop" not in start
    assert "--force stop a server even while a client is connected" in " ".join(_help(capsys, "stop").split())
    status = _help(capsys, "status")
    assert "--serial" not in status and "--max-fail-percentage" not in status and "--check" not in status
    assert "--serial" in _help(capsys, "restart")
    # -f: --follow on logs (as tail -f), --forks elsewhere; the inventory commands fork nothing
    logs = parse_args(["logs", "-f", "--forks", "3"])
    assert logs.follow and logs.forks == 3
    assert parse_args(["logs", "--follow"]).follow and not parse_args(["logs"]).follow
    assert parse_args(["ping", "-f", "3"]).forks == 3 and parse_args(["-f", "3", "logs"]).forks == 3
    for argv in (["inventory", "list"], ["inventory", "graph"], ["inventory", "show", "h1"]):
        assert "--forks" not in _help(capsys, *argv), argv


def test_ctx_takes_k_and_m_on_every_command_that_has_it() -> None:
    assert fields.context("8k") == 8192 and fields.context(" 128K ") == 131072
    assert fields.context("1m") == 1 << 20 and fields.context("4096") == 4096
    for argv in (["plan", "-m", "m.gguf"], ["run", "-m", "m.gguf", "-p", "x"], ["model", "info", "m.gguf"]):
        assert parse_args([*argv, "--ctx", "8k"]).ctx == 8192
    assert parse_args(["model", "synth", "o.gguf", "--ctx-train", "32k"]).ctx_train == 32768
    from orchestrator.cli.report import parse_contexts

    assert parse_contexts(["8k,32k"]) == [8192, 32768]


def test_choices_copied_into_the_cli_match_their_source() -> None:
    """The CLI lists some choices itself (importing their modules would slow every command down)."""
    from typing import get_args

    from orchestrator.cli import model, probe, report
    from orchestrator.models.synth import WeightType
    from orchestrator.probe.fleet import FAIL_ON
    from orchestrator.probe.settings import DEFAULT_TIMEOUT
    from orchestrator.report.render import FORMATS

    assert probe.FAIL_ON == FAIL_ON and report.FORMATS == FORMATS
    assert get_args(WeightType) == model.WEIGHT_TYPES
    args = parse_args(["probe"])
    assert args.timeout == DEFAULT_TIMEOUT
    assert f"(default: {DEFAULT_TIMEOUT:g})" in " ".join(
        a.help or "" for a in args._parser._actions if a.dest == "timeout"
    )


# --- Ctrl-C and SIGTERM at any moment of start-up -------------------------------------------------------


@pytest.mark.soak
def test_a_signal_at_any_moment_of_start_up_says_interrupted_and_exits_130(rounds: int) -> None:
    """20 rounds (soak; 2 in the suite, a SIGTERM and a SIGINT): the signal lands at a random moment once
    the handlers are installed (the interpreter's start, the package's lazy `__init__` and
    `orchestrator.core.signals` before that run no command code): during the other imports, the parsing,
    the command."""
    rng = random.Random(15)
    interrupted = 0
    for round_no in range(rounds):
        sig = signal.SIGINT if round_no % 2 else signal.SIGTERM
        proc = subprocess.Popen(
            [sys.executable, "-X", "importtime", "-m", "orchestrator", "inventory", "list", "-i", FLEET],
            env=_child_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stderr is not None
        lines = []
        # Import lines up to the first after orchestrator.core.signals': `__main__` installs the handlers
        # between the two (a machine under load may pause the child anywhere before that).
        installed = False
        for line in proc.stderr:
            lines.append(line)
            if installed:
                break
            installed = line.rstrip().endswith("| orchestrator.core.signals")
        delay = rng.uniform(0.002, 0.1)
        time.sleep(delay)
        proc.send_signal(sig)
        rest = proc.stderr.read()
        status = proc.wait(30)
        messages = [line for line in rest.splitlines() if not line.startswith("import time:")]
        assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest
        if status == 130:
            interrupted += 1
            assert messages == ["interrupted"], messages
        else:
            assert status == 0 and messages == [], (round_no, sig, delay, status, rest[-3000:])
    assert interrupted >= rounds // 2


_INTERRUPT_IN_A_TASK = """\
import asyncio, gc, sys
from orchestrator.cli._running import run_async

async def victim() -> None:
    await asyncio.sleep(0)
    raise KeyboardInterrupt  # where the signal's handler raises it when the signal lands in this task

async def main() -> None:
    await asyncio.gather(victim(), asyncio.sleep(5))

try:
    run_async(main())
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
gc.collect()  # a task that still holds the interrupt is collected: asyncio would report it here
"""


def test_an_interrupt_that_lands_inside_a_task_is_reported_once() -> None:
    """A signal during a probe raises inside one of its tasks: `interrupted`, never also asyncio's "Task
    exception was never retrieved" and a traceback (tests/cli/test_interrupts_lab.py: the probe phase)."""
    result = subprocess.run(
        [sys.executable, "-c", _INTERRUPT_IN_A_TASK],
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stderr) == (0, "interrupted\n")


# --- model synth / model info -------------------------------------------------------------------------------


def test_model_synth_then_info(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_path = tmp_path / "m.gguf"
    argv = ["model", "synth", str(out_path), "--layers", "3", "--embd", "64", "--heads", "4"]
    status, out, _ = run(capsys, *argv, "--kv-heads", "2", "--ff", "128", "--ctx-train", "2k")
    assert status == 0 and f"wrote {out_path}" in out
    assert run(capsys, *argv)[0] == 2  # exists: not overwritten without --force
    status, out, _ = run(capsys, "model", "info", str(out_path), "--ctx", "8k", "--json")
    info = json.loads(out)
    assert status == 0
    assert (info["layers"], info["embd"], info["heads"], info["kv_heads"]) == (3, 64, 4, 2)
    assert info["training_context"] == 2048 and len(info["bytes_per_layer"]) == 3
    assert info["tensors"] == 2 + 1 + 9 * 3  # token_embd, output_norm, output + 9 per layer
    # K and V of 2 heads x 16 dims, f16, in each of 3 layers; at 8192 tokens
    assert info["kv_bytes_per_token"] == 3 * 2 * (2 * 16) * 2 and info["kv_bytes"] == 8192 * 384
    status, out, _ = run(capsys, "model", "info", str(out_path))
    assert "layers:           3," in out and "training context: 2048" in out
    status, _, err = run(capsys, "model", "synth", str(tmp_path / "bad.gguf"), "--embd", "30", "--heads", "4")
    assert status == 2 and "multiple of n_head" in err and not (tmp_path / "bad.gguf").exists()


def test_model_synth_force_keeps_the_old_file_when_the_write_fails(tmp_path: Path) -> None:
    """A write that fails halfway (here: the file size limit, EFBIG, as a full disk would) leaves the old
    model as it was and no temporary file, and says why with exit status 2."""
    import resource

    old = tmp_path / "m.gguf"
    old.write_bytes(b"the user's old model" * 1000)
    before = old.read_bytes()

    def limit() -> None:  # in the child: writes beyond 64 KiB fail with EFBIG instead of a signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "model", "synth", str(old), "--force", "--layers", "4"],
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
        cwd=ROOT,
    )
    err = " ".join(done.stderr.split())
    assert done.returncode == 2, done.stderr
    assert f"error: cannot write {old}: " in err and "Traceback" not in err
    assert old.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    # without the limit, --force replaces it
    assert main(["model", "synth", str(old), "--force", "--layers", "4"]) == 0
    assert old.read_bytes() != before and old.read_bytes()[:4] == b"GGUF"


# --- the pure pieces behind messages ------------------------------------------------------------------------


def _placement() -> Placement:
    device = DevicePlacement(
        label="10.0.0.1:50052#0",
        name="RPC0",
        endpoint="10.0.0.1:50052",
        index=0,
        planned_layers=(0, 1, 2),
        actual_layers=(0, 1, 2),
        predicted=MemoryBytes(30 * MiB, 4 * MiB, 15 * MiB),
        actual=MemoryBytes(30 * MiB, 4 * MiB, 14 * MiB),
    )
    host = HostPlacement(MiB, 0, 5 * MiB, MiB, MiB, 0, 4 * MiB, MiB)
    return Placement((device,), host, (("RPC0", "x"),), 0.2, ())


def test_placement_prints_as_a_table() -> None:
    text = str(_placement())
    lines = text.splitlines()
    assert lines[0] == "placement (MiB)"
    assert lines[1].split() == ["device", "name", "layers", "weights", "KV", "compute", "output", "total"]
    assert lines[2].split() == [
        "10.0.0.1:50052#0",
        "RPC0",
        "0-2",
        "plan",
        "30.00",
        "4.00",
        "15.00",
        "-",
        "49.00",
    ]
    assert lines[3].split() == ["0-2", "actual", "30.00", "4.00", "14.00", "-", "48.00"]
    # the host's total is the sum of its columns, the output (logits) buffer included
    assert lines[4].split() == ["host", "CPU", "plan", "1.00", "0.00", "5.00", "1.00", "7.00"]
    assert lines[5].split() == ["actual", "1.00", "0.00", "4.00", "1.00", "6.00"]
    assert "Placement(" not in text


def test_a_host_is_named_once() -> None:
    error = ServiceError("the rpc-server exited", host="node1", hint="see `rpcfleet logs`")
    assert str(error).startswith("node1: the rpc-server exited")
    assert error.describe(with_host=False).startswith("the rpc-server exited")
    assert "node1" not in error.describe(with_host=False)


def test_a_port_taken_by_another_rpc_server_is_not_called_a_stranger() -> None:
    server = Listener("0.0.0.0:50052", "ggml-rpc-server", 4242)
    hint = taken_hint(server, "~/.rpcfleet")
    assert "another rpc-server (pid 4242)" in hint and "not the one rpcfleet runs from ~/.rpcfleet" in hint
    assert taken_hint(Listener("0.0.0.0:50052", "nginx", 7), "~/.rpcfleet") == (
        "stop that process or choose another rpc_port"
    )


def test_every_log_line_has_a_timestamp() -> None:
    event = {
        "event": "command_failed",
        "level": "warning",
        "timestamp": "2026-12-01T07:00:00.000000Z",
        "host": "node1",
        "stderr": "line one\nline two",
        "exception": "Traceback (most recent call last):\n  File x\nValueError: boom",
    }
    lines = render_text(None, "warning", dict(event)).splitlines()
    assert len(lines) == 4
    assert all(line.startswith("2026-12-01T07:00:00.000000Z warning ") for line in lines)
    assert "command_failed host=node1 stderr='line one\\nline two'" in lines[0]
    assert lines[-1].endswith("ValueError: boom")


def test_a_signal_inside_the_import_machinery_is_handled_again_later_not_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exception raised in a module lock's weakref callback is printed and dropped by CPython."""
    import types

    from orchestrator.core import signals

    armed: list[float] = []
    monkeypatch.setattr(signals.signal, "setitimer", lambda which, seconds: armed.append(seconds))
    monkeypatch.setattr(signals.signal, "signal", lambda sig, handler: None)
    inside = types.SimpleNamespace(f_code=compile("pass", "<frozen importlib._bootstrap>", "exec"))
    signals.interrupt(signal.SIGTERM, inside)  # type: ignore[arg-type]
    assert armed == [signals._RETRY] and signals._deferred == [signal.SIGTERM]
    signals._again(signal.SIGALRM, inside)  # type: ignore[arg-type]  # still inside: again later
    assert len(armed) == 2
    with pytest.raises(KeyboardInterrupt):  # outside: the interrupt
        signals._again(signal.SIGALRM, sys._getframe())
    error = RuntimeError("Error calling __set_name__")
    error.__cause__ = KeyboardInterrupt()
    assert signals.interrupted_by(error) and not signals.interrupted_by(RuntimeError("other"))


def _signal_inside(callback_runs: Callable[[Callable[[], None]], None]) -> None:
    """20 rounds: `callback_runs(send)` makes CPython run `send` in a callback whose exceptions it drops;
    `send` sends a real SIGTERM, whose handler runs at the next bytecode, in there. The interrupt still
    comes, a moment later, outside it.

    The deferred signal re-arms ITIMER_REAL and takes SIGALRM, which pytest-timeout's signal method uses
    for the per-test limit: the tests that call this keep theirs with the thread method (`TIMED`), and
    no timer may be armed here that this would silently replace."""
    from orchestrator.core import signals

    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0), "a timer is armed: use @TIMED"

    def send() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):
            pass

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}
    signals.install()
    try:
        for round_ in range(20):
            signals.forget()
            with pytest.raises(KeyboardInterrupt):
                callback_runs(send)
                deadline = time.monotonic() + 2
                while time.monotonic() < deadline:
                    time.sleep(0.001)
                raise AssertionError(f"round {round_}: the signal was lost")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)  # a retry still pending would fire under SIG_DFL: exit
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signals.forget()


# The per-test limit from a watchdog thread, not SIGALRM (which the deferred signal takes, see above).
TIMED = pytest.mark.timeout(60, method="thread")


@TIMED
def test_a_signal_inside_a_finalizer_is_not_lost() -> None:
    """A SIGTERM that lands in an object's `__del__` (a socket, a transport, a process collected)."""

    def in_a_finalizer(send: Callable[[], None]) -> None:
        class Finalized:
            def __del__(self) -> None:
                send()

        Finalized()  # collected at once: __del__ runs here

    _signal_inside(in_a_finalizer)


@TIMED
def test_a_signal_inside_a_weakref_callback_is_not_lost() -> None:
    """A SIGTERM that lands in a weakref callback: asyncio's selector keeps its file descriptors in a weak
    dictionary, where a Ctrl-C of `logs --follow` was lost."""
    import weakref

    class Watched:
        pass

    def in_a_weakref_callback(send: Callable[[], None]) -> None:
        weakref.finalize(Watched(), send)  # collected at once: the callback runs here

    _signal_inside(in_a_weakref_callback)


_AFTERMATH = """\
import asyncio, gc, signal, sys, threading
from orchestrator.core import signals

signals.quiet_after_interrupt()

class HalfMade:
    def __del__(self) -> None:
        raise AttributeError("no attribute '_signal_handlers'")  # an event loop the signal cut short

async def cut_short() -> None:
    pass

def left_pending() -> None:
    # asyncio.run's closing shutdown_asyncgens that the signal cut short: a task collected pending
    loop = asyncio.new_event_loop()
    task = loop.create_task(asyncio.Event().wait())
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    del task
    gc.collect()

def thread_cut_short() -> None:
    thread = threading.Thread(target=lambda: 1 / 0, name="serve-load")  # its engine closed under it
    thread.start()
    thread.join()

HalfMade(); cut_short(); left_pending(); thread_cut_short()
sys.stderr.write("@interrupted\\n")
try:
    signals.interrupt(signal.SIGTERM, None)
except KeyboardInterrupt:
    pass
HalfMade(); cut_short(); left_pending(); thread_cut_short()
"""


def test_after_an_interrupt_what_it_cut_short_is_collected_in_silence() -> None:
    """The last stop's CI: SIGTERM landed while asyncio made an event loop; the half-made loop's `__del__`
    and a coroutine never awaited printed a traceback after `interrupted`. Before any interrupt, the
    same complaints are printed as Python prints them."""
    argv = [sys.executable, "-c", _AFTERMATH]
    done = subprocess.run(argv, env=_child_env(), capture_output=True, text=True)
    before, _, after = done.stderr.partition("@interrupted\n")
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" in before and "was never awaited" in before, before
    assert "Task was destroyed but it is pending!" in before, before
    assert "Exception in thread serve-load" in before and "ZeroDivisionError" in before, before
    assert after == "", after
