"""Prefix-affine routing (pure): which formation of a model should take a request so that requests sharing
a prompt prefix (the turns of one chat, one user's requests) land where llama-server's slots already hold
that prefix in their KV cache, and skip its prompt processing.

The affinity key of a request (`affinity_key`) is the OpenAI `user` field when the client gives one; else
a hash of the prompt's beginning: for a chat, the messages up to and including the first user message
(the system prompt and the first turn: what every later turn of the conversation repeats first); for a
completion, the prompt's first `PROMPT_PREFIX_CHARS` characters. Characters, not tokens: tokenizing in the
front would need the model's tokenizer in serve's process (llama.cpp never runs there) or a round trip to
the engine per request; texts that begin alike tokenize alike up to the last token or so, which is all a
hash of a beginning needs.

A key goes to a formation by rendezvous (highest-random-weight) hashing over the model's serving
formations (`rendezvous`): each (key, formation name) pair gets a stable weight and the heaviest wins, so
a formation that leaves or joins moves only the keys it loses or wins, and every front (restarted or
not) agrees. When that formation is saturated (every slot taken: admitted >= parallel) the request goes
to the least-loaded one instead (`route`): a hot key never queues behind its own slots while others idle.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.serve.states import SERVING

POLICIES = ("affine", "least-loaded")
PROMPT_PREFIX_CHARS = 2048  # a completion's prompt: its first characters (about 500 tokens) make the key
CHAT_PREFIX_CHARS = 65536  # a chat's leading messages: a bound on the text hashed (about 16k tokens)

# why a request went where it went (the `reason` label of rpcfleet_formation_routed_total)
AFFINE, FALLBACK, LEAST_LOADED = "affine", "fallback", "least_loaded"


@dataclass(frozen=True)
class Load:
    """One formation as the router sees it for a request: its name, state, requests admitted (served and
    waiting) and slots (llama-server's --parallel)."""

    name: str
    state: str
    admitted: int
    parallel: int

    @property
    def saturated(self) -> bool:
        return self.admitted >= self.parallel


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def affinity_key(route: str, body: Mapping[str, Any]) -> str | None:
    """The key requests that share a prefix share: `user:NAME` for the OpenAI `user` field, else
    `chat:HASH` of the leading messages or `prompt:HASH` of the prompt's beginning; None when the body
    has neither (embeddings, odd bodies: least-loaded)."""
    user = body.get("user")
    if isinstance(user, str) and user.strip():
        return f"user:{user.strip()}"
    messages = body.get("messages")
    if route.endswith("/chat/completions") and isinstance(messages, list) and messages:
        leading: list[Any] = []
        for message in messages:
            leading.append(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break
        text = json.dumps(leading, sort_keys=True, ensure_ascii=False, default=str)
        return f"chat:{_digest(text[:CHAT_PREFIX_CHARS])}"
    prompt = body.get("prompt")
    if route.endswith("/completions") and prompt:
        if isinstance(prompt, list):  # a batch or tokens: the first entry's beginning
            prompt = prompt[0]
        text = prompt if isinstance(prompt, str) else json.dumps(prompt, default=str)
        return f"prompt:{_digest(text[:PROMPT_PREFIX_CHARS])}"
    return None


def weight(key: str, name: str) -> int:
    """The rendezvous weight of `key` on the formation `name` (stable across processes)."""
    return int.from_bytes(hashlib.blake2b(f"{key}\0{name}".encode(), digest_size=8).digest(), "big")


def rendezvous(key: str, names: Sequence[str]) -> int | None:
    """The index of `key`'s formation among `names` (highest weight; None when there are none)."""
    if not names:
        return None
    return max(range(len(names)), key=lambda i: (weight(key, names[i]), names[i]))


def least_loaded(loads: Sequence[Load], turn: int = 0, prefer: int | None = None) -> list[int]:
    """The serving formations by index, least loaded first; ties go to `prefer`, then in turns from the
    `turn`-th on (so that a light load still reaches every formation)."""
    serving = [i for i, load in enumerate(loads) if load.state in SERVING]
    return sorted(serving, key=lambda i: (loads[i].admitted, i != prefer, (i - turn) % len(loads)))


def route(
    loads: Sequence[Load], key: str | None, policy: str = "affine", turn: int = 0
) -> tuple[list[int], int | None]:
    """The formations to try for a request, by index, and the one its key maps to (None: least-loaded
    routing, or no key, or none serving). Affine: the key's formation first while it has a free slot;
    saturated, the least-loaded first (ties to the key's)."""
    if policy != "affine" or key is None:
        return least_loaded(loads, turn), None
    serving = [i for i, load in enumerate(loads) if load.state in SERVING]
    chosen = rendezvous(key, [loads[i].name for i in serving])
    if chosen is None:
        return [], None
    best = serving[chosen]
    if not loads[best].saturated:
        return [best, *(i for i in least_loaded(loads, turn) if i != best)], best
    return least_loaded(loads, turn, prefer=best), best


def reason(taken: int, best: int | None) -> str:
    """Why the formation `taken` served the request that mapped to `best` (`route`'s second answer)."""
    if best is None:
        return LEAST_LOADED
    return AFFINE if taken == best else FALLBACK
