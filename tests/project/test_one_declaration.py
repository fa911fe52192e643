"""The planner's choices (KV cache types, strategies, flash attention's modes) are listed once, in
`orchestrator/planning/settings.py`: no other module of the package spells the list again (an AST walk
for a tuple, list or set literal holding all of one of them)."""

from __future__ import annotations

import ast
from pathlib import Path

from orchestrator.planning.settings import FLASH_ATTN_MODES, KV_CACHE_TYPE_NAMES, STRATEGIES

PACKAGE = Path(__file__).resolve().parents[2] / "orchestrator"
HOME = PACKAGE / "planning" / "settings.py"
LISTS = {"KV cache types": set(KV_CACHE_TYPE_NAMES), "strategies": set(STRATEGIES)}
LISTS["flash attention modes"] = set(FLASH_ATTN_MODES)


def relisted(source: str) -> list[tuple[int, str]]:
    """(line, which list) for each literal collection in `source` that spells one of LISTS whole."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            words = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            found += [(node.lineno, name) for name, names in LISTS.items() if names <= words]
    return found


def test_the_planners_choices_are_listed_once() -> None:
    wrong = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: lists the {name} again (see planning/settings.py)"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != HOME
        for line, name in relisted(path.read_text())
    ]
    assert not wrong, "\n".join(wrong)


def test_the_check_finds_a_list_spelled_again() -> None:
    assert relisted('CHOICES = ["proportional", "fewest"]\nx = ("on", "off")\n') == [(1, "strategies")]
