"""Tier 0 for issue 42 (item 2): the pure part of a request that outlives its engine (`serve.resume`):
which streams can go on, what the engine is asked, the continuation's request, and the rewrite of a
continuation's events into the client's first stream (the same id, no text repeated, usage once)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from orchestrator.serve import resume
from orchestrator.serve.proxy import resumes
from orchestrator.serve.resume import CHAT, COMPLETIONS, StreamEdit
from orchestrator.serve.states import Failure


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def _piece(route: str, text: str, token: int | None, decoded: int, first: bool = False) -> dict[str, Any]:
    """An engine's event of one token (llama-server's shape with logprobs and timings_per_token)."""
    logprobs = {"content": [{"id": token, "token": text, "logprob": -0.1}]} if token is not None else None
    if route == CHAT:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        if logprobs:
            choice["logprobs"] = logprobs
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": None}
        kind = "text_completion"
    return {
        "id": "first-id" if first else "other-id",
        "created": 1 if first else 2,
        "model": "g",
        "object": kind,
        "choices": [choice],
        "timings": {"predicted_n": decoded},
    }


def _events(out: bytes) -> list[Any]:
    return [json.loads(e[6:]) if e[6:] != b"[DONE]" else "[DONE]" for e in out.split(b"\n\n") if e]


@pytest.mark.parametrize(
    ("route", "data", "why"),
    [
        (COMPLETIONS, {"prompt": "hi"}, None),
        (COMPLETIONS, {"prompt": [1, 2, 3]}, None),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}]}, None),
        (COMPLETIONS, {"prompt": ["a", "b"]}, "not one prompt"),
        (COMPLETIONS, {"prompt": "hi", "n": 2}, "several choices"),
        (CHAT, {"messages": [], "tools": [{"type": "function"}]}, "tools"),
        (COMPLETIONS, {"prompt": "hi", "grammar": "root ::= x"}, "grammar"),
        (CHAT, {"messages": [], "response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/embeddings", {"input": "hi"}, "not a generation"),
    ],
)
def test_which_streams_can_go_on(route: str, data: dict[str, Any], why: str | None) -> None:
    got = resume.not_resumable(route, data)
    assert (got is None) if why is None else (got is not None and why in got), got


def test_the_engine_is_asked_for_each_tokens_id_and_the_count_decoded_unless_the_client_asked() -> None:
    chat = resume.engine_body(CHAT, {"messages": [], "max_tokens": 5})
    assert chat["logprobs"] is True and chat["top_logprobs"] == 1 and chat["timings_per_token"] is True
    asked = resume.engine_body(CHAT, {"messages": [], "logprobs": True, "top_logprobs": 5})
    assert asked["top_logprobs"] == 5  # the client's own, kept
    text = resume.engine_body(COMPLETIONS, {"prompt": "hi"})
    assert text["n_probs"] == 1 and "logprobs" not in text


def test_the_continuation_is_the_prompts_tokens_then_those_streamed_with_the_bound_left() -> None:
    data = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 10,
        "n_predict": 10,
        "temperature": 0,
        "seed": 7,
        "stop": ["\n\n"],
        "tools": None,
        "stream": True,
        "cache_prompt": False,
    }
    body = resume.continuation_body(CHAT, data, [2, 100, 101], [5, 6, 7])
    assert body["prompt"] == [2, 100, 101, 5, 6, 7]
    assert body["max_tokens"] == body["n_predict"] == 7
    assert body["temperature"] == 0 and body["seed"] == 7 and body["stop"] == ["\n\n"]
    assert "messages" not in body and "logprobs" not in body and body["n_probs"] == 1
    assert body["stream"] is True and body["timings_per_token"] is True
    assert body["cache_prompt"] is True  # the replay filled the slot's cache: used, not computed again


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_a_continuation_reads_as_the_first_stream_with_usage_counted_once(route: str) -> None:
    edit = StreamEdit(route, client_logprobs=False, client_timings=False, client_usage=True)
    first = edit.feed(
        _event(_piece(route, "Hel", 10, 1, first=True)) + _event(_piece(route, "lo", 11, 2, True))
    )
    seen = _events(first)
    assert [e["id"] for e in seen] == ["first-id", "first-id"]
    assert all("timings" not in e for e in seen)  # asked for the ids, not by the client: removed
    choice = seen[0]["choices"][0]
    assert ("logprobs" not in choice) if route == CHAT else choice["logprobs"] is None
    assert edit.generated == [10, 11] and edit.resumable()
    edit.resume(prompt_tokens=4)
    # the continuation is a completion stream whatever the route (its prompt: the tokens)
    more = _piece(COMPLETIONS, " world", 12, 1)
    end = {
        **_piece(COMPLETIONS, "", None, 1),
        "usage": {"prompt_tokens": 6, "completion_tokens": 1, "total_tokens": 7},
    }
    end["choices"][0]["finish_reason"] = "length"
    out = _events(edit.feed(_event(more) + _event(end) + b"data: [DONE]\n\n"))
    assert out[-1] == "[DONE]"
    events = out[:-1]
    assert {e["id"] for e in events} == {"first-id"} and {e["created"] for e in events} == {1}
    texts = [
        (e["choices"][0].get("delta", {}).get("content") if route == CHAT else e["choices"][0]["text"])
        for e in events
        if e["choices"]
    ]
    assert texts[0] == " world"
    if route == CHAT:
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens"] == 4
    usage = [e["usage"] for e in events if e.get("usage")][-1]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (4, 3, 7)
    assert edit.generated == [10, 11, 12] and not edit.resumable()


def test_a_token_held_back_is_a_gap_and_the_stream_cannot_go_on() -> None:
    """A character split over two tokens: llama-server sends nothing for the first, then both pieces'
    text with the second's id alone; `predicted_n` says 2 where 1 id is known."""
    edit = StreamEdit(COMPLETIONS, client_logprobs=False, client_timings=False)
    edit.feed(_event(_piece(COMPLETIONS, "a", 1, 1, True)))
    assert edit.resumable()
    edit.feed(_event(_piece(COMPLETIONS, "é", 3, 3)))
    assert edit.gap and not edit.resumable()


def test_text_without_ids_is_a_gap_and_an_event_cut_in_two_pieces_is_read_whole() -> None:
    edit = StreamEdit(COMPLETIONS, client_logprobs=False, client_timings=False)
    whole = _event(_piece(COMPLETIONS, "abc", 5, 1, True))
    assert edit.feed(whole[:20]) == b""
    assert _events(edit.feed(whole[20:]))[0]["choices"][0]["text"] == "abc"
    assert edit.generated == [5]
    edit.feed(_event({"choices": [{"index": 0, "text": "x", "finish_reason": None}]}))
    assert edit.gap


def test_the_clients_own_logprobs_and_an_error_event_pass_as_they_are() -> None:
    edit = StreamEdit(CHAT, client_logprobs=True, client_timings=True)
    out = _events(edit.feed(_event(_piece(CHAT, "a", 1, 1, True))))
    assert out[0]["choices"][0]["logprobs"]["content"][0]["id"] == 1 and "timings" in out[0]
    error = {"error": {"message": "boom", "code": 500}}
    assert _events(edit.feed(_event(error))) == [error]


@pytest.mark.parametrize(
    ("failure", "goes_on"),
    [
        (Failure(503, "lost 10.0.0.2:50052", "node_lost", lost=("10.0.0.2:50052",)), True),
        (Failure(502, "the engine ended: signal SIGABRT", "server_error"), True),
        (Failure(502, "the engine broke the request off", "server_error", engine_alive=True), False),
        (Failure(503, "the engine was stopped", "unavailable"), False),
        (Failure(400, "bad", "invalid_request_error"), False),
    ],
)
def test_a_request_goes_on_elsewhere_only_when_its_engine_was_lost(failure: Failure, goes_on: bool) -> None:
    """An engine that runs on but broke a request off (it cannot answer that request) is not a loss: asked
    again, it would break it off again, without end; the client gets its 502."""
    assert resumes(failure) is goes_on


@pytest.mark.parametrize("asked", [None, True, False])
def test_a_replay_decodes_one_token_a_step_and_computes_the_prompt_as_the_request_asked(
    asked: bool | None,
) -> None:
    data: dict[str, Any] = {"temperature": 0} if asked is None else {"temperature": 0, "cache_prompt": asked}
    assert resume.greedy(data) and resume.greedy({"top_k": 1}) and not resume.greedy({"temperature": 0.7})
    first = resume.replay_body(data, [1, 2], [10, 11, 12], 0)
    assert first == {"prompt": [1, 2], "n_predict": 1, "temperature": 0, "cache_prompt": asked is not False}
    step = resume.replay_body(data, [1, 2], [10, 11, 12], 2)
    assert step["prompt"] == [1, 2, 10, 11] and step["cache_prompt"] is True  # one token past the cache
