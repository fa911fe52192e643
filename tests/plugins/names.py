"""AST helpers for the project's "one home" checks (loops and threads, child processes): which qualified
name an expression stands for, and which nodes only name a type."""

from __future__ import annotations

import ast


def dotted(node: ast.expr) -> list[str] | None:
    """`a.b.c` -> ["a", "b", "c"]; None for anything not a plain chain of names."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def annotations(tree: ast.AST) -> list[ast.expr]:
    """Every annotation in `tree` (arguments, annotated assignments, return types)."""
    found: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg | ast.AnnAssign) and node.annotation is not None:
            found.append(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
            found.append(node.returns)
    return found
