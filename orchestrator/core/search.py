"""Binary search over whole numbers, for "the largest context that fits" and "the least memory to add"."""

from __future__ import annotations

from collections.abc import Callable


def first_true(pred: Callable[[int], bool], lo: int, hi: int) -> int:
    """The least `n` in `(lo, hi]` for which `pred(n)` holds, given that `pred(lo)` does not and
    `pred(hi)` does (neither is called for them); about log2(hi - lo) calls of `pred`.

    For a `pred` that is not monotone the result is still a boundary: `pred(n)` holds and `pred(n - 1)`
    does not (or `n - 1` is `lo`).
    """
    if hi <= lo:
        raise ValueError(f"first_true needs lo < hi, got {lo} and {hi}")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid
    return hi
