"""A CI run does not pass on skips: with `CI` set (`.ci/run` sets it), a whole-suite run that skipped any
test fails, naming each one and its reason. CI runs as root on a machine `make setup` prepared, so a
skip there is a tier that did not run (a lab without privileges, a missing tool), not a choice.

An xfail is not a skip: it is a known failure written down with its reason, listed at the end; one that
passes fails the run (`xfail_strict`). Under pytest-xdist the controller sees every worker's reports and
decides; the workers do nothing here.
"""

from __future__ import annotations

import os

import pytest

from tests.plugins.timing import whole_suite

_skipped: list[tuple[str, str]] = []
_xfailed: list[tuple[str, str]] = []


def ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _applies(config: pytest.Config) -> bool:
    return ci() and whole_suite(config) and not hasattr(config, "workerinput")


def _reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: why")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(getattr(report, "wasxfail", "") or longrepr)


def pytest_sessionstart(session: pytest.Session) -> None:
    _skipped.clear()
    _xfailed.clear()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.skipped:
        return
    if hasattr(report, "wasxfail"):
        _xfailed.append((report.nodeid, report.wasxfail or "no reason given"))
    else:
        _skipped.append((report.nodeid, _reason(report)))


@pytest.hookimpl(tryfirst=True)  # before timing.py records the run's exit status
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped and _applies(session.config) and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if not _applies(config):
        return
    if _skipped:
        terminalreporter.section("CI: skipped tests fail the run", red=True, bold=True)
        for nodeid, reason in _skipped:
            terminalreporter.line(f"{nodeid}: {reason}")
    if _xfailed:
        terminalreporter.section("CI: expected failures (xfail), allowed")
        for nodeid, reason in _xfailed:
            terminalreporter.line(f"{nodeid}: {reason}")
