"""engine/children.py is the one place that starts child processes (issue 32, item 6), as engine/ is the
one place that makes loops and threads (test_concurrency_home.py).

Outside it, no module names a starter of processes: `subprocess.run` / `Popen` / `call` / `check_call` /
`check_output` / `getoutput` / `getstatusoutput`, `asyncio.create_subprocess_exec` / `_shell`, `os.system`
/ `popen` / `fork` / `exec*` / `spawn*` / `posix_spawn*`. The others use `run_child`, `open_child`,
`start_child`, `start_shell_child` and `spawn_child`. `subprocess`'s constants and types (`PIPE`,
`TimeoutExpired`, `CompletedProcess`) stay allowed.

Two modules are exempt, each for a reason the layers give: artifacts/buildenv.py runs as a script of the
standard library alone, before any dependency exists (scripts/setup.sh), and core/fnv.py compiles its
helper with the C compiler from core, below engine."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.plugins.names import annotations, dotted

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "orchestrator"
HOME = Path(PACKAGE) / "engine" / "children.py"
EXEMPT = {Path(PACKAGE) / "artifacts" / "buildenv.py", Path(PACKAGE) / "core" / "fnv.py"}

STARTERS = frozenset(
    {
        *(f"subprocess.{n}" for n in ("run", "Popen", "call", "check_call", "check_output")),
        *(f"subprocess.{n}" for n in ("getoutput", "getstatusoutput")),
        "asyncio.create_subprocess_exec",
        "asyncio.create_subprocess_shell",
        "asyncio.subprocess.create_subprocess_exec",
        "asyncio.subprocess.create_subprocess_shell",
        "os.system",
        "os.popen",
        "os.fork",
        "os.forkpty",
    }
)
PREFIXES = ("os.exec", "os.spawn", "os.posix_spawn")


def _starter(qualified: str) -> bool:
    return qualified in STARTERS or qualified.startswith(PREFIXES)


def scan(source: str, rel: str) -> list[str]:
    tree = ast.parse(source, filename=rel)
    bound: dict[str, str] = {}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                bound[alias.asname or alias.name] = full
                if _starter(full):
                    found.append(f"{rel}:{node.lineno}: from {node.module} import {alias.name}")
    typed = {id(n) for a in annotations(tree) for n in ast.walk(a)}  # a type names, it starts nothing
    for node in ast.walk(tree):
        if id(node) in typed:
            continue
        if not isinstance(node, ast.Attribute | ast.Name) or not isinstance(node.ctx, ast.Load):
            continue
        chain = dotted(node)
        if chain is None or chain[0] not in bound:
            continue
        qualified = ".".join([bound[chain[0]], *chain[1:]])
        if _starter(qualified):
            found.append(f"{rel}:{node.lineno}: {'.'.join(chain)}")
    return sorted(set(found), key=lambda f: (int(f.split(":")[1]), f))


def test_only_engine_children_starts_child_processes() -> None:
    found: list[str] = []
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel == HOME or rel in EXEMPT:
            continue
        found += scan(path.read_text(), str(rel))
    assert not found, "child processes started outside orchestrator/engine/children.py:\n" + "\n".join(found)


def test_the_walk_finds_each_starter() -> None:
    """The rule can fail: each way of starting a process is found, the allowed names beside them are not."""
    source = (
        "import subprocess, os\nimport asyncio as aio\nfrom subprocess import Popen as P\n"
        "subprocess.run(['x'])\nP(['x'])\naio.create_subprocess_shell('x')\nos.execvp('x', [])\n"
        "done: subprocess.CompletedProcess[str]\nx = subprocess.PIPE\n"
    )
    found = scan(source, "m.py")
    assert [f.split(": ", 1)[1] for f in found] == [
        "from subprocess import Popen",
        "subprocess.run",
        "P",
        "aio.create_subprocess_shell",
        "os.execvp",
    ], found
