"""The probe's defaults that front ends show before anything is probed: a constant that imports nothing
(the command line reads it at start-up; `probe.host` pulls in asyncio and the facts)."""

from __future__ import annotations

DEFAULT_TIMEOUT = 3.0  # seconds, per host, for the RPC probe and for the facts alike
