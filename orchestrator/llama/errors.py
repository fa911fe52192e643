"""Typed errors of preflight and loading.

An endpoint that fails the preflight raises the RPC client's own family (`rpc.errors`, re-exported
here): `EndpointUnreachableError`, `EndpointBusyError` or `ProtocolMismatchError`, all
`EndpointProbeError`s holding the probe's result. The rest are `LoaderError`s.
"""

from __future__ import annotations

from orchestrator.core.errors import LoaderError
from orchestrator.rpc.errors import (
    EndpointBusyError,
    EndpointProbeError,
    EndpointUnreachableError,
    ProtocolMismatchError,
)

__all__ = [
    "DeviceMismatchError",
    "EndpointBusyError",
    "EndpointLimitError",
    "EndpointProbeError",
    "EndpointUnreachableError",
    "LoadFailedError",
    "LocalDeviceError",
    "ProtocolMismatchError",
    "RpcUnavailableError",
    "UnknownArgumentError",
]


class DeviceMismatchError(LoaderError):
    """The plan's devices do not match what the servers report or what is registered."""


class EndpointLimitError(LoaderError):
    """Loading would register more distinct endpoints than one process allows."""


class RpcUnavailableError(LoaderError):
    """llama-cpp-python is missing, is another version, or was built without RPC."""


class LocalDeviceError(LoaderError):
    """A local GPU named in the plan does not exist in this process."""


class UnknownArgumentError(LoaderError, TypeError):
    """A keyword argument the stock constructor would swallow without a word."""


class LoadFailedError(LoaderError):
    """llama.cpp refused the model after preflight (its own error, e.g. a file it cannot read)."""
