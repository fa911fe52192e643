"""Playbooks as typed data: steps, plays and results."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from orchestrator.core.errors import (
    PlaybookError,
    SourceLocation,
)
from orchestrator.engine.executor import (
    HostContext,
    HostResult,
    Recap,
    RunResult,
    Session,
    StepOutcome,
)
from orchestrator.inventory.model import Host

if TYPE_CHECKING:  # imported lazily at run time: planning pulls in numpy
    from orchestrator.planning.plan import Plan
    from orchestrator.probe.fleet import FleetProbe


Serial = int | str | tuple[int | str, ...] | None


Scope = Literal["host", "fleet"]


T = TypeVar("T")


Step = Callable[[HostContext], Awaitable[StepOutcome[Any]]]


@dataclass(frozen=True)
class PlaybookStep:
    """One step: the operation, its validated arguments, where it is written, its optional name."""

    op: str
    args: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    location: SourceLocation | None = field(default=None, compare=False)
    name: str | None = None
    index: int = 1  # 1-based position in the playbook

    @property
    def label(self) -> str:
        """How messages name the step: `step 2 (restart)` or `step 2 "name" (restart)`."""
        named = f' "{self.name}"' if self.name else ""
        return f"step {self.index}{named} ({self.op})"


@dataclass(frozen=True)
class Playbook:
    name: str
    steps: tuple[PlaybookStep, ...]
    hosts: str = "all"
    serial: Serial = None
    max_fail_percentage: float | None = None
    vars: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    path: Path | None = None


class PlaybookErrors(PlaybookError):
    """Several errors in one playbook: `errors` lists each, in file order; the message shows them all."""

    def __init__(self, errors: Sequence[PlaybookError]) -> None:
        self.errors = tuple(errors)
        super().__init__("\n".join(err.message for err in self.errors))

    @property
    def location(self) -> SourceLocation | None:
        return self.errors[0].location


@dataclass
class PlayState:
    """What fleet steps leave for the steps after them (the latest probe and plan) and the documents
    (plans, reports) the run produced."""

    probe: FleetProbe | None = None
    plan: Plan | None = None
    documents: list[Document] = field(default_factory=list)


@dataclass(frozen=True)
class Document:
    """A text a step produced for the user (a plan, a report): the CLI prints it or says where it went."""

    step: str
    kind: str
    text: str
    path: str | None = None  # written there (None: not written)


@dataclass(frozen=True)
class Play:
    """What an operation's factory gets besides its arguments."""

    session: Session
    hosts: tuple[Host, ...]  # the hosts still in play for this step
    check: bool
    state: PlayState
    step: PlaybookStep
    wait_lock: float = 0.0  # seconds to wait for another operator's host lock


@dataclass(frozen=True)
class StepRun:
    step: PlaybookStep
    run: RunResult[Any]


@dataclass(frozen=True)
class PlaybookResult:
    playbook: Playbook
    hosts: tuple[Host, ...]
    steps: tuple[StepRun, ...]
    documents: tuple[Document, ...] = ()
    aborted: bool = False  # a failure threshold stopped the play
    check: bool = False

    @property
    def recap(self) -> Recap:
        recap = Recap()
        for step_run in self.steps:
            recap.add(step_run.run)
        return recap

    @property
    def ok(self) -> bool:
        return (
            not self.aborted
            and all(s.run.ok for s in self.steps)
            and len(self.steps) == len(self.playbook.steps)
        )

    def to_json(self) -> dict[str, Any]:
        """The whole run as JSON: each step's result per host, and the recap."""

        def value(result: HostResult[Any]) -> Any:
            to_json = getattr(result.value, "to_json", None)
            return to_json() if callable(to_json) else None

        return {
            "playbook": self.playbook.name,
            "check": self.check,
            "ok": self.ok,
            "aborted": self.aborted,
            "interrupted": any(s.run.interrupted for s in self.steps),
            "steps": [
                {
                    "step": s.step.label,
                    "results": [
                        {
                            "host": r.host.name,
                            "status": r.status,
                            "message": r.message,
                            "result": value(r),
                            "error": str(r.error) if r.error else None,
                        }
                        for r in s.run.results
                    ],
                }
                for s in self.steps
            ],
            "recap": self.recap.to_json(),
        }

    def by_host(self) -> dict[str, list[HostResult[Any]]]:
        """Every result of each host, step by step."""
        out: dict[str, list[HostResult[Any]]] = {h.name: [] for h in self.hosts}
        for step_run in self.steps:
            for result in step_run.run.results:
                out.setdefault(result.host.name, []).append(result)
        return out
