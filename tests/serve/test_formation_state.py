"""A formation's state has one owner (issue 42, item 1): `serve/formation.py: Formation` moves it, only by
its named moves, and only as `serve/states.py: MOVES` allows (any other move raises `IllegalMove`); no other
module writes it; and the modules of `serve/` import one another without a circle."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from orchestrator.observe.snapshot import FORMATION_STATES
from orchestrator.planning.strategy import make_plan
from orchestrator.serve.formation import Formation, FormationHooks
from orchestrator.serve.states import MOVES, SERVING, FormationState, IllegalMove, Running, ServeConfig, moved
from tests.plugins.llama import plan_devices
from tests.plugins.serve_rig import ENDPOINTS, FakeEngine, FakeFleet

ROOT = Path(__file__).resolve().parents[2]
S = FormationState
EDGES = [(was, to) for was in S for to in S]


def _no_engine(plan: Any, targets: Any) -> Any:
    raise AssertionError("these formations load nothing")


def test_the_table_has_every_state_and_shows_as_before() -> None:
    """Every state has its row; the values are the strings /health, /metrics and the exporter show."""
    assert set(MOVES) == set(S) and all(set(to) <= set(S) for to in MOVES.values())
    assert tuple(S) == FORMATION_STATES  # the exporter's list (observe may not import serve)
    assert {"ready", "degraded"} == SERVING and S.READY == "ready" and f"{S.DRAINING}" == "draining"
    assert not any(S.LOADING in to for to in MOVES.values())  # loading is a formation's first state only
    assert MOVES[S.DRAINING] == {S.RECOVERING, S.DEGRADED}  # a drain ends restarting, or as it was


@pytest.mark.parametrize(("was", "to"), EDGES, ids=[f"{a}-{b}" for a, b in EDGES])
def test_a_move_is_allowed_exactly_when_the_table_lists_it(was: FormationState, to: FormationState) -> None:
    if to in MOVES[was]:
        assert moved(was, to) is to
    else:
        with pytest.raises(IllegalMove, match=f"from {was} to {to}"):
            moved(was, to)


def _running(fleet: FakeFleet, endpoints: tuple[str, ...]) -> Running:
    plan = make_plan(plan_devices(list(endpoints)), fleet.profile(), fleet.options)
    return Running(FakeEngine(plan, fleet, 0), plan)  # type: ignore[arg-type]


def _moves(fleet: FakeFleet) -> Mapping[FormationState, Callable[[Formation], None]]:
    """The named move that leads to each state (degraded: a rejoin's `resume` from draining, else a load
    on fewer nodes)."""
    return {
        S.READY: lambda f: f.serve_on(_running(fleet, ENDPOINTS)),
        S.DEGRADED: lambda f: (
            f.resume() if f.state == S.DRAINING else f.serve_on(_running(fleet, ENDPOINTS[:2]))
        ),
        S.RECOVERING: lambda f: f.restart("restarting"),
        S.DRAINING: lambda f: f.drain("reloading"),
        S.FAILED: lambda f: f.give_up("gave up"),
    }


def _reach(formation: Formation, state: FormationState, fleet: FakeFleet) -> None:
    """`formation` (new: loading) brought to `state` by named moves."""
    path = {
        S.LOADING: [],
        S.READY: [S.READY],
        S.DEGRADED: [S.DEGRADED],
        S.RECOVERING: [S.READY, S.RECOVERING],
        S.DRAINING: [S.DRAINING],
        S.FAILED: [S.FAILED],
    }[state]
    for step in path:
        _moves(fleet)[step](formation)
    assert formation.state is state


@pytest.mark.parametrize(("was", "to"), [e for e in EDGES if e[1] != S.LOADING], ids=lambda s: str(s))
def test_the_named_moves_make_the_allowed_moves_and_refuse_the_others(
    tiny_model: Path, was: FormationState, to: FormationState
) -> None:
    """On a real formation: from each state, the named move to each other state moves it when the table
    allows it (and the waiters are woken), else raises and leaves it as it was."""
    fleet = FakeFleet(tiny_model)
    failed: list[str] = []

    async def scenario() -> None:
        hooks = FormationHooks(on_failed=lambda f: failed.append(f.reason))
        formation = Formation("m#0", "m", fleet, ServeConfig(), _no_engine, hooks=hooks)
        _reach(formation, was, fleet)
        woken = asyncio.ensure_future(formation.changed.wait(5.0))
        await asyncio.sleep(0)
        if to in MOVES[was]:
            _moves(fleet)[to](formation)
            assert formation.state is to
            await asyncio.wait_for(woken, 1.0)
        else:
            reason = formation.reason
            with pytest.raises(IllegalMove):
                _moves(fleet)[to](formation)
            assert formation.state is was and formation.reason == reason
            woken.cancel()

    asyncio.run(scenario())
    gave_up = [was == S.FAILED, to == S.FAILED and to in MOVES[was]]  # reaching failed, then moving there
    assert failed == ["gave up"] * sum(gave_up)  # each give_up tells the maker once


def test_a_lost_engine_moves_a_serving_formation_to_recovering_naming_the_nodes(tiny_model: Path) -> None:
    fleet = FakeFleet(tiny_model)

    async def scenario() -> None:
        formation = Formation("m#0", "m", fleet, ServeConfig(), _no_engine)
        running = _running(fleet, ENDPOINTS)
        formation.serve_on(running)
        assert formation.state is S.READY and formation.current is running
        stale = _running(fleet, ENDPOINTS)
        formation.lose(stale, (ENDPOINTS[0],), "not this engine")  # an engine no longer serving: no move
        assert formation.state is S.READY
        formation.lose(running, (ENDPOINTS[1],), "lost 10.9.0.2")
        assert (formation.state, formation.current, formation.lost) == (S.RECOVERING, None, (ENDPOINTS[1],))
        assert formation.nodes[ENDPOINTS[1]] == "lost" and formation.reason == "lost 10.9.0.2"
        formation.serve_on(_running(fleet, ENDPOINTS[:2]))
        assert formation.state is S.DEGRADED and formation.reason == f"1 node(s) left out: {ENDPOINTS[2]}"

    asyncio.run(scenario())


# -- no other module writes the state


def state_writes(source: str) -> list[str]:
    """Each write of an attribute `state` or `_state` in `source` (assignments, augmented and annotated,
    within tuples; `setattr` by name): `LINE: TARGET`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in ("state", "_state")
        ):
            found.append(f"{node.lineno}: setattr({ast.unparse(node.args[0])}, {node.args[1].value!r})")
        while targets:
            target = targets.pop()
            if isinstance(target, ast.Tuple | ast.List):
                targets.extend(target.elts)
            elif isinstance(target, ast.Attribute) and target.attr in ("state", "_state"):
                found.append(f"{node.lineno}: {ast.unparse(target)}")
    return found


def test_the_scan_finds_a_write_from_outside() -> None:
    """The check can fail: the writes of the old code are found."""
    old = 'backend.state, backend.reason = "draining", "x"\nself.state = "ready"\nsetattr(b, "state", 1)\n'
    assert state_writes(old) == ["1: backend.state", "2: self.state", "3: setattr(b, 'state')"]
    assert state_writes("request.state.key_name = 'a'\nstate = 'x'\n") == []


def test_only_the_formation_writes_a_formation_state() -> None:
    """In serve/ and workflows/ (where formations live: observe may not import serve), the one write of a
    state is the formation's own `self._state`, in `_move` and its first value."""
    writes = {
        str(path.relative_to(ROOT)): state_writes(path.read_text())
        for folder in ("orchestrator/serve", "orchestrator/workflows")
        for path in sorted((ROOT / folder).rglob("*.py"))
    }
    owner = "orchestrator/serve/formation.py"
    assert [w.partition(": ")[2] for w in writes.pop(owner)] == ["self._state", "self._state"]
    assert {path: found for path, found in writes.items() if found} == {}


# -- no import circle in serve/


def imports_of(folder: Path, package: str) -> dict[str, set[str]]:
    """The modules of `package` (in `folder`) each one imports: every import statement, at the top, in a
    function or under TYPE_CHECKING."""
    modules = {f"{package}.{p.stem}": p for p in folder.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            named: list[str] = []
            if isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                named = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            graph[name] |= {n for n in named if n in modules and n != name}
    return graph


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Each import circle once, from its smallest module."""
    found = []

    def walk(start: str, path: list[str]) -> None:
        for next_ in sorted(graph[path[-1]]):
            if next_ == start:
                found.append(path)
            elif next_ > start and next_ not in path:
                walk(start, [*path, next_])

    for start in sorted(graph):
        walk(start, [start])
    return found


def test_the_circle_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_modules_of_serve_import_one_another_without_a_circle() -> None:
    graph = imports_of(ROOT / "orchestrator" / "serve", "orchestrator.serve")
    assert {"orchestrator.serve.formation", "orchestrator.serve.router"} <= set(graph)
    assert any(graph.values())  # the scan reads the imports
    assert circles(graph) == []
