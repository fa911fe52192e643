"""Conventions of the code base that a reader relies on (issue 19): checked on the source, by AST."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_to_json_returns_a_dict() -> None:
    """`x.to_json()` is JSON data (a dict) everywhere; text and bytes have their own names (`to_text`,
    `to_bytes`), so a caller never has to know which kind of object it holds."""
    wrong = []
    for path in sorted((ROOT / "orchestrator").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "to_json":
                returns = ast.unparse(node.returns) if node.returns is not None else "None"
                if not returns.startswith("dict["):
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: to_json -> {returns}")
    assert not wrong, "\n".join(wrong)
