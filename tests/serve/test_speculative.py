"""Tier 1 for serve's speculative decoding (issue 34): the draft's flags and models-file keys, and the drafts
refused before anything starts (exit 2 naming the file): missing, not a GGUF, another vocabulary. The
planning of the draft: tests/planning/test_draft.py; a real serve with a draft: test_speculative_lab.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.core.errors import UsageError
from orchestrator.serve.models_file import ModelEntry, parse_models_file
from tests.plugins.servers import free_port


def test_a_models_file_entry_names_its_draft_and_its_lengths(tmp_path: Path) -> None:
    path = tmp_path / "models.yml"
    text = (
        "- model: a.gguf\n"
        "  draft: small.gguf\n"
        "  draft-max: 6\n"
        "  draft-min: 2\n"
        "  device-draft: first\n"
        "- model: b.gguf\n"
    )
    entries = parse_models_file(path, text)
    assert entries[0] == ModelEntry(
        tmp_path / "a.gguf",
        line=1,
        draft=tmp_path / "small.gguf",
        draft_max=6,
        draft_min=2,
        device_draft="first",
    )
    assert entries[1].draft is None and entries[1].device_draft is None
    bad = {
        "- model: a.gguf\n  draft-max: 0\n": (2, "draft-max: expected an integer >= 1"),
        "- model: a.gguf\n  draft-min: -1\n": (2, "draft-min: expected an integer >= 0"),
        "- model: a.gguf\n  device-draft: gpu\n": (2, "device-draft"),
        "- model: a.gguf\n  draft: ''\n": (2, "draft: is empty"),
        "- model: a.gguf\n  drafts: b.gguf\n": (2, "unknown key 'drafts' (did you mean 'draft'?)"),
    }
    for body, (line, message) in bad.items():
        with pytest.raises(UsageError) as caught:
            parse_models_file(path, body)
        assert f"{path}:{line}" in str(caught.value) and message in str(caught.value), (
            body,
            str(caught.value),
        )


def test_serve_refuses_a_draft_it_cannot_use_before_it_starts_with_exit_2(
    tiny_model: Path, gemma_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def serve(*argv: str) -> str:
        assert main(["serve", "--port", str(free_port()), *argv]) == 2
        return " ".join(capsys.readouterr().err.split())

    missing = tmp_path / "missing.gguf"
    assert f"draft model {missing} does not exist" in serve("-m", str(tiny_model), "--draft", str(missing))
    text = tmp_path / "notes.gguf"
    text.write_text("not a model at all, but long enough to have a header\n")
    err = serve("-m", str(tiny_model), "--model-draft", str(text))
    assert "not a GGUF file" in err and str(text) in err and "Traceback" not in err, err
    # llama-server would start and refuse to speculate: the vocabularies are compared from the headers
    err = serve("-m", str(tiny_model), "-md", str(gemma_model))
    assert (
        f"cannot draft for {tiny_model}" in err and "BOS differs (added True, id 1; added True, id 2)" in err
    ), err
    err = serve("-m", str(tiny_model), "--draft", str(tiny_model), "--draft-max", "2", "--draft-min", "3")
    assert "--draft-min 3 is more than --draft-max 2" in err, err
    models = tmp_path / "models.yml"
    models.write_text(f"- model: {tiny_model}\n- model: {gemma_model}\n  draft: {tiny_model}\n")
    err = serve("--models", str(models))
    assert f"{models}:2: draft model {tiny_model} cannot draft for {gemma_model}" in err, err
    assert "choice 'gpu'" in serve("-m", str(tiny_model), "--device-draft", "gpu")
