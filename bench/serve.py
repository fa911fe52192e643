"""Benchmark: `rpcfleet serve` (llama-server behind serve's front) against llama-server started by hand on
the same nodes with the same flags, from 1 to 32 clients on 8 slots (the queue), long prompts; and serve's
recovery after a node kill.

    .venv/bin/python bench/serve.py                       # print the section
    .venv/bin/python bench/serve.py --clients 1,4 --requests 1 --rounds 1 --prompt-tokens 200   # shorter
    .venv/bin/python bench/serve.py --prompt-tokens 2000  # the long prompts: about 4x the prompt work

The defaults (6 concurrencies up to 32 clients, 500-token prompts, 2 rounds) are sized for about 8
minutes on 2 cores: the prompts' processing dominates (about 200-400 tokens/s here), so 2,000-token
prompts take about four times as long.
    .venv/bin/python bench/serve.py --write               # and replace the "serve" section of BENCHMARKS.md

Three real `ggml-rpc-server`s on loopback (an inventory of `connection: local` hosts), the real Gemma 3
270M (from the cache). Each round runs serve (`--parallel P`), measures every concurrency, stops it, then
runs llama-server by hand and measures the same: alternately, `--rounds` of each, the order swapped every
other round. The llama-server by hand gets the very argv serve's engine got (read from the engine's
process: `engine.engine_args` of serve's plan, i.e. `llama_cli_args` + `-b`, `--metrics`...: the same
`--rpc` endpoints, `-ts`/`-ngl` split, ctx, `-fa`, `--fit off`, `-ub`, `--parallel`, chat template), only
its `--port` differs; it is printed in the section. Both get the same requests (seed 0), so only serve's
front differs.

The prompt: a text repeated to about `--prompt-tokens` tokens (the count the engine reports in `usage`
is printed), each request's own number first so that no slot reuses another's cached prefix. At C
clients, each client sends `--requests` streamed completions of `--tokens` tokens (greedy, ignore_eos)
one after the other (C above P: the rest wait in serve's queue, or llama-server's): aggregate tokens/s =
all completion tokens / the wall time of the whole concurrency; time to first token (TTFT) = the request
to its first content chunk, p50 and p95 (over 20 requests or more; over fewer, the largest, called
max). The official `openai` client sends them. The context and slots the section names are read from
the engine's argv, not from what was asked of serve.

Verdicts, computed: per row, serve / by hand (tokens/s and TTFT p50) against the target (serve within
5 % of llama-server by hand) and against the rounds' spread (the min-max of each round's ratio: a ratio
of 1 inside it is noise); the curve's shape (tokens/s against clients: grows, then flat or falls).

Recovery: serve with 4 streams running, SIGKILL of one server; detection (the kill to the clients' error),
serve's re-probe + plan and engine start (its /health), the first token of a new request, against the
engine's load time.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import shlex
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
    median,
    ms,
    servers,
    stamp,
    tail,
    write_section,
)

from orchestrator.models.catalogue import GEMMA3_270M, cached_path

SECTION = "serve"
TARGET = 0.05  # serve within 5 % of llama-server by hand (tokens/s and time to first token)
GROWS = 0.10  # a curve grows where a point is 10 % above the one before; falls where 10 % under its peak

TIMEOUT = 600  # seconds the client waits for one request
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening, trimmed the wick, wound the clockwork "
    "and watched the beam sweep across the grey water, counting the ships that passed in the night. "
)


def long_prompt(base: str, tokens: int) -> tuple[str, int]:
    """`TEXT` repeated to about `tokens` tokens, counted by the engine (`usage.prompt_tokens` of one
    request at `base`): the prompt and its count."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)

    def count(text: str) -> int:
        answer = client.completions.create(model="bench", prompt=text, max_tokens=1, temperature=0)
        assert answer.usage is not None
        return int(answer.usage.prompt_tokens)

    per = count(TEXT * 4) / 4
    text = TEXT * max(1, round(tokens / per))
    return text, count(f"Request 0.0: {text}")


def measure_stream(
    base: str, clients: int, requests: int, tokens: int, prompt: str
) -> dict[str, float | list[float]]:
    """`clients` OpenAI clients at once, each streaming `requests` completions of `tokens` tokens (EOS
    ignored, seed 0) of `prompt` against `base`: aggregate tokens/s and each request's time to its first
    content chunk."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)

    def one(i: int) -> list[tuple[float, int]]:
        done = []
        for j in range(requests):
            started = time.monotonic()
            first = math.nan
            generated = pieces = 0
            for chunk in client.completions.create(
                model="bench",
                prompt=f"Request {i}.{j}: {prompt}",  # its own start: no slot reuses another's prefix
                max_tokens=tokens,
                temperature=0,
                seed=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            ):
                if chunk.choices and chunk.choices[0].text:
                    pieces += 1
                    if math.isnan(first):
                        first = time.monotonic() - started
                if chunk.usage is not None:
                    generated = chunk.usage.completion_tokens
            done.append((first, generated or pieces))
        return done

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(one, range(clients)) for r in rs]
    wall = time.monotonic() - started
    return {"tps": sum(r[1] for r in results) / wall, "ttft": [r[0] for r in results]}


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
def _serve(
    inventory: Path, model: Path, folder: Path, parallel: int, ctx: int, queue: int
) -> Iterator[tuple[str, dict[str, Any]]]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "orchestrator", "serve", "-i", str(inventory), "-m", str(model)]
    argv += ["--ctx", str(ctx), "--port", str(port), "--model-name", "bench", "--parallel", str(parallel)]
    argv += ["--queue", str(queue), "--queue-timeout", str(TIMEOUT), "--seed", "0"]
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


def engine_argv(health: dict[str, Any]) -> list[str]:
    """The argv serve started its engine with (`engine_args` of serve's plan), read from the process."""
    import psutil

    return list(psutil.Process(health["engine"]["pid"]).cmdline())


def engine_context(engine: list[str]) -> tuple[int, int]:
    """(n_ctx, slots) the engine runs with: its `-c` and `--parallel` arguments."""
    return int(engine[engine.index("-c") + 1]), int(engine[engine.index("--parallel") + 1])


def by_hand_argv(engine: list[str], port: int) -> list[str]:
    """serve's engine's argv on `port`: the same binary, model, plan and flags."""
    at = engine.index("--port")
    return [*engine[: at + 1], str(port), *engine[at + 2 :]]


def shown(argv: list[str]) -> str:
    """The by-hand command for the section: the binary and the model by their file names."""
    names = [Path(argv[0]).name, *argv[1:]]
    names[names.index("-m") + 1] = Path(names[names.index("-m") + 1]).name
    at = names.index("--port")
    names[at + 1] = "PORT"
    return shlex.join(names)


@contextlib.contextmanager
def _by_hand(engine: list[str], folder: Path) -> Iterator[str]:
    port = free_port()
    argv = by_hand_argv(engine, port)
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


def shape(xs: list[int], ys: list[float]) -> str:
    """tokens/s against clients: where it grows (each point 10 % above the one before), then flat or
    falling (the last point against the peak)."""
    if len(xs) < 2:
        return "one point, no shape"
    grew = 0
    while grew + 1 < len(ys) and ys[grew + 1] > ys[grew] * (1 + GROWS):
        grew += 1
    peak = max(range(len(ys)), key=lambda i: ys[i])
    head = f"grows from {xs[0]} to {xs[grew]} clients" if grew else f"does not grow from {xs[0]} clients"
    if grew == len(xs) - 1:
        return f"{head} (to the last point)"
    last = ys[-1] / ys[peak]
    if last < 1 - GROWS:
        tail = f"falls to {xs[-1]} ({(last - 1) * 100:+.0f} % of the peak at {xs[peak]})"
    else:
        tail = f"flat to {xs[-1]} (within {GROWS * 100:.0f} % of the peak at {xs[peak]})"
    return f"{head}, then {tail}"


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--clients", default="1,2,4,8,16,32", help="concurrencies (default 1,2,4,8,16,32)")
    parser.add_argument("--requests", type=int, default=1, help="requests per client (default 1)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per completion (default 16)")
    parser.add_argument(
        "--prompt-tokens", type=int, default=500, help="prompt length (default 500; 2000: the long prompts)"
    )
    parser.add_argument("--parallel", type=int, default=8, help="slots of both servers (default 8)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of each (default 2)")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.clients.split(",")]
    # every slot holds a whole request: n_ctx is split between the slots (c/P each)
    per_slot = args.prompt_tokens + args.tokens + 256
    ctx = -(-args.parallel * per_slot // 1024) * 1024
    queue = max(concurrencies) * args.requests
    model = cached_path(GEMMA3_270M)
    load_before = load_average()
    serve_runs: dict[int, list[dict[str, Any]]] = {c: [] for c in concurrencies}
    hand_runs: dict[int, list[dict[str, Any]]] = {c: [] for c in concurrencies}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        with servers(3, folder) as ports:
            inventory = local_inventory(folder, ports)
            pids = _server_pids(ports)
            print("serve: its engine's argv and the prompt", file=sys.stderr, flush=True)
            with _serve(inventory, model, folder, args.parallel, ctx, queue) as (base, health):
                engine = engine_argv(health)
                prompt, prompt_tokens = long_prompt(base, args.prompt_tokens)

            def run_serve(i: int) -> None:
                print(f"round {i + 1}: rpcfleet serve", file=sys.stderr, flush=True)
                with _serve(inventory, model, folder, args.parallel, ctx, queue) as (base, _):
                    for c in concurrencies:
                        serve_runs[c].append(measure_stream(base, c, args.requests, args.tokens, prompt))

            def run_by_hand(i: int) -> None:
                print(f"round {i + 1}: llama-server by hand", file=sys.stderr, flush=True)
                with _by_hand(engine, folder) as base:
                    for c in concurrencies:
                        hand_runs[c].append(measure_stream(base, c, args.requests, args.tokens, prompt))

            for i in range(args.rounds):  # serve first in odd rounds, by hand first in even ones: a drift
                first, second = (run_serve, run_by_hand) if i % 2 == 0 else (run_by_hand, run_serve)
                first(i)  # of the machine's load favours neither
                second(i)
            print("recovery", file=sys.stderr, flush=True)
            with _serve(inventory, model, folder, args.parallel, ctx, queue) as (base, _):
                rec = recovery(base, pids, args.tokens)

    def tps(runs: list[dict[str, Any]]) -> float:
        return median([r["tps"] for r in runs])

    def ttft(runs: list[dict[str, Any]]) -> list[float]:
        return [t for r in runs for t in r["ttft"]]

    def ttfts(runs: list[dict[str, Any]]) -> str:
        """TTFT p50 / tail (p95 or max) of `runs`."""
        name, value = tail(ttft(runs))
        return f"{ms(median(ttft(runs)))} / {name} {ms(value)}"

    rows, missed, noise = [], [], []
    for c in concurrencies:
        s, h = serve_runs[c], hand_runs[c]
        each = [a["tps"] / b["tps"] for a, b in zip(s, h, strict=True)]
        each_first = [median(a["ttft"]) / median(b["ttft"]) for a, b in zip(s, h, strict=True)]
        ratio = tps(s) / tps(h)
        first_ratio = median(ttft(s)) / median(ttft(h))
        met = ratio >= 1 - TARGET and first_ratio <= 1 + TARGET
        if not met:
            missed.append(c)
        if len(each) < 2:
            spread = "one round: no spread"
        elif min(each) <= 1 <= max(each):
            spread = f"1 inside {min(each):.2f}-{max(each):.2f}: noise"
            noise.append(c)
        else:
            spread = f"1 outside {min(each):.2f}-{max(each):.2f}"
        rows.append(
            f"| {c} | {tps(s):.1f} ({ttfts(s)}) | {tps(h):.1f} ({ttfts(h)}) "
            f"| {ratio:.2f} / {first_ratio:.2f} | {', '.join(f'{x:.2f}' for x in each)} ({spread}); "
            f"TTFT p50 {', '.join(f'{x:.2f}' for x in each_first)} "
            f"| **{'met' if met else 'not met'}** |"
        )
    serve_shape = shape(concurrencies, [tps(serve_runs[c]) for c in concurrencies])
    hand_shape = shape(concurrencies, [tps(hand_runs[c]) for c in concurrencies])
    verdict = "met" if not missed else "not met"
    n_ctx, slots = engine_context(engine)
    asked = f"; serve was asked for --ctx {ctx}" if n_ctx != ctx else ""
    body = [
        f"## {SECTION}",
        "",
        f"{stamp()}; load average {load_before:.2f} at the start, {load_average():.2f} at the end. "
        f"`bench/serve.py --clients {args.clients} --requests {args.requests} --tokens {args.tokens} "
        f"--prompt-tokens {args.prompt_tokens} --parallel {args.parallel} --rounds {args.rounds}`: "
        f"3 loopback servers, Gemma 3 270M Q4_K_M, n_ctx {n_ctx} ({slots} slots of {n_ctx // slots}; "
        f"from the engine's argv{asked}), "
        f"prompts of {prompt_tokens} tokens (the engine's count), streamed greedy completions of "
        f"{args.tokens} tokens; each client sends {args.requests} one after the other, clients beyond "
        f"{args.parallel} wait in the queue; rounds alternate (serve first in odd rounds, by hand first "
        "in even ones). llama-server by hand runs serve's engine's own argv (its `--port` aside):",
        "",
        f"    {shown(by_hand_argv(engine, 0))}",
        "",
        f"| clients | rpcfleet serve --parallel {args.parallel}: tok/s (TTFT p50 / p95 or max) "
        f"| llama-server by hand | serve / by hand: tok/s / TTFT p50 (medians) | each round's tok/s "
        f"(spread); TTFT p50 | target: serve within {TARGET * 100:.0f} % |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Target (serve within {TARGET * 100:.0f} % of llama-server by hand: tokens/s not under, TTFT p50 "
        f"not over): **{verdict}**"
        + (f" (missed at {', '.join(map(str, missed))} clients)" if missed else f" at all {len(rows)} rows")
        + f"; the difference was within the rounds' spread at {len(noise)} of {len(rows)} rows. "
        f"Shape of tokens/s against clients: serve {serve_shape}; by hand {hand_shape}.",
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
        port = getattr(conn.laddr, "port", None)  # an empty tuple for a socket not bound
        if conn.status == psutil.CONN_LISTEN and port in ports and conn.pid:
            found[f"127.0.0.1:{port}"] = conn.pid
    return found


if __name__ == "__main__":
    main()
