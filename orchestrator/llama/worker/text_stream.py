"""Generated text as it may be streamed, decoded token by token in linear time (pure; no llama_cpp).

llama-cpp-python's own streaming re-detokenizes every growing run of tokens that is not yet valid UTF-8,
once per new token: cubic in the tokens when a model emits bytes that never form a character (a
random-weight model does so all the time, a real one on a broken byte sequence). `TextStream` feeds
each token's bytes once through one incremental UTF-8 decoder instead.

Its text is the text of llama-cpp-python's non-streamed completion, built up: invalid bytes are dropped
(as that completion's `decode("utf-8", errors="ignore")` drops them), a character split across tokens
waits for its last byte, and text that could be the start of a stop sequence waits until it is not
(the completion is cut at a stop sequence, which must never reach the caller).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable


class TextStream:
    """Feed each generated token's bytes (`feed`); each call returns the text that may be sent now."""

    def __init__(self, stops: Iterable[str] = (), *, strip_leading_space: bool = False) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        self._stops: tuple[str, ...] = ()
        self._held = ""  # decoded, not yet sent: it could be the start of a stop sequence
        self._sent: list[str] = []
        self._strip = strip_leading_space  # llama-cpp-python drops it after a BOS (an empty prompt)
        self.stopped = False  # a stop sequence was reached: nothing more is sent
        self.set_stops(stops)

    def set_stops(self, stops: Iterable[str]) -> None:
        """The stop sequences (a chat template adds its own, known only once the request is formatted)."""
        self._stops = tuple(stops)

    @property
    def sent(self) -> str:
        """Everything `feed` and `finish` returned so far."""
        return "".join(self._sent)

    def feed(self, piece: bytes) -> str:
        """The text that may be sent after `piece` (a token's bytes): possibly empty."""
        if self._strip and piece:
            self._strip = False
            piece = piece.removeprefix(b" ")
        return self._release(self._held + self._decoder.decode(piece), final=False)

    def finish(self) -> str:
        """The rest, once no token follows: the held-back text (an incomplete character is dropped)."""
        return self._release(self._held + self._decoder.decode(b"", final=True), final=True)

    def _release(self, text: str, *, final: bool) -> str:
        if self.stopped:
            return ""
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            ready, self._held = text[:cut], ""
        else:
            hold = 0 if final else self._stop_prefix(text)
            ready, self._held = text[: len(text) - hold], text[len(text) - hold :]
        if ready:
            self._sent.append(ready)
        return ready

    def _stop_prefix(self, text: str) -> int:
        """The length of the longest end of `text` that begins a stop sequence (without being one)."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
