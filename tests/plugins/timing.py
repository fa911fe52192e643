"""Records each whole-suite run (`make test`, `.ci/run`: no file, `-k` or `-m` selection) in
`$RPCFLEET_HOME/timings/suite.jsonl`, so that bench/firsthour.py prints the suite's time as measured."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import pytest

from orchestrator.core.paths import rpcfleet_home

_started: dict[str, float] = {}


def _whole_suite(config: pytest.Config) -> bool:
    selected = (
        config.getoption("keyword") or config.getoption("markexpr") or config.getoption("lf", default=False)
    )
    return not selected and list(config.args) in ([], ["tests"], [str(Path(config.rootpath) / "tests")])


def pytest_sessionstart(session: pytest.Session) -> None:
    _started["monotonic"] = time.monotonic()
    _started["load1"] = os.getloadavg()[0]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if "monotonic" not in _started or not _whole_suite(session.config):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = getattr(reporter, "stats", {})
    count = {
        key: len([r for r in reports if getattr(r, "when", "call") == "call"])
        for key, reports in stats.items()
    }
    root = str(session.config.rootpath)
    sha = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    record = {
        "date": datetime.date.today().isoformat(),
        "seconds": round(time.monotonic() - _started["monotonic"], 1),
        "passed": count.get("passed", 0),
        "failed": count.get("failed", 0) + len(stats.get("error", [])),
        "skipped": len(stats.get("skipped", [])),
        "exitstatus": int(exitstatus),
        "commit": sha.stdout.strip() or "unknown",
        "machine": f"{os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "load1": round(_started["load1"], 2),
    }
    path = rpcfleet_home() / "timings" / "suite.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as sink:
        sink.write(json.dumps(record) + "\n")
