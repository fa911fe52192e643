"""Typed errors of preflight and loading."""

from __future__ import annotations

from orchestrator.core.errors import LoaderError
from orchestrator.rpc.protocol import Outcome, ProbeResult


class PreflightError(LoaderError):
    """An endpoint failed the preflight probe; `probe` holds what the probe learned."""

    probe: ProbeResult | None = None


class EndpointUnreachableError(PreflightError):
    """An endpoint refused the connection, timed out or closed it (nothing listens, or a node is down)."""


class EndpointBusyError(PreflightError):
    """An endpoint serves another client (the server takes one client at a time)."""


class ProtocolMismatchError(PreflightError):
    """An endpoint speaks another RPC protocol version (or is not a ggml-rpc-server at all)."""


class DeviceMismatchError(LoaderError):
    """The plan's devices do not match what the servers report or what is registered."""


class EndpointLimitError(LoaderError):
    """Loading would register more distinct endpoints than one process allows."""


class RpcUnavailableError(LoaderError):
    """llama-cpp-python is missing, is another version, or was built without RPC."""


class LocalDeviceError(LoaderError):
    """A local GPU named in the plan does not exist in this process."""


class LoadFailedError(LoaderError):
    """llama.cpp refused the model after preflight (its own error, e.g. a file it cannot read)."""


def _error_for_probe(result: ProbeResult) -> PreflightError:
    cls: type[PreflightError]
    hint: str
    if result.outcome is Outcome.BUSY:
        cls, hint = EndpointBusyError, "another client holds this server; stop it or pick another node"
    elif result.outcome in (Outcome.VERSION_MISMATCH, Outcome.PROTOCOL_ERROR):
        cls = ProtocolMismatchError
        hint = "install a server built from the same llama.cpp as llama-cpp-python (rpcfleet install)"
    else:
        cls, hint = EndpointUnreachableError, "start the server (rpcfleet start) or remove it from the plan"
    err = cls(f"refused before loading: {result.outcome}: {result.message}", host=result.endpoint, hint=hint)
    err.probe = result
    return err
