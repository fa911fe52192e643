"""Benchmark: `rpcfleet serve` (llama-server behind serve's front) against llama-server started by hand on
the same nodes with the same split, at 1, 2, 4 and 8 clients; and serve's recovery after a node kill.

    .venv/bin/python bench/serve.py                       # print the section
    .venv/bin/python bench/serve.py --clients 1,4 --requests 2 --rounds 1   # shorter
    .venv/bin/python bench/serve.py --write               # and replace the "serve" section of BENCHMARKS.md

Three real `ggml-rpc-server`s on loopback (an inventory of `connection: local` hosts), the real Gemma 3
270M (from the cache). Each round runs serve (`--parallel P`), measures every concurrency, stops it, then
runs llama-server by hand (`--rpc` the same servers, `-ts` serve's split, `-ngl 99`, `-c` serve's
context, `-np P`) and measures the same: alternately, `--rounds` of each, the order swapped every other
round. At C clients, each client sends
`--requests` completions of `--tokens` tokens (greedy, ignore_eos) one after the other: aggregate tokens/s
= all completion tokens / the wall time of the whole concurrency; latency = each request's time, p50 and
p95. The official `openai` client sends them.

Recovery: serve with 4 streams running, SIGKILL of one server; detection (the kill to the clients' error),
serve's re-probe + plan and engine start (its /health), the first token of a new request, against the
engine's load time.
"""

from __future__ import annotations

import contextlib
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
    local_inventory,
    measure,
    median,
    ms,
    servers,
    stamp,
    write_section,
)

from orchestrator.models.catalogue import GEMMA3_270M, cached_path

SECTION = "serve"


TIMEOUT = 600  # seconds the client waits for one request


def wait_serving(base: str, limit: float = 180, health: bool = True) -> dict[str, Any]:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            data: dict[str, Any] = get_json(f"{base}/health")
            if not health or data.get("status") in ("ready", "degraded", "ok"):
                return data
        except OSError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"{base} not serving within {limit} s")


@contextlib.contextmanager
def _serve(inventory: Path, model: Path, folder: Path, parallel: int) -> Iterator[tuple[str, dict[str, Any]]]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "orchestrator", "serve", "-i", str(inventory), "-m", str(model)]
    argv += ["--ctx", "4096", "--port", str(port), "--model-name", "bench", "--parallel", str(parallel)]
    argv += ["--rejoin-interval", "0", "--split"]  # one formation over the 3 nodes, as measured
    env = {**os.environ, "RPCFLEET_HOME": str(folder / "home")}
    env.pop("RPCFLEET_API_KEY", None)
    with (folder / "serve.log").open("ab") as log:
        serve = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield base, wait_serving(base)
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(60)


@contextlib.contextmanager
def _by_hand(health: dict[str, Any], model: Path, folder: Path, parallel: int) -> Iterator[str]:
    from orchestrator.artifacts.build import llama_server_binary

    plan = health["plan"]
    port = free_port()
    argv = [str(llama_server_binary()), "-m", str(model), "--rpc", ",".join(plan["endpoints"])]
    argv += ["-ts", ",".join(str(x) for x in plan["tensor_split"]), "-ngl", "99", "-c", str(plan["n_ctx"])]
    argv += ["-np", str(parallel), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    with (folder / "llama-server.log").open("ab") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_serving(f"http://127.0.0.1:{port}", health=False)
        while _status(f"http://127.0.0.1:{port}") != 200:
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(30)


def _status(base: str) -> int:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as answer:
            return int(answer.status)
    except OSError:
        return 0


def recovery(base: str, pids: dict[str, int], tokens: int) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
    before = get_json(f"{base}/health")
    victim = before["plan"]["endpoints"][-1]
    going = threading.Barrier(5)
    errors: list[float] = []

    def stream(i: int) -> None:
        first = True
        try:
            for _ in client.completions.create(
                model="bench", prompt=f"{PROMPT} {i}", max_tokens=4 * tokens, temperature=0, stream=True
            ):
                if first:
                    going.wait(60)
                    first = False
        except openai.APIError:
            errors.append(time.monotonic())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    going.wait(120)
    killed = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    for thread in threads:
        thread.join(300)
    health = wait_serving(base)
    serving = time.monotonic()
    first = time.monotonic()
    for _ in client.completions.create(
        model="bench", prompt=PROMPT, max_tokens=4, temperature=0, stream=True
    ):
        first = time.monotonic()
        break
    last = health["last_recovery"]
    return {
        "nodes": f"{len(before['plan']['endpoints'])} -> {len(health['plan']['endpoints'])}",
        "errors": len(errors),
        "detection": max(errors) - killed if errors else float("nan"),
        "replan": last["replan"],
        "reload": last["reload"],
        "serving": serving - killed,
        "first_token": first - killed,
        "load": before["load_seconds"],
    }


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--clients", default="1,2,4,8", help="concurrencies (default 1,2,4,8)")
    parser.add_argument("--requests", type=int, default=3, help="requests per client (default 3)")
    parser.add_argument("--tokens", type=int, default=96, help="tokens per completion (default 96)")
    parser.add_argument("--parallel", type=int, default=8, help="slots of both servers (default 8)")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of each (default 1)")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.clients.split(",")]
    model = cached_path(GEMMA3_270M)
    load_before = load_average()
    serve_runs: dict[int, list[dict[str, Any]]] = {c: [] for c in concurrencies}
    hand_runs: dict[int, list[dict[str, Any]]] = {c: [] for c in concurrencies}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        with servers(3, folder) as ports:
            inventory = local_inventory(folder, ports)
            pids = _server_pids(ports)
            health: dict[str, Any] = {}

            def run_serve(i: int) -> None:
                nonlocal health
                print(f"round {i + 1}: rpcfleet serve", file=sys.stderr, flush=True)
                with _serve(inventory, model, folder, args.parallel) as (base, health):
                    for c in concurrencies:
                        serve_runs[c].append(measure(base, c, args.requests, args.tokens, timeout=TIMEOUT))

            def run_by_hand(i: int) -> None:
                print(f"round {i + 1}: llama-server by hand", file=sys.stderr, flush=True)
                with _by_hand(health, model, folder, args.parallel) as base:
                    for c in concurrencies:
                        hand_runs[c].append(measure(base, c, args.requests, args.tokens, timeout=TIMEOUT))

            for i in range(args.rounds):  # serve first in odd rounds, by hand first in even ones: a drift
                first, second = (run_serve, run_by_hand) if i % 2 == 0 else (run_by_hand, run_serve)
                first(i)  # of the machine's load favours neither
                second(i)
            print("recovery", file=sys.stderr, flush=True)
            with _serve(inventory, model, folder, args.parallel) as (base, _):
                rec = recovery(base, pids, args.tokens)

    def med(runs: list[dict[str, Any]], key: str) -> float:
        return median([r[key] for r in runs])

    rows = []
    for c in concurrencies:
        s, h = serve_runs[c], hand_runs[c]
        each = ", ".join(f"{a['tps'] / b['tps']:.2f}" for a, b in zip(s, h, strict=True))
        rows.append(
            f"| {c} | {med(s, 'tps'):.1f} ({med(s, 'p50'):.1f} s / {med(s, 'p95'):.1f} s) "
            f"| {med(h, 'tps'):.1f} ({med(h, 'p50'):.1f} s / {med(h, 'p95'):.1f} s) "
            f"| {med(s, 'tps') / med(h, 'tps'):.2f} "
            f"| {each} |"
        )
    body = [
        f"## {SECTION}",
        "",
        f"{stamp()}; load average {load_before:.2f} at the start, {load_average():.2f} at the end. "
        f"`bench/serve.py --clients {args.clients} "
        f"--requests {args.requests} --tokens {args.tokens} --parallel {args.parallel} "
        f"--rounds {args.rounds}`: 3 loopback servers, Gemma 3 270M Q4_K_M, n_ctx 4096, greedy "
        f"completions of {args.tokens} tokens; each client sends {args.requests} one after the other; "
        "rounds alternate (serve and llama-server by hand on the same servers with serve's split, "
        "serve first in odd rounds, by hand first in even ones). "
        "serve's engine gets the plan's flags (`-fa on`, llama-server's `auto` on these devices, `-b`, "
        "`-ub`, `--fit off`...), the one by hand llama-server's defaults.",
        "",
        f"| clients | rpcfleet serve --parallel {args.parallel}: tok/s (p50 / p95 latency) "
        f"| llama-server -np {args.parallel} by hand | serve / by hand (medians) | each round's |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "Recovery after SIGKILL of one server during 4 streams (detection: the kill to the last client's "
        "error; serving: the kill to `/health` serving again; first token: the kill to a new request's "
        "first token):",
        "",
        "| nodes | streams ended with the error | detection | re-probe + plan | engine start | serving "
        "| first token | engine load before |",
        "|---|---|---|---|---|---|---|---|",
        f"| {rec['nodes']} | {rec['errors']} of 4 | {ms(rec['detection'])} | {ms(rec['replan'])} "
        f"| {ms(rec['reload'])} | {ms(rec['serving'])} | {ms(rec['first_token'])} | {ms(rec['load'])} |",
    ]
    text = "\n".join(body) + "\n"
    print(text)
    if args.write:
        write_section(args.write, SECTION, text)


def _server_pids(ports: list[int]) -> dict[str, int]:
    import psutil

    found: dict[str, int] = {}
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port in ports and conn.pid:
            found[f"127.0.0.1:{conn.laddr.port}"] = conn.pid
    return found


if __name__ == "__main__":
    main()
