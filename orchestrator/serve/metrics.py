"""Serving counters and their Prometheus text (pure: no I/O, no clock of its own).

Exposition format 0.0.4 (`text/plain; version=0.0.4`): counters end in `_total`, the time to first token
is a summary (`_sum`, `_count`), per-endpoint up/down is a gauge with an `endpoint` label.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Recovery:
    """How one recovery went (seconds): detection is from the request's last answer to the error."""

    lost: tuple[str, ...]
    detection: float
    replan: float  # probes and plans, every round until one fits
    reload: float  # spawning the worker and loading the model
    total: float  # from the error to serving again
    detected_at: float  # wall clock (time.time()) of the error


@dataclass(frozen=True)
class Rejoin:
    """One return to more nodes (seconds): the wait for the worker (the request being served ends), then
    unload, re-plan and load."""

    back: tuple[str, ...]  # the nodes that answered again
    idle_wait: float
    reload: float
    at: float  # wall clock (time.time()) when serving again


@dataclass
class Metrics:
    """Serving counters, on the serving loop: `record_*` are called by the backend and the routes."""

    requests: Counter[tuple[str, int]] = field(default_factory=Counter)  # (route, status code)
    key_requests: Counter[tuple[str, str, int]] = field(default_factory=Counter)  # (key's name, route, code)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    decode_tokens_per_second: float = 0.0  # llama.cpp's, of the last request
    ttft_sum: float = 0.0
    ttft_count: int = 0
    reloads: int = 0
    resumed: Counter[tuple[str, str]] = field(default_factory=Counter)  # (route, how: restarted, continued)
    resumed_tokens: int = 0  # tokens an engine processed again for a resumed request (its prompt, its text)
    recoveries: list[Recovery] = field(default_factory=list)
    rejoins: list[Rejoin] = field(default_factory=list)

    def record_request(self, route: str, code: int) -> None:
        self.requests[(route, code)] += 1

    def record_key_request(self, name: str, route: str, code: int) -> None:
        """A request of a per-user key (`--keys`), by its name: never the key."""
        self.key_requests[(name, route, code)] += 1

    def record_done(self, prompt: int, completion: int, tokens_per_second: float, ttft: float | None) -> None:
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        if tokens_per_second > 0:
            self.decode_tokens_per_second = tokens_per_second
        if ttft is not None:
            self.ttft_sum += ttft
            self.ttft_count += 1

    def record_resumed(self, route: str, *, restarted: bool, tokens: int) -> None:
        """A request whose engine was lost went on elsewhere: sent again whole (`restarted`: nothing had
        been sent to the client) or continued from its streamed tokens; `tokens` processed again (a
        continuation's prompt and streamed tokens; a restart's are its whole answer's, unknown here)."""
        self.resumed[(route, "restarted" if restarted else "continued")] += 1
        self.resumed_tokens += tokens

    def record_reload(self) -> None:
        self.reloads += 1

    def record_recovery(self, recovery: Recovery) -> None:
        self.recoveries.append(recovery)

    def record_rejoin(self, rejoin: Rejoin) -> None:
        self.rejoins.append(rejoin)

    def render(self, endpoints: Mapping[str, bool], state: str) -> str:
        """The Prometheus text: `endpoints` maps every endpoint of the fleet to up (True) or down."""
        lines = [
            "# HELP rpcfleet_requests_total HTTP requests answered, by route and status code.",
            "# TYPE rpcfleet_requests_total counter",
        ]
        for (route, code), n in sorted(self.requests.items()):
            lines.append(f'rpcfleet_requests_total{{route="{_label(route)}",code="{code}"}} {n}')
        if self.key_requests:  # serve with --keys only
            lines += [
                "# HELP rpcfleet_key_requests_total HTTP requests answered, by key name, route and code.",
                "# TYPE rpcfleet_key_requests_total counter",
            ]
            for (name, route, code), n in sorted(self.key_requests.items()):
                labels = f'key="{_label(name)}",route="{_label(route)}",code="{code}"'
                lines.append(f"rpcfleet_key_requests_total{{{labels}}} {n}")
        lines += [
            "# HELP rpcfleet_tokens_total Tokens evaluated (prompt) and generated (completion).",
            "# TYPE rpcfleet_tokens_total counter",
            f'rpcfleet_tokens_total{{kind="prompt"}} {self.prompt_tokens}',
            f'rpcfleet_tokens_total{{kind="completion"}} {self.completion_tokens}',
            "# HELP rpcfleet_tokens_per_second Decoding speed of the last request (llama.cpp's timings).",
            "# TYPE rpcfleet_tokens_per_second gauge",
            f"rpcfleet_tokens_per_second {self.decode_tokens_per_second:.6g}",
            "# HELP rpcfleet_time_to_first_token_seconds From admission to the first generated text.",
            "# TYPE rpcfleet_time_to_first_token_seconds summary",
            f"rpcfleet_time_to_first_token_seconds_sum {self.ttft_sum:.6g}",
            f"rpcfleet_time_to_first_token_seconds_count {self.ttft_count}",
            "# HELP rpcfleet_endpoint_up 1 when the endpoint answers its probes or serves the model.",
            "# TYPE rpcfleet_endpoint_up gauge",
        ]
        for endpoint, up in endpoints.items():
            lines.append(f'rpcfleet_endpoint_up{{endpoint="{_label(endpoint)}"}} {int(up)}')
        lines += [
            "# HELP rpcfleet_state 1 for the serving state the endpoint is in.",
            "# TYPE rpcfleet_state gauge",
        ]
        for name in ("loading", "ready", "degraded", "recovering", "draining", "failed"):
            lines.append(f'rpcfleet_state{{state="{name}"}} {int(name == state)}')
        lines += [
            "# HELP rpcfleet_reloads_total Reloads (SIGHUP, POST /admin/reload).",
            "# TYPE rpcfleet_reloads_total counter",
            f"rpcfleet_reloads_total {self.reloads}",
            "# HELP rpcfleet_requests_resumed_total Requests whose engine was lost, finished elsewhere: sent "
            "again whole (nothing sent yet) or continued from the tokens streamed.",
            "# TYPE rpcfleet_requests_resumed_total counter",
            *(
                f'rpcfleet_requests_resumed_total{{route="{_label(route)}",how="{how}"}} {n}'
                for (route, how), n in sorted(self.resumed.items())
            ),
            "# HELP rpcfleet_resumed_prefill_tokens_total Tokens processed again to continue resumed streams "
            "(the prompt and the tokens already streamed), not billed in the client's usage.",
            "# TYPE rpcfleet_resumed_prefill_tokens_total counter",
            f"rpcfleet_resumed_prefill_tokens_total {self.resumed_tokens}",
            "# HELP rpcfleet_recoveries_total Recoveries after a lost node or a dead worker.",
            "# TYPE rpcfleet_recoveries_total counter",
            f"rpcfleet_recoveries_total {len(self.recoveries)}",
            "# HELP rpcfleet_rejoins_total Returns to more nodes once nodes left out answered again.",
            "# TYPE rpcfleet_rejoins_total counter",
            f"rpcfleet_rejoins_total {len(self.rejoins)}",
            "# HELP rpcfleet_recovery_seconds The last recovery, by phase.",
            "# TYPE rpcfleet_recovery_seconds gauge",
        ]
        if self.recoveries:
            last = self.recoveries[-1]
            for phase in ("detection", "replan", "reload", "total"):
                lines.append(f'rpcfleet_recovery_seconds{{phase="{phase}"}} {getattr(last, phase):.6g}')
        return "\n".join(lines) + "\n"


MODEL_STATES = ("unloaded", "loading", "loaded", "backoff", "recovering", "draining", "failed")
UNLOAD_REASONS = ("idle", "swap", "failed")


@dataclass(frozen=True)
class ModelView:
    """An on-demand model as `/metrics` shows it: its state, loads started (resumes included), failed
    loads, unloads by reason (idle, swap: swapped out for another model, failed), requests waiting for
    its load, its last load's seconds (placement to serving) and the seconds left of its backoff."""

    model: str
    state: str
    loads: int
    load_failures: int
    unloads: Mapping[str, int]
    waiting: int
    load_seconds: float | None
    backoff_seconds: float


def model_metrics(models: Sequence[ModelView]) -> str:
    """The on-demand models' families, each sample with a `model` label."""
    lines = [
        "# HELP rpcfleet_model_state 1 for the state the on-demand model is in.",
        "# TYPE rpcfleet_model_state gauge",
    ]
    for m in models:
        lines += [
            f'rpcfleet_model_state{{model="{_label(m.model)}",state="{state}"}} {int(m.state == state)}'
            for state in MODEL_STATES
        ]
    families: tuple[tuple[str, str, str, Callable[[ModelView], float | None]], ...] = (
        (
            "loads_total",
            "counter",
            "Loads of the on-demand model started (resumes included).",
            lambda m: m.loads,
        ),
        (
            "load_failures_total",
            "counter",
            "Loads of the on-demand model that failed.",
            lambda m: m.load_failures,
        ),
        ("waiting", "gauge", "Requests waiting for the on-demand model's load.", lambda m: m.waiting),
        (
            "load_seconds",
            "gauge",
            "The model's last load, from placement to serving.",
            lambda m: m.load_seconds,
        ),
        (
            "backoff_seconds",
            "gauge",
            "Seconds before a failed model's next load (0: none).",
            lambda m: m.backoff_seconds,
        ),
    )
    for name, kind, text, value in families:
        lines += [f"# HELP rpcfleet_model_{name} {text}", f"# TYPE rpcfleet_model_{name} {kind}"]
        for m in models:
            got = value(m)
            if got is not None:
                lines.append(f'rpcfleet_model_{name}{{model="{_label(m.model)}"}} {got:.6g}')
    lines += [
        "# HELP rpcfleet_model_unloads_total Unloads of the on-demand model, by reason: idle (past its "
        "idle_unload), swap (swapped out for another model), failed (its load or recovery failed).",
        "# TYPE rpcfleet_model_unloads_total counter",
    ]
    for m in models:
        model = _label(m.model)
        lines += [
            f'rpcfleet_model_unloads_total{{model="{model}",reason="{why}"}} {m.unloads.get(why, 0)}'
            for why in UNLOAD_REASONS
        ]
    return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def label_value(value: str) -> str:
    """`value` escaped for a Prometheus label."""
    return _label(value)


ENGINE_PREFIX = "llamacpp:"


@dataclass(frozen=True)
class EngineScrape:
    """One formation's engine as a scrape read it: its name, model, llama-server's `/metrics` text (empty
    when it did not answer in time, or none serves) and the requests serve has handed it."""

    formation: str
    model: str
    text: str
    served: int
    slots: str = ""  # llama-server's /slots JSON (empty when it did not answer)


@dataclass(frozen=True)
class KvUsed:
    """A formation's KV cache in use: tokens held over context, all slots together, and per slot id."""

    ratio: float
    slots: tuple[tuple[int, float], ...]


def kv_used(slots_json: str) -> KvUsed | None:
    """The KV cache in use from llama-server's `/slots` (a list of slots: `id`, `n_ctx` its context,
    `n_prompt_tokens` the tokens its cache holds, prompt and generated, absent while never used); None
    when the text is not such a list. Not `--kv-unified` (serve's engines): each slot has its own `n_ctx`
    cells, so the formation's share is the tokens held over the contexts' sum."""
    try:
        slots = json.loads(slots_json) if slots_json else None
    except ValueError:
        return None
    if not isinstance(slots, list) or not slots:
        return None
    held = total = 0
    per_slot: list[tuple[int, float]] = []
    for i, slot in enumerate(slots):
        if not isinstance(slot, dict) or not isinstance(slot.get("n_ctx"), int) or slot["n_ctx"] <= 0:
            return None
        tokens = slot.get("n_prompt_tokens")
        tokens = min(tokens, slot["n_ctx"]) if isinstance(tokens, int) and tokens > 0 else 0
        held += tokens
        total += slot["n_ctx"]
        slot_id = slot.get("id")
        per_slot.append((slot_id if isinstance(slot_id, int) else i, tokens / slot["n_ctx"]))
    return KvUsed(held / total, tuple(per_slot))


def _with_labels(sample: str, labels: str) -> str:
    """A sample line with `labels` first (`name value` or `name{...} value`)."""
    name, brace, rest = sample.partition("{")
    if brace:
        return f"{name}{{{labels},{rest}" if not rest.startswith("}") else f"{name}{{{labels}{rest}"
    name, space, value = sample.partition(" ")
    return f"{name}{{{labels}}}{space}{value}"


def engine_metrics(engines: Sequence[EngineScrape], parallel: int, admitted: int) -> str:
    """Serve's slot gauges, then every formation's engine families (llama-server's `/metrics`: tokens,
    throughput, requests processing, deferred...) renamed `llamacpp:X` -> `rpcfleet_engine_X` (a counter
    gets `_total` when llama-server's name lacks it), each sample with `formation` and `model` labels
    (counters of the engine process now serving: a restarted engine starts from 0). `rpcfleet_slots_busy`
    sums each engine's `requests_processing` where it answered, else the requests serve has handed it."""
    helps: dict[str, list[str]] = {}  # family -> its HELP and TYPE lines (the first engine's)
    samples: dict[str, list[str]] = {}
    busy = 0.0
    for engine in engines:
        # Prometheus names a counter `*_total`; llama-server does not always (n_tokens_max, ...)
        counters = {
            fields[2][len(ENGINE_PREFIX) :]
            for fields in (line.split() for line in engine.text.splitlines() if line.startswith("# TYPE "))
            if len(fields) == 4 and fields[2].startswith(ENGINE_PREFIX) and fields[3] == "counter"
        }

        def renamed(name: str, counters: set[str] = counters) -> str:
            bare = name[len(ENGINE_PREFIX) :]
            suffix = "_total" if bare in counters and not bare.endswith("_total") else ""
            return f"rpcfleet_engine_{bare}{suffix}"

        labels = f'formation="{_label(engine.formation)}",model="{_label(engine.model)}"'
        processing: float | None = None
        for line in engine.text.splitlines():
            if line.startswith("# "):
                fields = line.split(" ", 3)
                if len(fields) >= 3 and fields[1] in ("HELP", "TYPE") and fields[2].startswith(ENGINE_PREFIX):
                    family = renamed(fields[2])
                    if len(helps.setdefault(family, [])) < 2 and not any(
                        h.startswith(f"# {fields[1]} ") for h in helps[family]
                    ):
                        helps[family].append(" ".join([fields[0], fields[1], family, *fields[3:]]))
                continue
            if not line.startswith(ENGINE_PREFIX):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            family = renamed(name)
            samples.setdefault(family, []).append(_with_labels(family + line[len(name) :], labels))
            if name == f"{ENGINE_PREFIX}requests_processing":
                try:
                    processing = float(line.rpartition(" ")[2])
                except ValueError:
                    processing = None
        busy += processing if processing is not None else engine.served
    head = [
        "# HELP rpcfleet_slots_busy Slots of the engines generating now (their requests_processing).",
        "# TYPE rpcfleet_slots_busy gauge",
        f"rpcfleet_slots_busy {busy:g}",
        "# HELP rpcfleet_slots Slots of the engines (--parallel).",
        "# TYPE rpcfleet_slots gauge",
        f"rpcfleet_slots {parallel}",
        "# HELP rpcfleet_requests_admitted Requests admitted: served and waiting for a slot.",
        "# TYPE rpcfleet_requests_admitted gauge",
        f"rpcfleet_requests_admitted {admitted}",
    ]
    lines = list(head)
    for family in dict.fromkeys([*helps, *samples]):
        lines += helps.get(family, []) + samples.get(family, [])
    return "\n".join(lines) + "\n"
