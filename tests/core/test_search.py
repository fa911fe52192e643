"""`first_true`, the one binary search behind the largest context and the least memory to add."""

from __future__ import annotations

import math

import pytest

from orchestrator.core.search import first_true


def test_first_true_finds_every_threshold_in_log_calls() -> None:
    for lo in range(0, 4):
        for hi in range(lo + 1, 70):
            for threshold in range(lo + 1, hi + 1):
                calls: list[int] = []

                def pred(n: int, threshold: int = threshold, calls: list[int] = calls) -> bool:
                    calls.append(n)
                    return n >= threshold

                assert first_true(pred, lo, hi) == threshold
                assert all(lo < n < hi for n in calls)  # the ends are given, never asked
                assert len(calls) <= math.ceil(math.log2(hi - lo))


def test_a_pred_that_is_not_monotone_still_gives_a_boundary() -> None:
    holds = {3, 4, 9, 10, 11, 20}
    n = first_true(lambda k: k in holds, 0, 20)
    assert n in holds and n - 1 not in holds


def test_first_true_needs_an_interval() -> None:
    with pytest.raises(ValueError, match="lo < hi"):
        first_true(lambda n: True, 5, 5)
