"""Benchmark: a streamed completion against the same completion not streamed, through the worker.

    .venv/bin/python bench/stream.py                # print the results table
    .venv/bin/python bench/stream.py --write        # and replace the "stream" section of BENCHMARKS.md

One real `ggml-rpc-server` on loopback, a generated llama model with random weights (the tests' tiny
model: 4 layers, n_embd 256, 300-token vocabulary of which 256 are byte tokens), one worker. Its greedy
text is mostly bytes that never form a UTF-8 character: the case where llama-cpp-python's own
streaming re-detokenized every held-back run of tokens once per token (cubic; 2,000 tokens took hours).
For each length (`--tokens`), alternating rounds (streamed, not streamed, ...; `--rounds` of each) of
`Worker.complete(prompt, n, temperature=0)`:
  (A) streamed: the `Token` events read as they come, then `Done`;
  (B) not streamed: `Done` only.
tokens/s: completion tokens over the wall time from the request to `Done` (the caller's clock), and
llama.cpp's own decoding speed (tokens evaluated / eval time). Both must stay flat as n grows (linear time).

Target, computed: linear time, streamed and not: the log-log slope of the wall time over the tokens
(first to last length) at most 1.2 (`_common.shape`: flat under 0.3, linear up to 1.2, worse above).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    LINEAR,
    R2_MIN,
    arg_parser,
    curve_shape,
    load_average,
    median,
    ms,
    servers,
    stamp,
    write_section,
)

from orchestrator.core.log import configure_logging

configure_logging("text", "WARNING")

from orchestrator.llama.worker.parent import Done, Token, Worker
from orchestrator.models.synth import write_tiny_llama
from orchestrator.planning.plan import PlanDevice, PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan

SECTION = "stream"
GiB = 1 << 30
PROMPT = "hello world"


def one(worker: Worker, n: int, stream: bool) -> dict[str, Any]:
    started = time.monotonic()
    pieces: list[str] = []
    done: Done | None = None
    for event in worker.complete(PROMPT, max_tokens=n, temperature=0.0, seed=0, stream=stream):
        if isinstance(event, Token):
            pieces.append(event.text)
        else:
            done = event
    wall = time.monotonic() - started
    assert done is not None and done.completion_tokens == n, done
    assert not stream or "".join(pieces) == done.text  # what streamed is the whole text
    return {
        "rate": n / wall,
        "perf": done.tokens_per_second,
        "kept": n / wall / done.tokens_per_second if done.tokens_per_second else 0.0,
        "first": done.first_token_seconds,
        "pieces": len(pieces),
        "chars": len(done.text),
    }


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each per length (default 3)")
    parser.add_argument(
        "--tokens", default="250,500,1000,2000", help="completion lengths (default 250,500,1000,2000)"
    )
    args = parser.parse_args()
    lengths = [int(x) for x in args.tokens.split(",")]
    load_before = load_average()
    results: dict[tuple[int, bool], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = write_tiny_llama(folder / "bench.gguf")
        with servers(1, folder) as ports:
            devices = [
                PlanDevice(f"127.0.0.1:{p}", 0, "CPU", total=8 * GiB, free=8 * GiB, usable=8 * GiB)
                for p in ports
            ]
            plan = make_plan(devices, profile_model(model), PlanOptions(n_ctx=max(lengths) + 64))
            with Worker.start(plan, model, {"seed": 0}, folder / "worker.log") as worker:
                one(worker, 1, False)  # the prompt's first evaluation, out of the rounds
                for n in lengths:
                    for i in range(args.rounds):
                        for stream in (True, False) if i % 2 == 0 else (False, True):  # alternating
                            results.setdefault((n, stream), []).append(one(worker, n, stream))
    load_after = load_average()

    def med(n: int, stream: bool, key: str) -> float:
        return median([r[key] for r in results[(n, stream)]])

    rows = []
    for n in lengths:
        a, b = med(n, True, "rate"), med(n, False, "rate")
        rows.append(
            f"| {n} | {a:.1f} | {b:.1f} | {(a / b - 1) * 100:+.1f} % "
            f"| {med(n, True, 'kept') * 100:.0f} % | {med(n, False, 'kept') * 100:.0f} % "
            f"| {ms(med(n, True, 'first'))} | {med(n, True, 'pieces'):.0f} | {med(n, True, 'chars'):.0f} |"
        )
    kept = [med(n, stream, "kept") * 100 for n in lengths for stream in (True, False)]
    fits = {
        stream: curve_shape(lengths, [n / med(n, stream, "rate") for n in lengths])
        if len(lengths) > 1
        else (0.0, 0.0, "one length: no shape")
        for stream in (True, False)
    }
    # at most linear: flat, sublinear or linear, from a fit that holds (an irregular curve proves nothing)
    met = len(lengths) > 1 and all(f[2] in ("flat", "sublinear", "linear") for f in fits.values())

    def said(stream: bool) -> str:
        slope, r2, name = fits[stream]
        return f"slope {slope:.2f}, R^2 {r2:.2f} ({name})"

    spread = [
        max(r["rate"] for r in results[(n, stream)]) / min(r["rate"] for r in results[(n, stream)]) - 1
        for n in lengths
        for stream in (True, False)
    ]
    body = "\n".join(
        [
            f"## {SECTION}",
            "",
            f"{stamp()}; load average {load_before:.2f} at the start, {load_after:.2f} at the end. "
            f"`bench/stream.py --rounds {args.rounds} --tokens {args.tokens}`: one `ggml-rpc-server` on "
            "loopback, the tests' random-weight tiny llama (4 layers, n_embd 256, 300-token vocabulary, "
            "256 of them byte tokens), one worker, greedy; medians of alternating rounds (streamed first "
            "in odd rounds, not streamed first in even ones). tokens/s: completion tokens over the "
            "caller's wall time from the request to `Done`. The greedy text is mostly bytes that never "
            "complete a UTF-8 character (the characters column against the tokens), the case where "
            "llama-cpp-python's own streaming was cubic.",
            "",
            "| tokens | streamed (tok/s) | not streamed (tok/s) | streamed vs not | streamed, of "
            "llama.cpp's rate | not streamed, of llama.cpp's rate | first text (streamed) | pieces "
            "streamed | characters |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "Of llama.cpp's rate: the caller's tokens/s over llama.cpp's own decoding speed in the same "
            f"request, {min(kept):.0f}-{max(kept):.0f} % at every length, streamed or not. Streaming costs "
            "one JSON line per piece of text on the worker's pipe. The rounds of one length and mode "
            f"spread by up to {max(spread) * 100:.0f} % in tokens/s (largest over smallest).",
            "",
            f"Target (at most linear time: the least-squares log-log slope of the wall time over the "
            f"tokens, {lengths[0]} to {lengths[-1]}, at most {LINEAR} with R^2 at least {R2_MIN}): "
            f"**{'met' if met else 'not met'}**: streamed {said(True)}, not streamed {said(False)}.",
        ]
    )
    print(body)
    if args.write is not None:
        write_section(args.write, SECTION, body)


if __name__ == "__main__":
    main()
