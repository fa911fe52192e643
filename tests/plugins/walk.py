"""A newcomer's walk of a command (issue 19): the stages its calls pass through, in the order they are
reached, traced in-process with `sys.setprofile` while the command runs.

Only orchestrator's own functions count (not module bodies, class bodies or generated code; a coroutine
or generator once, when it starts, not at each resumption), and only on the command's thread (a worker
process and the tunnels' thread are their own walks). A call's caller is the nearest orchestrator frame
below it, whatever library code lies between (asyncio's loop, argparse).
A call into a stage from a stage below it in the layer order (pyproject's import contract) is a callback:
the executor running an operation's step, a progress bar. It reaches no stage: the stage was reached when
the callback was handed down.

`front_end`: what the command's own code (cli frames that are not a callback) calls in other stages, in
order; `reached`: every stage in the order it is first reached; `callbacks`: the calls up the layers. Trace
a command once untraced first, so imports and first-use caches are not part of its walk.
"""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from inspect import CO_ASYNC_GENERATOR, CO_COROUTINE, CO_GENERATOR, CO_NEWLOCALS
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

PACKAGE = Path(__file__).resolve().parents[2] / "orchestrator"
LAYERS: list[str] = [
    name.removeprefix("orchestrator.")
    for name in tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"
    ][0]["layers"]
]


_STAGES: dict[CodeType, str | None] = {}  # a code object's stage, looked up once (the trace is hot)


def stage_of(frame: FrameType) -> str | None:
    """The stage (orchestrator's subpackage) of a frame's code; None outside orchestrator's stages."""
    code = frame.f_code
    if code not in _STAGES:
        path = Path(code.co_filename)
        parts = path.relative_to(PACKAGE).parts if path.is_relative_to(PACKAGE) else ()
        _STAGES[code] = parts[0] if len(parts) > 1 and parts[0] in LAYERS else None
    return _STAGES[code]


_MODULES: dict[CodeType, str] = {}


def module_of(frame: FrameType) -> str:
    """The dotted module below orchestrator of a frame in one of its stages."""
    code = frame.f_code
    if code not in _MODULES:
        _MODULES[code] = ".".join(Path(code.co_filename).relative_to(PACKAGE).with_suffix("").parts)
    return _MODULES[code]


def below(callee: str, caller: str) -> bool:
    """Whether `callee`'s stage lies below `caller`'s (a call down the layers, not a callback)."""
    return LAYERS.index(callee) > LAYERS.index(caller)


@dataclass
class Walk:
    """The calls between stages, in order: (caller stage, callee stage, callee module.function), each
    marked as made by the front end or not."""

    calls: list[tuple[str, str, str, bool]] = field(default_factory=list)
    modules: set[str] = field(default_factory=set)
    # every call from one module to another, in order, stages alike (within a stage too): (caller module,
    # callee module, callee function); a request's path through serve/ is read from it
    module_calls: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def reached(self) -> list[str]:
        """The stages in the order they are first reached (the command's own stage first)."""
        order = ["cli"]
        for caller, callee, _, _ in self.calls:
            if callee not in order and below(callee, caller):
                order.append(callee)
        return order

    @property
    def front_end(self) -> list[str]:
        """The stages the front end's own code calls, in order, repeats next to each other merged."""
        out: list[str] = []
        for _, callee, _, own in self.calls:
            if own and (not out or out[-1] != callee):
                out.append(callee)
        return out

    @property
    def callbacks(self) -> list[str]:
        """The calls up the layers, each once: "caller stage -> callee function"."""
        return list(dict.fromkeys(f"{a} -> {name}" for a, b, name, _ in self.calls if not below(b, a)))

    def first_calls(self, stage: str) -> list[str]:
        """The functions the front end calls in `stage` (first calls first), to name a wrong turn."""
        return list(dict.fromkeys(name for _, callee, name, own in self.calls if own and callee == stage))


def trace(command: Callable[[], Any], walk: Walk | None = None) -> tuple[Walk, Any]:
    """Run `command` traced; its walk (`walk`, filled as it runs, when given) and what it returned."""
    walk = walk if walk is not None else Walk()
    # A coroutine or generator reports a "call" each time it is resumed: only its start is a call (its
    # frames are kept for the trace's length, so that no id is reused).
    started: dict[int, FrameType] = {}

    def profile(frame: FrameType, event: str, _: Any) -> None:
        if event != "call" or not frame.f_code.co_flags & CO_NEWLOCALS:
            return
        callee = stage_of(frame)
        if callee is None:
            return
        if frame.f_code.co_flags & (CO_COROUTINE | CO_GENERATOR | CO_ASYNC_GENERATOR):
            if id(frame) in started:
                return
            started[id(frame)] = frame
        walk.modules.add(module_of(frame))
        caller_frame = frame.f_back
        while caller_frame is not None and stage_of(caller_frame) is None:
            caller_frame = caller_frame.f_back
        if caller_frame is None:
            return
        caller = stage_of(caller_frame)
        assert caller is not None
        caller_module, callee_module = module_of(caller_frame), module_of(frame)
        if caller_module != callee_module:
            walk.module_calls.append((caller_module, callee_module, frame.f_code.co_name))
        if caller == callee:
            return
        # the front end's own code: a cli frame with no other stage under it (not a callback)
        own = caller == "cli"
        outer = caller_frame.f_back
        while own and outer is not None:
            own = stage_of(outer) in (None, "cli")
            outer = outer.f_back
        walk.calls.append((caller, callee, f"{module_of(frame)}.{frame.f_code.co_name}", own))

    before = sys.getprofile()
    sys.setprofile(profile)
    try:
        result = command()
    finally:
        sys.setprofile(before)
    return walk, result
