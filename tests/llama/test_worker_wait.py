"""A request's silence is reported every few seconds (`Worker.complete(on_wait=...)`), so that `run` can
say why the first token is slow: a fresh Vulkan server compiles its shaders then (issue 43)."""

from __future__ import annotations

import queue

import pytest

from orchestrator.llama.worker import parent
from orchestrator.llama.worker.parent import Worker


def silent_worker() -> Worker:
    """The parent's side of the pipe alone: what `_next` reads (no child runs)."""
    worker = object.__new__(Worker)
    worker._dead = None
    worker._lines = queue.Queue()
    return worker


def test_a_silence_is_reported_until_the_answer_comes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parent, "WAIT_REPORT_S", 0.05)
    worker = silent_worker()
    waits: list[float] = []

    def on_wait(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 3:
            worker._lines.put(b'{"event": "token", "text": "hi"}\n')

    assert worker._next(10.0, "generating", on_wait) == {"event": "token", "text": "hi"}
    assert len(waits) == 3 and waits == sorted(waits) and 0.05 <= waits[0] < 1.0


def test_without_on_wait_an_answer_is_read_as_before() -> None:
    worker = silent_worker()
    worker._lines.put(b'{"event": "done"}\n')
    assert worker._next(1.0, "generating") == {"event": "done"}
