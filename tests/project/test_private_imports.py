"""No module of orchestrator/ uses another module's private names (issue 19, item 3).

A name with a leading underscore is private to the module that defines it: `from orchestrator.x import _y`,
`x._y` on an imported orchestrator module, and `import orchestrator.x._y` all fail here when they cross a
module boundary. A private *module* (`cli/_common.py`) is private to its package: its siblings may import
it, other packages may not. Names of other libraries (`os._exit`, `argparse._SubParsersAction`) are not
this project's to rename and are left alone. import-linter cannot express this rule (its contracts see
modules, not the names imported from them), hence an AST walk."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "orchestrator"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found: dict[str, Path] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = _package_of(module, path).split(".")
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, *([node.module] if node.module else [])])


def _crosses(importer: str, importer_path: Path, target: str, known: dict[str, Path]) -> bool:
    """Whether reaching the private name `target` from `importer` crosses a module boundary."""
    if target in known:  # a private module: fine from inside its own package
        return _package_of(importer, importer_path) != target.rpartition(".")[0]
    return True


def violations(root: Path = ROOT) -> list[Violation]:
    known = modules(root)
    found: list[Violation] = []
    for module, path in known.items():
        rel = str(path.relative_to(root))
        tree = ast.parse(path.read_text(), filename=rel)
        bound: dict[str, str] = {}  # local name -> the orchestrator module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _absolute(module, path, node)
                if base.split(".")[0] != PACKAGE:
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in known:
                        bound[alias.asname or alias.name] = full
                    if _private(alias.name) and _crosses(module, path, full, known):
                        found.append(Violation(rel, node.lineno, f"from {base} import {alias.name}"))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] != PACKAGE:
                        continue
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    parts = alias.name.split(".")
                    for i, part in enumerate(parts):
                        if _private(part) and _crosses(module, path, ".".join(parts[: i + 1]), known):
                            found.append(Violation(rel, node.lineno, f"import {alias.name}"))
                            break
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
            ):
                target = f"{bound[node.value.id]}.{node.attr}"
                if bound[node.value.id] != module and _crosses(module, path, target, known):
                    found.append(Violation(rel, node.lineno, f"{node.value.id}.{node.attr}"))
    return found


def test_no_private_name_crosses_a_module_boundary() -> None:
    found = violations()
    assert not found, "private names used across modules:\n" + "\n".join(map(str, found))


def test_the_walk_finds_each_kind_of_violation(tmp_path: Path) -> None:
    """The rule can fail: a package with one violation of each kind, and the allowed cases beside them."""
    pkg = tmp_path / PACKAGE
    (pkg / "cli").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("_hidden = 1\nshown = 2\n")
    (pkg / "cli" / "__init__.py").write_text("")
    (pkg / "cli" / "_common.py").write_text("escape = 1\n")
    (pkg / "cli" / "run.py").write_text(
        "import os\n"
        "from orchestrator.cli import _common\n"  # allowed: a private module of its own package
        "from orchestrator.a import shown\n"  # allowed: public
        "os._exit\n"  # allowed: not ours
    )
    (pkg / "b.py").write_text(
        "from orchestrator.a import _hidden\n"
        "from . import a\n"
        "import orchestrator.a as mod\n"
        "from orchestrator.cli import _common\n"
        "a._hidden\n"
        "mod._hidden\n"
    )
    texts = sorted(v.text for v in violations(tmp_path))
    assert texts == sorted(
        [
            "from orchestrator.a import _hidden",
            "from orchestrator.cli import _common",
            "a._hidden",
            "mod._hidden",
        ]
    )
