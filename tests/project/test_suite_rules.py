"""The suite's rules on marks and skips (issue 43's H7 and its CI rule), on a real pytest over a small tree
of test modules: a test that uses a lab or a real server without its mark fails, named, in one process and
under pytest-xdist (tests/plugins/tiers.py); with `CI` set, a whole-suite run that skipped a test fails,
naming it and its reason, while a run without `CI`, or of a selection, passes (tests/plugins/ci_skips.py;
tests/project/test_suite_schedule.py covers the same rule decided on pytest-xdist's controller)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = "tests"  # the tree's test folder (its modules' paths are made here, not cited)
TIERS_MODULE = f"{TESTS}/test_tiers.py"
SKIPS_MODULE = f"{TESTS}/test_skips.py"

# The plugins' roots by name (tests/plugins/tiers.py reads fixture names, not where they come from).
CONFTEST = """
import pytest


@pytest.fixture
def lab():
    return "a lab"


@pytest.fixture
def rpc_server_binary():
    return "an rpc-server"


@pytest.fixture
def healthy_lab(lab):  # built on a root, as the plugins' fixtures are
    return lab
"""

TIERS = """
import pytest


def own_lab():
    return "a lab of the module's own"


@pytest.mark.lab
def test_marked(healthy_lab):
    assert healthy_lab


@pytest.mark.llama
def test_marked_server(rpc_server_binary):
    assert rpc_server_binary


def test_plain():
    pass


def test_lab_unmarked(healthy_lab):
    assert healthy_lab


def test_server_unmarked(rpc_server_binary):
    assert rpc_server_binary


def test_own_lab_unmarked():
    assert own_lab()
"""

SKIPS = """
import pytest


def test_ok():
    pass


def test_skipped():
    pytest.skip("no root here")


@pytest.mark.xfail(reason="a known failure")
def test_known():
    assert False
"""

UNMARKED = {
    f"{TIERS_MODULE}::test_lab_unmarked": "needs @pytest.mark.lab (fixture lab)",
    f"{TIERS_MODULE}::test_server_unmarked": "needs @pytest.mark.llama (fixture rpc_server_binary)",
    f"{TIERS_MODULE}::test_own_lab_unmarked": "needs @pytest.mark.lab (it calls own_lab)",
}


def _tree(root: Path, modules: dict[str, str]) -> None:
    (root / "pytest.ini").write_text(
        f"[pytest]\ntestpaths = {TESTS}\nmarkers =\n    lab: a lab\n    llama: a real server\n"
    )
    (root / TESTS).mkdir()
    (root / TESTS / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    for name, text in modules.items():
        (root / TESTS / name).write_text(textwrap.dedent(text))


def _pytest(root: Path, plugin: str, *args: str, ci: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RPCFLEET_HOME": str(root / "home"), "CI": ci}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", plugin, *args],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_test_without_the_marks_of_what_it_uses_fails_collection_named(tmp_path: Path) -> None:
    """In one process: a usage error listing each unmarked test with why it needs the mark, also under
    `make unit`'s -m (the check runs before -m deselects); the marked and plain tests are not named."""
    _tree(tmp_path, {"test_tiers.py": TIERS})
    for args in ([], ["-m", "not lab and not llama"]):
        done = _pytest(tmp_path, "tests.plugins.tiers", *args)
        assert done.returncode == 4, done.stdout + done.stderr  # pytest's usage error
        said = done.stdout + done.stderr
        assert "tests without the marks of what they use" in said, said
        for nodeid, why in UNMARKED.items():
            assert f"{nodeid}: {why}" in said, said
        for fine in ("test_marked", "test_marked_server", "test_plain"):
            assert f"::{fine}:" not in said, said
        assert "Traceback" not in said, said


def test_under_xdist_each_unmarked_test_fails_at_its_setup_named(tmp_path: Path) -> None:
    """A worker's collection error would be an internal error that hides the message: there each unmarked
    test fails at its setup with it, and the others run."""
    _tree(tmp_path, {"test_tiers.py": TIERS})
    done = _pytest(tmp_path, "tests.plugins.tiers", "-n", "2", "-rE")
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert "3 passed, 3 errors" in said, said
    for nodeid, why in UNMARKED.items():
        assert f"{nodeid}: {why}" in said, said


def test_with_ci_set_a_whole_run_that_skipped_a_test_fails_naming_it(tmp_path: Path) -> None:
    """One process, `CI=1`: the skip fails the run, named with its reason; the xfail is listed and
    allowed. Without `CI`, or for a selection (not the whole suite), the same run passes."""
    _tree(tmp_path, {"test_skips.py": SKIPS})
    done = _pytest(tmp_path, "tests.plugins.ci_skips", ci="1")
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert "1 passed, 1 skipped, 1 xfailed" in said, said
    assert "CI: skipped tests fail the run" in said, said
    assert f"{SKIPS_MODULE}::test_skipped: no root here" in said, said
    assert "CI: expected failures (xfail), allowed" in said, said
    assert f"{SKIPS_MODULE}::test_known: a known failure" in said, said
    done = _pytest(tmp_path, "tests.plugins.ci_skips")
    assert done.returncode == 0 and "CI:" not in done.stdout, done.stdout + done.stderr
    done = _pytest(tmp_path, "tests.plugins.ci_skips", SKIPS_MODULE, ci="1")
    assert done.returncode == 0 and "CI:" not in done.stdout, done.stdout + done.stderr
