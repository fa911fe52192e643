"""BENCHMARKS.md holds only what bench/ measured (issue 19, item 7): every figure sits in a block a script
generated, each block says when, at which commit and under what load it was measured, and the text between
blocks is hand-written and has no figures. Also `write_section`, which keeps that text when a block is
rewritten."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
BLOCK = re.compile(
    r"^<!-- (bench/[\w.]+\.py): generated, do not edit -->\n(.*?)^<!-- end \1 -->$", re.S | re.M
)
FIGURE = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|s|%|x|MB/s|GB/s|Gbit/s|tok/s|KiB|MiB|GiB|MB|GB|min)(?![\w-])")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
COMMIT = re.compile(r"commit `[0-9a-f]{7,40}`")
LOAD = re.compile(r"load(?: average)?(?: before)?:? \d+(?:\.\d+)?|load average \d")

# Blocks measured before their script printed the commit and the date, not re-run since (each takes far
# longer than a quick check on a shared 2-core machine). A re-run stamps the block and must remove it here.
STALE: set[str] = set()


def _benchmarks() -> str:
    return (ROOT / "BENCHMARKS.md").read_text()


def test_every_block_names_a_script_that_writes_it() -> None:
    blocks = BLOCK.findall(_benchmarks())
    assert blocks, "no generated block in BENCHMARKS.md"
    for script, _ in blocks:
        source = ROOT / script
        assert source.is_file(), f"{script} does not exist"
        assert "write_section" in source.read_text(), f"{script} does not write its block"


def test_every_block_says_when_at_which_commit_and_under_what_load() -> None:
    for script, body in BLOCK.findall(_benchmarks()):
        stamped = bool(DATE.search(body) and COMMIT.search(body))
        if script in STALE:
            assert not stamped, f"{script} was re-run: take it off STALE"
            continue
        assert stamped, f"the block of {script} has no date or no commit"
        assert LOAD.search(body), f"the block of {script} does not give the load average"


def test_no_figure_outside_the_generated_blocks() -> None:
    hand = BLOCK.sub("", _benchmarks())
    figures = [m.group(0) for m in FIGURE.finditer(hand)]
    assert not figures, f"hand-written figures in BENCHMARKS.md: {figures}"


def test_no_script_prints_a_figure_or_commit_it_did_not_measure() -> None:
    """A constant such as "it took 22.7 ms before commit b75dac3" printed on every run is no measurement."""
    for script in sorted(BENCH.glob("*.py")):
        text = script.read_text()
        assert not re.search(r"commit `[0-9a-f]{7,40}`", text), f"{script.name} prints a fixed commit"
        assert not re.search(r"before commit", text), f"{script.name} prints an old figure"


@pytest.fixture
def write_section() -> Iterator[Callable[..., None]]:
    sys.path.insert(0, str(BENCH))
    try:
        import _common  # type: ignore[import-not-found]

        yield _common.write_section
    finally:
        sys.path.remove(str(BENCH))


def test_a_rewrite_replaces_the_block_and_keeps_the_hand_written_text(
    write_section: Callable[..., None], tmp_path: Path
) -> None:
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\nintro\n\n## other\n\nkept\n")
    write_section(doc, "probe", "## probe\n\nfirst 1 ms\n", "bench/probe.py")
    text = doc.read_text()
    assert "<!-- bench/probe.py: generated, do not edit -->\nfirst 1 ms\n<!-- end bench/probe.py -->" in text
    doc.write_text(text.rstrip("\n") + "\n\nA hand-written reading.\n")
    write_section(doc, "probe", "## probe\n\nsecond 2 ms\n", "bench/probe.py")
    text = doc.read_text()
    assert "second 2 ms" in text and "first 1 ms" not in text
    assert text.endswith("<!-- end bench/probe.py -->\n\nA hand-written reading.\n")
    assert "## other\n\nkept\n" in text and text.count("## probe") == 1
    with pytest.raises(ValueError, match="must start with '## probe'"):
        write_section(doc, "probe", "## plan\n\nx\n", "bench/probe.py")
