"""Node-side scripts: one way to hold, run and read the shell scripts rpcfleet runs on a node.

A `NodeScript` is data: its name, its text (POSIX sh), its timeout and what to call it in an error. The
scripts speak to the controller in `@key value` lines on stdout (`@started 4242`, `@busy 10.0.0.2`,
`@error cannot create the user`); every other line is left alone. `parse_key_line` is the one parser of
such a line, `ScriptOutput` the typed result of a finished script, and `run_script` the one runner: it
runs the script on a `Connection` under its timeout and raises `NodeScriptError` (the script's error
class) when the script reports `@error`, exits with a status it does not expect, or times out.

Check mode (`--check --diff`): inside `recording()`, `would_run` notes the scripts a change would run,
per host, without running them; the CLI prints them afterwards, as pyinfra's dry run does.
"""

from __future__ import annotations

import contextvars
import shlex
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from orchestrator.connectors.base import Connection
from orchestrator.core.errors import CommandTimeoutError, NodeScriptError

MARK = "@"
ERROR_KEY = "error"


def parse_key_line(line: str) -> tuple[str, str] | None:
    """(key, value) of one `@key value` line, the value stripped; None for any other line (no `@`, or a
    bare `@`, or `@@...`, the markers of gathered facts)."""
    if not line.startswith(MARK) or line.startswith(MARK * 2):
        return None
    key, _, value = line[1:].partition(" ")
    key = key.strip()
    if not key:
        return None
    return key, value.strip()


def parse_key_lines(text: str) -> tuple[tuple[str, str], ...]:
    """Every `@key value` line of `text`, in order."""
    found = (parse_key_line(line) for line in text.splitlines())
    return tuple(pair for pair in found if pair is not None)


@dataclass(frozen=True)
class ScriptOutput:
    """What a finished script said: its `@key value` lines in order, and its raw output."""

    host: str
    script: str
    exit_status: int
    stdout: str
    stderr: str = ""
    keys: tuple[tuple[str, str], ...] = ()
    duration: float = 0.0  # seconds

    @classmethod
    def parse(
        cls, host: str, script: str, exit_status: int, stdout: str, stderr: str = "", duration: float = 0.0
    ) -> ScriptOutput:
        return cls(host, script, exit_status, stdout, stderr, parse_key_lines(stdout), duration)

    def __contains__(self, key: object) -> bool:
        return any(k == key for k, _ in self.keys)

    def get(self, key: str, default: str | None = None) -> str | None:
        """The value of the first `@key` line (default when there is none)."""
        return next((v for k, v in self.keys if k == key), default)

    def values(self, key: str) -> tuple[str, ...]:
        """The values of every `@key` line, in order."""
        return tuple(v for k, v in self.keys if k == key)

    @property
    def last(self) -> tuple[str, str] | None:
        """The last `@key value` line."""
        return self.keys[-1] if self.keys else None

    @property
    def error(self) -> str | None:
        """The first `@error` text (None when the script reported none)."""
        return self.get(ERROR_KEY)


@dataclass(frozen=True)
class NodeScript:
    """One script to run on a node.

    `what` names the action in errors ("starting the rpc-server: ...", "... did not finish within 60 s");
    with `error_is_message` the script's `@error` text is the whole message. `consequence` is added to
    every error ("old stays installed"). `command` replaces the default `sh -c '<text>'` (then `text`,
    when given, is sent on stdin); `ok_exits`: the exit statuses that are not a failure (None: any).
    """

    name: str
    text: str
    timeout: float
    what: str
    error: type[NodeScriptError] = NodeScriptError
    consequence: str = ""
    error_is_message: bool = False
    command: str | None = None
    ok_exits: frozenset[int] | None = frozenset({0})
    hint: str | None = None

    @property
    def shell_command(self) -> str:
        """The exact command line the connection runs."""
        return self.command if self.command is not None else f"sh -c {shlex.quote(self.text)}"

    @property
    def stdin(self) -> str | None:
        return self.text if self.command is not None and self.text else None

    def shown(self) -> str:
        """The command as a shell would be given it, its stdin as a here-document (check mode)."""
        if self.stdin is None:
            return self.shell_command
        return f"{self.shell_command} <<'RPCFLEET_EOF'\n{self.stdin.rstrip(chr(10))}\nRPCFLEET_EOF"

    def failure(
        self,
        host: str,
        message: str,
        *,
        reported: str | None = None,
        exit_status: int | None = None,
        stderr: str | None = None,
    ) -> NodeScriptError:
        """This script's error, with its consequence and hint."""
        text = f"{message}; {self.consequence}" if self.consequence else message
        return self.error(
            text,
            host=host,
            script=self.name,
            reported=reported,
            exit_status=exit_status,
            stderr=stderr,
            hint=self.hint,
        )

    def reported(self, host: str, text: str, *, stderr: str | None = None) -> NodeScriptError:
        """The error for an `@error text` line."""
        message = text if self.error_is_message else f"{self.what}: {text}"
        return self.failure(host, message, reported=text, stderr=stderr)

    def check(self, output: ScriptOutput) -> ScriptOutput:
        """`output` when the script succeeded; its error otherwise (`@error`, or an unexpected exit)."""
        if output.error is not None:
            raise self.reported(output.host, output.error, stderr=output.stderr or None)
        if self.ok_exits is not None and output.exit_status not in self.ok_exits:
            raise self.failure(
                output.host,
                f"{self.what}: exit status {output.exit_status}",
                exit_status=output.exit_status,
                stderr=output.stderr or output.stdout,
            )
        return output


async def run_script(conn: Connection, script: NodeScript) -> ScriptOutput:
    """Run `script` on `conn` under its timeout and parse its `@key value` lines; raises the script's
    `NodeScriptError` on `@error`, an unexpected exit status or a timeout."""
    try:
        result = await conn.run(script.shell_command, timeout=script.timeout, input=script.stdin)
    except CommandTimeoutError as exc:
        raise script.failure(
            conn.host.name, f"{script.what} did not finish within {script.timeout:g} s", stderr=exc.stdout
        ) from exc
    output = ScriptOutput.parse(
        result.host, script.name, result.exit_status, result.stdout, result.stderr, result.duration
    )
    return script.check(output)


@dataclass(frozen=True)
class Planned:
    """A command check mode would have run on a host (a script, or an upload)."""

    host: str
    name: str
    command: str


@dataclass
class Recording:
    """The commands noted by `would_run`, in the order they were noted."""

    planned: list[Planned] = field(default_factory=list)

    def by_host(self) -> dict[str, list[Planned]]:
        hosts: dict[str, list[Planned]] = {}
        for item in self.planned:
            hosts.setdefault(item.host, []).append(item)
        return hosts


_RECORDING: contextvars.ContextVar[Recording | None] = contextvars.ContextVar(
    "nodescript_recording", default=None
)


@contextmanager
def recording() -> Iterator[Recording]:
    """Note what `would_run` is told within (the executor's tasks, created inside, share it)."""
    notes = Recording()
    token = _RECORDING.set(notes)
    try:
        yield notes
    finally:
        _RECORDING.reset(token)


def would_run(host: str, scripts: Iterable[NodeScript | Planned]) -> None:
    """Check mode: note that `scripts` would run on `host` (nothing is run; a no-op outside
    `recording()`)."""
    notes = _RECORDING.get()
    if notes is None:
        return
    for script in scripts:
        if isinstance(script, Planned):
            notes.planned.append(script)
        else:
            notes.planned.append(Planned(host, script.name, script.shown()))
