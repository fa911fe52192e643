"""Long loops (a race tried 20 times, a soak) run a couple of rounds in the suite and their full count when
soaking: `pytest -m soak` (only those tests) or `RPCFLEET_SOAK=1` (any selection). Run them so before
closing the issue a loop guards.

A looping test asks for `rounds` and carries `@pytest.mark.soak` (`soak(rounds=N)` for another full count,
`soak(quick=N)` where its rounds differ and each kind must run in the suite too);
tests/plugins/tiers.py fails collection for a test that asks without the mark.
"""

from __future__ import annotations

import os

import pytest

QUICK = 2  # rounds in the suite: the path runs, the race is tried
FULL = 20  # rounds when soaking


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "soak: a loop run 2 rounds, or its full count under `-m soak` or RPCFLEET_SOAK=1"
    )


def soaking(config: pytest.Config) -> bool:
    if os.environ.get("RPCFLEET_SOAK", "").strip() not in ("", "0"):
        return True
    expr = " ".join(str(config.getoption("markexpr") or "").split())
    return "soak" in expr and "not soak" not in expr


def rounds_for(config: pytest.Config, marker: pytest.Mark | None) -> int:
    kwargs = marker.kwargs if marker is not None else {}
    full = int(kwargs.get("rounds", FULL))
    return full if soaking(config) else min(int(kwargs.get("quick", QUICK)), full)


@pytest.fixture
def rounds(request: pytest.FixtureRequest) -> int:
    """How many rounds this looping test runs: QUICK, or its full count when soaking."""
    return rounds_for(request.config, request.node.get_closest_marker("soak"))
