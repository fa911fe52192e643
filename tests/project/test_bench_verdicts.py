"""The targets issue 45 gave the benchmarks that had none, and the asked ones, as their scripts compute them
from the figures: fit, exporter, security, affinity, speculative and transport (bench/*.py)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


Importer = Callable[[str], ModuleType]


@pytest.fixture
def bench() -> Iterator[Importer]:
    """Import bench scripts as their folder does (they import `_common` beside them)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(ROOT / "bench"))


def row(ours: int, theirs: int, limit: int, mine: list[int], their: list[int]) -> dict[str, object]:
    return {"ours": ours, "theirs": theirs, "limit": limit, "ours_alloc": mine, "theirs_alloc": their}


def test_fit_rpcfleet_within_the_limit_and_at_least_a_sound_llama_fit(bench: Importer) -> None:
    fit = bench("fit")
    fits = row(4096, 3584, 10, [9], [9])
    assert fit.fit_target([fits])
    # llama-fit-params' answer over the limit: nothing sound to be at least (its larger context counts not)
    assert fit.fit_target([fits, row(3072, 4096, 10, [10], [12])])
    # a sound llama-fit-params answer with the larger context: not met
    assert not fit.fit_target([fits, row(3072, 4096, 10, [10], [8])])
    # rpcfleet's own answer over the limit, or not loaded at all: not met
    assert not fit.fit_target([row(4096, 0, 10, [11], [])])
    assert not fit.fit_target([row(4096, 0, 10, [], [])])


def test_exporter_targets(bench: Importer) -> None:
    exporter = bench("exporter")

    def met(**changes: object) -> dict[str, bool]:
        figures: dict[str, object] = {
            "cost": 3.0,
            "held": [4.0, 4.0, 3.0],
            "largest": 32,
            "round_largest": 3.35,
            "round_linear": True,
            "shape_said": "its shape linear",
            "scrape_medians": [0.0013, 0.0175, 0.0032],
        }
        figures.update(changes)
        return {what: ok for what, (ok, _) in exporter.exporter_targets(**figures).items()}

    assert all(met().values())
    assert sum(met(cost=5.1).values()) == 3  # more than 5 % of serve's tokens/s
    assert sum(met(cost=-2.0).values()) == 4  # faster with it: no cost
    assert sum(met(held=[4.0, 0.0]).values()) == 3  # a run that held no round measured nothing
    assert sum(met(round_linear=False).values()) == 3  # an irregular or worse-than-linear round curve
    assert sum(met(round_largest=15.0).values()) == 3  # a round as long as the interval
    assert sum(met(scrape_medians=[0.001, 0.051]).values()) == 3


def test_security_needs_ok_and_a_reason_for_every_open_directive(bench: Importer) -> None:
    security = bench("security")
    kept = list(security.KEPT)[:2]
    assert security.verdict((1.7, "OK", kept))[0]
    assert security.verdict((0.4, "SAFE", []))[0]
    met, why = security.verdict((1.7, "OK", [*kept, "ProtectHome="]))
    assert not met and "1 directive(s) open without a reason" in why
    assert not security.verdict((5.2, "MEDIUM", kept))[0]


def test_affinity_better_where_it_is_for_and_worse_in_nothing(bench: Importer) -> None:
    affinity = bench("affinity")
    names = {"p50": "TTFT p50", "p95": "TTFT p95", "tps": "tokens/s", "processed": "prompt tokens"}
    better, within, worse = "affine better", "within the spread", "affine worse"
    assert affinity.routing_target(
        {"processed": better, "p50": better, "p95": within, "tps": better}, names
    ) == (
        True,
        [],
    )
    # the previous run: cheaper prompts, but TTFT p50 within the spread and its tail worse
    assert affinity.routing_target(
        {"processed": better, "p50": within, "p95": worse, "tps": better}, names
    ) == (
        False,
        ["TTFT p95"],
    )
    assert not affinity.routing_target({"processed": within, "p50": better}, names)[0]
    # the per-figure verdicts the target is made of
    assert affinity.verdict([1.0, 1.1], [1.2, 1.3], False) == better  # lower is better: every run beats
    assert affinity.verdict([1.0, 1.25], [1.2, 1.3], False) == within
    assert affinity.verdict([25.0, 24.8], [22.8, 22.1], True) == better
    assert affinity.verdict([1.0], [2.0], False).startswith("no verdict")


def test_speculative_self_draft_acceptance_and_unchanged_text(bench: Importer) -> None:
    speculative = bench("speculative")
    assert speculative.draft_target(726, 798, 2, 2) == (True, pytest.approx(0.910, abs=0.001))
    assert not speculative.draft_target(726, 798, 1, 2)[0]  # the draft changed one pair's greedy text
    assert not speculative.draft_target(700, 798, 2, 2)[0]  # 0.877: a self-draft should agree more
    assert speculative.draft_target(0, 0, 2, 2) == (False, 0.0)  # nothing drafted: nothing shown


def test_transport_decode_within_5_and_load_within_15_percent(bench: Importer) -> None:
    transport = bench("transport")
    assert transport.within_targets(1.14, 0.96)
    assert transport.within_targets(0.98, 1.02)
    assert not transport.within_targets(1.16, 1.0)  # load 16 % longer
    assert not transport.within_targets(1.0, 0.94)  # decode 6 % slower: 10 % would have passed it
