"""One root error, one subclass per layer.

Every error a user can cause or a node can report is an `RpcfleetError`; the CLI prints it without a
traceback. Errors carry the context needed to act on them: the host, the command, its exit status and
the tail of its stderr, or the file/line/column of the offending input.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def tail(text: str, lines: int = 8) -> str:
    """The last `lines` non-empty lines of `text` (enough to show why a remote command failed)."""
    kept = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


class RpcfleetError(Exception):
    """Root of every error rpcfleet raises on purpose."""

    def __init__(
        self,
        message: str,
        *,
        host: str | None = None,
        command: str | None = None,
        exit_status: int | None = None,
        stderr: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.host = host
        self.command = command
        self.exit_status = exit_status
        self.stderr_tail = tail(stderr) if stderr else None
        self.hint = hint

    def __str__(self) -> str:
        return self.describe()

    def describe(self, *, with_host: bool = True) -> str:
        """The message with its command, stderr and hint; `with_host=False` where the host is already
        named (a recap row, a table cell), so that it is not said twice."""
        parts = [f"{self.host}: {self.message}" if self.host and with_host else self.message]
        if self.command is not None:
            status = "" if self.exit_status is None else f" (exit status {self.exit_status})"
            parts.append(f"  command: {self.command}{status}")
        if self.stderr_tail:
            parts.append("  stderr: " + self.stderr_tail.replace("\n", "\n          "))
        if self.hint:
            parts.append(f"  hint: {self.hint}")
        return "\n".join(parts)


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
        self.location = location
        text = f"{location}: {message}" if location else message
        if location and location.snippet:
            text += f"\n    {location.snippet.strip()}"
        super().__init__(text, hint=hint)


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
        super().__init__(message, stderr=stderr, **kw)  # type: ignore[arg-type]
        self.stdout = stdout


class NodeScriptError(HostError):
    """A node-side script (`connectors.nodescript`) reported `@error`, exited non-zero where it must not, or
    did not finish within its timeout. `script` names it; `reported` is its `@error` text (None when it
    failed another way)."""

    def __init__(self, message: str, *, script: str, reported: str | None = None, **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.script = script
        self.reported = reported


class TransferError(HostError):
    """An upload or download failed."""


class LabError(RpcfleetError):
    """The emulated lab could not be brought up, inspected or torn down."""


class ArtifactError(RpcfleetError):
    """An rpc-server artifact cannot be built, fetched, verified or chosen."""


class InstallError(HostError):
    """Installing an artifact on a host failed; the previous version is left in place."""


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
