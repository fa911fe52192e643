"""A playbook step and the command line take the planning and probe options of one declaration
(`orchestrator.workflows.options`): the same names, defaults and meanings, and a bad value is an error
naming the file and the line, as any other argument's."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from orchestrator.cli import parse_args
from orchestrator.core.errors import PlaybookError
from orchestrator.playbooks.ops import REGISTRY
from orchestrator.playbooks.reader import load_playbook
from orchestrator.workflows.options import OPTIONS, PLAN_OPTIONS, plan_options, probe_settings

# Step arguments named like a declared option that mean something else (seconds until HELLO, a load's limit).
OTHER_MEANINGS = {("restart", "timeout"), ("wait_ready", "timeout"), ("load_check", "timeout")}
OTHER_MEANINGS |= {("serve_reload", "timeout")}


def _steps(text: str, tmp_path: Path) -> list[dict[str, object]]:
    path = tmp_path / "play.yml"
    path.write_text(textwrap.dedent(text))
    return [dict(step.args) for step in load_playbook(path, {}).steps]


def test_every_step_argument_named_as_an_option_is_made_from_its_declaration() -> None:
    wrong = [
        f"{op.name}: {arg.name}"
        for op in REGISTRY.values()
        for arg in op.args
        if arg.name in OPTIONS
        and (op.name, arg.name) not in OTHER_MEANINGS
        and arg.option is not OPTIONS[arg.name]
    ]
    assert not wrong, f"step arguments declared by hand, not by option_arg: {wrong}"
    for name in ("plan", "report"):
        taken = {arg.name for arg in REGISTRY[name].args}
        assert {option.name for option in PLAN_OPTIONS} <= taken, name


def test_the_plan_step_and_the_plan_command_have_the_same_names_and_defaults() -> None:
    cli = vars(parse_args(["plan", "-m", "m.gguf"]))
    step = {arg.name: arg.default for arg in REGISTRY["plan"].args}
    for option in PLAN_OPTIONS:
        assert cli[option.name] == step[option.name] == option.default, option.name
    assert plan_options(cli) == plan_options(step)
    report = {arg.name: arg.default for arg in REGISTRY["report"].args}
    assert report["ctx"] == (cli["ctx"],)
    assert plan_options(report, n_ctx=report["ctx"][0]) == plan_options(cli)


def test_the_probe_step_and_the_probe_command_have_the_same_names_and_defaults() -> None:
    cli = vars(parse_args(["probe"]))
    step = {arg.name: arg.default for arg in REGISTRY["probe"].args}
    assert cli["timeout"] == step["timeout"] and cli["facts"] == step["facts"] is True
    assert probe_settings(cli) == probe_settings(step) == probe_settings({})
    cli = vars(parse_args(["probe", "--timeout", "7", "--no-facts"]))
    assert probe_settings(cli) == probe_settings({"timeout": 7.0, "facts": False})


def test_the_same_values_mean_the_same_plan_from_a_flag_and_from_yaml(tmp_path: Path) -> None:
    flags = "--ctx 8k --type-k q8_0 --type-v q8_0 -fa off --swa-full -np 2 --kv-unified --n-cpu-moe 3"
    cli = parse_args(
        [
            "plan",
            "-m",
            "m.gguf",
            *flags.split(),
            "--ubatch",
            "256",
            "--margin",
            "1GiB",
            "--strategy",
            "fewest",
        ]
    )
    (step,) = _steps(
        """\
        name: x
        steps:
          - plan:
              model: m.gguf
              ctx: 8k
              type_k: q8_0
              type_v: q8_0
              flash_attn: off
              swa_full: true
              parallel: 2
              kv_unified: yes
              n_cpu_moe: 3
              ubatch: 256
              margin: 1GiB
              strategy: fewest
        """,
        tmp_path,
    )
    assert plan_options(vars(cli)) == plan_options(step)
    assert step["flash_attn"] == "off"  # YAML's off is a boolean: false = off, as -fa off


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ("type_k: q9_0", "type_k: expected one of f32, f16, bf16, q8_0"),
        ("strategy: fastest", "strategy: expected one of proportional, fewest"),
        ("flash_attn: maybe", "flash_attn: expected one of on, off, auto"),
        ("parallel: 300", "parallel: "),
    ],
)
def test_a_bad_option_value_names_the_file_and_line(tmp_path: Path, argument: str, message: str) -> None:
    text = f"name: x\nsteps:\n  - probe\n  - plan:\n      model: m.gguf\n      {argument}\n"
    with pytest.raises(PlaybookError) as info:
        _steps(text, tmp_path)
    shown = str(info.value)
    assert f"step 2 (plan): {message}" in shown, shown
    assert f"{tmp_path / 'play.yml'}:6:" in shown
