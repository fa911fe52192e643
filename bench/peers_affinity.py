"""Benchmark (issue 45, the peers a user would pick): serve's prefix-affine routing against llama-server's own
prompt cache with no prefix-aware router in front. Is the router's gain real when the engine reuses
prefixes itself?

    .venv/bin/python bench/peers_affinity.py                 # print the section
    .venv/bin/python bench/peers_affinity.py --users 4 --turns 3 --rounds 1   # shorter
    .venv/bin/python bench/peers_affinity.py --write         # and replace its block in BENCHMARKS.md

Three real `ggml-rpc-server`s on loopback (an inventory of `connection: local` hosts), the real Gemma 3
270M from the cache, bench/affinity.py's multi-turn chat workload (`workload`: `--users` conversations at
once, `--turns` streamed chat turns each, one shared system prompt of about 1,000 tokens, the whole
history sent back each turn). Three sides, each restarted for each run:

- affine: `rpcfleet serve --replicas auto --routing affine` (three formations of one node, `--parallel`
  slots each): a conversation's next turn goes to the formation whose slot holds its history.
- round robin: the same three llama-servers started by hand with the argv serve's engines ran with (their
  `--port` aside) behind nginx's default round robin (bench/peers_serve.py's): each engine keeps and
  reuses its slots' prompts (`cache_prompt`, its slot choice by prompt similarity), but a turn lands on
  whichever engine is next.
- one engine: a single llama-server by hand over the three nodes with three times the slots and the
  context (the argv of `rpcfleet serve --split --parallel 3P --ctx 3C`'s engine), clients straight to
  it: every conversation's history is in one engine's slots, no router at all.

Figures per run, as bench/affinity.py: time to first token p50 and tail, tokens/s, the workload's wall
time, prompt tokens processed per turn after the first (llama-server's `timings.prompt_n`: what its
cache did not hold). Rounds rotate the sides' order. Verdicts as bench/affinity.py's: better or worse
when every run of one beats every run of the other, else within the spread.

Target, computed: the router's gain is real when affine is better than the round robin in prompt tokens
processed per later turn and in TTFT p50 (the engine's own cache does not do the router's work) and worse
than neither peer in TTFT p50 or tokens/s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import (
    ROOT,
    arg_parser,
    free_port,
    load_average,
    local_inventory,
    median,
    servers,
    stamp,
    tail_name,
    write_section,
)
from affinity import verdict, wait_formations, workload
from peers_serve import engine_argvs, on_port, round_robin, stop, wait_health

from orchestrator.models.catalogue import GEMMA3_270M, cached_path

SECTION = "peers: affinity vs the engine's prompt cache"
SIDES = ("affine", "round robin", "one engine")
PEERS = SIDES[1:]


@contextlib.contextmanager
def serving(inventory: Path, model: Path, folder: Path, mode: list[str], ctx: int, parallel: int,
            formations: int) -> Iterator[tuple[str, dict[str, Any]]]:  # fmt: skip
    """serve on the loopback servers in `mode` (`--replicas auto --routing affine`, `--split`): its base URL
    and /health once `formations` serve."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "orchestrator", "serve", "-i", str(inventory), "-m", str(model)]
    argv += ["--ctx", str(ctx), "--parallel", str(parallel), "--port", str(port), "--model-name", "bench"]
    argv += ["--rejoin-interval", "0", *mode]
    env = {**os.environ, "RPCFLEET_HOME": str(folder / "home")}
    env.pop("RPCFLEET_API_KEY", None)
    with (folder / "serve.log").open("ab") as log:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield base, wait_formations(base, formations)
    finally:
        stop(process, signal.SIGINT)


@contextlib.contextmanager
def one_engine(argv: list[str], folder: Path) -> Iterator[str]:
    """The split engine's argv by hand on a port of its own, clients straight to it."""
    port = free_port()
    with (folder / "one-engine.log").open("ab") as log:
        process = subprocess.Popen(on_port(argv, port), stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_health(base, process, ready=False)  # llama-server answers 503 while it loads
        yield base
    finally:
        stop(process)


LOGS = {"round robin": "llama-servers.log", "one engine": "one-engine.log"}


def failure(exc: BaseException, folder: Path, side: str) -> str:
    """A failed run in one line: the client's error and the last line of the side's engine log (its
    reason, when the engine logged one)."""
    log = folder / LOGS[side]
    lines = (
        [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        if log.exists()
        else []
    )
    return f"{type(exc).__name__}: {exc}" + (f"; the engine's log ends: {lines[-1][:300]}" if lines else "")


def gain_target(verdicts: dict[str, dict[str, str]]) -> tuple[bool, list[str]]:
    """(met, what misses): `verdicts[peer][figure]` in `verdict`'s words (affine against that peer).
    Affine better than the round robin in prompt tokens processed and TTFT p50; worse than no peer in
    TTFT p50 or tokens/s."""
    misses = [
        f"{figure} against the round robin"
        for figure in ("processed", "p50")
        if verdicts["round robin"][figure] != "affine better"
    ]
    misses += [
        f"{figure} against the {peer}"
        for peer in PEERS
        for figure in ("p50", "tps")
        if verdicts[peer][figure] == "affine worse"
    ]
    return not misses, misses


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--users", type=int, default=8, help="conversations at once (default 8)")
    parser.add_argument("--turns", type=int, default=6, help="turns of each conversation (default 6)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per turn (default 32)")
    parser.add_argument("--parallel", type=int, default=4, help="slots of each formation (default 4)")
    parser.add_argument("--ctx", type=int, default=8192, help="context of each formation (default 8192)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each side (default 2)")
    args = parser.parse_args()
    import httpx  # the workload's client

    model = cached_path(GEMMA3_270M)
    load_before = load_average()
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    failures: dict[str, list[str]] = {side: [] for side in SIDES}
    affine = ["--replicas", "auto", "--routing", "affine"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        with servers(3, folder) as ports:
            inventory = local_inventory(folder, ports)
            print("the engines' argv", file=sys.stderr, flush=True)
            with serving(inventory, model, folder, affine, args.ctx, args.parallel, 3) as (_, health):
                engines = engine_argvs(health)
            split = (inventory, model, folder, ["--split"], 3 * args.ctx, 3 * args.parallel, 1)
            with serving(*split) as (_, health):
                single = engine_argvs(health)[0]
            for i in range(args.rounds):
                for side in SIDES[i % 3 :] + SIDES[: i % 3]:  # each round starts with the next side
                    print(f"round {i + 1}: {side}", file=sys.stderr, flush=True)
                    with contextlib.ExitStack() as stack:
                        if side == "affine":
                            base = stack.enter_context(
                                serving(inventory, model, folder, affine, args.ctx, args.parallel, 3)
                            )[0]
                        elif side == "round robin":
                            base = stack.enter_context(round_robin(engines, folder))
                        else:
                            base = stack.enter_context(one_engine(single, folder))
                        try:
                            runs[side].append(workload(base, args.users, args.turns, args.tokens))
                        except (OSError, RuntimeError, httpx.HTTPError) as exc:  # a peer that fails
                            if side == "affine":  # is a finding, serve failing is not measured
                                raise
                            failures[side].append(failure(exc, folder, side))

    def cell(values: list[float], digits: int) -> str:
        if not values:
            return "failed"
        return f"{median(values):.{digits}f} ({', '.join(f'{v:.{digits}f}' for v in values)})"

    tail = tail_name(min(r["samples"] for rs in runs.values() for r in rs))
    figures = (
        ("p50", "time to first token p50 (s)", 2, False),
        ("p95", f"time to first token {tail} (s)", 2, False),
        ("tps", "tokens/s (all users)", 1, True),
        ("wall", "workload wall time (s)", 1, False),
        ("processed", "prompt tokens processed per turn after the first (mean)", 0, False),
    )
    verdicts: dict[str, dict[str, str]] = {peer: {} for peer in PEERS}
    rows = []
    for key, name, digits, higher in figures:
        got = {side: [r[key] for r in runs[side]] for side in SIDES}
        for peer in PEERS:
            verdicts[peer][key] = verdict(got["affine"], got[peer], higher) if got[peer] else "failed"
        rows.append(
            f"| {name} | {' | '.join(cell(got[side], digits) for side in SIDES)} | "
            + " | ".join(
                f"{median(got['affine']) / median(got[peer]):.2f}, {verdicts[peer][key]}"
                if got[peer]
                else "-"
                for peer in PEERS
            )
            + " |"
        )
    met, misses = gain_target(verdicts)
    single_shown = [Path(single[0]).name, *single[1:]]
    single_shown[single_shown.index("-m") + 1] = Path(single_shown[single_shown.index("-m") + 1]).name
    body = [
        f"## {SECTION}",
        "",
        f"`bench/peers_affinity.py --users {args.users} --turns {args.turns} --tokens {args.tokens} "
        f"--parallel {args.parallel} --ctx {args.ctx} --rounds {args.rounds}`, {stamp()}; load average "
        f"{load_before:.2f} at the start. 3 loopback servers, Gemma 3 270M Q4_K_M; bench/affinity.py's "
        f"workload: {args.users} users at once, {args.turns} streamed chat turns each (a shared system "
        f"prompt of about 1,000 tokens, the whole history sent back each turn, {args.tokens} tokens, "
        "greedy, EOS ignored). affine = `rpcfleet serve --replicas auto --routing affine` (3 formations "
        f"of one node, {args.parallel} slots each); round robin = the same 3 llama-servers by hand (serve's "
        "engines' argv, their `--port` aside) behind nginx's default round robin; one engine = one "
        f"llama-server by hand over the 3 nodes with {3 * args.parallel} slots and n_ctx {3 * args.ctx} "
        "(serve `--split`'s engine argv), no front. Each side restarted for each run, the order rotated "
        "each round. Medians of the runs, each run in brackets; verdict: better or worse when every run "
        "of one beats every run of the other, else within the spread. The one engine's argv:",
        "",
        f"    {' '.join(on_port(single_shown, 0)).replace('--port 0', '--port PORT')}",
        "",
        "| figure | affine | round robin | one engine | affine / round robin | affine / one engine |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "Target (the router's gain is real: affine better than the round robin in prompt tokens processed "
        "per later turn and in TTFT p50, worse than neither peer in TTFT p50 or tokens/s): "
        f"**{'met' if met else 'not met'}**" + (f" (missed: {'; '.join(misses)})." if misses else "."),
        *[
            f"\n{side}: {len(failed)} of {args.rounds} run(s) failed: {' | '.join(failed)}"
            for side, failed in failures.items()
            if failed
        ],
    ]
    text = "\n".join(body) + "\n"
    print(text)
    if args.write:
        write_section(args.write, SECTION, text)


if __name__ == "__main__":
    main()
