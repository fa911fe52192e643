"""One root error, one subclass per layer.

Every error a user can cause or a node can report is an `RpcfleetError`; the CLI prints it without a
traceback. Errors carry the context needed to act on them: the host, the command, its exit status and
the tail of its stderr, or the file/line/column of the offending input.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Self, TypeVar

from orchestrator.core.target import Target


def tail(text: str, lines: int = 8) -> str:
    """The last `lines` non-empty lines of `text` (enough to show why a remote command failed)."""
    kept = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


class RpcfleetError(Exception):
    """Root of every error rpcfleet raises on purpose.

    Immutable once built: an error may be shared (one failed attempt raised to every caller of
    `engine.shared.Shared`), so no layer may change it for another. A layer that knows more makes a copy:
    `with_host`, `with_hint` (same type, message, cause and other fields). A subclass sets its own fields
    before calling `super().__init__`, which freezes the error."""

    def __init__(
        self,
        message: str,
        *,
        host: str | Target | None = None,
        command: str | None = None,
        exit_status: int | None = None,
        stderr: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message)
        self._message = message
        self._host, self._target = where(host)
        self._command = command
        self._exit_status = exit_status
        self._stderr_tail = tail(stderr) if stderr else None
        self._hint = hint
        self._frozen = True

    def __setattr__(self, name: str, value: object) -> None:
        # Dunders stay settable: the interpreter keeps __traceback__, __cause__, __notes__ on them.
        if self.__dict__.get("_frozen") and not (name.startswith("__") and name.endswith("__")):
            raise AttributeError(
                f"{type(self).__name__} is immutable: {name} cannot be set (use with_host/with_hint)"
            )
        super().__setattr__(name, value)

    def __reduce__(self) -> tuple[object, ...]:
        return (rebuild_error, (type(self), self.args, dict(self.__dict__)))

    @property
    def message(self) -> str:
        return self._message

    @property
    def host(self) -> str | None:
        return self._host

    @property
    def target(self) -> Target | None:
        """The server's endpoint and the address dialed for it, when the error is about one."""
        return self._target

    @property
    def command(self) -> str | None:
        return self._command

    @property
    def exit_status(self) -> int | None:
        return self._exit_status

    @property
    def stderr_tail(self) -> str | None:
        return self._stderr_tail

    @property
    def hint(self) -> str | None:
        return self._hint

    def with_host(self, host: str | Target | None) -> Self:
        """A copy naming `host` (the same error, seen from the layer that knows where it happened)."""
        name, target = where(host)
        return self.replaced(_host=name, _target=target)

    def with_hint(self, hint: str | None) -> Self:
        """A copy with `hint` (what to do about it) instead of this one's."""
        return self.replaced(_hint=hint)

    def with_stderr(self, stderr: str, lines: int = 8) -> Self:
        """A copy showing the last `lines` lines of `stderr` (what the command said on its way out)."""
        return self.replaced(_stderr_tail=tail(stderr, lines) or None)

    def replaced(self, **fields: object) -> Self:
        """A copy with some stored fields (`_host`, `_stderr_tail`, a subclass's) replaced; made without
        calling `__init__`, whose arguments differ by subclass. The cause and context are kept."""
        clone = rebuild_error(type(self), self.args, {**self.__dict__, **fields})
        clone.__cause__ = self.__cause__
        clone.__context__ = self.__context__
        clone.__suppress_context__ = self.__suppress_context__
        clone.__traceback__ = self.__traceback__
        return clone

    def __str__(self) -> str:
        return self.describe()

    def describe(self, *, with_host: bool = True) -> str:
        """The message with its command, stderr and hint; `with_host=False` where the host is already
        named (a recap row, a table cell), so that it is not said twice."""
        named = str(self._target) if self._target is not None else self.host
        parts = [f"{named}: {self.message}" if named and with_host else self.message]
        if self.command is not None:
            status = "" if self.exit_status is None else f" (exit status {self.exit_status})"
            parts.append(f"  command: {self.command}{status}")
        if self.stderr_tail:
            parts.append("  stderr: " + self.stderr_tail.replace("\n", "\n          "))
        if self.hint:
            parts.append(f"  hint: {self.hint}")
        return "\n".join(parts)


E = TypeVar("E", bound=BaseException)


def where(host: str | Target | None) -> tuple[str | None, Target | None]:
    """An error's host (a target names its endpoint) and its target (kept only when tunneled: else
    the host says all)."""
    if isinstance(host, Target):
        return host.endpoint, host if host.tunneled else None
    return host, None


def rebuild_error(cls: type[E], args: tuple[object, ...], fields: dict[str, object]) -> E:
    """An error of `cls` with `args` and the stored `fields`, without its `__init__` (copies, pickles)."""
    made = cls.__new__(cls, *args)
    made.__dict__.update(fields)  # bypasses the frozen check: this is still building it
    return made


@dataclass(frozen=True)
class SourceLocation:
    """A place in a user's file: 1-based line and column, plus the text found there."""

    path: Path | None
    line: int | None = None
    column: int | None = None
    snippet: str | None = None

    def __str__(self) -> str:
        where = str(self.path) if self.path else "<input>"
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        return where


class InputError(RpcfleetError):
    """Bad user input in a file (inventory, playbook, plan) or on the command line."""

    def __init__(self, message: str, location: SourceLocation | None = None, *, hint: str | None = None):
        self._location = location
        text = f"{location}: {message}" if location else message
        if location and location.snippet:
            text += f"\n    {location.snippet.strip()}"
        super().__init__(text, hint=hint)

    @property
    def location(self) -> SourceLocation | None:
        return self._location


class InventoryError(InputError):
    """The inventory cannot be read or is invalid."""


class PlaybookError(InputError):
    """A playbook cannot be read or is invalid."""


class UsageError(InputError):
    """A bad command-line flag or argument."""


class HostError(RpcfleetError):
    """Something went wrong on, or on the way to, one host."""


class NotStartedError(HostError):
    """A host's step did not begin (the run was interrupted first): nothing was changed there."""


class UnreachableError(HostError):
    """The host could not be connected to (refused, timed out, link cut, name unknown)."""


class AuthenticationError(UnreachableError):
    """The host answered but refused our credentials."""


class HostKeyError(UnreachableError):
    """The host's key is unknown or does not match known_hosts."""


class CommandError(HostError):
    """A remote (or local) command exited non-zero while success was required."""


class CommandTimeoutError(HostError):
    """A command did not finish within its timeout; the output received so far is kept."""

    def __init__(self, message: str, *, stdout: str = "", stderr: str = "", **kw: object) -> None:
        self.stdout = stdout
        super().__init__(message, stderr=stderr, **kw)  # type: ignore[arg-type]


class NodeScriptError(HostError):
    """A node-side script (`connectors.nodescript`) reported `@error`, exited non-zero where it must not, or
    did not finish within its timeout. `script` names it; `reported` is its `@error` text (None when it
    failed another way)."""

    def __init__(self, message: str, *, script: str, reported: str | None = None, **kw: object) -> None:
        self.script = script
        self.reported = reported
        super().__init__(message, **kw)  # type: ignore[arg-type]


class TransferError(HostError):
    """An upload or download failed."""


class LabError(RpcfleetError):
    """The emulated lab could not be brought up, inspected or torn down."""


class ArtifactError(RpcfleetError):
    """An rpc-server artifact cannot be built, fetched, verified or chosen."""


class InstallError(HostError):
    """Installing an artifact on a host failed; the previous version is left in place."""


class NodeMismatchError(InputError, InstallError):
    """The inventory asks a node for what it cannot run (a backend without its driver, a device it does
    not have): the user's to correct, named at the inventory's line; nothing is installed or switched."""


class ServiceError(HostError):
    """Starting, stopping or checking an rpc-server failed."""


class InstallScriptError(NodeScriptError, InstallError):
    """A node-side install script failed: a `NodeScriptError` that is an `InstallError` too."""


class ServiceScriptError(NodeScriptError, ServiceError):
    """A node-side server script (start, stop, firewall, lock, unit) failed: a `NodeScriptError` that is
    a `ServiceError` too."""


class ProbeError(RpcfleetError):
    """Probing an endpoint failed (raised only by the raising API of the RPC client)."""


class ModelError(InputError):
    """A GGUF model cannot be read or profiled: the file a user named is not a model rpcfleet can use
    (or the dimensions asked of a generated one do not make a model)."""


class FetchError(RpcfleetError):
    """A catalogued model could not be fetched into the cache (download failed, wrong size or sha256):
    not the user's input, so exit status 1."""


class PlanError(RpcfleetError):
    """A plan is invalid or cannot be made."""


class PlanFileError(InputError, PlanError):
    """A saved plan a user named (`run --plan`) cannot be read or is not a valid plan."""


class LoaderError(RpcfleetError):
    """Loading a model through a plan was refused or failed before native code could abort."""
