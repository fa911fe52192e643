"""`Target`: a server's endpoint and the address this controller dials to reach it.

With `rpc_transport: ssh` the controller dials a local SSH forward (`127.0.0.1:40001`) for a server
whose endpoint is `10.0.0.2:50052`; otherwise both are the same. The tunnel layer makes targets
(`connectors.tunnel`); probes, loads, the worker and serve's engine dial `target.dial` and name
`target.endpoint`, and `str(target)` is the one wording of the pair for messages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """`endpoint`: the server's own "host:port" (what plans, reports and errors name); `dial`: the
    "host:port" connected to (an SSH forward's local end, or the endpoint itself)."""

    endpoint: str
    dial: str

    @classmethod
    def direct(cls, endpoint: str) -> Target:
        """A server dialed at its own endpoint (no tunnel)."""
        return cls(endpoint, endpoint)

    @property
    def tunneled(self) -> bool:
        return self.dial != self.endpoint

    def __str__(self) -> str:
        return f"{self.endpoint} (via {self.dial})" if self.tunneled else self.endpoint


def targets_for(endpoints: Iterable[str], targets: Mapping[str, Target] | None) -> list[Target]:
    """One target per endpoint: the one `targets` has for it, else the endpoint dialed directly."""
    known = targets or {}
    return [known.get(ep) or Target.direct(ep) for ep in endpoints]


def dial_addresses(targets: Iterable[Target]) -> dict[str, str]:
    """Endpoint -> the address dialed, for the tunneled ones (what a native load or llama-server's
    `--rpc` is given: the process connects to the forward)."""
    return {t.endpoint: t.dial for t in targets if t.tunneled}
