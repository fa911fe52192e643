"""Benchmark (issue 45, the peers a user would pick): `rpcfleet run` against llama.cpp by hand, `llama-server
--rpc ... -ts ...` on the same lab nodes with the same model and placement.

    .venv/bin/python bench/peers_run.py                  # print the section
    .venv/bin/python bench/peers_run.py --rounds 2       # shorter
    .venv/bin/python bench/peers_run.py --write          # and replace its block in BENCHMARKS.md

A 2-node lab (network namespaces, real sshd, real `ggml-rpc-server`s deployed by `rpcfleet deploy`), two
models: a tiny synthetic llama (`write_tiny_llama`, random weights) and the real Gemma 3 270M from the
catalogue's cache. The pinned tools build has no `llama-cli` (orchestrator/artifacts/build.py builds
`llama-server` and `llama-fit-params` only), so "by hand" is the `llama-server` built from the same
llama.cpp source as the binding `rpcfleet run` loads through.

- A, `rpcfleet run -i LAB -m MODEL -p PROMPT -n N --ctx C`: a fresh process; its time to first token is
  a run with `-n 1`, the spawn to the first byte on its stdout (Python's start, the probe over SSH, the
  plan, the worker's load over RPC and the prompt included); its phase line (probe, plan, load) is read
  from its output. Its decoding: a run of `--tokens`, llama.cpp's own tokens/s as it prints them.
- B, by hand: the `llama-server` argv that `rpcfleet plan --format llama-cli` prints for the same lab and
  model (the same `--rpc` endpoints, `-ts`, `-ngl`, `-c`, `-fa`), made once before the rounds and not
  timed (a user writing it by hand needs the split some other way), plus `--host 127.0.0.1 --port P`,
  then one `/completion` of the same prompt (greedy) once `/health` answers 200 (polled every 20 ms). Its
  time to first token: `n_predict` 1, the spawn to the answer; its decoding: `n_predict` `--tokens`,
  llama-server's own `timings.predicted_per_second`. Not streamed: llama-server holds a stream's text
  back while it ends in an incomplete UTF-8 character, which the random-weight model's bytes do.

Both run greedy with llama-server's and the binding's defaults otherwise (llama-server warms up with an
empty run before it answers; that is its default, so it counts). Rounds alternate (A first in odd rounds,
B first in even ones), after one warm-up of each, not counted, that reads the GGUF into the page cache.

Targets, computed: A's median time to first token at most `TTFT_EXTRA` s over B's (the cost of a probe and
a plan on a small fleet: what rpcfleet adds, the by-hand user paying it in their own time instead); A's
decoding tokens/s at least `DECODE_SHARE` of B's (the same llama.cpp and placement: a gap is the tool's).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from _common import ROOT, arg_parser, free_port, load_average, median, stamp, write_section

from orchestrator.artifacts.build import llama_server_binary
from orchestrator.lab.lifecycle import lab_down, lab_up, reap_stale
from orchestrator.lab.state import Lab
from orchestrator.models.catalogue import GEMMA3_270M, cached_path
from orchestrator.models.synth import write_tiny_llama

SECTION = "peers: rpcfleet run vs llama-server by hand"
LAB_NAME = "peersrun"
NODES = 2
TTFT_EXTRA = 1.0  # seconds rpcfleet run may add to the first token: its probe and plan on a small fleet
DECODE_SHARE = 0.95  # rpcfleet run's decoding tokens/s at least 95 % of llama-server's on the same plan
TINY = {"n_layer": 8, "n_embd": 512, "n_head": 8, "n_ff": 1408}  # 8 layers to split over the nodes
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
TIMEOUT = 300.0  # seconds one side may take to its last token


@dataclass(frozen=True)
class Side:
    """One run of one side: `first` = the spawn to the first token's answer (s), with `-n 1`; or the
    decoding tokens/s and the tokens generated, with `-n N`; (rpcfleet run only) its phases as printed."""

    first: float
    tps: float
    tokens: int
    phases: dict[str, float]


_PHASE = re.compile(r"\b([a-z][a-z ]*?) (\d+(?:\.\d+)?) s\b")
_DECODE = re.compile(r"(\d+) tokens? generated, decoding at (\d+(?:\.\d+)?) tokens/s")


def parse_run_output(text: str) -> tuple[dict[str, float], int, float]:
    """From `rpcfleet run`'s closing lines: its phases (`probe 0.60 s · plan 0.00 s · load 2.51 s ·
    ready`), the tokens generated and its decoding tokens/s (0 with `-n 1`: no decoding step). ValueError
    when the phase line is missing."""
    phases: dict[str, float] = {}
    for line in text.splitlines():
        if line.rstrip().endswith("· ready"):
            phases = {name.strip(): float(value) for name, value in _PHASE.findall(line)}
    if not phases:
        raise ValueError(f"rpcfleet run printed no phase line: {text[-400:]!r}")
    decode = _DECODE.search(text)
    return phases, int(decode.group(1)) if decode else 0, float(decode.group(2)) if decode else 0.0


def ttft_verdict(ours: list[float], theirs: list[float], extra: float = TTFT_EXTRA) -> tuple[float, bool]:
    """(median of ours - median of theirs, met): rpcfleet's time to first token at most `extra` s over
    the by-hand one's."""
    gap = median(ours) - median(theirs)
    return gap, gap <= extra


def decode_verdict(ours: list[float], theirs: list[float], share: float = DECODE_SHARE) -> tuple[float, bool]:
    """(median of ours / median of theirs, met): rpcfleet's decoding tokens/s at least `share` of the
    by-hand one's."""
    ratio = median(ours) / median(theirs)
    return ratio, ratio >= share


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """`median (min-max)` of a side's rounds."""
    return f"{fmt.format(median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def deploy(lab: Lab) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "deploy", "-i", str(lab.inventory)],
        capture_output=True, text=True, timeout=900, check=False, cwd=ROOT,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"deploy failed: {done.stdout}{done.stderr}")


def by_hand_args(lab: Lab, model: Path, ctx: int) -> list[str]:
    """The llama-server arguments `rpcfleet plan --format llama-cli` prints for `model` on the lab."""
    argv = [sys.executable, "-m", "orchestrator", "plan", "-i", str(lab.inventory), "-m", str(model)]
    argv += ["--ctx", str(ctx), "--format", "llama-cli"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True, cwd=ROOT)
    return shlex.split(done.stdout.splitlines()[0])


def run_rpcfleet(lab: Lab, model: Path, ctx: int, tokens: int) -> Side:
    """`rpcfleet run ... -n tokens`, a fresh process: the spawn to the first byte on its stdout (with
    `-n 1`, the one token's text or, where that token ends no character, the newline right after it)."""
    argv = [sys.executable, "-m", "orchestrator", "run", "-i", str(lab.inventory), "-m", str(model)]
    argv += ["-p", PROMPT, "-n", str(tokens), "--ctx", str(ctx)]
    env = {**os.environ, "COLUMNS": "300"}  # one line each: the phase line is read back
    started = time.monotonic()
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None
    head = process.stdout.read(1)
    first = time.monotonic() - started
    out, err = process.communicate(timeout=TIMEOUT)
    if process.returncode != 0 or not head:
        raise RuntimeError(f"rpcfleet run failed ({process.returncode}): {err.decode()[-2000:]}")
    phases, generated, tps = parse_run_output((head + out).decode(errors="replace") + err.decode())
    return Side(first, tps, generated, phases)


def _health(base: str) -> int:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as answer:
            return int(answer.status)
    except OSError:
        return 0


def run_by_hand(args: list[str], tokens: int, folder: Path) -> Side:
    """llama-server with `args`, then one `/completion` of `tokens` tokens once `/health` answers 200: the
    spawn to the answer (not streamed: llama-server holds back a stream's text while it ends in an
    incomplete UTF-8 character, which a random-weight model's bytes often do) and its own timings."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [str(llama_server_binary()), *args, "--host", "127.0.0.1", "--port", str(port)]
    started = time.monotonic()
    with (folder / "llama-server.log").open("ab") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        while _health(base) != 200:
            if server.poll() is not None or time.monotonic() - started > TIMEOUT:
                raise RuntimeError(f"llama-server did not start: see {folder / 'llama-server.log'}")
            time.sleep(0.02)
        body = {"prompt": PROMPT, "n_predict": tokens, "temperature": 0, "seed": 0}
        request = urllib.request.Request(
            f"{base}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=TIMEOUT) as answer:
            done = json.loads(answer.read())
        first = time.monotonic() - started
        timings = done["timings"]
        return Side(first, float(timings["predicted_per_second"]), int(timings["predicted_n"]), {})
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@dataclass
class Runs:
    """Each side's runs of one model: to the first token (`-n 1`) and decoding (`-n N`)."""

    args: list[str]
    ours_first: list[Side]
    theirs_first: list[Side]
    ours_decode: list[Side]
    theirs_decode: list[Side]


def compare(lab: Lab, model: Path, ctx: int, tokens: int, rounds: int, folder: Path) -> Runs:
    """One warm-up of each, then `rounds` alternating rounds, each a first-token run and a decoding run of
    both sides."""
    runs = Runs(by_hand_args(lab, model, ctx), [], [], [], [])
    run_rpcfleet(lab, model, ctx, 1)  # warm-ups: the GGUF into the page cache, not counted
    run_by_hand(runs.args, 1, folder)
    for i in range(rounds):
        ours_first = i % 2 == 0  # A first in odd rounds, B in even ones: a drift of the load favours neither
        for ours in (ours_first, not ours_first):
            print(f"{model.name} round {i + 1}: {'rpcfleet run' if ours else 'by hand'}", file=sys.stderr)
            if ours:
                runs.ours_first.append(run_rpcfleet(lab, model, ctx, 1))
                runs.ours_decode.append(run_rpcfleet(lab, model, ctx, tokens))
            else:
                runs.theirs_first.append(run_by_hand(runs.args, 1, folder))
                runs.theirs_decode.append(run_by_hand(runs.args, tokens, folder))
    return runs


def shown(args: list[str]) -> str:
    """The by-hand command for the section, the model by its file name."""
    names = ["llama-server", *args, "--host", "127.0.0.1", "--port", "PORT"]
    names[names.index("-m") + 1] = Path(names[names.index("-m") + 1]).name
    return shlex.join(names)


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds of each (default 7)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens of a decoding run (default 64)")
    parser.add_argument("--ctx", type=int, default=4096, help="context of both (default 4096)")
    args = parser.parse_args()
    load_before = load_average()
    results: list[tuple[str, Runs]] = []
    reap_stale()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tiny = write_tiny_llama(folder / "tiny.gguf", **TINY)  # type: ignore[arg-type]
        models = [("tiny synthetic llama (8 layers, n_embd 512, f16)", tiny)]
        models.append(("Gemma 3 270M Q4_K_M", cached_path(GEMMA3_270M)))
        with contextlib.ExitStack() as stack:
            lab = lab_up(NODES, name=LAB_NAME, owner_pid=os.getpid())
            stack.callback(lab_down, LAB_NAME)
            deploy(lab)
            for label, model in models:
                results.append((label, compare(lab, model, args.ctx, args.tokens, args.rounds, folder)))

    rows, verdicts, commands = [], [], []
    for label, runs in results:
        ours = [s.first for s in runs.ours_first]
        theirs = [s.first for s in runs.theirs_first]
        gap, first_met = ttft_verdict(ours, theirs)
        gaps = [a - b for a, b in zip(ours, theirs, strict=True)]
        ours_tps = [s.tps for s in runs.ours_decode]
        theirs_tps = [s.tps for s in runs.theirs_decode]
        ratio, decode_met = decode_verdict(ours_tps, theirs_tps)
        phases = {k: [s.phases.get(k, 0.0) for s in runs.ours_first] for k in runs.ours_first[0].phases}
        # what the phase line does not hold: Python's start and imports, the worker's spawn, the prompt
        phases["rest"] = [s.first - sum(s.phases.values()) for s in runs.ours_first]
        phase_text = ", ".join(f"{k} {spread(v)} s" for k, v in phases.items())
        each = [a / b for a, b in zip(ours_tps, theirs_tps, strict=True)]
        tokens = sorted({s.tokens for s in runs.ours_decode} | {s.tokens for s in runs.theirs_decode})
        rows.append(
            f"| {label} | {spread(ours)} s | {spread(theirs)} s | {gap:+.2f} s ({min(gaps):+.2f} to "
            f"{max(gaps):+.2f}) | {phase_text} | {spread(ours_tps, '{:.1f}')} | "
            f"{spread(theirs_tps, '{:.1f}')} | {ratio:.2f}x ({min(each):.2f}-{max(each):.2f}) "
            f"| {'/'.join(map(str, tokens))} |"
        )
        verdicts.append(
            f"{label}: first token {gap:+.2f} s over by hand (target at most +{TTFT_EXTRA:g} s): "
            f"**{'met' if first_met else 'not met'}**; decoding {ratio:.2f}x of by hand (target at least "
            f"{DECODE_SHARE:g}x): **{'met' if decode_met else 'not met'}**"
            + (
                f"; the rounds' ratios ({min(each):.2f}-{max(each):.2f}) span {DECODE_SHARE:g}: within noise."
                if min(each) <= DECODE_SHARE <= max(each)
                else "."
            )
        )
        commands.append(f"    {shown(runs.args)}")
    body = [
        f"## {SECTION}",
        "",
        f"`bench/peers_run.py --rounds {args.rounds} --tokens {args.tokens} --ctx {args.ctx}`, {stamp()}; "
        f"load average {load_before:.2f} at the start. A {NODES}-node lab (network namespaces, real sshd, "
        "CPU `ggml-rpc-server`s deployed by `rpcfleet deploy`). A = `rpcfleet run -i LAB -m MODEL -p "
        f"PROMPT -n N --ctx {args.ctx}`, a fresh process each time; B = `llama-server` by hand (the pinned "
        "tools build has no `llama-cli`), built from the same llama.cpp source as the binding A loads "
        "through, with the arguments `rpcfleet plan --format llama-cli` printed for the same lab and model "
        "(made once, not timed), then one `/completion` of the same prompt, greedy, once `/health` answers "
        "200. First token: a run with `-n 1` (B: `n_predict` 1), the spawn to A's first byte on stdout, to "
        f"B's answer. Decoding: a run of {args.tokens} tokens, llama.cpp's own timing (A: the tokens/s "
        "`rpcfleet run` prints; B: `timings.predicted_per_second`). Median (min-max) of "
        f"{args.rounds} rounds, A first in odd rounds and B in even ones, after one warm-up of each, not "
        "counted. The by-hand commands:",
        "",
        *commands,
        "",
        "| model | A: rpcfleet run, first token | B: by hand, first token | A - B (rounds' range) "
        "| A's phases (its own line; rest: the first token less them) | A: decoding tok/s "
        "| B: decoding tok/s | A / B (rounds' range) | tokens generated |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        *[f"- {v}" for v in verdicts],
        "- A's time holds what B's user does before typing the command: the probe (RPC memory and SSH "
        "facts of each node) and the plan that gives `-ts`; B's holds llama-server's HTTP start and its "
        "warm-up run (its default).",
    ]
    text = "\n".join(body) + "\n"
    print(text)
    if args.write:
        write_section(args.write, SECTION, text)


if __name__ == "__main__":
    main()
