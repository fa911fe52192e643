"""Structured logging (structlog): human-readable by default, JSON with --log-format json.

Logs go to stderr and are separate from what the CLI prints for the user. Bind context per host and
run: `log = get_logger().bind(host=host.name, run_id=run_id)`. Events are snake_case.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal

import structlog

LogFormat = Literal["text", "json"]


class _StderrLogger:
    """Writes to whatever sys.stderr is at the time of the call (tests swap it; the CLI may too)."""

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


def _stderr_logger_factory(*_args: Any) -> _StderrLogger:
    return _StderrLogger()


def configure_logging(fmt: LogFormat = "text", level: str | int = "WARNING") -> None:
    """Configure structlog for the process (the CLI calls this; a library user may configure their own)."""
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    exc_info: Any = (
        structlog.processors.format_exc_info if fmt == "json" else structlog.processors.StackInfoRenderer()
    )
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=_stderr_logger_factory,
        cache_logger_on_first_use=False,
    )


def get_logger(**context: Any) -> Any:
    """A structlog logger with `context` bound."""
    # Lazy proxy: a module-level logger must follow configure_logging() called later by the CLI.
    return structlog.get_logger("rpcfleet", **context)


# structlog's own default prints every level to stdout, which would corrupt --json output and
# the output of programs using orchestrator as a library; start quiet on stderr unless the
# application configured structlog first.
if not structlog.is_configured():
    configure_logging()
