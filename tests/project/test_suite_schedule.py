"""The suite's own machinery under pytest-xdist (tests/plugins/schedule.py, tests/plugins/timing.py): a real
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

# module -> (tests, seconds in the record); xdist's own order (most tests first) would start `fast`
TREE = {
    "suite/a/test_fast.py": (3, 1.0),
    "suite/a/test_mid.py": (1, 50.0),
    "suite/a/test_slow.py": (1, 100.0),
    "tests/lab/test_lab.py": (1, 2.0),
    "tests/lab/test_lab_cpus.py": (1, 2.0),
}
SEEN = """
import os
from pathlib import Path

def seen(name):
    with Path(os.environ["SEEN_LOG"]).open("a") as log:
        log.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {__file__} {name}\\n")
"""


def _tree(root: Path) -> Path:
    (root / "pytest.ini").write_text("[pytest]\n")
    for module, (count, _) in TREE.items():
        path = root / module
        path.parent.mkdir(parents=True, exist_ok=True)
        tests = "".join(f"\n\ndef test_{i}():\n    seen('test_{i}')\n" for i in range(count))
        path.write_text(textwrap.dedent(SEEN) + tests)
    home = root / "home"
    (home / "timings").mkdir(parents=True)
    record = {
        "date": "2026-12-07",
        "commit": "x",
        "modules": {m: {"seconds": s} for m, (_, s) in TREE.items()},
    }
    lines = [json.dumps(record), json.dumps({"date": "2026-12-07", "commit": "y", "modules": {}}), "{torn"]
    (home / "timings" / "modules.jsonl").write_text("\n".join(lines) + "\n")
    return home


def _pytest(root: Path, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RPCFLEET_HOME": str(home), "SEEN_LOG": str(root / "seen")}
    plugins = ["-p", "tests.plugins.schedule", "-p", "tests.plugins.timing"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugins, *args],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_two_workers_start_with_the_slowest_modules_and_keep_the_reapers_together(tmp_path: Path) -> None:
    home = _tree(tmp_path)
    done = _pytest(tmp_path, home, "-n", "2", "--dist", "loadfile")
    assert done.returncode == 0, done.stdout + done.stderr
    runs: dict[str, list[str]] = {}
    for line in (tmp_path / "seen").read_text().splitlines():
        worker, path, _ = line.split()
        module = str(Path(path).relative_to(tmp_path))
        runs.setdefault(worker, []).append(module)
    assert sorted(runs) == ["gw0", "gw1"] and sum(map(len, runs.values())) == 7, runs
    assert {modules[0] for modules in runs.values()} == {"suite/a/test_mid.py", "suite/a/test_slow.py"}, runs
    reapers = {worker for worker, modules in runs.items() for m in modules if m.startswith("tests/lab/")}
    assert len(reapers) == 1, runs
    # The controller wrote the whole run's times: the next run orders by them.
    assert set(recorded_seconds(home / "timings" / "modules.jsonl")) == set(TREE)


def test_a_collect_only_run_records_no_time(tmp_path: Path) -> None:
    home = _tree(tmp_path)
    before = (home / "timings" / "modules.jsonl").read_text()
    done = _pytest(tmp_path, home, "--collect-only")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (home / "timings" / "modules.jsonl").read_text() == before
    assert not (home / "timings" / "suite.jsonl").exists()


def test_the_order_is_by_recorded_time_with_a_guess_by_tier_for_a_new_module() -> None:
    nodeids = [
        "suite/x/test_a.py::test_1",
        "suite/x/test_b_lab.py::test_1",
        "suite/x/test_a.py::test_2",
        "suite/x/test_c.py::test_1",
        f"{REAPERS[1]}::test_1",
        f"{REAPERS[0]}::test_1",
    ]
    seconds = {"suite/x/test_c.py": 30.0, "suite/x/test_a.py": 3.0, REAPERS[0]: 2.0, REAPERS[1]: 2.0}
    # test_c (30 s), the new lab module (guessed 20 s), the reapers together (4 s), test_a (3 s)
    assert slowest_first(nodeids, seconds) == [
        "suite/x/test_c.py::test_1",
        "suite/x/test_b_lab.py::test_1",
        f"{REAPERS[1]}::test_1",
        f"{REAPERS[0]}::test_1",
        "suite/x/test_a.py::test_1",
        "suite/x/test_a.py::test_2",
    ]
    assert {scope_of(f"{module}::t") for module in REAPERS} == {TOGETHER}
    # No record yet: a lab module counts 20 s (test_lab.py is one), another 1 s.
    assert slowest_first(nodeids, {}) == [
        f"{REAPERS[1]}::test_1",
        f"{REAPERS[0]}::test_1",
        "suite/x/test_b_lab.py::test_1",
        "suite/x/test_a.py::test_1",
        "suite/x/test_a.py::test_2",
        "suite/x/test_c.py::test_1",
    ]
