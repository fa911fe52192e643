"""Conventions of the code base that a reader relies on (issue 19): checked on the source, by AST."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_to_json_returns_a_dict() -> None:
    """`x.to_json()` (and every `thing_to_json(x)`) is JSON data (a dict) everywhere; text and bytes have
    their own names (`to_text`, `to_bytes`), so a caller never has to know which kind of object it holds.
    `devices_to_json` once gave a list."""
    wrong = []
    for path in sorted((ROOT / "orchestrator").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and (
                node.name == "to_json" or node.name.endswith("_to_json")
            ):
                returns = ast.unparse(node.returns) if node.returns is not None else "None"
                if not returns.startswith("dict["):
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} -> {returns}")
    assert not wrong, "\n".join(wrong)


def _sources() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("orchestrator", "tests", "bench", "scripts"):
        found += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh", ".md"))
    return [p for p in found if p.is_file() and p != Path(__file__)]


def test_the_docs_the_code_cites_are_in_the_repository() -> None:
    """Every `docs/NAME.md` cited exists, every `§N` of docs/llama-rpc.md cited is one of its sections, and
    nothing points outside the repository (the docs once lived in ../shared/docs)."""
    sections = set(re.findall(r"^## (\d+)\.", (ROOT / "docs" / "llama-rpc.md").read_text(), re.MULTILINE))
    wrong = []
    for path in _sources():
        text = path.read_text(errors="replace")
        where = path.relative_to(ROOT)
        if "shared/docs" in text:
            wrong.append(f"{where}: cites ../shared/docs, outside the repository")
        for name in re.findall(r"\bdocs/([\w-]+\.md)\b", text):
            if not (ROOT / "docs" / name).is_file():
                wrong.append(f"{where}: cites docs/{name}, which does not exist")
        cited = re.findall(r"§(\d+)(?:-§(\d+))? of (?:\[)?docs/llama-rpc\.md", text)
        cited += re.findall(r"docs/llama-rpc\.md §(\d+)()", text)
        for first, last in cited:
            for n in range(int(first), int(last or first) + 1):
                if str(n) not in sections:
                    wrong.append(f"{where}: cites §{n} of docs/llama-rpc.md, which has no such section")
    assert not wrong, "\n".join(wrong)
