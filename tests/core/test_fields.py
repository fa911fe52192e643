"""One field parser per kind of value, and every front end agrees on it: an inventory (YAML and INI), a
playbook step (written in the file and passed as `-e`), an artifact spec and a command-line flag read
the same text as the same value, or refuse it with the same message."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cli import _parser, build_parser
from orchestrator.core import fields
from orchestrator.core.errors import InputError
from orchestrator.inventory.load import load_inventory_text
from orchestrator.playbooks.reader import load_playbook_text, parse_extra_vars

MiB, GiB = 1 << 20, 1 << 30


class Refused(Exception):
    """A front end refused the value; the message is what the user reads."""


FrontEnd = Callable[[str, Path, pytest.CaptureFixture[str]], Any]


def _inventory(variable: str, *, ini: bool = False) -> FrontEnd:
    def read(text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Any:
        source = f"a {variable}={text}\n" if ini else f"hosts:\n  a: {{{variable}: {text}}}\n"
        try:
            inventory = load_inventory_text(source, tmp_path / ("inv.ini" if ini else "inv.yml"))
        except InputError as exc:
            raise Refused(str(exc)) from exc
        return getattr(inventory.hosts[0], variable)

    return read


def _playbook(op: str, arg: str, *, extra_vars: bool = False, **others: str) -> FrontEnd:
    def read(text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Any:
        given = "'{{ value }}'" if extra_vars else text
        args = ", ".join(f"{k}: {v}" for k, v in {arg: given, **others}.items())
        source = f"name: x\nsteps:\n  - {op}: {{{args}}}\n"
        try:
            variables = parse_extra_vars([f"value={text}"]) if extra_vars else {}
            playbook = load_playbook_text(source, tmp_path / "play.yml", variables)
        except InputError as exc:
            raise Refused(str(exc)) from exc
        return playbook.steps[0].args[arg]

    return read


def _play_key(key: str) -> FrontEnd:
    def read(text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Any:
        try:
            playbook = load_playbook_text(f"name: x\n{key}: {text}\nsteps: [probe]\n", tmp_path / "play.yml")
        except InputError as exc:
            raise Refused(str(exc)) from exc
        return getattr(playbook, key)

    return read


def _spec(key: str) -> FrontEnd:
    def read(text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Any:
        from orchestrator.artifacts.spec import read_artifact_spec

        path = tmp_path / "artifact.yml"
        path.write_text(f"build: on_node\n{key}: {text}\n")
        try:
            spec = read_artifact_spec(path)
        except InputError as exc:
            raise Refused(str(exc)) from exc
        return getattr(spec, key)

    return read


def _flag(command: list[str], flag: str) -> FrontEnd:
    def read(text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Any:
        capsys.readouterr()
        try:
            args = build_parser().parse_args([*command, f"{flag}={text}"])
        except _parser.UsageExit as exc:
            assert exc.status == 2
            raise Refused(capsys.readouterr().err) from exc
        return getattr(args, flag.lstrip("-").replace("-", "_"))

    return read


# kind -> the front ends that take a value of that kind
FRONT_ENDS: dict[str, dict[str, FrontEnd]] = {
    "boolean": {
        "inventory yaml": _inventory("rpc_cache"),
        "inventory ini": _inventory("rpc_cache", ini=True),
        "playbook": _playbook("restart", "force"),
        "playbook -e": _playbook("restart", "force", extra_vars=True),
        "artifact spec": _spec("native"),
        # no flag takes a boolean value: boolean flags are switches (--force, --check)
    },
    "seconds": {
        "inventory yaml": _inventory("ssh_connect_timeout"),
        "inventory ini": _inventory("ssh_connect_timeout", ini=True),
        "playbook": _playbook("restart", "timeout"),
        "playbook -e": _playbook("restart", "timeout", extra_vars=True),
        "artifact spec": _spec("build_timeout"),
        "flag": _flag(["probe"], "--timeout"),
    },
    "size": {
        "inventory yaml": _inventory("memory_reserve"),
        "inventory ini": _inventory("memory_reserve", ini=True),
        "playbook": _playbook("plan", "margin", model="m.gguf"),
        "playbook -e": _playbook("plan", "margin", extra_vars=True, model="m.gguf"),
        "flag": _flag(["plan", "-m", "m.gguf"], "--margin"),
    },
    "count": {
        "inventory yaml": _inventory("keep_versions"),
        "inventory ini": _inventory("keep_versions", ini=True),
        "flag --forks": _flag(["probe"], "--forks"),
        "flag --ubatch": _flag(["plan", "-m", "m.gguf"], "--ubatch"),
    },
    "percentage": {
        "playbook": _play_key("max_fail_percentage"),
        "flag rolling": _flag(["restart", "--rolling"], "--max-fail-percentage"),
        "flag deploy": _flag(["deploy"], "--max-fail-percentage"),
    },
    "context": {
        "playbook": _playbook("plan", "ctx", model="m.gguf"),
        "playbook -e": _playbook("plan", "ctx", extra_vars=True, model="m.gguf"),
        "flag": _flag(["plan", "-m", "m.gguf"], "--ctx"),
    },
}


# kind -> (what the user writes, the value it means, or the start of the message refusing it)
VALUES: dict[str, list[tuple[str, object]]] = {
    "boolean": [
        *[(word, True) for word in ("true", "True", "yes", "YES", "on", "y", "Y", "t", "1")],
        *[(word, False) for word in ("false", "no", "Off", "n", "f", "0")],
        ("maybe", "expected a boolean (true/false, yes/no, on/off), got"),
        ("2", "expected a boolean (true/false, yes/no, on/off), got"),
    ],
    "seconds": [
        ("3", 3.0),
        ("2.5", 2.5),
        ("0", "expected a positive number of seconds, got"),
        ("-1", "expected a positive number of seconds, got"),
        ("soon", "expected a number of seconds, got"),
    ],
    "size": [
        ("512MiB", 512 * MiB),
        ("1.5G", 3 * GiB // 2),
        ("1024", 1024),
        ("lots", "expected a size such as 8GiB, 512MiB or 1.5G, got"),
    ],
    "count": [
        ("4", 4),
        ("0", "expected an integer >= 1, got 0"),
        ("2.5", "expected an integer, got"),
        ("many", "expected an integer, got"),
    ],
    "percentage": [
        ("25", 25.0),
        ("12.5%", 12.5),
        ("0", 0.0),
        ("150", "expected a number from 0 to 100, got"),
        ("some", "expected a number from 0 to 100, got"),
    ],
    "context": [
        ("4096", 4096),
        ("32k", 32768),
        ("big", "expected a context size such as 4096 or 32k, got"),
    ],
}


CASES = [
    pytest.param(kind, text, expected, name, id=f"{kind}-{text}-{name}")
    for kind, values in VALUES.items()
    for text, expected in values
    for name in FRONT_ENDS[kind]
]


@pytest.mark.parametrize(("kind", "text", "expected", "front_end"), CASES)
def test_every_front_end_reads_a_value_alike(
    kind: str, text: str, expected: object, front_end: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    read = FRONT_ENDS[kind][front_end]
    if isinstance(expected, str):
        with pytest.raises(Refused) as info:
            read(text, tmp_path, capsys)
        assert expected in str(info.value)
    else:
        value = read(text, tmp_path, capsys)
        assert value == expected and type(value) is type(expected)


def test_a_refusal_names_where_the_value_was() -> None:
    with pytest.raises(InputError) as info:
        load_inventory_text("a rpc_cache=maybe\n", Path("inv.ini"))
    assert str(info.value).startswith("inv.ini:1:")
    with pytest.raises(InputError) as info:
        load_playbook_text("name: x\nsteps:\n  - restart: {force: maybe}\n", Path("play.yml"))
    assert str(info.value).startswith("play.yml:3:") and "force: expected a boolean" in str(info.value)


@pytest.mark.parametrize(
    ("parse", "raw", "expected"),
    [
        (fields.list_of(fields.context), "4k, 8192,,", (4096, 8192)),
        (fields.list_of(fields.text), None, ()),
        (fields.optional(fields.size), "", None),
        (fields.optional(fields.size), "1k", 1024),
        (fields.choice(("ssh", "local"), {"smart": "ssh"}), " Local ", "local"),
        (fields.choice(("ssh", "local"), {"smart": "ssh"}), "smart", "ssh"),
        (fields.arguments, "-DGGML_CUDA=ON '-DX=a b'", ("-DGGML_CUDA=ON", "-DX=a b")),
        (fields.fraction, "5%", 0.05),
        (fields.port, "22", 22),
        (fields.boolean, 1.0, True),
    ],
)
def test_parsers(parse: Callable[[Any], Any], raw: object, expected: object) -> None:
    assert parse(raw) == expected


@pytest.mark.parametrize(
    ("parse", "raw", "message"),
    [
        (fields.text, True, "expected a string, got a boolean True"),
        (fields.text, [1], "expected a string, got a list [1]"),
        (fields.integer(), True, "expected an integer, got a boolean True"),
        (fields.integer(maximum=3), 4, "expected an integer <= 3, got 4"),
        (fields.port, 70000, "port 70000 is out of range (1-65535)"),
        (fields.seconds, float("inf"), "expected a positive number of seconds"),
        (fields.size, True, "expected a size such as 8GiB"),
        (fields.size, -1, "a size cannot be negative"),
        (fields.fraction, "150%", "between 0% and 100%"),
        (fields.choice(("cpu", "cuda")), "cdua", "one of cpu, cuda, got 'cdua' (did you mean 'cuda'?)"),
        (fields.arguments, "'unclosed", "cannot split"),
        (fields.list_of(fields.text), {"a": 1}, "expected a list (or comma-separated values), got"),
        (fields.matching(r"[0-9a-f]{4}", "4 hex digits"), "xyz", "expected 4 hex digits, got 'xyz'"),
    ],
)
def test_parser_messages(parse: Callable[[Any], Any], raw: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse(raw)
    assert message in str(info.value)
