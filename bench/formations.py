"""Benchmark: serve's formations (issues 24 and 42): `--replicas auto` (one formation per node: three
llama-servers behind serve's router, `--parallel P` each) against `--split` (one llama-server over the
three nodes with `--parallel 3P`: the same slots in all, each of the same context), at 1, 4 and 8
clients, and what a node kill costs the streams in flight.

    .venv/bin/python bench/formations.py                   # print the section
    .venv/bin/python bench/formations.py --clients 1,8 --requests 1 --rounds 1   # shorter
    .venv/bin/python bench/formations.py --write           # and replace its block in BENCHMARKS.md

A 3-node lab (network namespaces, real sshd, real `ggml-rpc-server`s deployed by `rpcfleet deploy`),
each node with its own CPU share (`lab up --cpus 0.6`: a cgroup quota, so three nodes behave like three
small machines rather than three processes sharing the host's cores), the real Gemma 3 270M from the
cache. Each round runs serve in one mode, measures every concurrency, stops it, then the other mode:
alternately, `--rounds` of each. At C clients, each client sends `--requests` completions of `--tokens`
tokens (greedy, ignore_eos) one after the other: aggregate tokens/s = all completion tokens / the wall
time of the whole concurrency; latency = each request's time, p50 and p95.

Then 1 client again on a lab of the same nodes without `--cpus`: a quota holds a node's bursts shorter
than the kernel's tick (a few ms: a split node's share of one token) only loosely, so a split's nodes,
idle between their bursts, run faster than their share; on equal unquoted nodes only the formation's size
differs.

Node kill: `--replicas auto` with 8 streaming clients; when every stream has its first token, the
formations' busy slots are read from /health and one node's server gets SIGKILL; the lost formation's
streams go on on the others (issue 42): the streams that end with an error are counted, and the longest
pause inside a stream.

Targets, computed (issue 42's: with the slots equal, the ratio measures the shape alone): `--replicas auto`
at least 1.5x `--split` in aggregate tokens/s (median of the rounds) at 8 clients, and within 10% of it at
1 client; at the node kill, no stream ends with an error.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import (
    PROMPT,
    ROOT,
    arg_parser,
    free_port,
    get_json,
    load_average,
    measure,
    median,
    stamp,
    write_section,
)

from orchestrator.lab.lifecycle import lab_down, lab_up, reap_stale
from orchestrator.lab.state import Lab
from orchestrator.models.catalogue import GEMMA3_270M, cached_path

SECTION = "formations"
LAB_NAME = "benchform"
MODES = {"auto": ["--replicas", "auto"], "split": ["--split"]}
FORMATIONS = 3  # one per node: split gets their slots together
SLOT_CTX = 512  # each slot's context, in either mode
AT_LOAD, AT_ONE = 8, 1  # the concurrencies the targets judge
TARGET_LOAD, TARGET_ONE = 1.5, 0.10  # auto / split at least 1.5 at 8 clients, within 10% at 1


TIMEOUT = 900  # seconds the client waits for one request


def wait_ready(base: str, process: subprocess.Popen[bytes], limit: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"serve exited with {process.returncode}")
        try:
            data: dict[str, Any] = get_json(f"{base}/health", 30)
            if data.get("status") == "ready":
                return data
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{base} not ready within {limit} s")


@contextlib.contextmanager
def serving(lab: Lab, model: Path, folder: Path, mode: str, parallel: int) -> Iterator[str]:
    """serve in `mode` with `parallel` slots per formation for auto, their sum for split."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    slots = parallel if mode == "auto" else parallel * FORMATIONS
    argv = [sys.executable, "-m", "orchestrator", "serve", "-i", str(lab.inventory), "-m", str(model)]
    argv += ["--ctx", str(slots * SLOT_CTX), "--parallel", str(slots), "--port", str(port)]
    argv += ["--model-name", "bench"]
    argv += ["--rejoin-interval", "1", "--observe-interval", "0", *MODES[mode]]
    env = {**os.environ, "RPCFLEET_HOME": str(folder / "home")}
    env.pop("RPCFLEET_API_KEY", None)
    with (folder / f"serve-{mode}.log").open("ab") as log:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(base, process)
        yield base
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def stream(base: str, tokens: int, started: threading.Event) -> tuple[bool, float]:
    """One streamed completion: whether it ended with [DONE] (not an error event), and its longest pause
    between two events after the first."""
    body = {"model": "bench", "prompt": PROMPT, "max_tokens": tokens, "stream": True, "ignore_eos": True}
    request = urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    pause, last = 0.0, None
    with urllib.request.urlopen(request, timeout=900) as answer:
        for raw in answer:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            pause, last = max(pause, now - last) if last is not None else pause, now
            if line == "data: [DONE]":
                return True, pause
            if '"error"' in line:
                return False, pause
            started.set()
    return False, pause


def server_pid(lab: Lab, node: str) -> int:
    import psutil

    for pid in lab.node_pids(node):
        with contextlib.suppress(psutil.NoSuchProcess):
            if "rpc-server" in psutil.Process(pid).name():
                return pid
    raise RuntimeError(f"no rpc-server on {node}")


def node_kill(lab: Lab, model: Path, folder: Path, parallel: int, tokens: int) -> dict[str, Any]:
    with serving(lab, model, folder, "auto", parallel) as base:
        starts = [threading.Event() for _ in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(stream, base, tokens, s) for s in starts]
            for started in starts:
                started.wait(600)
            victim = lab.nodes[-1]
            endpoint = f"{victim.address}:50052"
            health = get_json(f"{base}/health", 30)
            lost = [f for f in health["formations"] if any(victim.address in n for n in f["nodes"])]
            in_flight = lost[0]["slots_busy"] if lost else 0
            os.kill(server_pid(lab, victim.name), signal.SIGKILL)
            ended = [s.result() for s in streams]
        after = measure(base, 6, 1, 8, timeout=TIMEOUT)
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
    resumed = sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in metrics.splitlines()
        if line.startswith("rpcfleet_requests_resumed_total{")
    )
    return {
        "errors": sum(1 for whole, _ in ended if not whole),
        "pause": max(pause for _, pause in ended),
        "resumed": resumed,
        "in_flight": in_flight,
        "streams": len(ended),
        "after_tps": after["tps"],
        "victim": endpoint,
    }


def deploy(lab: Lab) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "deploy", "-i", str(lab.inventory)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise RuntimeError(f"deploy failed: {done.stdout}{done.stderr}")


Runs = dict[str, dict[int, list[dict[str, float]]]]  # mode -> clients -> each round's figures


def alternate(
    lab: Lab, model: Path, folder: Path, args: argparse.Namespace, concurrencies: list[int], runs: Runs
) -> None:
    """`args.rounds` rounds of each mode, the order swapped every other round (a drift of the machine's
    load favours neither)."""
    for i in range(args.rounds):
        for mode in list(MODES) if i % 2 == 0 else list(MODES)[::-1]:
            print(f"round {i + 1}: serve {' '.join(MODES[mode])}", file=sys.stderr, flush=True)
            with serving(lab, model, folder, mode, args.parallel) as base:
                for c in concurrencies:
                    runs[mode][c].append(measure(base, c, args.requests, args.tokens, timeout=TIMEOUT))


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--clients", default="1,4,8", help="concurrencies (default 1,4,8)")
    parser.add_argument("--requests", type=int, default=2, help="requests per client (default 2)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per completion (default 32)")
    parser.add_argument("--parallel", type=int, default=4, help="--parallel of each engine (default 4)")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of each mode (default 1)")
    parser.add_argument("--cpus", type=float, default=0.6, help="each node's CPU share (default 0.6)")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.clients.split(",")]
    model = cached_path(GEMMA3_270M)
    load_before = load_average()
    runs: Runs = {m: {c: [] for c in concurrencies} for m in MODES}
    unquoted: Runs = {m: {1: []} for m in MODES}
    reap_stale()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        lab = lab_up(3, name=LAB_NAME, owner_pid=os.getpid(), cpus=args.cpus)
        try:
            deploy(lab)
            alternate(lab, model, folder, args, concurrencies, runs)
            print("node kill", file=sys.stderr, flush=True)
            kill = node_kill(lab, model, folder, args.parallel, args.tokens * 4)
        finally:
            lab_down(LAB_NAME)
        # One client without quotas: a share holds a node's bursts shorter than the kernel's tick only
        # loosely (docs/lab.md), so a split's nodes, idle between them, run faster than their share. On equal
        # nodes with no quota, the formation's size is all that differs.
        lab = lab_up(3, name=LAB_NAME, owner_pid=os.getpid())
        try:
            deploy(lab)
            alternate(lab, model, folder, args, [1], unquoted)
        finally:
            lab_down(LAB_NAME)

    def med(of: Runs, mode: str, c: int, key: str) -> float:
        return median([r[key] for r in of[mode][c]])

    def row(of: Runs, c: int, label: str) -> str:
        auto, split = (
            f"{med(of, m, c, 'tps'):.1f} ({med(of, m, c, 'p50'):.1f} s / {med(of, m, c, 'p95'):.1f} s)"
            for m in MODES
        )
        each = ", ".join(
            f"{a['tps'] / b['tps']:.2f}" for a, b in zip(of["auto"][c], of["split"][c], strict=True)
        )
        ratio = med(of, "auto", c, "tps") / med(of, "split", c, "tps")
        ratios[label] = ratio
        target = "-"
        if label == str(AT_LOAD):
            target = f"at least {TARGET_LOAD:g}x: **{'met' if ratio >= TARGET_LOAD else 'not met'}**"
        elif label == str(AT_ONE):
            near = abs(ratio - 1) <= TARGET_ONE
            target = f"within {TARGET_ONE:.0%}: **{'met' if near else 'not met'}**"
        return f"| {label} | {auto} | {split} | {ratio:.2f}x | {each} | {target} |"

    ratios: dict[str, float] = {}
    rows = [row(runs, c, str(c)) for c in concurrencies]
    rows.append(row(unquoted, 1, "1, no CPU quota"))
    verdicts = []
    for c, bound in ((AT_LOAD, f"at least {TARGET_LOAD:g}x"), (AT_ONE, f"within {TARGET_ONE:.0%}")):
        if str(c) not in ratios:
            verdicts.append(f"{c} client(s) not run: not judged")
            continue
        met = ratios[str(c)] >= TARGET_LOAD if c == AT_LOAD else abs(ratios[str(c)] - 1) <= TARGET_ONE
        verdicts.append(
            f"{bound} at {c} client(s) ({ratios[str(c)]:.2f}x): **{'met' if met else 'not met'}**"
        )
    throughput = "; ".join(verdicts)
    kill_met = kill["errors"] == 0
    body = [
        f"## {SECTION}",
        "",
        f"{stamp()}; load average {load_before:.2f} at the start. `bench/formations.py --clients "
        f"{args.clients} --requests {args.requests} --tokens {args.tokens} --parallel {args.parallel} "
        f"--rounds {args.rounds} --cpus {args.cpus:g}`: a 3-node lab, each node `--cpus {args.cpus:g}`, "
        f"Gemma 3 270M Q4_K_M, {SLOT_CTX} tokens of context per slot, greedy completions of "
        f"{args.tokens} tokens; each client sends "
        f"{args.requests} one after the other; the modes alternate (auto first in odd rounds, split first "
        "in even ones). The last row: the same lab without `--cpus`, 1 client.",
        "",
        f"| clients | --replicas auto (3 formations of {args.parallel} slots): tok/s (p50 / p95) "
        f"| --split (1 formation of {args.parallel * FORMATIONS} slots) | auto / split (medians) "
        "| each round's | target |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Node kill (`--replicas auto`, {kill['streams']} streams of {args.tokens * 4} tokens, SIGKILL of "
        f"one node's server, {kill['victim']}): the lost formation had {kill['in_flight']} in flight, "
        f"{kill['resumed']} request(s) went on elsewhere, {kill['errors']} stream(s) ended with an error; "
        f"the longest pause inside a stream {kill['pause']:.1f} s; then 6 requests at "
        f"{kill['after_tps']:.1f} tok/s, all answered.",
        "",
        f"Targets (`--replicas auto` / `--split`, the slots equal): {throughput}; a node kill ends no stream "
        f"with an error ({kill['errors']}): **{'met' if kill_met else 'not met'}**.",
    ]
    text = "\n".join(body) + "\n"
    print(text)
    if args.write:
        write_section(args.write, SECTION, text)


if __name__ == "__main__":
    main()
