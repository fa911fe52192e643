"""The `slow` tier: a test that pays a large download on a fresh machine (the ~600 MB CUDA toolkit from
PyPI) is left out of every run (deselected, not skipped: a CI run does not fail on it) unless asked for,
with `-m slow` (or any `-m` that names it) or RPCFLEET_SLOW=1. A slow test names, in its docstring, the
fast test that still covers its code path.
"""

from __future__ import annotations

import os

import pytest

MARK = "slow"
ENV = "RPCFLEET_SLOW"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARK}: a large download (the CUDA toolkit); runs under `-m {MARK}` or {ENV}=1"
    )


def wanted(config: pytest.Config) -> bool:
    asked = os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no")
    return asked or MARK in (config.getoption("markexpr", "") or "")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if wanted(config):
        return
    slow = [item for item in items if item.get_closest_marker(MARK) is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker(MARK) is None]
