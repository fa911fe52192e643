"""Playbooks without I/O: parsing, validation (every error names file, line and step), variables."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.core.errors import PlaybookError, UsageError
from orchestrator.engine.executor import batch_sizes
from orchestrator.inventory.load import load_inventory_text
from orchestrator.operations.restart import memory_back
from orchestrator.playbooks.model import PlaybookErrors
from orchestrator.playbooks.ops import REGISTRY
from orchestrator.playbooks.reader import (
    load_playbook,
    load_playbook_text,
    parse_extra_vars,
    rolling_restart_playbook,
)
from orchestrator.playbooks.runner import play_hosts
from orchestrator.rpc.records import DeviceMemory

PLAYBOOKS = Path(__file__).resolve().parents[2] / "playbooks"
GiB = 1 << 30


def _load(text: str, tmp_path: Path, **extra: object) -> object:
    path = tmp_path / "play.yml"
    path.write_text(textwrap.dedent(text))
    return load_playbook(path, extra)


def _error(text: str, tmp_path: Path, **extra: object) -> PlaybookError:
    with pytest.raises(PlaybookError) as info:
        _load(text, tmp_path, **extra)
    return info.value


@pytest.mark.parametrize("name", ["deploy", "rolling-restart", "preload", "capacity-report", "teardown"])
def test_every_shipped_playbook_is_valid(name: str) -> None:
    playbook = load_playbook(PLAYBOOKS / f"{name}.yml", {"model": "/models/m.gguf"})
    assert playbook.steps and playbook.name
    assert all(step.op in REGISTRY for step in playbook.steps)


def test_a_playbook_parses_into_typed_steps(tmp_path: Path) -> None:
    playbook = _load(
        """\
        name: roll
        hosts: lab:!n3
        serial: [1, "50%"]
        max_fail_percentage: 25
        vars: {model: /m.gguf, n: 8192}
        steps:
          - restart: {force: yes, timeout: 20}
          - name: wait
            wait_ready:
          - probe
          - plan: {model: "{{ model }}", ctx: "{{ n }}", margin: 1GiB}
        """,
        tmp_path,
    )
    assert playbook.hosts == "lab:!n3"  # type: ignore[attr-defined]
    assert playbook.serial == (1, "50%")  # type: ignore[attr-defined]
    assert playbook.max_fail_percentage == 25.0  # type: ignore[attr-defined]
    steps = playbook.steps  # type: ignore[attr-defined]
    assert [s.op for s in steps] == ["restart", "wait_ready", "probe", "plan"]
    assert steps[0].args["force"] is True and steps[0].args["timeout"] == 20.0
    assert steps[1].name == "wait" and steps[1].label == 'step 2 "wait" (wait_ready)'
    assert steps[1].args["timeout"] == 15.0  # the default
    assert steps[3].args["model"] == "/m.gguf" and steps[3].args["ctx"] == 8192
    assert steps[3].args["margin"] == GiB
    assert steps[3].location.line == 11
    with pytest.raises(TypeError):
        steps[0].args["force"] = False  # read-only past validation


def test_extra_vars_win_and_keep_their_types(tmp_path: Path) -> None:
    extra = parse_extra_vars(["model=/other.gguf", "ctx=32k", "force=true", "serial=2"])
    assert extra == {"model": "/other.gguf", "ctx": "32k", "force": True, "serial": 2}
    playbook = load_playbook(PLAYBOOKS / "preload.yml", extra)
    plan = next(s for s in playbook.steps if s.op == "plan")
    assert plan.args["model"] == "/other.gguf" and plan.args["ctx"] == 32768
    assert playbook.steps[0].args["force"] is True
    rolling = load_playbook(PLAYBOOKS / "rolling-restart.yml", {"serial": "[1, 50%]"})
    assert rolling.serial == (1, "50%")
    with pytest.raises(UsageError, match="key=value"):
        parse_extra_vars(["model"])


def test_a_template_inside_text_is_substituted(tmp_path: Path) -> None:
    playbook = _load(
        """\
        name: t
        vars: {dir: /srv/models}
        steps:
          - plan: {model: "{{ dir }}/m-{{dir}}.gguf"}
        """,
        tmp_path,
    )
    assert playbook.steps[0].args["model"] == "/srv/models/m-/srv/models.gguf"  # type: ignore[attr-defined]


# Each case: the playbook, the expected message, the line it must point at.
ERRORS = [
    ("name: x\nsteps:\n  - restrat\n", "step 1: unknown operation 'restrat' (did you mean 'restart'?)", 3),
    (
        "name: x\nsteps:\n  - probe\n  - restart: {forse: true}\n",
        "step 2 (restart): unknown argument 'forse' (did you mean 'force'?)",
        4,
    ),
    ("name: x\nsteps:\n  - restart: {timeout: soon}\n", "step 1 (restart): timeout: expected a number", 3),
    ("name: x\nsteps:\n  - restart: {force: maybe}\n", "step 1 (restart): force: expected a boolean", 3),
    ("name: x\nsteps:\n  - probe\n  - plan: {ctx: 4096}\n", "step 2 (plan): missing required argument", 4),
    ("name: x\nsteps:\n  - plan: {model: '{{ modle }}'}\n", "step 1 (plan): model: undefined variable", 3),
    ("name: x\nsteps:\n  - name: both\n    stop:\n    start:\n", 'step 1 "both": a step is one operation', 3),
    ("name: x\nsteps:\n  - restart: [force]\n", "step 1 (restart): arguments must be a mapping", 3),
    ("name: x\nsteps:\n  - [probe]\n", "step 1: expected an operation name", 3),
    ("name: x\nserial: 0\nsteps: [probe]\n", "serial: a batch needs at least one host", 2),
    ("name: x\nserial: lots\nsteps: [probe]\n", "serial: expected a number or a percentage", 2),
    ("name: x\nmax_fail_percentage: 150\nsteps: [probe]\n", "max_fail_percentage: expected a number", 2),
    ("name: x\nhostz: all\nsteps: [probe]\n", "unknown key 'hostz' (did you mean 'hosts'?)", 2),
    ("name: x\nsteps: []\n", "steps must be a non-empty list", 2),
    ("steps: [probe]\n", "missing required key 'name'", 1),
    ("name: x\nsteps:\n  - probe: {timeout: 1\n", "invalid YAML", 4),
    ("name: x\nsteps:\n  - report: {format: pdf}\n", "format: expected one of text, md, json, html", 3),
]


@pytest.mark.parametrize(("text", "message", "line"), ERRORS, ids=[e[1][:40] for e in ERRORS])
def test_every_error_names_file_line_and_step(tmp_path: Path, text: str, message: str, line: int) -> None:
    err = _error(text, tmp_path)
    shown = str(err)
    assert message in shown, shown
    assert err.location is not None and err.location.line == line, shown
    assert f"{tmp_path / 'play.yml'}:{line}:" in shown
    if "invalid YAML" not in message:  # PyYAML may point past the last line
        assert "\n    " in shown  # the offending line is quoted


def test_all_errors_of_a_file_are_reported_together_in_file_order(tmp_path: Path) -> None:
    err = _error(
        """\
        name: x
        serial: -1
        steps:
          - restart: {force: 3}
          - probe: {timout: 2}
          - teleport
        """,
        tmp_path,
    )
    assert isinstance(err, PlaybookErrors)
    assert [e.location.line for e in err.errors if e.location] == [2, 4, 5, 6]
    text = str(err)
    for part in ("serial:", "step 1 (restart): force", "step 2 (probe): unknown argument 'timout'", "step 3"):
        assert part in text


def test_the_inline_playbook_of_rolling_restart_matches_the_shipped_one() -> None:
    shipped = load_playbook(PLAYBOOKS / "rolling-restart.yml")
    inline = rolling_restart_playbook(serial=1, max_fail_percentage=0)
    assert (inline.serial, inline.max_fail_percentage) == (shipped.serial, shipped.max_fail_percentage)
    assert [s.op for s in inline.steps] == [s.op for s in shipped.steps] == ["restart"]
    assert dict(inline.steps[0].args) == {**dict(shipped.steps[0].args), "timeout": 15.0}
    assert batch_sizes(3, inline.serial) == [1, 1, 1]


def test_play_hosts_combines_the_pattern_and_limit(tmp_path: Path) -> None:
    inventory = load_inventory_text(
        "hosts:\n  a: {connection: local}\n  b: {connection: local, rpc_port: 50053}\n"
        "  c: {connection: local, rpc_port: 50054}\ngroups:\n  g: {hosts: [a, b]}\n",
        Path("inv.yml"),
    )
    playbook = load_playbook_text("name: x\nhosts: g\nsteps: [probe]\n")
    assert [h.name for h in play_hosts(playbook, inventory)] == ["a", "b"]
    assert [h.name for h in play_hosts(playbook, inventory, "b,c")] == ["b"]
    with pytest.raises(UsageError, match="none of the play's hosts"):
        play_hosts(playbook, inventory, "c")


def test_memory_back_within_tolerance() -> None:
    base = [DeviceMemory(0, 20 * GiB, 24 * GiB), DeviceMemory(1, 10 * GiB, 24 * GiB)]
    assert memory_back(base, base) is None
    slightly = [DeviceMemory(0, 19 * GiB, 24 * GiB), DeviceMemory(1, 10 * GiB, 24 * GiB)]
    assert memory_back(base, slightly, tolerance=0.05) is None  # 1 GiB < 5% of 24 GiB
    held = [DeviceMemory(0, 20 * GiB, 24 * GiB), DeviceMemory(1, 4 * GiB, 24 * GiB)]
    why = memory_back(base, held, tolerance=0.05)
    assert why is not None and why.startswith("device 1:")
    assert memory_back(base, base[:1]) == "device 1 is missing after the restart"


def test_cli_reports_a_bad_playbook_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("name: x\nsteps:\n  - restart: {force: 3}\n")
    inventory = tmp_path / "inv.yml"
    inventory.write_text("hosts:\n  a: {connection: local}\n")
    assert main(["run-playbook", str(bad), "-i", str(inventory)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:3:" in err and "step 1 (restart): force" in err and "Traceback" not in err
    assert main(["run-playbook", str(tmp_path / "missing.yml"), "-i", str(inventory)]) == 2
    assert "playbook not found" in capsys.readouterr().err
