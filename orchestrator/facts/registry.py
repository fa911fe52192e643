"""Every fact type by name (the data-driven tests and `--fact` look them up here).

Derived from the classes: every concrete `Fact` defined in a module of `orchestrator.facts` is here
under its `name`, so a new fact cannot be left out (nor, then, its data cases: tests/facts/test_facts.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Mapping
from types import ModuleType
from typing import Any

from orchestrator.facts import gpus, server, system, systemd
from orchestrator.facts.base import Fact

FACT_MODULES = (system, gpus, server, systemd)  # imported for their classes


def _subclasses(cls: type) -> Iterator[type[Fact[Any]]]:
    sub: type[Fact[Any]]
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def fact_types(modules: Iterable[ModuleType] = FACT_MODULES) -> dict[str, type[Fact[Any]]]:
    """Every concrete fact class of `modules` by name; ValueError when two share a name."""
    names = {m.__name__ for m in modules}
    found: dict[str, type[Fact[Any]]] = {}
    for cls in _subclasses(Fact):
        if cls.__module__ not in names or inspect.isabstract(cls):
            continue  # a fact defined elsewhere (a test's) is not one of rpcfleet's
        if cls.name in found and found[cls.name] is not cls:
            raise ValueError(
                f"facts {found[cls.name].__name__} and {cls.__name__} share the name {cls.name!r}"
            )
        found[cls.name] = cls
    return dict(sorted(found.items()))


FACT_TYPES: Mapping[str, type[Fact[Any]]] = fact_types()
