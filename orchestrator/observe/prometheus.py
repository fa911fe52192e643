"""The fleet's Prometheus text (exposition format 0.0.4), from a snapshot: pure, no I/O, no waiting.

Names follow Prometheus' conventions: `rpcfleet_` prefix, base units in the name (`_bytes`, `_seconds`),
counters end in `_total`, version and protocol in an `_info` gauge of value 1, a state as one gauge per
possible value (1 for the current one). Labels: `host` (inventory name), `endpoint` (host:port),
`device` (`<endpoint>#<index>`, as `rpcfleet probe` names it), `kind` (cpu, gpu), `formation` and
`model`. The names do not overlap serve's own (`orchestrator.serve.metrics`), which precede them on
serve's `/metrics`.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Mapping, Sequence

from orchestrator.observe.snapshot import FORMATION_STATES, SERVER_STATES, CacheView, FormationView, Snapshot

# Seconds: from a few ms (a short answer on a GPU) to minutes (a long stream on CPU nodes).
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RECOVERY_BUCKETS = (1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Histogram:
    """Cumulative bucket counts, their sum and count (thread-safe)."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)  # the last: above every bound (+Inf only)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value

    def state(self) -> tuple[list[int], float]:
        """Cumulative counts per bound (the last: +Inf) and the sum."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        out, running = [], 0
        for n in counts:
            running += n
            out.append(running)
        return out, total


def of_values(values: Iterable[float], buckets: Sequence[float]) -> Histogram:
    histogram = Histogram(buckets)
    for v in values:
        histogram.observe(v)
    return histogram


def label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**pairs: object) -> str:
    return "{" + ",".join(f'{k}="{label(v)}"' for k, v in pairs.items()) + "}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class _Text:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, text: str) -> None:
        self.lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]

    def sample(self, name: str, value: float, **pairs: object) -> None:
        self.lines.append(f"{name}{_labels(**pairs) if pairs else ''} {_number(value)}")

    def histogram(self, name: str, histogram: Histogram, **pairs: object) -> None:
        counts, total = histogram.state()
        for bound, n in zip([*histogram.buckets, float("inf")], counts, strict=True):
            le = "+Inf" if bound == float("inf") else _number(bound)
            self.sample(f"{name}_bucket", n, **pairs, le=le)
        self.sample(f"{name}_sum", total, **pairs)
        self.sample(f"{name}_count", counts[-1], **pairs)


class RequestTimes:
    """Each formation's request histograms: `ttft` (time to first token) and `latency` (the request's
    duration), made on first use. Whoever serves observes into it; the exporter renders it."""

    def __init__(self) -> None:
        self.histograms: dict[tuple[str, str], Histogram] = {}

    def histogram(self, formation: str, metric: str) -> Histogram:
        """`ttft` or `latency` of `formation` (made on first use)."""
        key = (formation, metric)
        if key not in self.histograms:
            self.histograms[key] = Histogram(TTFT_BUCKETS if metric == "ttft" else LATENCY_BUCKETS)
        return self.histograms[key]

    def observe(self, formation: str, metric: str, seconds: float) -> None:
        self.histogram(formation, metric).observe(seconds)


def render(
    snapshot: Snapshot,
    formations: Sequence[FormationView] = (),
    histograms: Mapping[tuple[str, str], Histogram] | None = None,
) -> str:
    """The text: the snapshot's nodes, devices and caches; `formations` as they are now (serve's
    counters move between rounds); `histograms`: (formation, metric) -> its histogram, metric being
    `ttft` or `latency`."""
    histograms = histograms or {}
    t = _Text()
    nodes = snapshot.nodes
    t.family(
        "rpcfleet_node_up", "gauge", "1 when the node's rpc-server runs (answering, or serving a client)."
    )
    for n in nodes:
        t.sample("rpcfleet_node_up", int(n.up), host=n.host, endpoint=n.endpoint)
    t.family("rpcfleet_node_ssh_up", "gauge", "1 when the node's SSH connection worked in the last round.")
    for n in nodes:
        t.sample("rpcfleet_node_ssh_up", int(n.ssh), host=n.host, endpoint=n.endpoint)
    t.family("rpcfleet_node_server_state", "gauge", "1 for the state the node's rpc-server is in.")
    for n in nodes:
        for state in SERVER_STATES:
            t.sample(
                "rpcfleet_node_server_state",
                int(n.state == state),
                host=n.host,
                endpoint=n.endpoint,
                state=state,
            )
    t.family(
        "rpcfleet_node_info", "gauge", "The installed rpc-server version and its RPC protocol (value 1)."
    )
    for n in nodes:
        t.sample(
            "rpcfleet_node_info",
            1,
            host=n.host,
            endpoint=n.endpoint,
            version=n.version or "",
            protocol=n.protocol or "",
        )
    t.family(
        "rpcfleet_node_restarts_total",
        "counter",
        "Automatic restarts of the rpc-server by its supervisor since its last start by rpcfleet.",
    )
    for n in nodes:
        if n.restarts is not None:
            t.sample("rpcfleet_node_restarts_total", n.restarts, host=n.host, endpoint=n.endpoint)

    devices = [(n, d) for n in nodes for d in n.devices]
    for name, text, attr in (
        ("rpcfleet_device_total_bytes", "Device memory, total.", "total"),
        (
            "rpcfleet_device_free_bytes",
            "Device memory, free (CPU devices: the host's MemAvailable, divided among its CPU servers).",
            "free",
        ),
        (
            "rpcfleet_device_usable_bytes",
            "Device memory a plan may use: free less reserve, within limit.",
            "usable",
        ),
        ("rpcfleet_device_held_bytes", "Device memory the loaded plans hold (their prediction).", "held"),
        (
            "rpcfleet_device_total_share_bytes",
            "Device memory, total, divided as free is (CPU devices: the host's RAM divided among its CPU "
            "servers): free / total_share is the fraction free.",
            "total_share",
        ),
    ):
        t.family(name, "gauge", text)
        for n, d in devices:
            value = d.total if attr == "total_share" and d.total_share is None else getattr(d, attr)
            t.sample(name, value, host=n.host, endpoint=n.endpoint, device=d.name, kind=d.kind)
    t.family(
        "rpcfleet_device_measured_timestamp_seconds",
        "gauge",
        "When the device's memory was last read over RPC (a busy server keeps its last reading).",
    )
    for n, d in devices:
        t.sample(
            "rpcfleet_device_measured_timestamp_seconds",
            round(d.measured_at, 3),
            host=n.host,
            endpoint=n.endpoint,
            device=d.name,
            kind=d.kind,
        )

    # One cache per install: the servers of one host (`rpc_servers`) share its folder, counted once.
    caches: dict[str, tuple[str, CacheView]] = {}
    for n in nodes:
        if n.cache is not None:
            caches.setdefault(n.cache.install or n.endpoint, (n.cache.host or n.host, n.cache))
    for name, text, attr in (
        ("rpcfleet_cache_bytes", "Bytes in the install's tensor cache (its servers share it).", "bytes"),
        ("rpcfleet_cache_files", "Files in the install's tensor cache (its servers share it).", "files"),
    ):
        t.family(name, "gauge", text)
        for host, cache in caches.values():
            t.sample(name, getattr(cache, attr), host=host, install_dir=cache.install_dir)

    _formations(
        t, nodes_by_endpoint={n.endpoint: n.host for n in nodes}, formations=formations, histograms=histograms
    )

    t.family("rpcfleet_exporter_rounds_total", "counter", "Probe rounds completed.")
    t.sample("rpcfleet_exporter_rounds_total", snapshot.rounds)
    t.family("rpcfleet_exporter_round_seconds", "gauge", "How long the last probe round took.")
    t.sample("rpcfleet_exporter_round_seconds", round(snapshot.round_seconds, 4))
    t.family("rpcfleet_exporter_last_round_timestamp_seconds", "gauge", "When the last probe round ended.")
    t.sample("rpcfleet_exporter_last_round_timestamp_seconds", round(snapshot.at, 3))
    t.family("rpcfleet_exporter_interval_seconds", "gauge", "Seconds between two probe rounds.")
    t.sample("rpcfleet_exporter_interval_seconds", snapshot.interval)
    return "\n".join(t.lines) + "\n"


def _formations(
    t: _Text,
    *,
    nodes_by_endpoint: Mapping[str, str],
    formations: Sequence[FormationView],
    histograms: Mapping[tuple[str, str], Histogram],
) -> None:
    t.family("rpcfleet_formation_state", "gauge", "1 for the state the formation (a served model) is in.")
    for f in formations:
        for state in FORMATION_STATES:
            t.sample(
                "rpcfleet_formation_state",
                int(f.state == state),
                formation=f.name,
                model=f.model,
                state=state,
            )
    t.family("rpcfleet_formation_nodes", "gauge", "Nodes the formation's loaded plan uses.")
    for f in formations:
        t.sample("rpcfleet_formation_nodes", len(f.nodes), formation=f.name, model=f.model)
    t.family("rpcfleet_formation_slots", "gauge", "Requests the formation can serve at once.")
    for f in formations:
        t.sample("rpcfleet_formation_slots", f.slots, formation=f.name, model=f.model)
    t.family("rpcfleet_formation_slots_busy", "gauge", "Requests being served now.")
    for f in formations:
        t.sample("rpcfleet_formation_slots_busy", f.slots_busy, formation=f.name, model=f.model)
    t.family("rpcfleet_formation_requests_total", "counter", "Requests answered, by route and status code.")
    for f in formations:
        for (route, code), count in sorted(f.requests.items()):
            t.sample(
                "rpcfleet_formation_requests_total",
                count,
                formation=f.name,
                model=f.model,
                route=route,
                code=code,
            )
    t.family(
        "rpcfleet_formation_tokens_total", "counter", "Tokens evaluated (prompt) and generated (completion)."
    )
    for f in formations:
        t.sample(
            "rpcfleet_formation_tokens_total", f.prompt_tokens, formation=f.name, model=f.model, kind="prompt"
        )
        t.sample(
            "rpcfleet_formation_tokens_total",
            f.completion_tokens,
            formation=f.name,
            model=f.model,
            kind="completion",
        )
    for metric, name, text in (
        (
            "ttft",
            "rpcfleet_formation_time_to_first_token_seconds",
            "From admission to the first generated text.",
        ),
        (
            "latency",
            "rpcfleet_formation_request_duration_seconds",
            "From a request's arrival to its last byte.",
        ),
    ):
        t.family(name, "histogram", text)
        for f in formations:
            histogram = histograms.get((f.name, metric))
            if histogram is not None:
                t.histogram(name, histogram, formation=f.name, model=f.model)
    t.family(
        "rpcfleet_formation_recoveries_total", "counter", "Recoveries after a lost node or a dead worker."
    )
    for f in formations:
        t.sample("rpcfleet_formation_recoveries_total", len(f.recoveries), formation=f.name, model=f.model)
    t.family(
        "rpcfleet_formation_recovery_duration_seconds",
        "histogram",
        "From a lost node's error to serving again.",
    )
    for f in formations:
        t.histogram(
            "rpcfleet_formation_recovery_duration_seconds",
            of_values(f.recoveries, RECOVERY_BUCKETS),
            formation=f.name,
            model=f.model,
        )
    t.family("rpcfleet_formation_reloads_total", "counter", "Reloads (SIGHUP, POST /admin/reload).")
    for f in formations:
        t.sample("rpcfleet_formation_reloads_total", f.reloads, formation=f.name, model=f.model)
    t.family(
        "rpcfleet_formation_device_layers",
        "gauge",
        "Layers the formation's plan puts on the device, the output layer counted as one (as tensor_split).",
    )
    for f in formations:
        for d in f.devices:
            t.sample(
                "rpcfleet_formation_device_layers",
                d.layers,
                formation=f.name,
                model=f.model,
                host=nodes_by_endpoint.get(d.endpoint, ""),
                endpoint=d.endpoint,
                device=f"{d.endpoint}#{d.index}",
            )
    t.family(
        "rpcfleet_formation_device_held_bytes", "gauge", "Bytes the formation's plan holds on the device."
    )
    for f in formations:
        for d in f.devices:
            t.sample(
                "rpcfleet_formation_device_held_bytes",
                d.held,
                formation=f.name,
                model=f.model,
                host=nodes_by_endpoint.get(d.endpoint, ""),
                endpoint=d.endpoint,
                device=f"{d.endpoint}#{d.index}",
            )
