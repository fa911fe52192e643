"""Benchmark: prefix-affine routing against least-loaded routing between the formations of one model
(`rpcfleet serve --replicas auto --routing affine|least-loaded`) on a multi-turn chat workload.

    .venv/bin/python bench/affinity.py                          # print the section
    .venv/bin/python bench/affinity.py --users 4 --turns 3 --rounds 1   # shorter
    .venv/bin/python bench/affinity.py --write                  # and replace the "affinity" section

Three real `ggml-rpc-server`s on loopback (an inventory of `connection: local` hosts), the real Gemma 3
270M (from the cache), serve with `--replicas auto`: one formation per node (3). Workload: `--users`
users at once, each a conversation of `--turns` chat completions one after the other; every user shares
one system prompt of about 1,000 tokens, asks a question of its own each turn and sends the whole history
back (system prompt, earlier questions and the answers as the model gave them), `--tokens` tokens
generated per turn (greedy, EOS ignored), streamed. Time to first token: from sending a request to its
first piece of text (p50 and p95 over every turn of the run; under 20 turns the largest, called max);
tokens/s: all generated tokens / the wall
time of the whole workload; prompt tokens processed: llama-server's `timings.prompt_n` of each turn after
the first (the part of the prompt its slot's KV cache did not hold), their mean. Rounds alternate:
affine first in odd rounds, least-loaded first in even ones, serve restarted for each run (cold caches
for both). The verdict per figure: better (or worse) when each of affine's runs beats (or loses to)
every least-loaded run, else within the spread (the range of each policy's runs, printed); none from
one run each.

Target, computed from those verdicts: affine better in prompt tokens processed per later turn (what it
is for: a conversation's next turn lands on the slot that holds its history) and in time to first token
p50 (what a user gets from it), and worse in nothing (tokens/s, wall time, the TTFT tail: routing for
the cache must not cost throughput or pile conversations on one formation).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import (
    P95_MIN,
    ROOT,
    arg_parser,
    free_port,
    get_json,
    load_average,
    local_inventory,
    median,
    p95,
    servers,
    stamp,
    tail_name,
    write_section,
)

from orchestrator.models.catalogue import GEMMA3_270M, cached_path

SECTION = "affinity"
POLICIES = ("affine", "least-loaded")
TIMEOUT = 600.0  # seconds the client waits for one request

TOPICS = ("tides", "fog signals", "lamp oil", "storms", "ships", "gulls", "maps", "radio")


def system_prompt() -> str:
    """About 1,000 tokens of Gemma's tokenizer: the keeper's log, numbered rules."""
    rules = [
        f"Rule {i}: when asked about the lighthouse, answer briefly, cite log entry {100 + i}, and never "
        f"mention rule {i + 1} before rule {i}."
        for i in range(36)
    ]
    return "You are the keeper of the Skerry Point lighthouse. " + " ".join(rules)


def question(user: int, turn: int) -> str:
    topic = TOPICS[user % len(TOPICS)]
    return f"I am visitor {user}. Question {turn + 1}: tell me about the {topic} you saw on day {turn + 3}."


def _text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return str(answer.read().decode())


def wait_formations(base: str, formations: int, limit: float = 240) -> dict[str, Any]:
    """/health once `formations` formations serve (ready)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            data: dict[str, Any] = get_json(f"{base}/health")
            ready = [f for f in data.get("formations", []) if f["state"] == "ready"]
            if len(ready) >= formations:
                return data
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{base}: {formations} formations not serving within {limit} s")


@contextlib.contextmanager
def _serve(inventory: Path, model: Path, folder: Path, routing: str, args: Any) -> Iterator[str]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "orchestrator", "serve", "-i", str(inventory), "-m", str(model)]
    argv += ["--ctx", str(args.ctx), "--parallel", str(args.parallel), "--port", str(port)]
    argv += ["--model-name", "bench", "--replicas", "auto", "--routing", routing, "--rejoin-interval", "0"]
    env = {**os.environ, "RPCFLEET_HOME": str(folder / "home")}
    env.pop("RPCFLEET_API_KEY", None)
    with (folder / "serve.log").open("ab") as log:
        serve = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_formations(base, 3)
        yield base
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(60)


def turn(client: Any, base: str, messages: list[dict[str, str]], tokens: int) -> dict[str, Any]:
    """One streamed chat completion: its time to first text, its text, pieces and llama-server's timings."""
    body = {
        "model": "bench",
        "messages": messages,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.monotonic()
    first: float | None = None
    text: list[str] = []
    pieces, timings = 0, dict[str, Any]()
    with client.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=TIMEOUT) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the stream ended with an error: {event}")
            timings = event.get("timings") or timings
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if first is None:
                        first = time.monotonic() - started
                    text.append(piece)
                    pieces += 1
    assert first is not None, "no text in the answer"
    return {"ttft": first, "text": "".join(text), "pieces": pieces, "prompt_n": timings.get("prompt_n")}


def workload(base: str, users: int, turns: int, tokens: int) -> dict[str, Any]:
    """`users` conversations at once, `turns` each: every turn's figures and the wall time."""
    import httpx

    system = system_prompt()

    def conversation(user: int) -> list[dict[str, Any]]:
        done = []
        messages = [{"role": "system", "content": system}]
        with httpx.Client() as client:
            for t in range(turns):
                messages.append({"role": "user", "content": question(user, t)})
                got = turn(client, base, messages, tokens)
                got["turn"] = t
                messages.append({"role": "assistant", "content": got["text"]})
                done.append(got)
        return done

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(users) as pool:
        results = [r for rs in pool.map(conversation, range(users)) for r in rs]
    wall = time.monotonic() - started
    metrics = _text(f"{base}/metrics")
    routed: dict[str, int] = {}
    for line in metrics.splitlines():
        if line.startswith("rpcfleet_formation_routed_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            routed[reason] = routed.get(reason, 0) + int(float(line.rpartition(" ")[2]))
    ttfts = [r["ttft"] for r in results]
    # the turns whose history a slot may hold (every first turn's prompt is new to its formation)
    processed = [r["prompt_n"] for r in results if isinstance(r["prompt_n"], int) and r["turn"] > 0]
    print(f"  prompt_n by turn: {[(r['turn'], r['prompt_n']) for r in results]}", file=sys.stderr)
    return {
        "p50": median(ttfts),
        "p95": p95(ttfts) if len(ttfts) >= P95_MIN else max(ttfts),
        "samples": len(ttfts),
        "tps": sum(r["pieces"] for r in results) / wall,
        "wall": wall,
        "processed": sum(processed) / len(processed) if processed else float("nan"),
        "routed": routed,
    }


def verdict(affine: list[float], least: list[float], higher_is_better: bool) -> str:
    """better / worse when every affine run beats / loses to every least-loaded one, else within; no
    verdict from one run each (no spread to compare with)."""
    if min(len(affine), len(least)) < 2:
        return "no verdict (one run each: no spread)"
    sign = 1 if higher_is_better else -1
    if min(sign * a for a in affine) > max(sign * b for b in least):
        return "affine better"
    if max(sign * a for a in affine) < min(sign * b for b in least):
        return "affine worse"
    return "within the spread"


def routing_target(verdicts: dict[str, str], names: dict[str, str]) -> tuple[bool, list[str]]:
    """(met, the figures affine is worse in): affine better in prompt tokens processed and in TTFT p50,
    worse in nothing; `verdicts` by figure key (`verdict`'s words), `names` the figures' names."""
    gains = all(verdicts.get(k) == "affine better" for k in ("processed", "p50"))
    losses = [names[k] for k, v in verdicts.items() if v == "affine worse"]
    return gains and not losses, losses


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--users", type=int, default=8, help="conversations at once (default 8)")
    parser.add_argument("--turns", type=int, default=6, help="turns of each conversation (default 6)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per turn (default 32)")
    parser.add_argument("--parallel", type=int, default=4, help="slots of each formation (default 4)")
    parser.add_argument("--ctx", type=int, default=8192, help="context of each formation (default 8192)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of each (default 2)")
    args = parser.parse_args()
    model = cached_path(GEMMA3_270M)
    load_before = load_average()
    runs: dict[str, list[dict[str, Any]]] = {policy: [] for policy in POLICIES}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        with servers(3, folder) as ports:
            inventory = local_inventory(folder, ports)
            for i in range(args.rounds):  # affine first in odd rounds, least-loaded first in even ones
                for policy in POLICIES if i % 2 == 0 else POLICIES[::-1]:
                    print(f"round {i + 1}: --routing {policy}", file=sys.stderr, flush=True)
                    with _serve(inventory, model, folder, policy, args) as base:
                        got = workload(base, args.users, args.turns, args.tokens)
                    print(f"  {got}", file=sys.stderr, flush=True)
                    runs[policy].append(got)

    def figures(key: str) -> dict[str, list[float]]:
        return {policy: [r[key] for r in runs[policy]] for policy in POLICIES}

    def cell(values: list[float], unit: str, digits: int) -> str:
        each = ", ".join(f"{v:.{digits}f}" for v in values)
        return f"{median(values):.{digits}f}{unit} ({each})"

    rows, verdicts, names = [], {}, {}
    tail = tail_name(min(r["samples"] for rs in runs.values() for r in rs))
    for key, name, unit, digits, higher in (
        ("p50", "time to first token p50", " s", 2, False),
        ("p95", f"time to first token {tail}", " s", 2, False),
        ("tps", "tokens/s (all users)", "", 1, True),
        ("wall", "workload wall time", " s", 1, False),
        ("processed", "prompt tokens processed per turn after the first (mean)", "", 0, False),
    ):
        got = figures(key)
        a, b = got["affine"], got["least-loaded"]
        verdicts[key], names[key] = verdict(a, b, higher), name
        rows.append(
            f"| {name} | {cell(a, unit, digits)} | {cell(b, unit, digits)} "
            f"| {median(a) / median(b):.2f} | {verdicts[key]} |"
        )
    met, losses = routing_target(verdicts, names)
    target = (
        "Target (affine better in prompt tokens processed per later turn and in TTFT p50, worse in "
        f"nothing): **{'met' if met else 'not met'}** (prompt tokens: {verdicts['processed']}; TTFT p50: "
        f"{verdicts['p50']}; worse in: {', '.join(losses) or 'nothing'})."
    )
    routed = {
        policy: ", ".join(
            f"{reason} {median([r['routed'].get(reason, 0) for r in runs[policy]]):g}"
            for reason in ("affine", "fallback", "least_loaded")
        )
        for policy in POLICIES
    }
    body = [
        f"## {SECTION}",
        "",
        f"{stamp()}; load average {load_before:.2f} at the start, {load_average():.2f} at the end. "
        f"`bench/affinity.py --users {args.users} --turns {args.turns} --tokens {args.tokens} "
        f"--parallel {args.parallel} --ctx {args.ctx} --rounds {args.rounds}`: 3 loopback servers, Gemma 3 "
        f"270M Q4_K_M, `rpcfleet serve --replicas auto` (3 formations of one node, {args.parallel} slots "
        f"each); {args.users} users at once, {args.turns} streamed chat turns each (one shared system "
        f"prompt of about 1,000 tokens, the whole history sent back each turn, {args.tokens} tokens "
        "generated, greedy, EOS ignored). Rounds alternate (affine first in odd rounds, least-loaded "
        "first in even ones), serve restarted for each run. Medians of the runs, each run in brackets; "
        "verdict: better or worse when every run of one beats every run of the other, else within the "
        "spread. The three formations share this machine's cores, so a formation's load costs the others "
        "too: what routing changes here is the prompt work the engines' caches spare.",
        "",
        "| figure | --routing affine | --routing least-loaded | affine / least-loaded | verdict |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"Requests routed by reason (`rpcfleet_formation_routed_total`, median of the runs): affine runs: "
        f"{routed['affine']}; least-loaded runs: {routed['least-loaded']}.",
        "",
        target,
    ]
    text = "\n".join(body) + "\n"
    print(text)
    if args.write:
        write_section(args.write, SECTION, text)


if __name__ == "__main__":
    main()
