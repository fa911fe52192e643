"""The suite's own machinery under pytest-xdist (tests/plugins/schedule.py, timing.py, ci_skips.py): a real
pytest with two workers runs a small tree of test modules, each test writing down its worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.plugins.schedule import REAPERS, TOGETHER, recorded_seconds, scope_of, slowest_first

ROOT = Path(__file__).resolve().parents[2]
TESTS = "tests"  # the tree's test folder (its modules' paths are made here, not cited)

# module under TESTS -> (tests, seconds in the record); xdist's own order (most tests first) starts `fast`
TREE = {
    "a/test_fast.py": (3, 1.0),
    "a/test_mid.py": (1, 50.0),
    "a/test_slow.py": (1, 100.0),
    "lab/test_lab.py": (1, 2.0),
    "lab/test_lab_cpus.py": (1, 2.0),
}
SEEN = """
import os
from pathlib import Path

def seen(name):
    with Path(os.environ["SEEN_LOG"]).open("a") as log:
        log.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {__file__} {name}\\n")
"""


def _module(key: str) -> str:
    return f"{TESTS}/{key}"


def _tree(root: Path) -> Path:
    """The tree, and an RPCFLEET_HOME whose record (behind an empty and a torn line) has its times."""
    (root / "pytest.ini").write_text(f"[pytest]\ntestpaths = {TESTS}\n")  # no argument: a whole run
    for key, (count, _) in TREE.items():
        path = root / _module(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tests = "".join(f"\n\ndef test_{i}():\n    seen('test_{i}')\n" for i in range(count))
        path.write_text(textwrap.dedent(SEEN) + tests)
    home = root / "home"
    (home / "timings").mkdir(parents=True)
    modules = {_module(key): {"seconds": seconds} for key, (_, seconds) in TREE.items()}
    lines = [
        json.dumps({"date": "2026-12-07", "commit": "x", "modules": modules}),
        json.dumps({"date": "2026-12-07", "commit": "y", "modules": {}}),
        "{torn",
    ]
    (home / "timings" / "modules.jsonl").write_text("\n".join(lines) + "\n")
    return home


def _pytest(
    root: Path, home: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RPCFLEET_HOME": str(home),
        "SEEN_LOG": str(root / "seen"),
        "CI": "",
        **(env or {}),
    }
    plugins = ["-p", "tests.plugins.schedule", "-p", "tests.plugins.timing", "-p", "tests.plugins.ci_skips"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugins, *args],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _last(home: Path, name: str) -> dict[str, object]:
    record: dict[str, object] = json.loads((home / "timings" / name).read_text().splitlines()[-1])
    return record


def test_two_workers_start_with_the_slowest_modules_and_keep_the_reapers_together(tmp_path: Path) -> None:
    home = _tree(tmp_path)
    done = _pytest(tmp_path, home, "-n", "2", "--dist", "loadfile")
    assert done.returncode == 0, done.stdout + done.stderr
    runs: dict[str, list[str]] = {}
    for line in (tmp_path / "seen").read_text().splitlines():
        worker, path, _ = line.split()
        runs.setdefault(worker, []).append(str(Path(path).relative_to(tmp_path / TESTS)))
    assert sorted(runs) == ["gw0", "gw1"] and sum(map(len, runs.values())) == 7, runs
    assert {modules[0] for modules in runs.values()} == {"a/test_mid.py", "a/test_slow.py"}, runs
    reapers = {worker for worker, modules in runs.items() for m in modules if m.startswith("lab/")}
    assert len(reapers) == 1, runs
    # The controller recorded the whole run, from the workers' reports: the next run orders by it.
    suite = _last(home, "suite.jsonl")
    assert (suite["passed"], suite["workers"], suite["exitstatus"]) == (7, 2, 0), suite
    assert set(recorded_seconds(home / "timings" / "modules.jsonl")) == {_module(key) for key in TREE}
    assert _last(home, "modules.jsonl")["commit"] == suite["commit"]


def test_a_skip_in_a_worker_fails_a_ci_run(tmp_path: Path) -> None:
    """tests/plugins/ci_skips.py decides on the controller, from the workers' reports."""
    home = _tree(tmp_path)
    skip = tmp_path / _module("a/test_skip.py")
    skip.write_text("import pytest\n\n\ndef test_s():\n    pytest.skip('why')\n")
    done = _pytest(tmp_path, home, "-n", "2", "--dist", "loadfile", env={"CI": "1"})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "CI: skipped tests fail the run" in done.stdout, done.stdout
    assert f"{_module('a/test_skip.py')}::test_s: why" in done.stdout, done.stdout
    suite = _last(home, "suite.jsonl")
    assert (suite["passed"], suite["skipped"], suite["exitstatus"]) == (7, 1, 1), suite


def test_a_collect_only_run_records_no_time(tmp_path: Path) -> None:
    home = _tree(tmp_path)
    before = (home / "timings" / "modules.jsonl").read_text()
    done = _pytest(tmp_path, home, "--collect-only")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (home / "timings" / "modules.jsonl").read_text() == before
    assert not (home / "timings" / "suite.jsonl").exists()


def test_the_order_is_by_recorded_time_with_a_guess_by_tier_for_a_new_module() -> None:
    a, b_lab, c = (f"{TESTS}/x/{name}.py" for name in ("test_a", "test_b_lab", "test_c"))
    nodeids = [f"{a}::t1", f"{b_lab}::t1", f"{a}::t2", f"{c}::t1", f"{REAPERS[1]}::t1", f"{REAPERS[0]}::t1"]
    seconds = {c: 30.0, a: 3.0, REAPERS[0]: 2.0, REAPERS[1]: 2.0}
    # c (30 s), the new lab module (guessed 20 s), the reapers together (4 s), a (3 s)
    assert slowest_first(nodeids, seconds) == [
        f"{c}::t1",
        f"{b_lab}::t1",
        f"{REAPERS[1]}::t1",
        f"{REAPERS[0]}::t1",
        f"{a}::t1",
        f"{a}::t2",
    ]
    assert {scope_of(f"{module}::t") for module in REAPERS} == {TOGETHER}
    # No record yet: a lab module counts 20 s (test_lab.py is one), another 1 s.
    assert slowest_first(nodeids, {}) == [
        f"{REAPERS[1]}::t1",
        f"{REAPERS[0]}::t1",
        f"{b_lab}::t1",
        f"{a}::t1",
        f"{a}::t2",
        f"{c}::t1",
    ]
