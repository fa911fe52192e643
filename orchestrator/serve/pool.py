"""The pool of spare servers: those no formation holds (`SparePool`); serve/spares.py watches them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from orchestrator.inventory.model import Host


@dataclass
class SparePool:
    """Servers no formation holds (on the serving loop): a formation that no longer fits on its own nodes
    takes one (and gives it back once its own node returns); answering spares that hold a model make a
    new formation (`grow`). `order`: the inventory's endpoints, the order the pool keeps (given-back
    spares too)."""

    hosts: list[Host] = field(default_factory=list)
    order: Sequence[str] = ()

    def take(self) -> Host | None:
        return self.hosts.pop(0) if self.hosts else None

    def take_this(self, host: Host) -> bool:
        """Take `host` (the recovery rule's choice, `planning.recovery.next_spare`); False: not free."""
        if host not in self.hosts:
            return False
        self.hosts.remove(host)
        return True

    def take_these(self, endpoints: Sequence[str]) -> list[Host] | None:
        """The spares of `endpoints`, all taken at once; None (none taken) when one is no longer free."""
        chosen = [h for h in self.hosts if h.endpoint in endpoints]
        if len(chosen) != len(set(endpoints)):
            return None
        self.hosts = [h for h in self.hosts if h.endpoint not in endpoints]
        return chosen

    def put(self, hosts: Sequence[Host]) -> None:
        """Spares given back (a formation took back its own node), in the inventory's order."""
        rank = {ep: i for i, ep in enumerate(self.order)}
        known = {h.endpoint for h in self.hosts}
        self.hosts += [h for h in hosts if h.endpoint not in known]
        self.hosts.sort(key=lambda h: rank.get(h.endpoint, len(rank)))

    def snapshot(self) -> list[Host]:
        return list(self.hosts)
