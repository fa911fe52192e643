"""An error no stage expected (a bug) is one line naming its type and where it was raised, and the log
that holds its traceback: never a traceback, never the error's text (issue 42: `list.index` quoted 34 KB
of a served model's repr)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.cli import main


@dataclass(frozen=True)
class Bulky:
    weights: tuple[int, ...] = tuple(range(8000))


def test_an_unexpected_error_prints_one_line_with_its_log_and_never_its_repr(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def profile_model(path: Path) -> None:
        [Bulky(weights=(1,))].index(Bulky())  # ValueError: Bulky(weights=(0, 1, ...)) is not in list

    monkeypatch.setattr("orchestrator.planning.profile.profile_model", profile_model)
    monkeypatch.setenv("RPCFLEET_HOME", str(tmp_path))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert main(["model", "info", str(tmp_path / "m.gguf")]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    found = re.fullmatch(
        r"error: unexpected ValueError at orchestrator/cli/model\.py:\d+ \(a bug in rpcfleet\): "
        r"its traceback is in (\S+)\n",
        err,
    )
    assert found is not None, err
    log = Path(found.group(1))
    assert log.parent == tmp_path / "logs"
    text = log.read_text()
    assert text.startswith("Traceback") and "Bulky(weights=(0, 1, 2" in text and "Bulky" not in err
