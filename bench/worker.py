"""Benchmark: the cost of running the model in a worker process instead of in-process.

    .venv/bin/python bench/worker.py                # print the results table
    .venv/bin/python bench/worker.py --write        # and replace the "worker" section of BENCHMARKS.md

Two real `ggml-rpc-server`s on loopback, a generated llama model (8 layers, n_embd 1024, about 200 MiB),
one plan. Alternating rounds (in-process, worker, in-process, worker, ...; `--rounds` of each):
  (A) in-process: a fresh Python process imports llama_cpp and rpcfleet (not timed), then times
      `load_llama(plan, model)` and a completion of `--tokens` tokens at temperature 0, not streamed:
      llama-cpp-python's own streaming re-decodes held-back bytes once per token, a cost of its own that
      the worker does not pay (it runs the non-streamed completion with its own token loop), so a
      streamed baseline would compare llama-cpp-python's streaming, not the process boundary;
  (B) worker: this process times `Worker.start(plan, model)` (the child's interpreter start, its imports
      and the same load) and the same completion streamed from the worker's pipe.
Generation: the request to the last token, as tokens/s and as a share of llama.cpp's own decoding rate in
the same run (tokens evaluated / eval time, also compared directly). Both generate the same text
(checked). The three's order rotates each round.

Target, computed (as `rpcfleet run` uses it, pre-spawned): the pre-spawned worker's load within 5 % of the
in-process load's time, and its decoding (llama.cpp's count) within 5 % of the in-process tokens/s; each
also against the in-process rounds' spread. 5 % is what rpcfleet's other layers over llama.cpp are held
to: the loader against hand registration (plan), serve against llama-server by hand (serve), decoding
over SSH against TCP (transport).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import ROOT, arg_parser, load_average, median, ms, servers, stamp, write_section

from orchestrator.core.log import configure_logging

configure_logging("text", "WARNING")

from orchestrator.llama.worker.parent import Done, Worker
from orchestrator.models.synth import write_tiny_llama
from orchestrator.planning.plan import Plan, PlanDevice, PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan

SECTION = "worker"
TARGET = 0.05  # the pre-spawned worker within 5 % of in-process, load time and decoding: as the loader,
# serve and the transport are held to against llama.cpp without them
GiB = 1 << 30
PROMPT = "The quick brown fox"

IN_PROCESS = textwrap.dedent(
    """
    import json, sys, time
    import llama_cpp
    from orchestrator.llama.native.loader import load_llama
    from orchestrator.llama.native.libllama import generation_timings
    from orchestrator.planning.plan import Plan
    plan, model, prompt, n = Plan.from_text(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    started = time.monotonic()
    llm = load_llama(plan, model, seed=0)
    load = time.monotonic() - started
    started = time.monotonic()
    choice = llm(prompt, max_tokens=n, temperature=0.0, seed=0, stream=False)["choices"][0]
    generate = time.monotonic() - started
    t = generation_timings(llm)
    llm.close()
    print(json.dumps({"load": load, "generate": generate, "text": choice["text"],
                      "finish": choice["finish_reason"], "perf": t.tokens_per_second}))
    """
)


def in_process(plan: Plan, model: Path, tokens: int) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", IN_PROCESS, plan.to_text(), str(model), PROMPT, str(tokens)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "GGML_NO_BACKTRACE": "1"},
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def in_worker(plan: Plan, model: Path, tokens: int, log: Path, *, prespawned: bool) -> dict[str, Any]:
    """(B) cold: the clock starts before the child; (C) pre-spawned: the child has done its imports
    (as in `rpcfleet run`, which spawns it before probing and planning)."""
    started = time.monotonic()
    with Worker.spawn(log) as worker:
        if prespawned:
            worker.wait_ready()
            started = time.monotonic()
        placement = worker.load(plan, model, {"seed": 0})
        load = time.monotonic() - started
        done: Done | None = None
        started = time.monotonic()
        for event in worker.complete(PROMPT, max_tokens=tokens, temperature=0.0, seed=0):
            if isinstance(event, Done):
                done = event
        generate = time.monotonic() - started
    assert done is not None and done.completion_tokens == tokens
    return {
        "load": load,
        "inner": placement.load_seconds,
        "generate": generate,
        "text": done.text,
        "finish": done.finish_reason,
        "perf": done.tokens_per_second,
    }


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each (default 3)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per completion (default 256)")
    args = parser.parse_args()
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = write_tiny_llama(folder / "bench.gguf", n_layer=8, n_embd=1024, n_head=8, n_ff=2816)
        size = model.stat().st_size
        with servers(2, folder) as ports:
            devices = [
                PlanDevice(f"127.0.0.1:{p}", 0, "CPU", total=8 * GiB, free=8 * GiB, usable=8 * GiB)
                for p in ports
            ]
            plan = make_plan(devices, profile_model(model), PlanOptions(n_ctx=2048))
            a: list[dict[str, Any]] = []
            b: list[dict[str, Any]] = []
            c: list[dict[str, Any]] = []
            log = folder / "worker.log"
            kinds: list[tuple[list[dict[str, Any]], Callable[[], dict[str, Any]]]] = [
                (a, lambda: in_process(plan, model, args.tokens)),
                (b, lambda: in_worker(plan, model, args.tokens, log, prespawned=False)),
                (c, lambda: in_worker(plan, model, args.tokens, log, prespawned=True)),
            ]
            for i in range(args.rounds):
                for runs_of, run in kinds[i % 3 :] + kinds[: i % 3]:  # the order rotated each round
                    runs_of.append(run())
    runs = a + b + c
    assert len({r["text"] for r in runs}) == 1, "the worker and the in-process load generated different text"
    assert {r["finish"] for r in runs} == {"length"}  # every run generated exactly --tokens tokens

    def med(rs: list[dict[str, Any]], key: str) -> float:
        return median([r[key] for r in rs])

    load_a = med(a, "load")
    kinds_of = (("a", a), ("b", b), ("c", c))
    wall = {name: args.tokens / med(rs, "generate") for name, rs in kinds_of}
    perf = {name: med(rs, "perf") for name, rs in kinds_of}
    # each run's request-to-last-token rate over llama.cpp's own decoding rate in that run
    kept = {name: median([args.tokens / r["generate"] / r["perf"] for r in rs]) for name, rs in kinds_of}

    def pct(x: float, y: float) -> str:
        return f"{(x / y - 1) * 100:+.1f} %"

    def against(value: float, rs: list[dict[str, Any]], key: str) -> str:
        values = [r[key] for r in rs]
        low, high = min(values), max(values)
        return "within" if low <= value <= high else "outside"

    load_c, perf_spread = med(c, "load"), [r["perf"] for r in a]
    load_met = load_c <= load_a * (1 + TARGET)
    perf_met = perf["c"] >= perf["a"] * (1 - TARGET)
    verdict = (
        f"Target (pre-spawned worker: load within {TARGET * 100:.0f} % of in-process, decoding within "
        f"{TARGET * 100:.0f} %): **{'met' if load_met and perf_met else 'not met'}**: load {ms(load_c)} "
        f"against {ms(load_a)} ({pct(load_c, load_a)}, {against(load_c, a, 'load')} the in-process rounds' "
        f"{ms(min(r['load'] for r in a))}-{ms(max(r['load'] for r in a))}), decoding {perf['c']:.1f} "
        f"against {perf['a']:.1f} tok/s ({pct(perf['c'], perf['a'])}, {against(perf['c'], a, 'perf')} "
        f"their {min(perf_spread):.1f}-{max(perf_spread):.1f})."
    )

    rows = [
        ("load: call to loaded model", ms(load_a), ms(med(b, "load")), ms(med(c, "load"))),
        (
            "  difference",
            "",
            f"{(med(b, 'load') - load_a) * 1000:+.0f} ms",
            f"{(med(c, 'load') - load_a) * 1000:+.0f} ms",
        ),
        ("  llama.cpp's load inside the worker", "", ms(med(b, "inner")), ms(med(c, "inner"))),
        (
            f"generate {args.tokens} tokens, request to last token (tok/s; in-process not streamed)",
            f"{wall['a']:.1f}",
            f"{wall['b']:.1f} ({pct(wall['b'], wall['a'])})",
            f"{wall['c']:.1f} ({pct(wall['c'], wall['a'])})",
        ),
        (
            "  of llama.cpp's decoding rate in the same run",
            f"{kept['a'] * 100:.0f} %",
            f"{kept['b'] * 100:.0f} %",
            f"{kept['c'] * 100:.0f} %",
        ),
        (
            "decode, llama.cpp's count (tok/s)",
            f"{perf['a']:.1f}",
            f"{perf['b']:.1f} ({pct(perf['b'], perf['a'])})",
            f"{perf['c']:.1f} ({pct(perf['c'], perf['a'])})",
        ),
    ]
    body = "\n".join(
        [
            f"## {SECTION}",
            "",
            f"{stamp()}; load average {load_before:.2f} at the start. `bench/worker.py` "
            f"(`--rounds {args.rounds} --tokens {args.tokens}`): two `ggml-rpc-server`s on loopback, a "
            f"generated 8-layer llama (n_embd 1024, {size / 2**20:.0f} MiB), n_ctx 2048, temperature 0; "
            "medians of rounds in a rotating order. In-process: `load_llama` and the completion, not "
            "streamed (llama-cpp-python's streaming has a cost of its own the worker does not pay), in a "
            "fresh process (imports not timed). Worker: `Worker.spawn` + `load` and the same completion "
            "streamed from the worker's pipe; cold: the clock starts before the child, pre-spawned: once "
            "its imports are done. Same text in every run.",
            "",
            "| | in-process | worker, cold | worker, pre-spawned |",
            "|---|---:|---:|---:|",
            *[f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} |" for r in rows],
            "",
            "Cold, the load's extra time is the child's start: a Python interpreter importing llama_cpp, "
            "numpy and the loader. `rpcfleet run` spawns the worker before it probes and plans, so that "
            "time overlaps with the probe (the pre-spawned column: the child's imports are done when the "
            "clock starts); what remains is the plan and the placement crossing the pipe. The worker "
            "streams one JSON line per piece of text on its pipe: from the request to the last token it "
            f"kept {kept['c'] * 100:.0f} % of llama.cpp's own decoding rate pre-spawned, against "
            f"{kept['a'] * 100:.0f} % in-process without streaming."
            + f" Targets: {TARGET * 100:.0f} %, as rpcfleet's other layers over llama.cpp (loader, serve, "
            "transport).",
            "",
            verdict,
        ]
    )
    print(body)
    if args.write is not None:
        write_section(args.write, SECTION, body)


if __name__ == "__main__":
    main()
