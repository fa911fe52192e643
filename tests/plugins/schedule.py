"""Which module runs when under pytest-xdist (`make test`: 2 workers, `--dist loadfile`, a module's tests in
one worker, so its module-scoped lab or servers are made once).

- Slowest first. The controller hands out the modules longest first, by their times in the last
  whole-suite record ($RPCFLEET_HOME/timings/modules.jsonl, tests/plugins/timing.py), so that no long
  module starts last while the other worker has nothing left to do. xdist's own order is by test count,
  which would start a one-test lab module of two minutes (test_chaos_lab) last. A module the record lacks
  counts as its tier's typical time (`GUESS_S`).
- Together. `REAPERS` make stale labs on purpose and check that a reap removes them, and `lab up` reaps
  every stale lab of the machine: in two workers, one's reap would take the other's stale lab from under
  its test. They run in one worker, one after another.

The session lab's own reap of stale labs runs once, on the controller, before the workers start
(tests/plugins/lab.py).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from orchestrator.core.paths import rpcfleet_home

# Modules that make a stale lab and reap it, or run `lab up` (which reaps), as pytest names them.
REAPERS = (
    "tests/lab/test_lab.py",
    "tests/lab/test_lab_cpus.py",
    "tests/cli/test_default_inventory.py",
    "tests/project/test_readme.py",
)
TOGETHER = "modules that reap stale labs"

# A module with no recorded time: a lab module waits on sshd and servers for about 20 s, another takes
# about a second (the medians of the whole-suite record at 5432e27: 22.6 s and 1.3 s).
GUESS_S = {"lab": 20.0, "other": 1.0}


def scope_of(nodeid: str) -> str:
    """The unit a worker gets: the test's module, or TOGETHER for the reapers."""
    module = nodeid.split("::", 1)[0]
    return TOGETHER if module in REAPERS else module


def guess(module: str) -> float:
    return GUESS_S["lab" if module.endswith("_lab.py") else "other"]


def recorded_seconds(record: Path) -> dict[str, float]:
    """module -> seconds, from the last whole run in modules.jsonl (empty when there is none)."""
    try:
        lines = record.read_text().splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            modules: Mapping[str, Any] = json.loads(line)["modules"]
            seconds = {path: float(entry["seconds"]) for path, entry in modules.items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # a torn or foreign line
        if seconds:
            return seconds
    return {}


def slowest_first(nodeids: Sequence[str], seconds: Mapping[str, float]) -> list[str]:
    """`nodeids` grouped by `scope_of`, the longest scope first (ties: collection order); each scope's
    tests keep their order."""
    expected: dict[str, float] = {}
    for module in dict.fromkeys(nodeid.split("::", 1)[0] for nodeid in nodeids):
        scope = scope_of(module)
        expected[scope] = expected.get(scope, 0.0) + seconds.get(module, guess(module))
    rank = {scope: index for index, scope in enumerate(expected)}
    return sorted(nodeids, key=lambda nodeid: (-expected[scope_of(nodeid)], rank[scope_of(nodeid)]))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling  # type: ignore[import-untyped]  # no py.typed

    class SlowestFirst(LoadFileScheduling):  # type: ignore[misc]
        workqueue: OrderedDict[str, dict[str, bool]]  # scope -> its tests (and whether each ran)

        def __init__(self, config: pytest.Config, log: Any = None) -> None:
            super().__init__(config, log)
            self.seconds = recorded_seconds(rpcfleet_home() / "timings" / "modules.jsonl")
            self.ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            # The first unit handed out: the queue is complete. (The collection itself keeps its order:
            # the workers are told which tests to run by their index in it.)
            if not self.ordered:
                tests = [nodeid for unit in self.workqueue.values() for nodeid in unit]
                order = dict.fromkeys(scope_of(nodeid) for nodeid in slowest_first(tests, self.seconds))
                self.workqueue = OrderedDict((scope, self.workqueue[scope]) for scope in order)
                self.ordered = True
            super()._assign_work_unit(node)

    return SlowestFirst(config, log)
