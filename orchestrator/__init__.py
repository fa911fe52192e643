"""rpcfleet: orchestrate fleets of llama.cpp ggml-rpc-server nodes.

`orchestrator.load_llama(plan, model_path)` is imported lazily so that `import orchestrator` never
loads llama_cpp (native code) for commands that do not need it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from orchestrator.loader import load_llama as load_llama


def __getattr__(name: str) -> Any:
    if name == "load_llama":
        from orchestrator.loader import load_llama

        return load_llama
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
