"""What serve tells as it happens (`News`): an on-demand model's load, unload or swap, a request that
went on after its engine was lost. Each event is told to the console (`on_event`) and kept for the live
page's events (the newest EVENTS_KEPT, `since` a reader's cursor); the counters are in `/metrics`."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.core.log import get_logger

EVENTS_KEPT = 200  # the newest events, for the live page


@dataclass(frozen=True)
class ServeEvent:
    """One event: `kind` load, resume, loaded, load_failed, unload, swap (an on-demand model's) or
    resumed (a request that went on on `formation`); `at` wall clock."""

    at: float
    kind: str
    model: str
    formation: str
    message: str


class News:
    """serve's events: the newest kept, each told to `on_event` (the console) as it happens."""

    def __init__(self, on_event: Callable[[ServeEvent], None] | None = None) -> None:
        self.on_event = on_event
        self.latest: deque[ServeEvent] = deque(maxlen=EVENTS_KEPT)
        self.count = 0  # events ever (a reader's cursor over `latest`)

    def tell(self, kind: str, model: str, formation: str, message: str) -> ServeEvent:
        event = ServeEvent(time.time(), kind, model, formation, message)
        self.latest.append(event)
        self.count += 1
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception as exc:  # a display's bug must not stop a load, an unload or a request
                get_logger().warning("serve_event_display_failed", error=repr(exc))
        return event

    def since(self, cursor: int) -> tuple[list[ServeEvent], int]:
        """The events told after `cursor` (an earlier `count`; those no longer kept are skipped), and the
        cursor now."""
        new = min(self.count - cursor, len(self.latest))
        return (list(self.latest)[-new:] if new > 0 else []), self.count
