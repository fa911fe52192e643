"""Test configuration: every module in tests/plugins/ is a pytest plugin (fixtures by concern)."""

from __future__ import annotations

import pkgutil
from pathlib import Path

pytest_plugins = [
    f"tests.plugins.{module.name}"
    for module in pkgutil.iter_modules([str(Path(__file__).parent / "plugins")])
    if not module.name.startswith("_")
]
