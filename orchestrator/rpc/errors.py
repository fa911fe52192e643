"""The errors of an endpoint whose probe did not end ok: one family for the RPC client, the loader and
`Llama` (the outcome names the exact case, the class what to do about it)."""

from __future__ import annotations

from collections.abc import Mapping

from orchestrator.core.errors import ProbeError
from orchestrator.rpc.records import Outcome, ProbeResult


class EndpointProbeError(ProbeError):
    """An endpoint's probe did not end ok; `result` holds everything the probe learned (the server's
    version included, for a version mismatch)."""

    def __init__(self, result: ProbeResult, message: str, *, hint: str | None = None) -> None:
        self.result = result
        super().__init__(message, host=result.target, hint=hint)

    @property
    def outcome(self) -> Outcome:
        return self.result.outcome


class EndpointUnreachableError(EndpointProbeError):
    """The endpoint refused the connection, timed out or closed it (nothing listens, or a node is down)."""


class EndpointBusyError(EndpointProbeError):
    """The endpoint serves another client (the server takes one client at a time)."""


class ProtocolMismatchError(EndpointProbeError):
    """The endpoint speaks another RPC protocol version (or is not a ggml-rpc-server at all)."""


ERROR_FOR_OUTCOME: Mapping[Outcome, type[EndpointProbeError]] = {
    Outcome.REFUSED: EndpointUnreachableError,
    Outcome.TIMEOUT: EndpointUnreachableError,
    Outcome.CLOSED: EndpointUnreachableError,
    Outcome.BUSY: EndpointBusyError,
    Outcome.VERSION_MISMATCH: ProtocolMismatchError,
    Outcome.PROTOCOL_ERROR: ProtocolMismatchError,
}


_UNREACHABLE_HINT = "start the server (rpcfleet start) or check the address"


# A version mismatch's message already says what to deploy.
_HINTS: Mapping[Outcome, str | None] = {
    Outcome.REFUSED: _UNREACHABLE_HINT,
    Outcome.TIMEOUT: _UNREACHABLE_HINT,
    Outcome.CLOSED: _UNREACHABLE_HINT,
    Outcome.BUSY: "another client holds this server; stop it or pick another node",
    Outcome.VERSION_MISMATCH: None,
    Outcome.PROTOCOL_ERROR: "is it a ggml-rpc-server? deploy the pinned artifact (rpcfleet deploy)",
}


def error_for(
    result: ProbeResult, doing: str | None = None, *, also: str | None = None
) -> EndpointProbeError:
    """The typed error for a non-ok result: `outcome: message`, after `doing` when given (e.g.
    "refused before loading"), and `also` after it (the other endpoints that were refused)."""
    if result.ok:
        raise ValueError("an ok probe result has no error")
    cls = ERROR_FOR_OUTCOME[result.outcome]
    message = f"{result.outcome}: {result.message}"
    message = f"{doing}: {message}" if doing else message
    if also:
        message += f" (also refused: {also})"
    return cls(result, message, hint=_HINTS[result.outcome])
