"""A command given no inventory uses lab `lab`'s, and says so (issue 43): with two labs up, a deploy must
not land on the other fleet unannounced. Local labs: no root needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli import _output, main
from orchestrator.lab.lifecycle import lab_down, lab_up


@pytest.fixture
def labs_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RPCFLEET_HOME", str(tmp_path))
    monkeypatch.delenv("RPCFLEET_INVENTORY", raising=False)
    monkeypatch.chdir(tmp_path)  # no ./inventory.yml
    monkeypatch.setattr(_output.err_console, "_width", 400)
    monkeypatch.setattr(_output.console, "_width", 400)
    return tmp_path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_the_lab_inventory_used_is_named_with_the_other_labs_up(
    labs_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lab_up(1, local=True)
    lab_up(1, local=True, name="nb")
    try:
        status, out, err = run(capsys, "inventory", "list", "--json")
        assert status == 0 and out.startswith("[")  # stdout stays the JSON alone
        ours, other = labs_home / "lab" / "lab" / "inventory.yml", labs_home / "lab" / "nb" / "inventory.yml"
        assert err == (
            f"note: using lab 'lab''s inventory {ours} (no -i, $RPCFLEET_INVENTORY or ./inventory.yml); "
            f"also up: lab 'nb' (-i {other})\n"
        )
        # Named on the command line: nothing to say.
        status, _, err = run(capsys, "inventory", "list", "-i", str(other))
        assert (status, err) == (0, "")
    finally:
        lab_down("nb")
        lab_down()


def test_without_lab_lab_up_the_labs_that_are_up_are_listed(
    labs_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = run(capsys, "lab", "up", "--local", "--nodes", "1", "--name", "nb")
    try:
        inventory = labs_home / "lab" / "nb" / "inventory.yml"
        assert status == 0
        # how to point commands at it, since they use lab `lab` alone by themselves
        assert f"use it: rpcfleet COMMAND -i {inventory}, or export RPCFLEET_INVENTORY={inventory}" in out
        status, _, err = run(capsys, "inventory", "list")
        assert status == 2
        assert "no lab named 'lab' is up" in err and f"nb: -i {inventory}" in " ".join(err.split())
    finally:
        lab_down("nb")


def test_lab_up_without_a_name_needs_no_pointer(labs_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "lab", "up", "--local", "--nodes", "1")
    try:
        assert status == 0 and "use it:" not in out and "inventory: " in out
    finally:
        lab_down()
