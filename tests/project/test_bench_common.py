"""bench/_common.py's judgements (issue 45): a curve's shape from a fit of all its points, "p95" only over
enough samples, the bounded wait for a quiet machine with the load line it leaves in a block, and the
history of earlier runs a re-written block keeps."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def common() -> Iterator[ModuleType]:
    """A fresh bench/_common.py per test: its measurement state (the load at the start) is per process."""
    name = "bench_common_under_test"
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "_common.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclass resolves its annotations through it
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]


# --- shapes ---------------------------------------------------------------------------------------------


def test_a_power_law_fits_exactly(common: ModuleType) -> None:
    xs = [4, 16, 32]
    slope, r2 = common.loglog_fit(xs, [3 * x for x in xs])
    assert slope == pytest.approx(1.0) and r2 == pytest.approx(1.0)
    assert common.curve_shape(xs, [3 * x for x in xs])[2] == "linear"
    assert common.curve_shape(xs, [x**2 for x in xs])[2] == "worse than linear"
    assert common.curve_shape(xs, [1 / x for x in xs])[2] == "falls"


def test_every_point_counts_not_only_the_ends(common: ModuleType) -> None:
    # the exporter's scrape curve: its ends alone give a slope of 0.43, the fit of all three 0.64 with a
    # poor R^2, and it is no shape at all
    slope, r2, name = common.curve_shape([4, 16, 32], [1.3, 17.5, 3.2])
    assert slope == pytest.approx(0.640, abs=0.005)
    assert r2 == pytest.approx(0.263, abs=0.005)
    assert name == "irregular"
    assert common.shape_text([4, 16, 32], [1.3, 17.5, 3.2]) == "slope 0.64, R^2 0.26: irregular"
    # the first-and-last slope the old verdict used
    assert math.log(3.2 / 1.3) / math.log(32 / 4) == pytest.approx(0.433, abs=0.001)


def test_a_slope_of_0_31_is_sublinear_not_linear(common: ModuleType) -> None:
    xs = [2, 4, 8, 15]
    ys = [2.0 * x**0.31 for x in xs]
    slope, r2, name = common.curve_shape(xs, ys)
    assert slope == pytest.approx(0.31) and r2 == pytest.approx(1.0)
    assert name == "sublinear"
    assert common.shape(0.31) == "sublinear" and common.shape(0.79) == "sublinear"
    assert common.shape(0.8) == "linear" and common.shape(1.2) == "linear" and common.shape(1.21) != "linear"


def test_flat_needs_a_flat_slope_and_close_points(common: ModuleType) -> None:
    assert common.curve_shape([2, 4, 8, 16], [3.0, 3.2, 3.1, 3.3])[2] == "flat"
    # slope about 0, but the middle point is 10x the ends: not flat
    assert common.curve_shape([2, 4, 8], [1.0, 10.0, 1.0])[2] == "irregular"
    # a gentle but real growth: 1.7 -> 3.6 ms from 2 to 64 (plan scaling's formations) is no longer flat
    slope, _, name = common.curve_shape([2, 4, 8, 16, 32, 64], [1.7, 1.6, 1.7, 2.0, 2.5, 3.6])
    assert slope > common.FLAT and name != "flat"


def test_loglog_slope_fits_every_point(common: ModuleType) -> None:
    assert common.loglog_slope([1, 2, 4], [1.0, 4.0, 4.0]) == pytest.approx(1.0)  # ends alone: 1.0 too
    assert common.loglog_slope([1, 2, 4], [1.0, 1.0, 4.0]) == pytest.approx(1.0)
    assert common.loglog_slope([1, 2, 4], [1.0, 2.0, 1.0]) == pytest.approx(0.0)  # ends alone: 0, fit: 0
    assert common.loglog_slope([1, 2, 4, 8], [1.0, 8.0, 8.0, 8.0]) == pytest.approx(0.9)  # ends: 1.0


def test_a_fit_refuses_what_it_cannot_fit(common: ModuleType) -> None:
    with pytest.raises(ValueError, match="two points"):
        common.loglog_fit([1], [1.0])
    with pytest.raises(ValueError, match="two different x"):
        common.loglog_fit([2, 2], [1.0, 3.0])


# --- p95 or max -----------------------------------------------------------------------------------------


def test_under_20_samples_the_tail_is_called_max(common: ModuleType) -> None:
    fifteen = [float(i) for i in range(1, 16)]
    assert common.tail(fifteen) == ("max", 15.0)
    assert common.p95(fifteen) == 15.0  # the nearest-rank p95 of 15 is their largest: hence "max"
    nineteen = [float(i) for i in range(1, 20)]
    assert common.tail(nineteen) == ("max", 19.0)
    twenty = [float(i) for i in range(1, 21)]
    assert common.tail(twenty) == ("p95", 19.0)
    hundred = [float(i) for i in range(1, 101)]
    assert common.tail(hundred) == ("p95", 95.0)
    assert [common.tail_name(n) for n in (1, 19, 20, 500)] == ["max", "max", "p95", "p95"]


# --- a quiet machine ------------------------------------------------------------------------------------


class Clock:
    """A clock that moves only when slept on: the wait's bound and its polls without waiting for real."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_the_wait_ends_at_the_first_load_under_1(common: ModuleType) -> None:
    loads = iter([2.5, 1.4, 0.7, 0.2])
    clock = Clock()
    quiet = common.wait_quiet(120, read=lambda: next(loads), sleep=clock.sleep, clock=clock, poll=5)
    assert (quiet.start, quiet.waited, quiet.quiet) == (0.7, 10.0, True)
    assert clock.sleeps == [5, 5]


def test_the_wait_is_bounded_and_says_it_got_no_quiet_machine(common: ModuleType) -> None:
    clock = Clock()
    quiet = common.wait_quiet(12, read=lambda: 3.7, sleep=clock.sleep, clock=clock, poll=5)
    assert (quiet.start, quiet.waited, quiet.quiet) == (3.7, 12.0, False)
    assert clock.sleeps == [5, 5, 2]  # never past the bound
    line = common.load_words(quiet, 9.85)
    assert line.startswith("1-minute load average 3.70 at the start (**not quiet**: still 1 or more")
    assert "after waiting 12 s" in line and line.endswith("9.85 at the end.")


def test_a_quiet_start_says_how_long_it_waited(common: ModuleType) -> None:
    assert common.load_words(common.Quiet(0.42, 35.2, 120), 1.1) == (
        "1-minute load average 0.42 at the start (quiet: under 1 after 35 s of waiting), 1.10 at the end."
    )
    assert "under 1 without waiting" in common.load_words(common.Quiet(0.42, 0.0, 120), 0.5)


def test_no_wait_when_the_bound_is_0(common: ModuleType) -> None:
    clock = Clock()
    quiet = common.wait_quiet(0, read=lambda: 5.0, sleep=clock.sleep, clock=clock)
    assert not quiet.quiet and clock.sleeps == []


def test_the_first_load_average_starts_the_measurement(common: ModuleType) -> None:
    loads = iter([1.8, 0.6])
    clock = Clock()
    quiet = common.begin_measurement(60, read=lambda: next(loads), sleep=clock.sleep, clock=clock, poll=1)
    assert quiet.start == 0.6 and quiet.waited == 1.0
    assert common.load_average() == pytest.approx(common.one_minute_load(), abs=5)  # later calls: now


def test_quiet_wait_is_an_option_of_every_bench(common: ModuleType) -> None:
    parser = common.arg_parser("a bench")
    assert parser.parse_args(["--quiet-wait", "7"]).quiet_wait == 7.0
    assert common.QUIET_WAIT == 7.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--quiet-wait", "-1"])
    # a bench whose machine time is scarce (the GPU check) sets its own default
    assert common.arg_parser("gpu", quiet_wait=0).parse_args([]).quiet_wait == 0
    assert common.QUIET_WAIT == 0


# --- the block's load line and its earlier runs ----------------------------------------------------------


def test_a_written_block_gets_the_load_line(common: ModuleType, tmp_path: Path) -> None:
    common.begin_measurement(0, read=lambda: 0.5)
    doc = tmp_path / "BENCHMARKS.md"
    common.write_section(doc, "probe", "## probe\n\n2026-12-07, commit `abcdef1`: 1 ms\n", "bench/probe.py")
    block = doc.read_text()
    assert "1-minute load average 0.50 at the start (quiet: under 1 without waiting)" in block
    assert block.count(common.LOAD_NOTE) == 1
    # a body that carries its own load line does not get a second one
    common.write_section(doc, "plan", "## plan\n\n" + common.load_note() + "\n", "bench/plan.py")
    assert doc.read_text().count(common.LOAD_NOTE) == 2


def test_a_re_run_keeps_the_earlier_runs_stamps(common: ModuleType, tmp_path: Path) -> None:
    doc = tmp_path / "BENCHMARKS.md"

    def run(date: str, sha: str, load: str, figure: str) -> str:
        body = f"## probe\n\n{date}, 2 cores, commit `{sha}`; load average {load} at the start. {figure}\n"
        common.write_section(doc, "probe", body, "bench/probe.py")
        return doc.read_text()

    assert common.EARLIER not in run("2026-12-05", "1111111", "3.70", "9 ms")
    text = run("2026-12-06", "2222222", "0.84", "8 ms")
    assert "9 ms" not in text and "8 ms" in text
    assert common.EARLIER + "2026-12-05 at `1111111` (load 3.70)." in text
    text = run("2026-12-07", "3333333", "0.50", "7 ms")
    both = "2026-12-06 at `2222222` (load 0.84); 2026-12-05 at `1111111` (load 3.70)."
    assert common.EARLIER + both in text
    for day in range(8, 20):
        text = run(f"2026-12-{day:02d}", f"{day:07d}", "0.1", "1 ms")
    (line,) = [line for line in text.splitlines() if line.startswith(common.EARLIER)]
    assert line.count(" at `") == common.HISTORY and "2026-12-18 at `0000018`" in line


def test_a_block_without_a_stamp_leaves_no_history(common: ModuleType, tmp_path: Path) -> None:
    doc = tmp_path / "BENCHMARKS.md"
    common.write_section(doc, "probe", "## probe\n\nfirst 1 ms\n", "bench/probe.py")
    common.write_section(doc, "probe", "## probe\n\nsecond 2 ms\n", "bench/probe.py")
    assert common.EARLIER not in doc.read_text()


def test_the_intro_names_every_bench_that_needs_root() -> None:
    """BENCHMARKS.md's intro lists the scripts that bring up a lab (network namespaces: root)."""
    intro = (ROOT / "BENCHMARKS.md").read_text().split("\n## ", 1)[0]
    sentence = " ".join(intro.split()).split(" need root")[0].rsplit(". ", 1)[-1]
    named = set(re.findall(r"`(\w+)`", sentence))
    # the committed scripts (a new one still being written joins the list when it is committed)
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "bench"], capture_output=True, text=True, check=False
    ).stdout.split()
    scripts = [ROOT / f for f in listed if f.endswith(".py")] or list((ROOT / "bench").glob("*.py"))
    labs = {
        script.stem for script in scripts if re.search(r"\blab_up\(|\bprivileged\(\)", script.read_text())
    }
    assert labs, "no bench brings up a lab"
    assert not labs - named, f"BENCHMARKS.md's intro does not say these need root: {sorted(labs - named)}"
    assert not named - labs, (
        f"BENCHMARKS.md's intro says these need root, but they start no lab: {sorted(named - labs)}"
    )
