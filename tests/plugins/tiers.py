"""The tier marks follow from what a test uses: `make unit` (`-m "not lab and not llama"`) must start no lab
and no real server, so a test that needs one and lacks its mark fails collection, named. (So does a loop
that asks for `rounds` without `soak`: tests/plugins/soak.py.)

What needs a tier:
- a fixture in `FIXTURES` anywhere in the test's fixture closure (the plugins' roots; the fixtures built
  on them, `healthy_lab`, `deployed`, `nodes`, `local_serve`..., depend on one);
- a test function or fixture whose code (its nested functions included) names one of `CALLS`: a module's own
  lab fixture (`own_lab`, `lab_up`) or a server started without the plugins' fixtures.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# fixture name -> the mark a test using it needs
FIXTURES: dict[str, str] = {
    "lab": "lab",  # tests/plugins/lab.py; healthy_lab, lab_hosts, fresh_nodes, deployed build on it
    "rpc_server_binary": "llama",  # tests/plugins/servers.py; start_rpc_server, debug_rpc_servers, nodes
    "old_rpc_server_binary": "llama",  # the protocol-2.0.0 server (old_rpc_server)
    "rounds": "soak",  # tests/plugins/soak.py: a loop that runs its full count when soaking
}

# a global name in a test's or fixture's code -> the mark the test needs
CALLS: dict[str, str] = {
    "require_lab_privileges": "lab",
    "own_lab": "lab",
    "launch_rpc_server": "llama",
    "start_debug_server": "llama",
}


def _code_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions, lambdas, comprehensions
            yield from _code_names(const)


# fixtures whose code names a call above only on one of their paths, and checks at that call itself
SAYS_ITSELF = {"make_lab"}  # a local lab needs no root


def _called(function: Callable[..., Any] | None) -> dict[str, str]:
    """mark -> the name in `function`'s code that needs it."""
    code = getattr(getattr(function, "__wrapped__", function), "__code__", None)
    if code is None:
        return {}
    return {CALLS[name]: name for name in _code_names(code) if name in CALLS}


def needed_marks(item: pytest.Item) -> dict[str, str]:
    """mark -> why (the first fixture or call that needs it)."""
    needs: dict[str, str] = {}
    for mark, name in _called(getattr(item, "function", None)).items():
        needs.setdefault(mark, f"it calls {name}")
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        if name in FIXTURES:
            needs.setdefault(FIXTURES[name], f"fixture {name}")
        if name in SAYS_ITSELF:
            continue
        for fixturedef in info.name2fixturedefs.get(name, ()) if info is not None else ():
            for mark, called in _called(fixturedef.func).items():
                needs.setdefault(mark, f"fixture {name} calls {called}")
    return needs


_MISSING = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: `make unit` checks every test
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = []
    for item in items:
        have = {mark.name for mark in item.iter_markers()}
        lacks = [
            f"@pytest.mark.{m} ({why})" for m, why in sorted(needed_marks(item).items()) if m not in have
        ]
        if lacks:
            item.stash[_MISSING] = f"{item.nodeid}: needs " + ", ".join(lacks)
            missing.append(item.stash[_MISSING])
    if missing and not hasattr(config, "workerinput"):
        raise pytest.UsageError(
            "tests without the marks of what they use (`make unit` would run them):\n  "
            + "\n  ".join(missing)
        )


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under pytest-xdist a worker's collection error is an internal error that hides the message: there
    each such test fails, named, instead."""
    if _MISSING in item.stash:
        pytest.fail(item.stash[_MISSING], pytrace=False)
