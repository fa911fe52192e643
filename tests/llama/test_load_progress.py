"""Load progress: the worker's samples (llama.cpp's fraction, bytes the servers acknowledged per node), the
rates and ETA made of them, and the `load_progress` log events; real loads over `-c` servers, cold and warm.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from orchestrator.caches.plan import plan_cache
from orchestrator.core.log import configure_logging
from orchestrator.core.target import Target
from orchestrator.llama.worker.child import bytes_acked, endpoint_peers
from orchestrator.llama.worker.load_progress import (
    LoadProgress,
    ProgressTracker,
    planned_bytes,
    progress_sample,
)
from orchestrator.llama.worker.parent import Worker
from tests.plugins.cache import Node, cache_hosts, plan_on_nodes


def test_rates_eta_and_what_is_left_to_send() -> None:
    tracker = ProgressTracker(
        {"10.0.0.1:50052": 100_000_000},
        skipped={"10.0.0.1:50052": 40_000_000},
    )
    first = tracker.update(0.0, 0.0, {"10.0.0.1:50052": 0})
    assert first.eta_seconds is None and first.nodes[0].bytes_per_second == 0.0
    early = tracker.update(0.1, 0.5, {"10.0.0.1:50052": 10_000_000})
    assert early.nodes[0].bytes_per_second == pytest.approx(20e6)  # from the load's start
    tracker.update(0.3, 1.0, {"10.0.0.1:50052": 20_000_000})
    later = tracker.update(0.5, 2.0, {"10.0.0.1:50052": 50_000_000})
    node = later.nodes[0]
    assert (node.endpoint, node.sent, node.planned, node.to_send) == (
        "10.0.0.1:50052",
        50_000_000,
        100_000_000,
        60_000_000,  # the cache hits are not sent
    )
    assert node.bytes_per_second == pytest.approx(30e6)  # 30 MB over the last second
    assert later.eta_seconds == pytest.approx(2.0)  # half done in 2 s
    # A node that is done: its rate falls to 0 within the window.
    tracker.update(1.0, 2.5, {"10.0.0.1:50052": 60_000_000})
    done = tracker.update(1.0, 3.6, {"10.0.0.1:50052": 60_000_000})
    assert done.nodes[0].bytes_per_second == 0.0
    log = done.as_log()
    assert log["percent"] == 100.0 and log["nodes"]["10.0.0.1:50052"]["to_send"] == 60_000_000
    assert json.dumps(log)  # a log event's fields are JSON


def test_the_log_gets_one_sample_a_second_and_the_last() -> None:
    tracker = ProgressTracker({"a:1": 10})
    due = [
        tracker.due_for_log(tracker.update(f, t, {"a:1": 1}))
        for f, t in ((0.0, 0.0), (0.1, 0.5), (0.3, 1.0), (0.6, 1.5), (1.0, 1.7), (1.0, 1.9), (1.0, 2.8))
    ]
    assert due == [True, False, True, False, True, False, True]


def test_the_bars_follow_a_second_load_with_other_nodes() -> None:
    import io

    from rich.console import Console

    from orchestrator.cli import _output, _progress
    from orchestrator.llama.worker.load_progress import NodeProgress

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=120)
    original, _output.err_console = _output.err_console, console
    try:
        bars = _progress.LoadBars(True, names={"a:1": "alpha"})
    finally:
        _output.err_console = original
    bars(LoadProgress(0.5, 2.0, (NodeProgress("a:1", 30, 100, 60, 15.0),)))
    task = bars.progress.tasks[1]
    assert (task.description.strip(), task.completed, task.total) == ("alpha", 30, 60)  # 100 - 40 hits
    # serve loads again after a loss, on other nodes: the clock starts over, the bars too
    bars(LoadProgress(0.1, 0.3, (NodeProgress("b:2", 5, 50, 50, 1.0), NodeProgress("c:3", 0, 50, 50, 0.0))))
    assert [t.description.strip() for t in bars.progress.tasks] == ["load", "b:2", "c:3"]
    bars.finish()
    assert bars.progress.tasks == []


def test_a_malformed_sample_is_named() -> None:
    assert progress_sample({"fraction": 1, "seconds": 0.5, "sent": {"a:1": 3}}) == (1.0, 0.5, {"a:1": 3})
    for bad, field in (
        ({"fraction": "x", "seconds": 0, "sent": {}}, "fraction"),
        ({"fraction": 0, "seconds": True, "sent": {}}, "seconds"),
        ({"fraction": 0, "seconds": 0, "sent": {"a:1": 1.5}}, "sent"),
        ({"fraction": 0, "seconds": 0, "sent": []}, "sent"),
    ):
        with pytest.raises(ValueError, match=field):
            progress_sample(bad)


def test_bytes_acked_counts_what_the_peer_received() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    received = 0

    def sink() -> None:
        nonlocal received
        conn, _ = listener.accept()
        with conn:
            while chunk := conn.recv(1 << 20):
                received += len(chunk)

    reader = threading.Thread(target=sink, daemon=True)
    reader.start()
    port = listener.getsockname()[1]
    endpoint = f"127.0.0.1:{port}"
    peers = endpoint_peers([Target.direct(endpoint)])
    assert peers[("127.0.0.1", port)] == endpoint
    with socket.create_connection(("127.0.0.1", port)) as client:
        assert bytes_acked(peers)[endpoint] <= 1  # the SYN counts as one
        client.sendall(b"x" * 3_000_000)
        deadline = time.monotonic() + 5
        while bytes_acked(peers)[endpoint] < 3_000_000 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 3_000_000 <= bytes_acked(peers)[endpoint] <= 3_000_001
    reader.join(5)
    listener.close()
    assert received == 3_000_000
    assert bytes_acked({("127.0.0.1", 9): "127.0.0.1:9"}) == {"127.0.0.1:9": 0}  # no connection: nothing


def _load(plan, model: Path) -> list[LoadProgress]:  # type: ignore[no-untyped-def]
    seen: list[LoadProgress] = []
    with Worker.start(plan, model, {"seed": 0}, on_progress=seen.append) as worker:
        assert worker.placement is not None
    return seen


@pytest.mark.llama
def test_progress_of_a_cold_then_a_warm_load(
    nodes: list[Node],
    big_model: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    plan = plan_on_nodes(nodes, big_model)
    planned = planned_bytes(plan)
    configure_logging("json", "INFO")
    try:
        cold = _load(plan, big_model)
    finally:
        configure_logging("text", "WARNING")
    fractions = [p.fraction for p in cold]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert [p.seconds for p in cold] == sorted(p.seconds for p in cold)
    last = {n.endpoint: n for n in cold[-1].nodes}
    assert set(last) == set(plan.endpoints)
    for endpoint, node in last.items():
        # Every planned byte crossed the link (plus commands, headers and the compute graph's inputs).
        assert node.planned == planned[endpoint] > 0
        assert planned[endpoint] <= node.sent <= planned[endpoint] * 1.05 + (2 << 20), (endpoint, node)
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if '"load_progress"' in line]
    assert events and events[-1]["percent"] == 100.0
    assert set(events[-1]["nodes"]) == set(plan.endpoints) and events[-1]["eta_s"] == 0.0

    # Warm: every tensor over 10 MiB is a hit, so only the rest crosses the link.
    cached = plan_cache(plan, [big_model])
    warm = _load(plan, big_model)
    assert warm[-1].fraction == 1.0
    for node in warm[-1].nodes:
        hits = sum(c.tensor.size for c in cached[node.endpoint])
        assert hits > 0
        assert node.sent <= planned[node.endpoint] - hits + (2 << 20), node


@pytest.mark.llama
def test_run_shows_the_load_per_node_on_a_terminal(
    nodes: list[Node],
    big_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import io

    from rich.console import Console

    from orchestrator.cli import _output, _progress, main

    screen = io.StringIO()
    monkeypatch.setattr(_output, "err_console", Console(file=screen, force_terminal=True, width=150))
    updates: list[LoadProgress] = []

    class Recording(_progress.LoadBars):
        def __call__(self, update: LoadProgress) -> None:
            super().__call__(update)
            self.progress.refresh()
            updates.append(update)

    monkeypatch.setattr(_progress, "LoadBars", Recording)
    endpoints = [n.server.endpoint for n in nodes if n.server is not None]
    argv = ["run", "-m", str(big_model), "-p", "hi", "-n", "2", "--ctx", "256"]
    assert main([*argv, *(a for ep in endpoints for a in ("--endpoint", ep))]) == 0, capsys.readouterr().err
    shown = screen.getvalue()
    assert updates and updates[-1].fraction == 1.0
    for endpoint in endpoints:
        assert endpoint in shown  # a bar per node...
    assert "iB/s" in shown and "100%" in shown  # ...with its rate, and the load's fraction
    if any(0 < u.fraction < 1 for u in updates):
        assert "ETA" in shown
    capsys.readouterr()


@pytest.mark.llama
def test_serve_reports_its_load_in_health_warms_first_and_refuses_a_truncated_file(
    nodes: list[Node],
    big_model: Path,
) -> None:
    from orchestrator.core.poll import poll_async
    from orchestrator.planning.plan import PlanOptions
    from orchestrator.serve.engine import default_engines
    from orchestrator.serve.formation import Formation, FormationHooks
    from orchestrator.serve.states import ServeConfig
    from orchestrator.serve.upstream import Upstream
    from orchestrator.workflows.serving import ServeFleet

    hosts = cache_hosts(nodes)
    during: list[dict] = []  # type: ignore[type-arg]
    loaded: list[dict[str, float]] = []

    async def scenario() -> tuple[Formation, bool]:
        http = Upstream()
        engines, _template = default_engines(str(big_model), big_model.stem, http)
        fleet = ServeFleet(hosts, str(big_model), PlanOptions(n_ctx=256))
        hooks = FormationHooks(
            on_progress=lambda _progress: during.append(formation.health()),
            on_loaded=lambda _formation, _plan, phases: loaded.append(phases),
        )
        formation = Formation(big_model.stem, big_model.stem, fleet, ServeConfig(), engines, hooks=hooks)
        first = await fleet.plan_round()
        assert first.plan is not None
        cached = plan_cache(first.plan, [big_model])
        formation.start(first.plan)
        try:

            async def ready() -> bool | None:
                return True if formation.state == "ready" else None

            await poll_async(ready, limit=120, interval=0.05)
            assert formation.state == "ready", formation.reason
            assert during and all(h["status"] == "loading" for h in during)
            last = during[-1]["loading"]
            assert last["percent"] == 100.0 and set(last["nodes"]) == {h.endpoint for h in hosts}
            assert len(loaded) == 1 and set(loaded[0]) == {"cache", "load"} and loaded[0]["load"] > 0
            assert formation.health()["loading"] is None  # only while a load is under way
            # The empty caches of both nodes were warmed before the load: every cached tensor was a hit.
            assert formation.skipped == {ep: sum(c.tensor.size for c in cs) for ep, cs in cached.items()}
            for endpoint, node in last["nodes"].items():
                assert node["sent"] <= node["planned"] - formation.skipped[endpoint] + (2 << 20)
        finally:
            await formation.stop()
        # A file truncated under its own name: the next load is refused before llama.cpp reads it.
        victim = nodes[0].install / "cache" / "rpc" / cached[hosts[0].endpoint][0].file
        victim.write_bytes(victim.read_bytes()[:4096])
        refused = await formation.load(first.plan)
        assert fleet.shared is not None
        await fleet.shared.close()
        await http.aclose()
        return formation, refused

    formation, refused = asyncio.run(scenario())
    assert refused is False
    assert "truncated or corrupt" in formation.reason and nodes[0].name in formation.reason


def test_reading_the_sockets_leaks_no_descriptor() -> None:
    fds = Path("/proc/self/fd")
    before = len(list(fds.iterdir()))
    with Path(__file__).open("rb"):  # a descriptor that is not a socket
        for _ in range(200):
            bytes_acked({("127.0.0.1", 9): "127.0.0.1:9"})
        assert len(list(fds.iterdir())) == before + 1


@pytest.mark.llama
@pytest.mark.soak
def test_twenty_loads_each_report_to_the_end_before_loaded(
    debug_rpc_servers: list,  # type: ignore[type-arg]
    tiny_model: Path,
    rounds: int,
) -> None:
    """The meter's thread and the loader both write to the worker's pipe: 20 loads (soak), each of whose
    samples parse, run forward, and end at 100% before the worker says it is loaded."""
    from orchestrator.planning.plan import PlanOptions
    from orchestrator.planning.profile import profile_model
    from orchestrator.planning.strategy import make_plan
    from tests.plugins.llama import plan_devices

    endpoints = [s.endpoint for s in debug_rpc_servers]
    plan = make_plan(plan_devices(endpoints), profile_model(tiny_model), PlanOptions(n_ctx=256))
    for _ in range(rounds):
        seen = _load(plan, tiny_model)
        assert seen and seen[-1].fraction == 1.0, seen
        assert [p.seconds for p in seen] == sorted(p.seconds for p in seen)
        assert {n.endpoint for n in seen[-1].nodes} == set(endpoints)
        assert all(n.sent >= n.planned for n in seen[-1].nodes)
