"""Conventions of the code base that a reader relies on (issue 19): checked on the source, by AST."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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


def test_an_error_subclass_sets_its_fields_before_the_root_freezes_it() -> None:
    """Errors are immutable once `RpcfleetError.__init__` ran (tests/core/test_errors.py); a subclass
    that set a field after `super().__init__` would raise on every construction, in whatever rare path
    builds it. Checked on the source, so that no such path has to run to find it."""
    trees = {path: ast.parse(path.read_text()) for path in sorted((ROOT / "orchestrator").rglob("*.py"))}
    classes = [
        (path, c) for path, tree in trees.items() for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
    ]
    ours = {"RpcfleetError"}  # and every class that derives from one of ours, by name
    while (
        grown := {c.name for _, c in classes if {ast.unparse(b).split(".")[-1] for b in c.bases} & ours}
        - ours
    ):
        ours |= grown
    wrong = []
    for path, cls in classes:
        if cls.name in ours - {"RpcfleetError"}:  # the root itself freezes at its end
            for init in (f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"):
                built = False
                for statement in init.body:
                    text = ast.unparse(statement)
                    if "super().__init__" in text:
                        built = True
                    elif (
                        built
                        and isinstance(statement, ast.Assign | ast.AnnAssign | ast.AugAssign)
                        and "self." in text.split("=")[0]
                    ):
                        wrong.append(f"{path.relative_to(ROOT)}:{statement.lineno}: {cls.name}: {text}")
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


def _imported_modules(tree: ast.Module) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return found


def test_the_tests_mirror_the_stages() -> None:
    """Each test module sits in tests/<stage>/ for the orchestrator package it tests, or tests/project/ for
    checks of the whole project; tiers are markers, not folders. A test module imports no other one: what
    tests share lives in tests/plugins/ (so a move or a rename of a test file breaks nothing else)."""
    tests = ROOT / "tests"
    packages = {p.name for p in (ROOT / "orchestrator").iterdir() if (p / "__init__.py").is_file()}
    stages = packages | {"project"}
    wrong = []
    for path in sorted(tests.rglob("test_*.py")):
        where = path.relative_to(ROOT)
        folder = path.parent.relative_to(tests)
        if len(folder.parts) != 1 or folder.parts[0] not in stages:
            wrong.append(f"{where}: not in tests/<stage>/ (stages: {', '.join(sorted(stages))})")
        elif not (path.parent / "__init__.py").is_file():
            wrong.append(f"{where}: tests/{folder}/ has no __init__.py")
        for line, module in _imported_modules(ast.parse(path.read_text())):
            if re.fullmatch(r"tests(\.\w+)*\.test_\w+", module):
                wrong.append(f"{where}:{line}: imports the test module {module}")
    assert not wrong, "\n".join(wrong)


def test_the_architecture_page_lists_the_stages_of_the_import_contract() -> None:
    """pyproject.toml's layers contract is the one list of the stages, in flow order; the walk test reads
    it, and docs/architecture.md's table must say the same (every package is a stage)."""
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    layers = [name.removeprefix("orchestrator.") for name in contract["layers"]]
    page = (ROOT / "docs" / "architecture.md").read_text()
    table = re.findall(r"^\| `(\w+)/` \|", page, flags=re.MULTILINE)
    assert table == layers, (table, layers)
    packages = {p.name for p in (ROOT / "orchestrator").iterdir() if (p / "__init__.py").is_file()}
    assert set(layers) == packages, set(layers) ^ packages
    undocumented = [
        name
        for name in sorted(packages)
        if len(ast.get_docstring(ast.parse((ROOT / "orchestrator" / name / "__init__.py").read_text())) or "")
        < 40
    ]
    assert not undocumented, f"packages whose docstring does not say what the stage holds: {undocumented}"


def test_every_test_file_cited_exists() -> None:
    """The code, the docs and the configuration name test files and the suite's helpers by path: each such
    path exists (docs/kubernetes.md cited tests/kube/pod_security.py after it moved to tests/plugins)."""
    extra = [ROOT / "pyproject.toml", ROOT / "Makefile", *sorted((ROOT / "deploy").rglob("*.yml"))]
    wrong = []
    for path in [*_sources(), *extra]:
        text = path.read_text(errors="replace")
        for cited in sorted(set(re.findall(r"\btests/[\w/]*\.py\b", text))):
            if not (ROOT / cited).is_file():
                wrong.append(f"{path.relative_to(ROOT)}: cites {cited}, which does not exist")
    assert not wrong, "\n".join(wrong)
