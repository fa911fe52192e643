"""The drop-in API's multimodal handler: llama-cpp-python 0.3.36's generic `MTMDChatHandler` for an `mmproj`,
configured by `chat_handler_kwargs` (`use_gpu`, `verbose`, `extra_template_arguments`).

MTMD opens the projector on the first multimodal request (as the drop-in spec says), so a projector that
does not load fails there. Stock 0.3.36 then raises `ValueError("Failed to load mtmd context from:
...")` and, when not verbose, hides mtmd's reason (a width mismatch with the text model, a file that
is no projector). Here mtmd's log is captured while the projector loads and a `MultimodalError` (a
`LoaderError` and still a `ValueError`) names the file and mtmd's own reason. mtmd's log otherwise
follows the model's `verbose` (stock 0.3.36 prints it whatever `verbose` says): everything when
verbose, else only errors.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from orchestrator.core.errors import LoaderError

_GGML_LOG_LEVEL_ERROR = 4


_GGML_LOG_LEVEL_CONT = 5

HANDLER_KEYS = frozenset({"use_gpu", "verbose", "extra_template_arguments"})


class MultimodalError(LoaderError, ValueError):
    """The multimodal projector did not load (mtmd's reason in the message)."""


class _MtmdLog:
    """mtmd's and mtmd-helper's logs, routed here once per process. Both default to stderr whatever
    `verbose` says (stock 0.3.36 prints about 20 lines per image with verbose=False); here they are
    echoed when the request's model is verbose, else only errors, and collected while a projector
    loads. The callback lives as long as the process, like llama_cpp's own log callback."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.installed = False
        self.echo = True
        self.sink: list[tuple[int, str]] | None = None
        self.last_level = 0
        self.callback: Any = None

    def record(self, level: int, text: bytes, user_data: Any) -> None:
        if level == _GGML_LOG_LEVEL_CONT:
            level = self.last_level
        self.last_level = level
        decoded = text.decode("utf-8", "replace")
        if self.sink is not None:
            self.sink.append((level, decoded))
        elif self.echo or level >= _GGML_LOG_LEVEL_ERROR:
            with contextlib.suppress(Exception):  # stderr may be gone at interpreter exit
                sys.stderr.write(decoded)

    def install(self, mtmd: Any) -> None:
        with self.lock:
            if self.installed:
                return
            import llama_cpp

            self.callback = llama_cpp.llama_cpp.llama_log_callback(self.record)
            mtmd.mtmd_log_set(self.callback, ctypes.c_void_p(0))
            mtmd.mtmd_helper_log_set(self.callback, ctypes.c_void_p(0))
            self.installed = True

    @contextlib.contextmanager
    def routed(self, mtmd: Any, echo: bool) -> Iterator[None]:
        """Echo everything (`echo`) or only errors while the block runs."""
        self.install(mtmd)
        previous, self.echo = self.echo, echo
        try:
            yield
        finally:
            self.echo = previous

    @contextlib.contextmanager
    def collected(self, echo: bool) -> Iterator[list[tuple[int, str]]]:
        """Collect the log (level, text) while the block runs, echoing it too when `echo`."""
        records: list[tuple[int, str]] = []
        self.sink = records
        try:
            yield records
        finally:
            self.sink = None
            if echo:
                with contextlib.suppress(Exception):
                    sys.stderr.write("".join(text for _, text in records))


_LOG = _MtmdLog()


def _reason(records: list[tuple[int, str]]) -> str:
    """mtmd's error lines (with the hint lines that follow them), one line."""
    text = "".join(t for level, t in records if level == _GGML_LOG_LEVEL_ERROR)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = [line.split(": error: ", 1)[-1] for line in lines]
    return "; ".join(lines)


def mtmd_handler(mmproj: str | Path, verbose: bool, use_gpu: bool, handler_kwargs: Mapping[str, Any]) -> Any:
    """MTMD's chat handler for `mmproj`, taking the drop-in API's `chat_handler_kwargs`: `use_gpu`, `verbose`
    and `extra_template_arguments` (given to the chat template on every request). Any other key is an
    error naming those."""
    from llama_cpp.llama_chat_format import MTMDChatHandler

    class DropinMTMDChatHandler(MTMDChatHandler):
        def __init__(self, extra_template_arguments: Mapping[str, Any] | None = None, **kw: Any) -> None:
            super().__init__(**kw)
            self.extra_template_arguments = dict(extra_template_arguments or {})

        def __call__(self, **kw: Any) -> Any:
            with _LOG.routed(self._mtmd_cpp, echo=bool(getattr(kw.get("llama"), "verbose", True))):
                return super().__call__(**{**self.extra_template_arguments, **kw})

        def _init_mtmd_context(self, llama_model: Any) -> None:
            if self.mtmd_ctx is not None:
                return
            _LOG.install(self._mtmd_cpp)
            try:
                with _LOG.collected(echo=bool(llama_model.verbose)) as records:
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
        return DropinMTMDChatHandler(clip_model_path=str(mmproj), **options)
    except ValueError as exc:  # the projector file does not exist
        raise LoaderError(f"mmproj: {exc}") from None
