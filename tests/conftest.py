"""Test configuration: every module in tests/plugins/ is a pytest plugin (fixtures and shared rigs by
concern). The tests mirror the stages: tests/<stage>/ for each package of orchestrator/, tests/project/
for checks of the whole project; tiers are markers (`lab`, `llama`), not folders."""

from __future__ import annotations

import pkgutil
from pathlib import Path

import pytest

# Plugins import each other; rewrite their asserts whichever is imported first.
pytest.register_assert_rewrite("tests.plugins")

pytest_plugins = [
    f"tests.plugins.{module.name}"
    for module in pkgutil.iter_modules([str(Path(__file__).parent / "plugins")])
    if not module.name.startswith("_")
]
