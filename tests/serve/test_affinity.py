"""Prefix-affine routing (issue 34): the affinity key of a request, rendezvous hashing over a model's
serving formations, the fallback of a saturated formation, and the KV cache in use read from
llama-server's /slots. Pure: tables of data in, decisions out."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from orchestrator.serve.affinity import (
    AFFINE,
    FALLBACK,
    LEAST_LOADED,
    PROMPT_PREFIX_CHARS,
    Load,
    affinity_key,
    least_loaded,
    reason,
    rendezvous,
    route,
)
from orchestrator.serve.metrics import kv_used

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SYSTEM = {"role": "system", "content": "You are terse. " * 50}


def _turns(first: str, n: int) -> list[list[dict[str, str]]]:
    """The message lists of a conversation's `n` turns (each repeats the history before it)."""
    history: list[dict[str, str]] = [SYSTEM, {"role": "user", "content": first}]
    turns = [list(history)]
    for i in range(1, n):
        history += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"more {i}"}]
        turns.append(list(history))
    return turns


def test_every_turn_of_a_conversation_has_its_first_turns_key_and_other_conversations_others() -> None:
    keys = {affinity_key(CHAT, {"messages": messages}) for messages in _turns("hello", 6)}
    assert len(keys) == 1 and next(iter(keys)).startswith("chat:")
    other_user = affinity_key(CHAT, {"messages": _turns("bonjour", 1)[0]})
    other_system = affinity_key(
        CHAT,
        {"messages": [{"role": "system", "content": "Be verbose."}, {"role": "user", "content": "hello"}]},
    )
    assert len(keys | {other_user, other_system}) == 3


@pytest.mark.parametrize(
    ("route_", "body", "expected"),
    [
        (CHAT, {"user": "ann", "messages": [{"role": "user", "content": "x"}]}, "user:ann"),
        (COMPLETIONS, {"user": " bob ", "prompt": "x"}, "user:bob"),
        (CHAT, {"user": "", "messages": [{"role": "user", "content": "x"}]}, "chat:"),
        (CHAT, {"messages": []}, None),
        (COMPLETIONS, {"prompt": ""}, None),
        (COMPLETIONS, {"prompt": ["abc", "def"]}, "prompt:"),
        ("/v1/embeddings", {"input": "x"}, None),
    ],
)
def test_the_key_is_the_user_field_else_a_hash_of_the_prefix_else_none(
    route_: str, body: dict[str, Any], expected: str | None
) -> None:
    key = affinity_key(route_, body)
    if expected is None or not expected.endswith(":"):  # the whole key, or none
        assert key == expected
    else:  # a hash after the kind
        assert key is not None and key.startswith(expected) and len(key) == len(expected) + 32


def test_a_completion_is_keyed_on_its_prompts_first_characters_only() -> None:
    head = "s" * PROMPT_PREFIX_CHARS
    assert affinity_key(COMPLETIONS, {"prompt": head + "turn 1"}) == affinity_key(
        COMPLETIONS, {"prompt": head + "turn 1, answer, turn 2"}
    )
    assert affinity_key(COMPLETIONS, {"prompt": "a" + head}) != affinity_key(
        COMPLETIONS, {"prompt": "b" + head}
    )
    assert affinity_key(COMPLETIONS, {"prompt": ["abc", "x"]}) == affinity_key(COMPLETIONS, {"prompt": "abc"})


def _loads(*specs: tuple[str, int], parallel: int = 4) -> list[Load]:
    return [Load(f"m#{i}", state, admitted, parallel) for i, (state, admitted) in enumerate(specs)]


KEYS = [f"chat:{i}" for i in range(600)]


def test_the_same_key_goes_to_the_same_formation_whatever_the_loads_below_saturation() -> None:
    for key in KEYS[:50]:
        firsts = {
            route(_loads(("ready", a), ("ready", b), ("degraded", c)), key, turn=turn)[0][0]
            for a, b, c, turn in [(0, 0, 0, 0), (3, 0, 0, 1), (0, 3, 2, 2), (1, 2, 3, 7)]
        }
        assert len(firsts) == 1, key


def test_keys_spread_evenly_over_the_formations() -> None:
    names = ["m#0", "m#1", "m#2"]
    spread = Counter(rendezvous(key, names) for key in KEYS)
    assert sorted(spread) == [0, 1, 2]
    assert all(160 <= n <= 240 for n in spread.values()), spread  # 200 each, give or take


def test_a_formation_leaving_or_joining_moves_only_its_own_keys() -> None:
    four = ["m#0", "m#1", "m#2", "m#3"]
    three = ["m#0", "m#1", "m#3"]  # m#2 left
    before = {key: four[rendezvous(key, four) or 0] for key in KEYS}
    after = {key: three[rendezvous(key, three) or 0] for key in KEYS}
    moved = {key for key in KEYS if before[key] != after[key]}
    assert moved == {key for key in KEYS if before[key] == "m#2"}  # m#2's keys, and only they, move
    assert len({after[key] for key in moved}) == 3  # spread over the others, not piled on one
    # m#2 joining again (before <- after) moves exactly the keys it wins back
    assert {key for key in KEYS if after[key] != before[key]} == moved


def test_a_formation_not_serving_is_out_of_the_rendezvous_and_gets_its_keys_back_after() -> None:
    ready = _loads(("ready", 0), ("ready", 0), ("ready", 0))
    mine = [key for key in KEYS if route(ready, key)[1] == 1][:20]
    assert mine
    for state in ("recovering", "loading", "draining", "failed"):
        away = _loads(("ready", 0), (state, 0), ("ready", 0))
        for key in mine:
            order, best = route(away, key)
            assert best in (0, 2) and order[0] == best and 1 not in order
    assert {route(ready, key)[1] for key in mine} == {1}


@pytest.mark.parametrize(
    ("loads", "expected_order"),
    [
        # the key's formation (found below: index `b`) saturated: the least-loaded first
        ({"b": 4, "others": (1, 2)}, "least"),
        # everyone saturated alike: the key's formation first (ties go to it), then in load order
        ({"b": 4, "others": (4, 4)}, "b first"),
        # one slot left on the key's formation: still it
        ({"b": 3, "others": (0, 0)}, "b first"),
    ],
)
def test_a_saturated_formation_sends_its_keys_to_the_least_loaded(
    loads: dict[str, Any], expected_order: str
) -> None:
    key = "chat:saturation"
    b = route(_loads(("ready", 0), ("ready", 0), ("ready", 0)), key)[1]
    assert b is not None
    admitted = list(loads["others"])
    admitted.insert(b, loads["b"])
    order, best = route(_loads(*(("ready", n) for n in admitted)), key)
    assert best == b and sorted(order) == [0, 1, 2]
    if expected_order == "b first":
        assert order[0] == b and reason(order[0], best) == AFFINE
    else:
        assert order[0] != b and admitted[order[0]] == min(admitted)
        assert reason(order[0], best) == FALLBACK


def test_least_loaded_routing_and_keyless_requests_ignore_affinity() -> None:
    loads = _loads(("ready", 3), ("degraded", 1), ("recovering", 0), ("ready", 1))
    assert route(loads, "chat:x", "least-loaded") == ([1, 3, 0], None)
    assert route(loads, None) == ([1, 3, 0], None)
    assert route(loads, None, turn=2)[0] == [3, 1, 0]  # ties in turns
    assert [least_loaded(_loads(("ready", 0), ("ready", 0), ("ready", 0)), t)[0] for t in range(4)] == [
        0,
        1,
        2,
        0,
    ]
    assert route(_loads(("loading", 0), ("failed", 0)), "chat:x") == ([], None)
    assert reason(2, None) == LEAST_LOADED


# llama-server's /slots (tools/server/server-context.cpp, server_slot::to_json of the pinned llama.cpp):
# a slot never used has no n_prompt_tokens; n_prompt_tokens counts the tokens its cache holds.
SLOTS = [
    {"id": 0, "n_ctx": 1024, "speculative": False, "is_processing": False},
    {"id": 1, "n_ctx": 1024, "is_processing": True, "id_task": 7, "n_prompt_tokens": 512},
    {"id": 2, "n_ctx": 1024, "is_processing": False, "id_task": 3, "n_prompt_tokens": 256},
    {"id": 3, "n_ctx": 1024, "is_processing": False, "id_task": 2, "n_prompt_tokens": 0},
]


@pytest.mark.parametrize(
    ("text", "ratio", "slots"),
    [
        (json.dumps(SLOTS), 768 / 4096, ((0, 0.0), (1, 0.5), (2, 0.25), (3, 0.0))),
        (json.dumps(SLOTS[:1]), 0.0, ((0, 0.0),)),
        (json.dumps([{"id": 0, "n_ctx": 100, "n_prompt_tokens": 150}]), 1.0, ((0, 1.0),)),  # capped
        ("", None, None),  # the engine did not answer
        ("not json", None, None),
        ('{"error": {"code": 501}}', None, None),  # /slots disabled
        ("[]", None, None),
        ('[{"id": 0}]', None, None),  # no context: no ratio
    ],
)
def test_the_kv_cache_in_use_is_the_slots_tokens_over_their_contexts(
    text: str, ratio: float | None, slots: tuple[tuple[int, float], ...] | None
) -> None:
    kv = kv_used(text)
    if ratio is None:
        assert kv is None
    else:
        assert kv is not None and kv.ratio == pytest.approx(ratio) and kv.slots == slots
