"""The user guide (docs/, built by mkdocs) works as written: it builds with `--strict` (no broken link, no
page left out), every page is in mkdocs.yml's nav, every ```sh block of the guide and of the README's quick
start runs (they hold only commands that connect to nothing; the others are ```console examples), the
quick start's output is what those commands print, and the command reference is what its generator prints.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# What a ```sh block may hold: `rpcfleet` with these first words (they connect to nothing), or --help.
SAFE = [("--help",), ("--version",), ("inventory",), ("model", "synth"), ("model", "info"), ("export", "lws")]


def test_the_guide_builds_strictly(tmp_path: Path) -> None:
    """Not skipped without mkdocs: `make setup` installs the dev extras, mkdocs among them."""
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def _nav_pages(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node] if node.endswith(".md") else []
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    return []


def test_every_page_is_in_the_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs" and config["strict"] is True
    nav = _nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(set(nav)) == pages, (
        f"not in the nav: {set(pages) - set(nav)}; no such page: {set(nav) - set(pages)}"
    )
    assert len(nav) == len(set(nav)), "a page is in the nav twice"


def _sh_blocks(text: str) -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M)


def _quick_start() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("\n## Quick start\n")
    return readme[start : readme.index("\n## ", start + 1)]


def _commands(block: str) -> list[str]:
    lines = [line.split("  #", 1)[0].strip() for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _blocks() -> list[tuple[str, str]]:
    found = [("README.md#quick-start", block) for block in _sh_blocks(_quick_start())]
    for page in sorted(DOCS.rglob("*.md")):
        found += [(f"docs/{page.relative_to(DOCS)}", block) for block in _sh_blocks(page.read_text())]
    return found


def test_the_sh_blocks_hold_only_commands_that_connect_to_nothing() -> None:
    wrong = []
    for where, block in _blocks():
        for line in _commands(block):
            words = shlex.split(line)
            safe = words[0] == "rpcfleet" and (
                words[-1] == "--help" or any(tuple(words[1 : 1 + len(s)]) == s for s in SAFE)
            )
            if not safe:
                wrong.append(f"{where}: `{line}` (mark the block ```console: only safe commands are run)")
    assert not wrong, "\n".join(wrong)
    assert any(where.startswith("docs/") for where, _ in _blocks())


def _run_block(block: str, cwd: Path, home: Path) -> list[str]:
    """Run a block's commands in order, as `python -m orchestrator` of this checkout; their stdout lines."""
    (cwd / "inventory").symlink_to(ROOT / "inventory")
    env = {**os.environ, "RPCFLEET_HOME": str(home), "PYTHONPATH": str(ROOT)}
    env.pop("RPCFLEET_INVENTORY", None)
    printed = []
    for line in _commands(block):
        out = subprocess.run(
            [sys.executable, "-m", "orchestrator", *shlex.split(line)[1:]],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, f"`{line}` exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
        assert "Traceback" not in out.stderr, out.stderr
        printed += [text.rstrip() for text in out.stdout.splitlines()]
    return printed


@pytest.mark.parametrize("index", range(len(_blocks())), ids=[w for w, _ in _blocks()])
def test_the_sh_block_runs(index: int, tmp_path: Path) -> None:
    _, block = _blocks()[index]
    (tmp_path / "work").mkdir()
    _run_block(block, tmp_path / "work", tmp_path / "home")


def test_the_quick_start_shows_what_its_commands_print(tmp_path: Path) -> None:
    section = _quick_start()
    (block,) = _sh_blocks(section)
    shown = re.search(r"^```text\n(.*?)^```", section, re.S | re.M)
    assert shown is not None, "the quick start shows no output"
    (tmp_path / "work").mkdir()
    printed = _run_block(block, tmp_path / "work", tmp_path / "home")
    missing = [line for line in shown.group(1).splitlines() if line.strip() and line.rstrip() not in printed]
    assert not missing, "the README shows lines its quick start does not print:\n" + "\n".join(missing)


def test_the_command_reference_is_what_its_generator_prints() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "cli_reference.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    page = (DOCS / "reference.md").read_text()
    begin, end = (
        "<!-- scripts/cli_reference.py: generated, do not edit -->",
        "<!-- end scripts/cli_reference.py -->",
    )
    block = re.search(f"^{re.escape(begin)}\n(.*?)^{re.escape(end)}", page, re.S | re.M)
    assert block is not None, "docs/reference.md has no generated block"
    assert block.group(1) == out.stdout, (
        "docs/reference.md is stale: run python scripts/cli_reference.py --write"
    )
