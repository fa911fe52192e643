"""engine/ is the one place that makes event loops and threads (issue 19, item 2; docs/development.md,
"How it is built").

Outside orchestrator/engine/ no module names a maker of loops or threads: `asyncio.run`,
`asyncio.new_event_loop`, `asyncio.Runner`, `asyncio.run_coroutine_threadsafe` (a bridge from a thread to
a loop: `engine.runtime.run_sync` and `LoopThread` are the bridges), a loop's `run_forever` /
`run_until_complete`, `threading.Thread` / `Timer`, `concurrent.futures`' pools, `multiprocessing`,
`uvicorn.run`. The others use `engine.runtime` (`Runtime`, `run_once`, `run_sync`, `LoopThread`) and
`engine.threads` (`start_thread`, `thread_pool`). Named, not only called: `Thread(target=asyncio.run)`
counts. `asyncio.to_thread` / `run_in_executor` stay allowed: they use the running loop's (the runtime's)
executor. import-linter sees modules, not the names used from them, hence an AST walk."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from tests.plugins.names import annotations, dotted

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "orchestrator"
HOME = "engine"  # orchestrator/engine/: the runtime

MAKERS = frozenset(
    {
        "asyncio.run",
        "asyncio.new_event_loop",
        "asyncio.Runner",
        "asyncio.run_coroutine_threadsafe",
        "asyncio.events.new_event_loop",
        "threading.Thread",
        "threading.Timer",
        "_thread.start_new_thread",
        "concurrent.futures.ThreadPoolExecutor",
        "concurrent.futures.ProcessPoolExecutor",
        "concurrent.futures.thread.ThreadPoolExecutor",
        "uvicorn.run",
    }
)
LOOP_METHODS = frozenset({"run_forever", "run_until_complete"})  # on any loop, however it was reached
MODULES = ("multiprocessing",)  # any use at all


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


def _forbidden(qualified: str) -> bool:
    return qualified in MAKERS or any(qualified == m or qualified.startswith(m + ".") for m in MODULES)


def scan(path: Path, rel: str) -> list[Violation]:
    tree = ast.parse(path.read_text(), filename=rel)
    bound: dict[str, str] = {}  # local name -> the qualified name it stands for
    found: list[Violation] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    bound[top] = top
                if _forbidden(alias.name):
                    found.append(Violation(rel, node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                bound[alias.asname or alias.name] = full
                if _forbidden(full) or _forbidden(node.module):
                    found.append(Violation(rel, node.lineno, f"from {node.module} import {alias.name}"))
    seen: set[tuple[int, str]] = set()
    typed = {id(n) for a in annotations(tree) for n in ast.walk(a)}  # a type names, it makes nothing
    for node in ast.walk(tree):
        if id(node) in typed:
            continue
        if isinstance(node, ast.Attribute) and node.attr in LOOP_METHODS:
            found.append(Violation(rel, node.lineno, f".{node.attr}"))
            continue
        if not isinstance(node, ast.Attribute | ast.Name) or not isinstance(node.ctx, ast.Load):
            continue
        chain = dotted(node)
        if chain is None or chain[0] not in bound:
            continue
        qualified = ".".join([bound[chain[0]], *chain[1:]])
        if _forbidden(qualified) and (node.lineno, qualified) not in seen:
            seen.add((node.lineno, qualified))
            found.append(Violation(rel, node.lineno, ".".join(chain)))
    return found


def violations(root: Path = ROOT) -> list[Violation]:
    found: list[Violation] = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[1] == HOME:
            continue
        found += scan(path, str(rel))
    return found


def test_no_module_outside_engine_makes_a_loop_or_a_thread() -> None:
    found = violations()
    assert not found, "loops or threads made outside orchestrator/engine/:\n" + "\n".join(map(str, found))


def test_the_walk_finds_each_maker(tmp_path: Path) -> None:
    """The rule can fail: a module with each kind of maker (as the code had them before: the tunnels'
    private loop, the exporter's `Thread(target=asyncio.run)`, a pool), the allowed forms beside them,
    and engine/ itself left alone."""
    pkg = tmp_path / PACKAGE
    (pkg / HOME).mkdir(parents=True)
    (pkg / HOME / "runtime.py").write_text("import asyncio\nasyncio.run(main())\n")
    (pkg / "ok.py").write_text(
        "import asyncio\n"
        "import threading\n"
        "import concurrent.futures\n"
        "from orchestrator.engine.threads import start_thread\n"
        "threading.Lock()\n"
        "threading.Event()\n"
        "watcher: threading.Thread | None = None\n"
        "def g(pool: concurrent.futures.ThreadPoolExecutor) -> threading.Thread: ...\n"
        "async def f():\n"
        "    await asyncio.to_thread(print)\n"
        "    await asyncio.get_running_loop().run_in_executor(None, print)\n"
        "start_thread(print, name='x')\n"
    )
    (pkg / "bad.py").write_text(
        "import asyncio\n"
        "import asyncio as aio\n"
        "import threading\n"
        "import concurrent.futures\n"
        "import multiprocessing\n"
        "from concurrent.futures import ThreadPoolExecutor as Pool\n"
        "from threading import Thread\n"
        "loop = asyncio.new_event_loop()\n"
        "threading.Thread(target=loop.run_forever).start()\n"
        "threading.Thread(target=asyncio.run, args=(main(),))\n"
        "aio.run_coroutine_threadsafe(main(), loop)\n"
        "concurrent.futures.ThreadPoolExecutor(4)\n"
        "Pool(2)\n"
        "Thread(target=print)\n"
        "with aio.Runner() as runner:\n"
        "    pass\n"
        "loop.run_until_complete(main())\n"
    )
    texts = sorted((v.line, v.text) for v in violations(tmp_path))
    assert texts == sorted(
        [
            (5, "import multiprocessing"),
            (6, "from concurrent.futures import ThreadPoolExecutor"),
            (7, "from threading import Thread"),
            (8, "asyncio.new_event_loop"),
            (9, "threading.Thread"),
            (9, ".run_forever"),
            (10, "threading.Thread"),
            (10, "asyncio.run"),
            (11, "aio.run_coroutine_threadsafe"),
            (12, "concurrent.futures.ThreadPoolExecutor"),
            (13, "Pool"),
            (14, "Thread"),
            (15, "aio.Runner"),
            (17, ".run_until_complete"),
        ]
    )
