"""Host facts: each one a shell command plus a pure parser of its output (pyinfra's design).

A `Fact[T]` knows the command that reads it (`command()`) and how to turn that command's stdout,
stderr and exit status into a `T` (`parse()`); parsing does no I/O and is tested from data files.
`gather_command(facts, token)` joins several commands into one script, so one SSH round trip reads
them all; `split_output(stdout, token, n)` cuts that script's output back into per-fact outputs and
`parse_gathered` parses them; `gather(conn, facts, timeout=...)` does all three over a connection.
The state reads of operations/ (install/plan.py, server/state.py) and probe/ (host.py, fleet.py) are
these facts (change scripts reuse pieces).

A tool that is not installed (no nvidia-smi on a CPU node, no ss) is a normal answer ("none"), not an
error: only the caller knows whether it needed it.
"""

from __future__ import annotations

import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

if TYPE_CHECKING:
    from orchestrator.connectors.base import Connection


T = TypeVar("T")


MiB = 1024 * 1024


NOT_FOUND = 127  # the shell's "command not found"


# A GPU tool can hang on a wedged driver; one fact must not stall the whole gathering.
TOOL_TIMEOUT_S = 15


def with_tool(tool: str, args: str) -> str:
    """Run `tool args` under `timeout` when available; exit 127 when the tool is absent."""
    return (
        f"command -v {tool} >/dev/null 2>&1 || exit {NOT_FOUND}; "
        f"if command -v timeout >/dev/null 2>&1; then timeout {TOOL_TIMEOUT_S} {tool} {args}; "
        f"else {tool} {args}; fi"
    )


def tail(text: str, lines: int = 3) -> str:
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(kept[-lines:])


class Fact(ABC, Generic[T]):
    """A command that reads something about a host, and a pure parser of its output."""

    name: ClassVar[str]

    @abstractmethod
    def command(self) -> str:
        """A POSIX shell command (run by sh or bash) that prints what `parse` reads."""

    @abstractmethod
    def parse(self, stdout: str, stderr: str, exit_status: int) -> T:
        """Turn the command's output into the fact's value; never raises for odd output."""


@dataclass(frozen=True)
class RawOutput:
    stdout: str
    stderr: str
    exit_status: int


def new_token() -> str:
    """A delimiter token no command output will contain by chance."""
    return secrets.token_hex(8)


def _mark(token: str, index: int, part: str) -> str:
    return f"@@rpcfleet-{token}-{index}-{part}@@"


def gather_command(facts: Sequence[Fact[Any]], token: str) -> str:
    """One bash script running every fact's command in its own subshell, stdin closed.

    Its stdout carries, per fact: a marker, the fact's stdout, a marker, its stderr, a marker with its
    exit status. Each marker is preceded by a newline that `split_output` removes again, so outputs come
    back byte for byte. Needs bash or a POSIX sh with mktemp.
    """
    if not re.fullmatch(r"[0-9a-zA-Z]+", token):
        raise ValueError("the token must be alphanumeric")
    lines = ["__rf_err=$(mktemp) || exit 1", "trap 'rm -f \"$__rf_err\"' EXIT"]
    for i, fact in enumerate(facts):
        lines += [
            f"printf '\\n%s\\n' '{_mark(token, i, 'out')}'",
            f'( {fact.command()}\n) </dev/null 2>"$__rf_err"; __rf_rc=$?',
            f"printf '\\n%s\\n' '{_mark(token, i, 'err')}'",
            'cat "$__rf_err"',
            f"printf '\\n%s\\n' '@@rpcfleet-{token}-{i}-exit-'\"$__rf_rc\"'@@'",
        ]
    return "\n".join(lines) + "\n"


def split_output(stdout: str, token: str, count: int) -> list[RawOutput]:
    """Cut a gathered script's stdout into `count` per-fact outputs.

    A fact whose markers are missing (the script was cut short) gets exit status -1 and what was found.
    """
    pattern = re.compile(rf"\n@@rpcfleet-{re.escape(token)}-(\d+)-(out|err|exit-(-?\d+))@@\n")
    outs: dict[int, str] = {}
    errs: dict[int, str] = {}
    codes: dict[int, int] = {}
    current: tuple[int, str] | None = None
    position = 0
    for match in pattern.finditer(stdout):
        if current is not None:
            index, part = current
            (outs if part == "out" else errs)[index] = stdout[position : match.start()]
        index, part = int(match.group(1)), match.group(2)
        if part.startswith("exit-"):
            codes[index] = int(match.group(3))
            current = None
        else:
            current = (index, part)
        position = match.end()
    if current is not None:
        index, part = current
        (outs if part == "out" else errs)[index] = stdout[position:]
    return [RawOutput(outs.get(i, ""), errs.get(i, ""), codes.get(i, -1)) for i in range(count)]


def parse_gathered(facts: Sequence[Fact[Any]], stdout: str, token: str) -> dict[str, Any]:
    """Parse a gathered script's stdout: {fact.name: value}. Facts of one name: give them distinct names."""
    raws = split_output(stdout, token, len(facts))
    return {
        fact.name: fact.parse(raw.stdout, raw.stderr, raw.exit_status)
        for fact, raw in zip(facts, raws, strict=True)
    }


async def gather(
    conn: Connection,
    facts: Sequence[Fact[Any]],
    *,
    timeout: float,  # noqa: ASYNC109 (the API: a per-call limit)
    check: bool = True,
) -> dict[str, Any]:
    """Read `facts` over `conn` in one round trip: {fact.name: value}. `check`: raise CommandError when
    the script itself fails (a fact's own failure is part of its value)."""
    token = new_token()
    result = await conn.run(gather_command(facts, token), timeout=timeout, check=check)
    return parse_gathered(facts, result.stdout, token)
