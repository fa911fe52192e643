"""The OpenAI request bodies `serve` accepts, validated by pydantic (FastAPI's models).

The fields and defaults are llama-cpp-python's server models' (`llama_cpp/server/types.py` of 0.3.36),
kept to what serve uses: importing those models imports `llama_cpp`, which loads libllama into serve's
own process, the one place llama.cpp must never run (it runs in the worker). Other OpenAI fields are
accepted and ignored, as they were there (pydantic ignores unknown fields).
"""

from __future__ import annotations

from typing import Any, Literal, Required

from pydantic import BaseModel, Field
from typing_extensions import TypedDict  # pydantic validates only this one before Python 3.12


class ChatMessage(TypedDict, total=False):
    """One chat message, as the model's chat template reads it (llama-cpp-python's message types)."""

    role: Required[Literal["system", "user", "assistant", "tool", "function"]]
    content: str | list[dict[str, Any]] | None
    name: str
    tool_call_id: str
    tool_calls: list[dict[str, Any]]
    function_call: dict[str, Any]


class CompletionRequest(BaseModel):
    """`POST /v1/completions`."""

    model: str | None = None
    prompt: str | list[str] = ""
    max_tokens: int | None = Field(default=16, ge=0)
    temperature: float = 0.8
    seed: int | None = None
    stream: bool = False


class ChatCompletionRequest(BaseModel):
    """`POST /v1/chat/completions` (max_tokens None: serve's own default)."""

    model: str | None = None
    messages: list[ChatMessage] = []
    max_tokens: int | None = None
    temperature: float = 0.8
    seed: int | None = None
    stream: bool = False
