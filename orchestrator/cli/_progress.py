"""Progress on a terminal: rich bars and status lines fed by the callbacks the stages report through.

Nothing here is shown when the output is not a terminal (or with --json): a log or a pipe gets the
tables and the recap only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from orchestrator.cli import _output
from orchestrator.connectors.base import Progress as ProgressCallback
from orchestrator.core.units import format_size
from orchestrator.inventory.model import Host
from orchestrator.llama.worker.load_progress import LoadProgress
from orchestrator.operations.install.plan import InstallChange


def _bars(enabled: bool, *columns: ProgressColumn) -> Progress:
    """Rich bars on stderr, a description and a bar, then `columns`; gone once done; off unless `enabled`."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        *columns,
        console=_output.err_console,
        transient=True,
        disable=not enabled,
    )


class _TransferColumn(DownloadColumn):
    """Bytes done/total for an upload; the latest build log line for an on-node build."""

    def render(self, task: Task) -> Text:
        if "line" in task.fields:
            return Text(str(task.fields["line"])[:80], style="dim")
        return super().render(task)


class Uploads:
    """Rich progress bars for uploads, one per host, fed by `Connection.put`'s callback; for an on-node
    build, one status line per host showing the build log's latest line."""

    def __init__(self, enabled: bool) -> None:
        self.progress = _bars(enabled, _TransferColumn(), TransferSpeedColumn())

    def __call__(self, host: Host, change: InstallChange) -> ProgressCallback:
        what = f"the source of {change.version}" if change.build is not None else change.version
        task = self.progress.add_task(f"{host.name}: upload {what}", total=None)

        def update(done: int, total: int) -> None:
            self.progress.update(task, completed=done, total=total)

        return update

    def build_log(self, host: Host, change: InstallChange) -> Callable[[str], None]:
        task = self.progress.add_task(f"{host.name}: build {change.version}", total=None, line="starting")

        def update(line: str) -> None:
            self.progress.update(task, line=line)

        return update


class PlayProgress:
    """On a terminal: the play's steps done of all, and the hosts done in the current step (for a rolling
    restart, batch by batch), fed by the runner's `on_result` and `on_step` callbacks."""

    def __init__(self, name: str, steps: int, hosts: int, *, enabled: bool) -> None:
        self.hosts = hosts
        self.progress = _bars(enabled, TextColumn("{task.completed}/{task.total}"))
        self.steps = self.progress.add_task(f"{name}: steps", total=steps)
        self.current = self.progress.add_task("hosts", total=hosts)

    def host_done(self, result: object) -> None:
        self.progress.advance(self.current)

    def step_done(self, label: str) -> None:
        self.progress.advance(self.steps)
        self.progress.reset(self.current, total=self.hosts, description=f"after {label}: hosts")


class LoadBars:
    """On a terminal, while a model loads over RPC: one bar for the load (llama.cpp's own fraction, with
    the ETA) and one per node (bytes its server acknowledged of those it has to receive, and the rate),
    fed by `Worker.load`'s `on_progress`. A sample whose clock went back starts the bars of a new load
    (serve loads again after a loss)."""

    def __init__(self, enabled: bool, *, names: Mapping[str, str]) -> None:
        self.names = names
        self.progress = _bars(enabled, TextColumn("{task.fields[what]}"))
        self._load: TaskID | None = None
        self._nodes: dict[str, TaskID] = {}
        self._seconds = 0.0

    def __enter__(self) -> LoadBars:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def finish(self) -> None:
        """The load is over: its bars go (the display stays, for the next load)."""
        for task in [*self._nodes.values(), *([self._load] if self._load is not None else [])]:
            self.progress.remove_task(task)
        self._load, self._nodes = None, {}

    def __call__(self, update: LoadProgress) -> None:
        if update.seconds < self._seconds:
            self.finish()
        self._seconds = update.seconds
        if self._load is None:
            self._load = self.progress.add_task("load", total=1.0, what="")
        eta = update.eta_seconds
        self.progress.update(
            self._load,
            completed=update.fraction,
            what=f"{100 * update.fraction:.0f}%  {update.seconds:.1f} s"
            + (f", ETA {eta:.0f} s" if eta is not None and update.fraction < 1.0 else ""),
        )
        for node in update.nodes:
            if node.endpoint not in self._nodes:
                label = self.names.get(node.endpoint, node.endpoint)
                self._nodes[node.endpoint] = self.progress.add_task(f"  {label}", total=None, what="")
            self.progress.update(
                self._nodes[node.endpoint],
                completed=min(node.sent, node.to_send),
                total=max(node.to_send, 1),
                what=f"{format_size(node.sent)} of {format_size(node.to_send)}, "
                f"{format_size(int(node.bytes_per_second))}/s",
            )
