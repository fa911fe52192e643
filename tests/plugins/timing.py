"""Where the suite's time goes.

- Every run ends with its slowest modules (setup, call and teardown of their tests, summed; under
  pytest-xdist also the span from a module's first report to its last, as the controller saw them).
- A whole-suite run (`make test`, `.ci/run`: no file, `-k` or `-m` selection) appends its totals to
  `$RPCFLEET_HOME/timings/suite.jsonl` (bench/firsthour.py prints the suite's time from it) and its
  per-module times to `$RPCFLEET_HOME/timings/modules.jsonl`.

Under pytest-xdist the workers record nothing: their reports reach the controller, which adds them up.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.core.paths import rpcfleet_home

SHOWN = 15  # the slowest modules printed at the end of a run


@dataclass
class ModuleTime:
    seconds: float = 0.0  # durations of its tests' phases, summed
    tests: int = 0
    first: float = 0.0  # monotonic time of its first and last report here
    last: float = 0.0

    @property
    def span(self) -> float:
        return self.last - self.first


_started: dict[str, float] = {}
_modules: dict[str, ModuleTime] = {}


def whole_suite(config: pytest.Config) -> bool:
    selected = (
        config.getoption("keyword")
        or config.getoption("markexpr")
        or config.getoption("lf", default=False)
        or config.getoption("collectonly", default=False)  # runs nothing: no time to record
    )
    return not selected and list(config.args) in ([], ["tests"], [str(Path(config.rootpath) / "tests")])


def _controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")


def _workers(config: pytest.Config) -> int:
    return int(getattr(config.option, "numprocesses", 0) or 0)


def pytest_sessionstart(session: pytest.Session) -> None:
    _started["monotonic"] = time.monotonic()
    _started["load1"] = os.getloadavg()[0]
    _modules.clear()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    now = time.monotonic()
    module = _modules.setdefault(report.nodeid.split("::")[0], ModuleTime(first=now))
    module.seconds += report.duration
    module.last = now
    if report.when == "call" or (report.when == "setup" and not report.passed):
        module.tests += 1


def slowest(count: int = SHOWN) -> list[tuple[str, ModuleTime]]:
    return sorted(_modules.items(), key=lambda kv: kv[1].seconds, reverse=True)[:count]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if not _modules or not _controller(config):
        return
    spans = _workers(config) > 0
    terminalreporter.section(f"slowest modules (of {len(_modules)})")
    for path, module in slowest():
        span = f"  span {module.span:7.1f} s" if spans else ""
        terminalreporter.line(f"{module.seconds:8.1f} s{span}  {module.tests:4d} tests  {path}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if "monotonic" not in _started or not whole_suite(config) or not _controller(config):
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    stats = getattr(reporter, "stats", {})
    count = {
        key: len([r for r in reports if getattr(r, "when", "call") == "call"])
        for key, reports in stats.items()
    }
    root = str(config.rootpath)
    sha = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    record = {
        "date": datetime.date.today().isoformat(),
        "seconds": round(time.monotonic() - _started["monotonic"], 1),
        "passed": count.get("passed", 0),
        "failed": count.get("failed", 0) + len(stats.get("error", [])),
        "skipped": len(stats.get("skipped", [])),
        "exitstatus": int(session.exitstatus),
        "commit": sha.stdout.strip() or "unknown",
        "machine": f"{os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "load1": round(_started["load1"], 2),
        "workers": _workers(config),
    }
    modules = {
        path: {"seconds": round(m.seconds, 2), "span": round(m.span, 2), "tests": m.tests}
        for path, m in slowest(len(_modules))
    }
    folder = rpcfleet_home() / "timings"
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "suite.jsonl").open("a") as sink:
        sink.write(json.dumps(record) + "\n")
    with (folder / "modules.jsonl").open("a") as sink:
        sink.write(
            json.dumps({"date": record["date"], "commit": record["commit"], "modules": modules}) + "\n"
        )
