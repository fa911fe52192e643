"""Structured logging (structlog): one timestamped line per event by default, JSON with --log-format json.

Logs go to stderr and are separate from what the CLI prints for the user. Bind context per host and
run: `log = get_logger(host=host.name, run_id=run_id)`. Events are snake_case.

structlog costs about a quarter of a second to import, so it is imported on the first event that passes
the level: a command that logs nothing never pays for it (`rpcfleet --help` starts in a tenth of that).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

LogFormat = Literal["text", "json"]

# logging's numbers, without importing logging (10 ms) for them
LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "exception": 40, "critical": 50}
_SKIP = frozenset({"event", "level", "log_level", "timestamp"})


@dataclass(frozen=True)
class _Config:
    fmt: LogFormat
    level: int
    explicit: bool  # configure_logging() was called: it wins over structlog's own configuration


_config = _Config("text", LEVELS["warning"], explicit=False)
_applied: _Config | None = None  # what structlog was last configured with


class _StderrLogger:
    """Writes to whatever sys.stderr is at the time of the call (tests swap it; the CLI may too)."""

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


def _stderr_logger_factory(*_args: Any) -> _StderrLogger:
    return _StderrLogger()


def render_text(_logger: Any, _name: str, event: dict[str, Any]) -> str:
    """`TIMESTAMP level event key=value ...`; a multi-line value or traceback continues on lines that
    start with the same timestamp, so every line written carries one (grep and sort keep working)."""
    stamp = event.get("timestamp") or datetime.now(UTC).isoformat(timespec="milliseconds")
    level = str(event.get("level") or event.get("log_level") or "info")
    exc = event.pop("exception", None)
    pairs = " ".join(f"{key}={_value(value)}" for key, value in event.items() if key not in _SKIP)
    head = f"{event.get('event', '')} {pairs}".rstrip()
    lines = head.splitlines() or [""]
    if exc:
        lines += str(exc).rstrip("\n").splitlines()
    first = f"{stamp} {level:<7} {lines[0]}"
    return "\n".join([first, *(f"{stamp} {level:<7}   {line}" for line in lines[1:])])


def _value(value: Any) -> str:
    if isinstance(value, dict | list):  # structured fields stay machine-readable
        import json

        return json.dumps(value, separators=(",", ":"), default=str)
    text = value if isinstance(value, str) else repr(value)
    return text if text and " " not in text and "=" not in text else repr(text)


def configure_logging(fmt: LogFormat = "text", level: str | int = "WARNING") -> None:
    """Set the format and level for the process (the CLI calls this; a library user may configure
    structlog themselves instead). structlog itself is configured when the first event is logged."""
    global _config
    numeric = LEVELS[level.lower()] if isinstance(level, str) else level
    _config = _Config(fmt, numeric, explicit=True)
    if "structlog" in sys.modules:
        _apply()


def _apply() -> None:
    """Configure structlog with `_config` unless the application configured it and we were not asked."""
    global _applied
    import structlog

    if _applied == _config or (not _config.explicit and structlog.is_configured() and _applied is None):
        return
    renderer: Any = structlog.processors.JSONRenderer() if _config.fmt == "json" else render_text
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_config.level),
        logger_factory=_stderr_logger_factory,
        cache_logger_on_first_use=False,
    )
    _applied = _config


class Logger:
    """A logger with bound context that imports structlog on the first event at or above the level."""

    def __init__(self, context: dict[str, Any]) -> None:
        self._context = context

    def bind(self, **context: Any) -> Logger:
        return Logger({**self._context, **context})

    def _emit(self, method: str, event: str, kw: dict[str, Any]) -> Any:
        # Nothing below the level reaches structlog, unless someone else imported (and configured) it.
        if LEVELS[method] < _config.level and "structlog" not in sys.modules:
            return None
        import structlog

        _apply()
        return getattr(structlog.get_logger("rpcfleet", **self._context), method)(event, **kw)

    def debug(self, event: str, **kw: Any) -> Any:
        return self._emit("debug", event, kw)

    def info(self, event: str, **kw: Any) -> Any:
        return self._emit("info", event, kw)

    def warning(self, event: str, **kw: Any) -> Any:
        return self._emit("warning", event, kw)

    def error(self, event: str, **kw: Any) -> Any:
        return self._emit("error", event, kw)

    def exception(self, event: str, **kw: Any) -> Any:
        return self._emit("exception", event, kw)


def get_logger(**context: Any) -> Logger:
    """A logger with `context` bound; it follows configure_logging() called later by the CLI."""
    return Logger(context)
