"""What `rpcfleet serve` shows on stderr while it serves (`ServeScreen`): the events of
`orchestrator.workflows.serve.serve_fleet`, as text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from orchestrator.cli import _output
from orchestrator.cli._output import escape
from orchestrator.core.units import format_size


class ServeScreen:
    """What serve shows on stderr: warnings, the formations chosen, one load's bars, a line per load."""

    def __init__(self, bars: Any) -> None:
        self.bars = bars

    def events(self) -> Any:
        from orchestrator.workflows.serve import ServeEvents

        return ServeEvents(
            warning=lambda text: self.say(f"[yellow]warning:[/yellow] {escape(text)}"),
            formed=self.formed,
            progress=self.bars,
            loaded=self.loaded,
            engine_build=lambda line: self.say(escape(line)),
            news=self.news,
        )

    def say(self, markup: str) -> None:
        _output.err_console.print(markup, highlight=False)

    def formed(self, formed: Any, url: str, on_demand: Sequence[str] = ()) -> None:
        self.bars.names = {h.endpoint: h.name for one in formed for h in one.hosts}
        models = list(dict.fromkeys(one.model.name for one in formed))
        models += [f"{name} (on demand)" for name in on_demand]
        loading = " (loading...)" if formed else ""
        self.say(f"serving {escape(', '.join(models))} on {escape(url)}{loading}")
        for one in formed:
            self.say(
                f"  {escape(one.choice.name)}: {len(one.choice.endpoints)} node(s) "
                f"({escape(', '.join(one.choice.endpoints))}), llama-server with "
                f"{one.model.options.parallel} slot(s)"
            )
            if one.plan.draft is not None:
                from orchestrator.planning.draft import draft_note

                first = one.plan.devices[0].label if one.plan.devices else None
                self.say(f"    {escape(draft_note(one.plan.draft, first))}")

    def loaded(self, loaded: Any) -> None:
        self.bars.finish()
        cache = f" ({format_size(loaded.cache_hits)} from the nodes' caches)" if loaded.cache_hits else ""
        who = f"{loaded.formation} " if loaded.formation else ""
        self.say(
            f"{escape(who)}{loaded.state} on {loaded.nodes} node(s): "
            + " · ".join(f"{k} {v:.2f} s" for k, v in loaded.phases.items())
            + escape(cache)
        )

    def news(self, event: Any) -> None:
        """An on-demand model's load, resume, failed load, unload or swap, or a resumed request: one line."""
        colour = {"load_failed": "red", "resumed": "yellow"}.get(event.kind, "cyan")
        self.say(
            f"[{colour}]{escape(event.kind)}[/{colour}] {escape(event.formation)} ({escape(event.model)}): "
            f"{escape(event.message)}"
        )
