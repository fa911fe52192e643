"""The RPC protocol version this controller speaks: the one recorded by the locally built artifact's
manifest (the wire format itself is rpc/wire.py).

It lives here, not in `rpc`, because it reads the artifact store; `rpc` itself defaults to the protocol of
the pinned binding (llama-cpp-python 0.3.36).
"""

from __future__ import annotations

import functools
from pathlib import Path

from orchestrator.artifacts.build import cached_build
from orchestrator.core.errors import ArtifactError
from orchestrator.core.log import get_logger
from orchestrator.rpc.records import LLAMA_CPP_PYTHON_0_3_36_PROTOCOL, ProtocolVersion, parse_header_version

log = get_logger()


def _version_from_manifest() -> ProtocolVersion | None:
    """The protocol recorded in the manifest of the locally built CPU artifact, or None without one.

    Only the cheap lookup (`cached_build`): probing must never trigger a build.
    """
    try:
        artifact = cached_build("cpu")
        return ProtocolVersion.parse(artifact.manifest.protocol) if artifact is not None else None
    except (ArtifactError, ValueError) as exc:  # a broken manifest must not stop a probe
        log.debug("rpc_manifest_version_unreadable", error=str(exc))
        return None


@functools.cache
def cached_local_protocol_version() -> ProtocolVersion:
    """`local_protocol_version()`, read once per process (the manifest costs about a millisecond)."""
    return local_protocol_version()


def local_protocol_version(header: Path | None = None) -> ProtocolVersion:
    """The RPC protocol of the local llama.cpp build.

    From the artifact manifest when `orchestrator.artifacts` provides one, else from `header`
    (a llama.cpp `ggml/include/ggml-rpc.h`) when given, else 7.0.0 (llama-cpp-python 0.3.36).
    """
    manifest = _version_from_manifest()
    if manifest is not None:
        return manifest
    if header is not None:
        return parse_header_version(header.read_text(encoding="utf-8", errors="replace"))
    return ProtocolVersion.parse(LLAMA_CPP_PYTHON_0_3_36_PROTOCOL)
