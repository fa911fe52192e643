"""Benchmark: what the fleet exporter costs, on a lab of 16 nodes (namespaces, real sshd, real servers).

    .venv/bin/python bench/exporter.py            # print the results
    .venv/bin/python bench/exporter.py --write    # and replace the "exporter" section of BENCHMARKS.md

Measured:

* a probe round of 16 nodes (`Collector.round`: one SSH round trip per node on kept connections, one
  RPC probe per idle server), median and max of `--rounds` rounds back to back;
* a scrape of `/metrics` and of `/fleet.json` from `rpcfleet exporter`'s app on loopback while its
  rounds run every second: median and p95 of `--scrapes` scrapes (they read the snapshot only);
* the probe traffic per round: bytes in and out of the 16 nodes' interfaces and TCP connections they
  accepted (`PassiveOpens` of each node's namespace), over `--rounds` rounds, per round;
* tokens/s of `rpcfleet serve` on 3 of the nodes with the exporter off (`--observe-interval 0`), on
  at the default interval (15 s) and on every second (15 times the default rate), in turn `--pairs`
  times: each run `--requests` greedy completions of `--tokens` tokens; the client's rate (completion
  tokens over the requests' wall time) and llama.cpp's decoding rate (`rpcfleet_tokens_per_second`).
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

import _common  # noqa: F401  (puts the repository root on sys.path)
import uvicorn
from _common import arg_parser, free_port, load_average, median, ms, p95, stamp, write_section
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
KEY = "bench"


def deploy(hosts: list[Host]) -> None:
    artifact = default_artifact("cpu")

    async def go() -> None:
        async with Session(forks=16) as session:
            run = await session.run(hosts, make_deploy_step(ArtifactChooser(artifact.id)), name="deploy")
            if not run.ok:
                raise RuntimeError(f"deploy failed: {[str(r.error) for r in run.failed]}")

    asyncio.run(go())


def node_counters(lab: Lab) -> tuple[int, int]:
    """Bytes in + out of every node's interfaces (loopback excluded) and TCP connections accepted."""
    total_bytes = opens = 0
    for node in lab.nodes:
        ns = node.namespace
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


def rounds_and_traffic(lab: Lab, hosts: list[Host], rounds: int) -> dict[str, float]:
    collector = Collector(hosts, interval=1.0, timeout=5.0, forks=16)

    async def go() -> tuple[list[float], int, int]:
        await collector.round()  # connections opened, first readings: not counted
        bytes0, opens0 = node_counters(lab)
        times = []
        cpu0 = time.process_time()
        for _ in range(rounds):
            started = time.monotonic()
            snap = await collector.round()
            times.append(time.monotonic() - started)
            assert all(n.up for n in snap.nodes), [(n.host, n.state, n.message) for n in snap.nodes]
        cpu.append((time.process_time() - cpu0) / rounds)
        bytes1, opens1 = node_counters(lab)
        await collector.close()
        return times, bytes1 - bytes0, opens1 - opens0

    cpu: list[float] = []
    times, sent, opens = asyncio.run(go())
    return {
        "cpu_per_round": cpu[0],
        "round_median": median(times),
        "round_max": max(times),
        "bytes_per_round": sent / rounds,
        "connections_per_round": opens / rounds,
    }


def scrapes(hosts: list[Host], count: int) -> dict[str, float]:
    collector = Collector(hosts, interval=1.0, timeout=5.0, forks=16)
    app = FastAPI()
    mount(app, Exporter(collector), api_key=None, metrics=True)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    collector.start()
    out: dict[str, float] = {}
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
            out[f"{path}_median"], out[f"{path}_p95"], out[f"{path}_bytes"] = median(times), p95(times), size
        out["rounds"] = collector.snapshot.rounds
    finally:
        collector.stop()
        server.should_exit = True
        thread.join(10)
    return out


def serve_run(
    inventory: Path, limit: str, model: Path, interval: float, requests: int, tokens: int
) -> tuple[float, float]:
    """(client tokens/s, llama.cpp tokens/s) of one serve run with `--observe-interval interval`."""
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
        generated, took = 0, 0.0
        for _ in range(requests):
            body = json.dumps({"prompt": "the fleet", "max_tokens": tokens, "temperature": 0}).encode()
            request = urllib.request.Request(
                base + "/v1/completions", data=body, headers={**auth, "Content-Type": "application/json"}
            )
            started = time.monotonic()
            with urllib.request.urlopen(request, timeout=300) as answer:
                generated += json.loads(answer.read())["usage"]["completion_tokens"]
            took += time.monotonic() - started
        request = urllib.request.Request(base + "/metrics", headers=auth)
        with urllib.request.urlopen(request, timeout=30) as answer:
            metrics = answer.read().decode()
        native = next(
            float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith("rpcfleet_tokens_per_second ")
        )
        return generated / took, native
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--scrapes", type=int, default=50)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    reap_stale()
    load = load_average()
    lab = lab_up(args.nodes, name=LAB_NAME, owner_pid=os.getpid())
    try:
        hosts = list(load_inventory(lab.inventory).hosts)
        deploy(hosts)
        traffic = rounds_and_traffic(lab, hosts, args.rounds)
        scraped = scrapes(hosts, args.scrapes)
        with tempfile.TemporaryDirectory() as folder:
            model = write_tiny_llama(Path(folder) / "bench.gguf", n_layer=8, n_embd=512, n_head=8, n_ff=1408)
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in MODES}
            for _ in range(args.pairs):
                for name, interval in MODES:
                    limit = ",".join(h.name for h in hosts[:3])
                    runs[name].append(
                        serve_run(lab.inventory, limit, model, interval, args.requests, args.tokens)
                    )
    finally:
        lab_down(LAB_NAME)

    def rate(name: str, index: int) -> float:
        return median([r[index] for r in runs[name]])

    kib = {k: v / 1024 for k, v in scraped.items() if k.endswith("_bytes")}
    per_round = traffic["bytes_per_round"] / 1024
    off = (rate("off", 0), rate("off", 1))
    lines = [
        "## exporter",
        "",
        f"{stamp()}; load average {load:.2f} at the start. `bench/exporter.py --nodes {args.nodes} --rounds "
        f"{args.rounds} --scrapes {args.scrapes} --pairs {args.pairs} --requests {args.requests} --tokens "
        f"{args.tokens}`: a lab of {args.nodes} nodes (namespaces, real sshd, CPU rpc-servers), nothing "
        "serving them for the first three rows.",
        "",
        "| | median | max / p95 |",
        "|---|---|---|",
        f"| probe round, {args.nodes} nodes (SSH read + RPC probe each) | {ms(traffic['round_median'])} | "
        f"{ms(traffic['round_max'])} (max) |",
        f"| controller CPU per round (this process) | {ms(traffic['cpu_per_round'])} | |",
        f"| scrape `/metrics` ({kib['/metrics_bytes']:.1f} KiB) | {ms(scraped['/metrics_median'])} | "
        f"{ms(scraped['/metrics_p95'])} (p95) |",
        f"| `/fleet.json` ({kib['/fleet.json_bytes']:.1f} KiB) | {ms(scraped['/fleet.json_median'])} | "
        f"{ms(scraped['/fleet.json_p95'])} (p95) |",
        "",
        f"Probe traffic per round, {args.nodes} nodes: {per_round:.1f} KiB in and out of "
        f"the nodes ({per_round / args.nodes:.1f} KiB per node), "
        f"{traffic['connections_per_round']:.1f} TCP connections accepted (the RPC probes; the SSH "
        "connections stay open from round to round). At the default interval (15 s) that is "
        f"{per_round / 15:.1f} KiB/s for the fleet.",
        "",
        f"serve on 3 of the nodes (8-layer n_embd 512 model, greedy, {args.requests} x {args.tokens} tokens "
        f"per run), the exporter off (`--observe-interval 0`) and on, in turn, {args.pairs} times; medians:",
        "",
        "| exporter | tokens/s (client) | vs off | tokens/s (llama.cpp) | vs off | runs (client) |",
        "|---|---|---|---|---|---|",
        *(
            f"| {name} | {rate(name, 0):.1f} | {(rate(name, 0) - off[0]) / off[0] * 100:+.1f}% | "
            f"{rate(name, 1):.1f} | {(rate(name, 1) - off[1]) / off[1] * 100:+.1f}% | "
            + ", ".join(f"{r[0]:.1f}" for r in runs[name])
            + " |"
            for name, _ in MODES
        ),
        "",
        f"The runs with the exporter off spread from {min(r[0] for r in runs['off']):.1f} to "
        f"{max(r[0] for r in runs['off']):.1f} tokens/s on this machine (load average {load_average():.2f} "
        "at the end): a difference within that spread is noise, not the exporter. Inside serve a round "
        "reads serve's nodes over SSH only (no RPC probe after the first round); its cost is the "
        "controller's CPU above, in serve's process, once per interval.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write is not None:
        write_section(args.write, "exporter", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
