"""The report formats by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from orchestrator.report.build import Report
from orchestrator.report.data import render_json
from orchestrator.report.html import render_html
from orchestrator.report.text import render_markdown, render_text

Format = Literal["text", "md", "json", "html"]


FORMATS: tuple[str, ...] = ("text", "md", "json", "html")


_RENDERERS: dict[str, Callable[[Report], str]] = {
    "text": render_text,
    "md": render_markdown,
    "json": render_json,
    "html": render_html,
}


def render(report: Report, fmt: str) -> str:
    try:
        return _RENDERERS[fmt](report)
    except KeyError:
        raise ValueError(f"unknown report format {fmt!r}; expected one of {', '.join(FORMATS)}") from None
