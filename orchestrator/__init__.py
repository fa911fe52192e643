"""rpcfleet: orchestrate fleets of llama.cpp ggml-rpc-server nodes."""

from __future__ import annotations

__version__ = "0.1.0"
