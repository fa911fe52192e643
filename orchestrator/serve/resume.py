"""Requests that outlive their engine (pure: no I/O). A formation that loses a node loses its engine and
every answer in flight on it; serve finishes those answers on a formation that serves the model again.

- A whole answer (not streamed) has sent nothing yet: it is sent again, as the client wrote it.
- A stream has sent text: it goes on from where it stopped. serve asks the engine for each streamed token's
  id (`logprobs`: llama-server puts the sampled token's id in every event that carries text, and
  `timings_per_token`, whose `predicted_n` counts the tokens decoded, so that a token held back, a
  character split over tokens or a stop string's prefix, shows as a gap) and removes both from what the
  client sees unless the client asked for them. The continuation is a `/v1/completions` stream whose prompt
  is the request's prompt tokens (the template applied and tokenized by the new engine, as it tokenizes
  any prompt) followed by the token ids already streamed, never their text tokenized again, with the
  tokens left of the answer's bound and the request's own sampling fields. Its events are rewritten into
  the first stream: the same `id`, `created` and `model`, chat deltas for a chat, and usage counting the
  prompt once and every generated token.

A greedy stream (temperature 0, or top_k 1) is first replayed on the new engine one token at a time: the
prompt in one batch, then each streamed token on its own, as the lost engine decoded them, so that the
keys and values they leave equal the lost engine's and the greedy text goes on as it would have. A
continuation that prefills the streamed tokens in one batch computes them in another order, and a near-tie
can then flip. The replay costs about what decoding those tokens did, so it stops after `REPLAY_SECONDS`;
the tokens it did not reach are prefilled with the continuation, in one batch.

A stream is not continued where the continuation could not be the same request: several choices, tools,
grammars or response formats (a grammar would restart mid-answer), several prompts, or a gap in the ids.
It then ends with the lost node's error event, as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# Fields that shape the answer beyond sampling: a continuation from the middle would not honour them.
STRUCTURAL = ("tools", "functions", "grammar", "json_schema", "response_format")
# Chat-only fields, dropped from the continuation (a completion of the templated prompt).
CHAT_ONLY = (
    "messages",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "response_format",
    "chat_template",
    "chat_template_kwargs",
    "reasoning_format",
    "add_generation_prompt",
    "continue_final_message",
    "logprobs",
    "top_logprobs",
)


# A greedy stream's replay stops here, bounding the pause it adds (the aim: a resumed stream pauses at
# most the fault's recovery + 2 s); what is left is prefilled in one batch.
REPLAY_SECONDS = 1.5


def not_resumable(route: str, data: dict[str, Any]) -> str | None:
    """Pure: why a stream of `data` on `route` cannot be continued on another engine (None: it can)."""
    if route not in (COMPLETIONS, CHAT):
        return f"{route} is not a generation"
    if data.get("n", 1) not in (1, None):
        return "several choices (n)"
    for name in STRUCTURAL:
        if data.get(name):
            return f"{name} would restart mid-answer"
    if route == COMPLETIONS:
        prompt = data.get("prompt")
        if not isinstance(prompt, str) and not (
            isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            return "not one prompt (a text or a list of token ids)"
    return None


def asks_logprobs(route: str, data: dict[str, Any]) -> bool:
    if route == CHAT:
        return bool(data.get("logprobs"))
    return bool(data.get("logprobs") or data.get("n_probs"))


def engine_body(route: str, data: dict[str, Any]) -> dict[str, Any]:
    """Pure: what a continuable stream asks of its engine: the request, plus each token's id (the top
    candidate alone, a partial sort) and the count of tokens decoded in every event."""
    body = dict(data)
    if not asks_logprobs(route, data):
        if route == CHAT:
            body["logprobs"], body["top_logprobs"] = True, 1
        else:
            body["n_probs"] = 1
    body["timings_per_token"] = True
    return body


def continuation_body(
    route: str, data: dict[str, Any], prompt: list[int], generated: list[int]
) -> dict[str, Any]:
    """Pure: the `/v1/completions` stream that goes on from `generated` after `prompt` (token ids), with
    the request's sampling fields and the tokens left of its bound (`bound_answer` set `max_tokens`)."""
    body = {k: v for k, v in data.items() if k not in CHAT_ONLY} if route == CHAT else dict(data)
    left = max(int(data.get("max_tokens") or 1) - len(generated), 1)
    body.update(
        prompt=list(prompt) + list(generated),
        stream=True,
        max_tokens=left,
        n_predict=left,
        timings_per_token=True,
        cache_prompt=True,  # the replay left the prompt and the streamed tokens in a slot's cache
    )
    body.pop("max_completion_tokens", None)
    if route == CHAT and data.get("logprobs"):
        body["n_probs"] = int(data.get("top_logprobs") or 1)
    elif not asks_logprobs(route, data):
        body["n_probs"] = 1
    return body


def greedy(data: dict[str, Any]) -> bool:
    """Pure: whether the request samples greedily (its continuation is then replayed, token by token)."""
    temperature = data.get("temperature")
    return (isinstance(temperature, int | float) and temperature <= 0) or data.get("top_k") == 1


def replay_body(data: dict[str, Any], prompt: list[int], generated: list[int], upto: int) -> dict[str, Any]:
    """Pure: the native `/completion` that decodes the prompt and `generated[:upto]` on an engine that holds
    the prompt and `generated[:upto - 1]` in a slot's cache (llama-server picks the idle slot whose cache
    shares the longest prefix), so that it decodes one token. Its one sampled token is thrown away. The
    first (the prompt) uses the prompt cache as the request asked (`cache_prompt`: a prompt computed
    afresh, or partly from a cached prefix, as the lost engine computed it)."""
    return {
        "prompt": list(prompt) + list(generated[:upto]),
        "n_predict": 1,
        "temperature": 0,
        "cache_prompt": bool(data.get("cache_prompt", True)) if upto == 0 else True,
    }


@dataclass
class StreamEdit:
    """One stream as the client sees it, across engines: feed it the engine's bytes (`feed`), it returns
    the bytes to send. It keeps the ids of the tokens sent (`generated`) and whether they are all known
    (`gap`), and once `resume` was called, rewrites a continuation's events into the first stream."""

    route: str
    client_logprobs: bool
    client_timings: bool
    client_usage: bool = False  # a chat's stream_options.include_usage
    generated: list[int] = field(default_factory=list)
    decoded: int = 0  # the engine's count of tokens decoded (timings.predicted_n), across engines
    gap: bool = False
    finished: bool = False  # an event with a finish_reason was sent
    done: bool = False  # [DONE] was sent
    prompt_tokens: int | None = None  # the prompt's length, once a continuation knows it
    resumes: int = 0
    _rest: bytes = b""
    _first: dict[str, Any] = field(default_factory=dict)  # id, created, model, fingerprint of the stream
    _base: int = 0  # tokens generated before the current engine's stream

    def feed(self, piece: bytes) -> bytes:
        """The events of `piece` (and any cut-off event before it) that are whole, edited."""
        events = (self._rest + piece).split(b"\n\n")
        self._rest = events.pop()
        return b"".join(self._event(event) for event in events)

    def resumable(self) -> bool:
        """Whether the stream can go on: it did not end, and the id of every token it sent is known."""
        return not (self.finished or self.done or self.gap)

    def resume(self, prompt_tokens: int) -> None:
        """A continuation's stream comes next: `prompt_tokens` is the request's prompt's length."""
        self._rest = b""
        self._base = len(self.generated)
        self.prompt_tokens = prompt_tokens
        self.resumes += 1

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: "):
            return event + b"\n\n" if event.strip() else b""
        payload = event[len(b"data: ") :]
        if payload.strip() == b"[DONE]":
            self.done = True
            return event + b"\n\n"
        try:
            data = json.loads(payload)
        except ValueError:
            return event + b"\n\n"
        if not isinstance(data, dict) or "choices" not in data:
            return event + b"\n\n"  # an error event, passed as it is
        return b"".join(b"data: " + _compact(edited) + b"\n\n" for edited in self._edit(data))

    def _edit(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        choices = data.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        self._count(choice, data.get("timings"))
        if self.resumes == 0:
            for name in ("id", "created", "model", "system_fingerprint"):
                self._first.setdefault(name, data.get(name))
        else:
            data = self._as_first(data, choice)
            choice = data["choices"][0]
            if data.get("usage"):
                data["usage"] = self._usage_of(data["usage"])
        if choice.get("finish_reason"):
            self.finished = True
        if not self.client_logprobs and "logprobs" in choice:
            if self.route == CHAT:
                del choice["logprobs"]
            else:
                choice["logprobs"] = None
        if not self.client_timings and not choice.get("finish_reason") and "usage" not in data:
            data.pop("timings", None)
        if not self.resumes or self.route != CHAT:
            return [data]
        if not choice.get("finish_reason"):
            return [data] if _has_content(choice) else []  # no text: nothing a chat delta would say
        # a chat's end: the finish, then the usage in an event of its own when the client asked for it
        usage = data.pop("usage", None)
        usage_event = {**data, "choices": [], "usage": usage}
        usage_event.pop("timings", None)
        return [data, usage_event] if usage is not None and self.client_usage else [data]

    def _count(self, choice: dict[str, Any], timings: Any) -> None:
        logprobs = choice.get("logprobs")
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        ids = [e["id"] for e in content or () if isinstance(e, dict) and isinstance(e.get("id"), int)]
        self.generated += ids
        if not ids and _text(choice):
            self.gap = True  # text whose tokens are not known (an engine that does not say them)
        if isinstance(timings, dict) and isinstance(timings.get("predicted_n"), int):
            self.decoded = self._base + timings["predicted_n"]
            # a token decoded but not in any event: held back (a split character, a stop string's start)
            self.gap = self.gap or (not choice.get("finish_reason") and self.decoded != len(self.generated))

    def _as_first(self, data: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any]:
        """A continuation's (completion) event as the first stream's: its names, and a chat's delta."""
        out = {**data, **{k: v for k, v in self._first.items() if v is not None}}
        if self.route == CHAT:
            text = choice.get("text") or ""
            edited: dict[str, Any] = {
                "index": choice.get("index", 0),
                "delta": {"content": text} if text else {},
                "finish_reason": choice.get("finish_reason"),
            }
            if choice.get("logprobs") is not None:
                edited["logprobs"] = choice["logprobs"]
            out["choices"] = [edited]
            out["object"] = "chat.completion.chunk"
        return out

    def _usage_of(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The whole answer's usage: the prompt once, every token generated on every engine."""
        prompt = self.prompt_tokens or 0
        completion = self._base + int(usage.get("completion_tokens") or 0)
        total = prompt + completion
        return {**usage, "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}


def _text(choice: dict[str, Any]) -> str:
    """The text of an event's choice: a completion's `text`, a chat delta's `content`."""
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def _has_content(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    return isinstance(delta, dict) and bool(delta.get("content"))


def _compact(data: dict[str, Any]) -> bytes:
    """JSON as llama-server writes it (no spaces), so that what reads its events reads these alike."""
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
