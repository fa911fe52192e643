"""The seed's multimodal handler: llama-cpp-python 0.3.36's generic `MTMDChatHandler` for an `mmproj`,
configured by `chat_handler_kwargs` (`use_gpu`, `verbose`, `extra_template_arguments`).

MTMD opens the projector on the first multimodal request (as the seed says), so a projector that
does not load fails there. Stock 0.3.36 then raises `ValueError("Failed to load mtmd context from:
...")` and, when not verbose, hides mtmd's reason (a width mismatch with the text model, a file that
is no projector). Here mtmd's log is captured while the projector loads and a `MultimodalError` (a
`LoaderError` and still a `ValueError`) names the file and mtmd's own reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from orchestrator.core.errors import LoaderError

_GGML_LOG_LEVEL_ERROR = 4

HANDLER_KEYS = frozenset({"use_gpu", "verbose", "extra_template_arguments"})


class MultimodalError(LoaderError, ValueError):
    """The multimodal projector did not load (mtmd's reason in the message)."""


@contextlib.contextmanager
def _capture_mtmd_log(mtmd: Any, sink: list[tuple[int, str]], echo: bool) -> Iterator[None]:
    """Route mtmd's (and clip's) log into `sink` while the block runs, echoed to stderr when `echo`;
    mtmd's default logger (stderr) is restored afterwards (`mtmd_log_set(NULL)`)."""
    import llama_cpp

    def record(level: int, text: bytes, user_data: Any) -> None:
        decoded = text.decode("utf-8", "replace")
        sink.append((level, decoded))
        if echo:
            sys.stderr.write(decoded)

    callback = llama_cpp.llama_cpp.llama_log_callback(record)  # referenced until restored below
    mtmd.mtmd_log_set(callback, ctypes.c_void_p(0))
    try:
        yield
    finally:
        mtmd.mtmd_log_set(llama_cpp.llama_cpp.llama_log_callback(), ctypes.c_void_p(0))  # NULL: the default
        del callback


def _reason(records: list[tuple[int, str]]) -> str:
    """mtmd's error lines (with the hint lines that follow them), one line."""
    text = "".join(t for level, t in records if level == _GGML_LOG_LEVEL_ERROR)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = [line.split(": error: ", 1)[-1] for line in lines]
    return "; ".join(lines)


def mtmd_handler(mmproj: str | Path, verbose: bool, use_gpu: bool, handler_kwargs: Mapping[str, Any]) -> Any:
    """MTMD's chat handler for `mmproj`, taking the seed's `chat_handler_kwargs`: `use_gpu`, `verbose`
    and `extra_template_arguments` (given to the chat template on every request). Any other key is an
    error naming those."""
    from llama_cpp.llama_chat_format import MTMDChatHandler

    class SeedMTMDChatHandler(MTMDChatHandler):
        def __init__(self, extra_template_arguments: Mapping[str, Any] | None = None, **kw: Any) -> None:
            super().__init__(**kw)
            self.extra_template_arguments = dict(extra_template_arguments or {})

        def __call__(self, **kw: Any) -> Any:
            return super().__call__(**{**self.extra_template_arguments, **kw})

        def _init_mtmd_context(self, llama_model: Any) -> None:
            if self.mtmd_ctx is not None:
                return
            records: list[tuple[int, str]] = []
            try:
                with _capture_mtmd_log(self._mtmd_cpp, records, bool(llama_model.verbose)):
                    super()._init_mtmd_context(llama_model)
            except ValueError as exc:
                reason = _reason(records) or str(exc)
                raise MultimodalError(f"mmproj {self.clip_model_path} did not load: {reason}") from None

    unknown = sorted(set(handler_kwargs) - HANDLER_KEYS)
    if unknown:
        raise LoaderError(
            f"chat_handler_kwargs: unknown key(s) {', '.join(unknown)} "
            f"(the multimodal handler takes {', '.join(sorted(HANDLER_KEYS))})"
        )
    options = {"use_gpu": use_gpu, "verbose": verbose, **handler_kwargs}
    try:
        return SeedMTMDChatHandler(clip_model_path=str(mmproj), **options)
    except ValueError as exc:  # the projector file does not exist
        raise LoaderError(f"mmproj: {exc}") from None
