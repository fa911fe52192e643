"""Benchmark: what the fleet exporter costs, and how it scales, on a lab of up to 32 nodes (namespaces, real
sshd, real servers).

    .venv/bin/python bench/exporter.py            # print the results
    .venv/bin/python bench/exporter.py --nodes 4,8 --rounds 2 --scrapes 5 --pairs 1 --requests 1  # shorter
    .venv/bin/python bench/exporter.py --write    # and replace the "exporter" section of BENCHMARKS.md

One lab of the largest `--nodes` count; each count N uses the lab's first N nodes. Measured per count,
the counts in turns (all of them, then again, `--turns` times) so that a busy moment falls on every one:

* a probe round of N nodes (`Collector.round`: one SSH round trip per node on kept connections, one
  RPC probe per idle server), median and max of the turns' `--rounds` rounds back to back;
* a scrape of `/metrics` and of `/fleet.json` from `rpcfleet exporter`'s app on loopback while its
  rounds run every second: median and tail of `--scrapes` scrapes per turn, over all turns (they read
  the snapshot only; the tail is a p95 from 20 scrapes, else their max);
* the probe traffic per round: bytes in and out of the N nodes' interfaces and TCP connections they
  accepted (`PassiveOpens` of each node's namespace), over the rounds, per round;
* tokens/s of `rpcfleet serve` on 3 of the nodes with the exporter off (`--observe-interval 0`), on
  at the default interval (15 s) and on every second (15 times the default rate), `--pairs` times, the
  modes' order rotated each time (off, 15 s, 1 s; then 15 s, 1 s, off; ...): each run greedy
  completions of `--tokens` tokens one after the other for `--run-seconds` (at least `--requests` of
  them), long enough to hold rounds at the default interval (the rounds each run held are counted from
  serve's `rpcfleet_exporter_rounds_total`); the client's rate (completion tokens over the requests' wall
  time) and llama.cpp's decoding rate (`rpcfleet_tokens_per_second`).

Verdicts, computed: the shape of the round time and of the scrape time against the node count (a
least-squares log-log fit of every count, its slope and R^2: `_common.SHAPE_RULE`), each mode's median
against the spread (min-max) of the runs with the exporter off, and the targets:

* at the default interval the exporter costs serve at most 5 % of its client tokens/s (the median against
  the off runs' median), the tolerance serve itself is held to against llama-server by hand, and every
  such run held at least one round (a run that held none measured nothing);
* a probe round of the largest count takes less than the default interval (else rounds queue), and its
  time grows at most linearly with the nodes (a round reaches every node at once);
* a scrape of `/metrics` takes under 50 ms (median) at every count: it reads the last snapshot, so it
  must not wait for the nodes; 50 ms is 0.5 % of Prometheus' default 10 s scrape timeout.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import _common  # noqa: F401  (puts the repository root on sys.path)
import uvicorn
from _common import (
    SHAPE_RULE,
    arg_parser,
    curve_shape,
    free_port,
    load_average,
    median,
    ms,
    stamp,
    tail,
    write_section,
)
from fastapi import FastAPI

from orchestrator.artifacts.build import default_artifact
from orchestrator.engine.executor import Session
from orchestrator.inventory.load import load_inventory
from orchestrator.inventory.model import Host
from orchestrator.lab.lifecycle import lab_down, lab_up, reap_stale
from orchestrator.lab.state import Lab
from orchestrator.models.synth import write_tiny_llama
from orchestrator.observe.collect import Collector
from orchestrator.observe.web import Exporter, mount
from orchestrator.operations.install.ensure import ArtifactChooser
from orchestrator.operations.server.steps import make_deploy_step

LAB_NAME = "benchexp"
MODES = (("off", 0.0), ("on, every 15 s (default)", 15.0), ("on, every 1 s", 1.0))
DEFAULT = MODES[1][0]
KEY = "bench"
COST = 5.0  # %: the exporter's largest cost to serve's tokens/s at the default interval
INTERVAL = 15.0  # s: the default interval, which a round of the largest count must fit in
SCRAPE = 0.050  # s: a scrape's median at every count


def deploy(hosts: list[Host]) -> None:
    artifact = default_artifact("cpu")

    async def go() -> None:
        async with Session(forks=16) as session:
            run = await session.run(hosts, make_deploy_step(ArtifactChooser(artifact.id)), name="deploy")
            if not run.ok:
                raise RuntimeError(f"deploy failed: {[str(r.error) for r in run.failed]}")

    asyncio.run(go())


def node_counters(lab: Lab, count: int) -> tuple[int, int]:
    """Bytes in + out of the first `count` nodes' interfaces (loopback excluded) and TCP connections
    they accepted."""
    total_bytes = opens = 0
    for node in lab.nodes[:count]:
        ns = str(node.namespace)
        dev = subprocess.run(
            ["ip", "netns", "exec", ns, "cat", "/proc/net/dev"], capture_output=True, text=True
        )
        for line in dev.stdout.splitlines()[2:]:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                continue
            fields = rest.split()
            total_bytes += int(fields[0]) + int(fields[8])
        snmp = subprocess.run(
            ["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"], capture_output=True, text=True
        )
        tcp = [line.split() for line in snmp.stdout.splitlines() if line.startswith("Tcp:")]
        opens += int(tcp[1][tcp[0].index("PassiveOpens")])
    return total_bytes, opens


def rounds_and_traffic(lab: Lab, hosts: list[Host], rounds: int) -> dict[str, Any]:
    """`rounds` probe rounds of `hosts` (the lab's first nodes): each round's time, the controller's CPU
    and the nodes' traffic per round."""
    collector = Collector(hosts, interval=1.0, timeout=5.0, forks=16)

    async def go() -> tuple[list[float], int, int]:
        await collector.round()  # connections opened, first readings: not counted
        bytes0, opens0 = node_counters(lab, len(hosts))
        times = []
        cpu0 = time.process_time()
        for _ in range(rounds):
            started = time.monotonic()
            snap = await collector.round()
            times.append(time.monotonic() - started)
            assert all(n.up for n in snap.nodes), [(n.host, n.state, n.message) for n in snap.nodes]
        cpu.append((time.process_time() - cpu0) / rounds)
        bytes1, opens1 = node_counters(lab, len(hosts))
        await collector.close()
        return times, bytes1 - bytes0, opens1 - opens0

    cpu: list[float] = []
    times, sent, opens = asyncio.run(go())
    return {
        "times": times,
        "cpu_per_round": cpu[0],
        "bytes_per_round": sent / rounds,
        "connections_per_round": opens / rounds,
    }


def scrapes(hosts: list[Host], count: int) -> dict[str, Any]:
    collector = Collector(hosts, interval=1.0, timeout=5.0, forks=16)
    app = FastAPI()
    mount(app, Exporter(collector), api_key=None, metrics=True)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    collector.start()
    out: dict[str, Any] = {}
    try:
        collector.first_round.wait(60)
        while not server.started:
            time.sleep(0.05)
        for path in ("/metrics", "/fleet.json"):
            times, size = [], 0
            for _ in range(count):
                started = time.monotonic()
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as answer:
                    size = len(answer.read())
                times.append(time.monotonic() - started)
                time.sleep(0.02)
            out[path], out[f"{path}_bytes"] = times, size
        out["rounds"] = collector.snapshot.rounds
    finally:
        collector.stop()
        server.should_exit = True
        thread.join(10)
    return out


def metric(text: str, name: str) -> float | None:
    """A sample's value in a Prometheus text (None when absent: the exporter off has no rounds)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def serve_run(
    inventory: Path, limit: str, model: Path, interval: float, requests: int, tokens: int, seconds: float
) -> tuple[float, float, float]:
    """(client tokens/s, llama.cpp tokens/s, exporter rounds during the requests) of one serve run with
    `--observe-interval interval`: completions one after the other for `seconds`, at least `requests`."""
    port = free_port()
    argv = [sys.executable, "-m", "orchestrator", "serve", "-i", str(inventory), "-m", str(model)]
    argv += ["-l", limit, "--ctx", "2048", "--port", str(port), "--model-name", "bench", "--split"]
    argv += ["--observe-interval", str(interval), "--rejoin-interval", "0"]
    env = {**os.environ, "RPCFLEET_API_KEY": KEY}
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                request = urllib.request.Request(base + "/health", headers=auth)
                with urllib.request.urlopen(request, timeout=5) as answer:
                    if json.loads(answer.read())["status"] == "ready":
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("serve did not become ready")
            time.sleep(0.2)
        time.sleep(2.0)  # the same settling for every mode (the exporter's first round ran before the load)

        def read_metrics() -> str:
            request = urllib.request.Request(base + "/metrics", headers=auth)
            with urllib.request.urlopen(request, timeout=30) as answer:
                return str(answer.read().decode())

        rounds_before = metric(read_metrics(), "rpcfleet_exporter_rounds_total") or 0.0
        generated, took, done = 0, 0.0, 0
        window = time.monotonic()
        while done < requests or time.monotonic() - window < seconds:
            done += 1
            body = json.dumps({"prompt": "the fleet", "max_tokens": tokens, "temperature": 0}).encode()
            request = urllib.request.Request(
                base + "/v1/completions", data=body, headers={**auth, "Content-Type": "application/json"}
            )
            started = time.monotonic()
            with urllib.request.urlopen(request, timeout=300) as answer:
                generated += json.loads(answer.read())["usage"]["completion_tokens"]
            took += time.monotonic() - started
        metrics = read_metrics()
        native = metric(metrics, "rpcfleet_tokens_per_second")
        if native is None:
            raise RuntimeError("serve's /metrics has no rpcfleet_tokens_per_second")
        rounds = (metric(metrics, "rpcfleet_exporter_rounds_total") or 0.0) - rounds_before
        return generated / took, native, rounds
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def against_off(runs: dict[str, list[tuple[float, float, float]]], name: str, index: int) -> str:
    """Where mode `name`'s median lies against the spread (min-max) of the runs with the exporter off."""
    off = [r[index] for r in runs["off"]]
    value = median([r[index] for r in runs[name]])
    low, high = min(off), max(off)
    if len(off) < 2:
        return "one off run: no spread"
    if low <= value <= high:
        return "within the off spread"
    if value < low:
        return f"outside: {(low - value) / low * 100:.1f}% under the lowest off run"
    return f"outside: {(value - high) / high * 100:.1f}% over the highest off run"


def exporter_targets(
    cost: float,
    held: list[float],
    largest: int,
    round_largest: float,
    round_linear: bool,
    shape_said: str,
    scrape_medians: list[float],
) -> dict[str, tuple[bool, str]]:
    """Each target's (met, the figures it was judged on): `cost` the % of serve's tokens/s lost at the
    default interval, `held` the rounds each such run held, `round_largest` a round's median at the
    largest count (`round_linear`: its curve at most linear), `scrape_medians` per count (seconds)."""
    return {
        f"serve's tokens/s at the default interval at most {COST:g} % under the exporter off": (
            cost <= COST,
            f"{cost:.1f} % under" if cost >= 0 else f"{-cost:.1f} % over",
        ),
        "every run at the default interval held a round": (
            bool(held) and min(held) >= 1,
            "rounds held per run: " + ", ".join(f"{r:.0f}" for r in held),
        ),
        f"a probe round of {largest} nodes under the {INTERVAL:g} s interval, at most linear": (
            round_largest < INTERVAL and round_linear,
            f"{ms(round_largest)}, {shape_said}",
        ),
        f"a `/metrics` scrape under {ms(SCRAPE)} at every count": (
            max(scrape_medians) < SCRAPE,
            f"slowest median {ms(max(scrape_medians))}",
        ),
    }


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--nodes", default="4,16,32", help="node counts, comma-separated (default 4,16,32)")
    parser.add_argument("--turns", type=int, default=2, help="turns over the node counts (default 2)")
    parser.add_argument("--rounds", type=int, default=5, help="probe rounds per count and turn (default 5)")
    parser.add_argument("--scrapes", type=int, default=25, help="scrapes per path, count, turn (default 25)")
    parser.add_argument("--pairs", type=int, default=3, help="runs of each exporter mode (default 3)")
    parser.add_argument("--requests", type=int, default=2, help="completions per serve run, at least")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--run-seconds",
        type=float,
        default=60.0,
        help="each serve run's length (default 60: four rounds at the default 15 s interval)",
    )
    args = parser.parse_args()
    counts = sorted(int(n) for n in args.nodes.split(","))
    reap_stale()
    load_average()  # the measurement starts: a bounded wait for a quiet machine, its load kept for the block
    lab = lab_up(counts[-1], name=LAB_NAME, owner_pid=os.getpid())
    rounds: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    scraped: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _ in MODES}
    try:
        hosts = list(load_inventory(lab.inventory).hosts)
        deploy(hosts)
        for turn in range(args.turns):
            for n in counts if turn % 2 == 0 else counts[::-1]:  # in turns, the order reversed each turn
                print(f"turn {turn + 1}: {n} nodes", file=sys.stderr, flush=True)
                rounds[n].append(rounds_and_traffic(lab, hosts[:n], args.rounds))
                scraped[n].append(scrapes(hosts[:n], args.scrapes))
        with tempfile.TemporaryDirectory() as folder:
            model = write_tiny_llama(Path(folder) / "bench.gguf", n_layer=8, n_embd=512, n_head=8, n_ff=1408)
            limit = ",".join(h.name for h in hosts[:3])
            for i in range(args.pairs):
                for name, interval in MODES[i % len(MODES) :] + MODES[: i % len(MODES)]:  # rotated
                    print(f"serve {i + 1}: exporter {name}", file=sys.stderr, flush=True)
                    runs[name].append(
                        serve_run(
                            lab.inventory,
                            limit,
                            model,
                            interval,
                            args.requests,
                            args.tokens,
                            args.run_seconds,
                        )
                    )
    finally:
        lab_down(LAB_NAME)

    def rate(name: str, index: int) -> float:
        return float(median([r[index] for r in runs[name]]))

    def all_of(of: list[dict[str, Any]], key: str) -> list[float]:
        return [t for one in of for t in one[key]]

    def mean(of: list[dict[str, Any]], key: str) -> float:
        return float(sum(one[key] for one in of)) / len(of)

    round_medians = [median(all_of(rounds[n], "times")) for n in counts]
    scrape_medians = [median(all_of(scraped[n], "/metrics")) for n in counts]
    curve_rows = []
    for n in counts:
        times, per_round = all_of(rounds[n], "times"), mean(rounds[n], "bytes_per_round") / 1024
        metrics, fleet = all_of(scraped[n], "/metrics"), all_of(scraped[n], "/fleet.json")
        kib = {path: scraped[n][-1][f"{path}_bytes"] / 1024 for path in ("/metrics", "/fleet.json")}
        (m_tail, m_value), (f_tail, f_value) = tail(metrics), tail(fleet)
        curve_rows.append(
            f"| {n} | {ms(median(times))} ({ms(max(times))}) | {ms(mean(rounds[n], 'cpu_per_round'))} "
            f"| {ms(median(metrics))} ({m_tail} {ms(m_value)}; {len(metrics)}), {kib['/metrics']:.1f} KiB "
            f"| {ms(median(fleet))} ({f_tail} {ms(f_value)}; {len(fleet)}), {kib['/fleet.json']:.1f} KiB "
            f"| {per_round:.1f} KiB ({per_round / n:.1f} KiB per node), "
            f"{mean(rounds[n], 'connections_per_round'):.1f} connections |"
        )
    largest = counts[-1]
    if len(counts) > 1:
        round_fit = curve_shape(counts, round_medians)
        scrape_fit = curve_shape(counts, scrape_medians)
        shapes = (
            f"Shapes from {counts[0]} to {counts[-1]} nodes ({SHAPE_RULE}): probe round slope "
            f"{round_fit[0]:.2f}, R^2 {round_fit[1]:.2f} (**{round_fit[2]}**); scrape of `/metrics` slope "
            f"{scrape_fit[0]:.2f}, R^2 {scrape_fit[1]:.2f} (**{scrape_fit[2]}**)."
        )
        round_linear = round_fit[2] in ("flat", "sublinear", "linear")
        shape_said = f"its shape {round_fit[2]}"
    else:
        shapes = f"One node count ({counts[0]}): no shape."
        round_linear, shape_said = False, "no shape from one count"
    per_round = mean(rounds[largest], "bytes_per_round") / 1024
    off = (rate("off", 0), rate("off", 1))
    cost = (off[0] - rate(DEFAULT, 0)) / off[0] * 100
    held = [r[2] for r in runs[DEFAULT]]
    round_largest = round_medians[-1]
    targets = exporter_targets(cost, held, largest, round_largest, round_linear, shape_said, scrape_medians)
    verdict = "met" if all(ok for ok, _ in targets.values()) else "not met"
    target_lines = [
        f"- {what}: **{'met' if ok else 'not met'}** ({said})" for what, (ok, said) in targets.items()
    ]
    lines = [
        "## exporter",
        "",
        f"{stamp()}. `bench/exporter.py --nodes {args.nodes} --turns {args.turns} --rounds {args.rounds} "
        f"--scrapes {args.scrapes} --pairs {args.pairs} --requests {args.requests} --tokens {args.tokens} "
        f"--run-seconds {args.run_seconds:g}`: a lab of {largest} nodes (namespaces, real sshd, CPU "
        "rpc-servers), each count its first nodes, the counts in turns, nothing serving them for the "
        "first table.",
        "",
        "| nodes | probe round: median (max) | controller CPU per round (this process) "
        "| scrape `/metrics`: median (tail; scrapes), size | `/fleet.json`: median (tail; scrapes), size "
        "| probe traffic per round (in + out of the nodes), TCP connections accepted |",
        "|---|---|---|---|---|---|",
        *curve_rows,
        "",
        shapes
        + " The connections accepted are the RPC probes; the SSH connections stay open from round to round. "
        f"At the default interval (15 s), {largest} nodes' probe traffic is {per_round / 15:.1f} KiB/s.",
        "",
        f"serve on 3 of the nodes (8-layer n_embd 512 model, greedy, {args.tokens}-token completions one "
        f"after the other for {args.run_seconds:g} s per run, at least {args.requests}), the exporter off "
        f"(`--observe-interval 0`) and on, {args.pairs} runs of each, the order rotated every time; medians, "
        "and each against the spread of the off runs:",
        "",
        "| exporter | tokens/s (client) | vs off | against the off runs | tokens/s (llama.cpp) | vs off "
        "| against the off runs | runs (client) | exporter rounds per run |",
        "|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {name} | {rate(name, 0):.1f} | {(rate(name, 0) - off[0]) / off[0] * 100:+.1f}% | "
            f"{against_off(runs, name, 0)} | "
            f"{rate(name, 1):.1f} | {(rate(name, 1) - off[1]) / off[1] * 100:+.1f}% | "
            f"{against_off(runs, name, 1)} | "
            + ", ".join(f"{r[0]:.1f}" for r in runs[name])
            + " | "
            + ", ".join(f"{r[2]:.0f}" for r in runs[name])
            + " |"
            for name, _ in MODES
        ),
        "",
        f"The runs with the exporter off spread from {min(r[0] for r in runs['off']):.1f} to "
        f"{max(r[0] for r in runs['off']):.1f} tokens/s on this machine. Inside serve a round reads "
        "serve's nodes over SSH only (no RPC probe after the first round); its cost is the controller's CPU "
        "above, in serve's process, once per interval.",
        "",
        f"Targets: **{verdict}**.",
        *target_lines,
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write is not None:
        write_section(args.write, "exporter", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
