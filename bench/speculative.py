"""Benchmark: speculative decoding in `rpcfleet serve` (`--draft FILE`): tokens/s with and without a draft,
at 1 and 4 clients, the draft's acceptance rate, and whether greedy text stays the same.

    .venv/bin/python bench/speculative.py                   # print the section
    .venv/bin/python bench/speculative.py --rounds 1 --tokens 32   # shorter
    .venv/bin/python bench/speculative.py --write           # and replace the "speculative" section

One real `ggml-rpc-server` on loopback (an inventory of one `connection: local` host), `rpcfleet serve
--split --parallel 4 --ctx 4096`, the draft on this machine's CPU (`--device-draft none`, the default).
Two pairs:
- Gemma 3 270M Q4_K_M as its own draft: every drafted token should be accepted (the same model, greedy),
  so this measures what verifying and drafting cost against what accepted tokens save;
- a Q8_0 Gemma 3 270M target, made here from the Q4_K_M file with the `gguf` library (every tensor
  dequantized and quantized to Q8_0, the metadata copied: the same vocabulary by construction; cached
  under ~/.cache/rpcfleet/bench), with the real Q4_K_M as draft: a draft that differs from its target.
Each pair: without and with the draft, alternating A and B (A first in odd rounds, B first in even ones),
serve restarted for each run; per run, 1 client then 4 clients at once, each making `--requests`
completions of `--tokens` tokens (greedy, EOS ignored), aggregate tokens/s = generated tokens / wall
time. Acceptance = llama-server's `timings.draft_n_accepted / draft_n` summed over the requests; same
text: every prompt's greedy text with the draft equals the text without it (per prompt, same
temperature 0, seed and slots). Verdict per figure: faster (slower) when every run with the draft beats
(loses to) every run without, else within the spread; none from one run each.

What it cannot measure: speculation's gain. That needs a draft several times cheaper than its target
with the same vocabulary; the catalogue holds only Gemma 3 270M, and a random-weight pair accepts almost
nothing, so no such pair is at hand (and no toy one is built). Both pairs here draft with a model as
costly as the target: they measure the mechanism's cost (drafting and verifying) and its correctness.

Target, computed, on what these pairs can show: the model drafting for itself has at least 0.9 of its
drafted tokens accepted (greedy, the same weights: only the batched verification's rounding may
disagree), and greedy text with the draft is the same as without it on every prompt (speculative
decoding must not change what a greedy request answers).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import (
    ROOT,
    arg_parser,
    free_port,
    get_json,
    load_average,
    local_inventory,
    median,
    servers,
    stamp,
    write_section,
)

from orchestrator.models.catalogue import GEMMA3_270M, cached_path

SECTION = "speculative"
SELF_ACCEPTANCE = 0.9  # the least share of a self-draft's tokens accepted
TIMEOUT = 600.0
PROMPTS = (
    "The history of the lighthouse begins",
    "Write a short story about a fox who",
    "The three most important rules of cooking are",
    "In the year 2100, cities will",
)


def q8_target(source: Path) -> Path:
    """A Q8_0 copy of `source` (every quantized tensor dequantized and quantized to Q8_0, F32 kept), in
    the cache; made once."""
    import gguf
    import numpy as np

    out = Path.home() / ".cache" / "rpcfleet" / "bench" / f"{source.stem.replace('q4_k_m', 'q8_0')}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(out) + ".part", arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    for tensor in reader.tensors:
        qtype = tensor.tensor_type
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=qtype)
            continue
        values = gguf.quants.dequantize(tensor.data, qtype)  # float32, shape (rows, cols)
        q8 = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(tensor.name, q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(out) + ".part").replace(out)
    return out


@contextlib.contextmanager
def serve(inventory: Path, model: Path, draft: Path | None, folder: Path, args: Any) -> Iterator[str]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "orchestrator", "serve", "-i", str(inventory), "-m", str(model)]
    argv += ["--ctx", str(args.ctx), "--parallel", "4", "--port", str(port), "--split"]
    argv += ["--model-name", "bench", "--rejoin-interval", "0", "--observe-interval", "0"]
    if draft is not None:
        argv += ["--draft", str(draft), "--draft-max", str(args.draft_max)]
    env = {**os.environ, "RPCFLEET_HOME": str(folder / "home")}
    env.pop("RPCFLEET_API_KEY", None)
    log_path = folder / "serve.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"serve ended: {log_path.read_text()[-3000:]}")
            with contextlib.suppress(OSError, ValueError):
                if get_json(f"{base}/health").get("status") == "ready":
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"serve not ready in 300 s: {log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield base
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(60)


def complete(client: Any, base: str, prompt: str, tokens: int) -> dict[str, Any]:
    body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    answer = client.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
    answer.raise_for_status()
    data = answer.json()
    timings = data.get("timings") or {}
    return {
        "text": data["choices"][0]["text"],
        "tokens": data["usage"]["completion_tokens"],
        "draft_n": timings.get("draft_n", 0),
        "accepted": timings.get("draft_n_accepted", 0),
    }


def workload(base: str, clients: int, requests: int, tokens: int) -> dict[str, Any]:
    """`clients` at once, `requests` completions each (prompts in turn): tokens/s, texts, draft counts."""
    import httpx

    def one(i: int) -> list[dict[str, Any]]:
        with httpx.Client() as client:
            return [
                {**complete(client, base, PROMPTS[(i + j) % len(PROMPTS)], tokens), "prompt": (i + j) % 4}
                for j in range(requests)
            ]

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        done = [r for rs in pool.map(one, range(clients)) for r in rs]
    wall = time.monotonic() - started
    return {
        "tps": sum(r["tokens"] for r in done) / wall,
        "texts": {r["prompt"]: r["text"] for r in done},
        "draft_n": sum(r["draft_n"] for r in done),
        "accepted": sum(r["accepted"] for r in done),
    }


def verdict(with_draft: list[float], without: list[float]) -> str:
    if min(len(with_draft), len(without)) < 2:
        return "no verdict (one run each: no spread)"
    if min(with_draft) > max(without):
        return "faster with the draft"
    if max(with_draft) < min(without):
        return "slower with the draft"
    return "within the spread"


def run_pair(inventory: Path, target: Path, draft: Path, folder: Path, args: Any) -> dict[str, Any]:
    runs: dict[str, list[dict[int, dict[str, Any]]]] = {"without": [], "with": []}
    for i in range(args.rounds):
        for mode in ("without", "with") if i % 2 == 0 else ("with", "without"):
            print(f"  round {i + 1}: {mode} the draft", file=sys.stderr, flush=True)
            with serve(inventory, target, draft if mode == "with" else None, folder, args) as base:
                got = {c: workload(base, c, args.requests, args.tokens) for c in (1, 4)}
            print(f"    { ({c: round(g['tps'], 2) for c, g in got.items()}) }", file=sys.stderr, flush=True)
            runs[mode].append(got)
    return runs


def acceptance(runs: dict[str, list[dict[int, dict[str, Any]]]]) -> tuple[int, int]:
    """(accepted, drafted) tokens over every run with the draft."""
    drafted = sum(r[c]["draft_n"] for r in runs["with"] for c in (1, 4))
    accepted = sum(r[c]["accepted"] for r in runs["with"] for c in (1, 4))
    return accepted, drafted


def pair_rows(name: str, runs: dict[str, list[dict[int, dict[str, Any]]]]) -> tuple[list[str], str]:
    rows = []
    for clients in (1, 4):
        a = [r[clients]["tps"] for r in runs["with"]]
        b = [r[clients]["tps"] for r in runs["without"]]
        each = ", ".join(f"{v:.1f}" for v in a)
        each_b = ", ".join(f"{v:.1f}" for v in b)
        rows.append(
            f"| {name} | {clients} | {median(b):.1f} ({each_b}) | {median(a):.1f} ({each}) "
            f"| {median(a) / median(b):.2f} | {verdict(a, b)} |"
        )
    accepted, drafted = acceptance(runs)
    without_drafts = sum(r[c]["draft_n"] for r in runs["without"] for c in (1, 4))
    rate = f"{accepted / drafted:.3f} ({accepted} of {drafted} drafted tokens)" if drafted else "none drafted"
    note = (
        f"{name}: acceptance {rate}; runs without the draft drafted {without_drafts}. Greedy text with the "
        f"draft against without it, prompt by prompt at the same number of clients: {same_text(runs)[0]}."
    )
    return rows, note


def _common_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def same_text(runs: dict[str, list[dict[int, dict[str, Any]]]]) -> tuple[str, bool]:
    """How many (prompt, clients) answers are the same with and without the draft; where they differ, the
    characters they share first; and the same comparison between 1 and 4 clients without the draft (the
    batching's own effect on greedy text, for scale)."""

    def compare(a: dict[int, str], b: dict[int, str]) -> tuple[int, int, list[int]]:
        shared = [p for p in a if p in b]
        differ = [p for p in shared if a[p] != b[p]]
        prefixes = [_common_prefix(a[p], b[p]) for p in differ]
        return len(shared) - len(differ), len(shared), prefixes

    same = total = 0
    prefixes: list[int] = []
    for clients in (1, 4):
        for with_run, without_run in zip(runs["with"], runs["without"], strict=True):
            s, t, p = compare(with_run[clients]["texts"], without_run[clients]["texts"])
            same, total, prefixes = same + s, total + t, prefixes + p
    text = f"the same in {same} of {total}"
    if prefixes:
        text += f" (the others share their first {min(prefixes)}-{max(prefixes)} characters, then differ)"
    base = runs["without"][0]
    s, t, _ = compare(base[1]["texts"], base[4]["texts"])
    return f"{text}; without the draft, 1 client against 4: the same in {s} of {t}", same == total


def draft_target(accepted: int, drafted: int, unchanged: int, pairs: int) -> tuple[bool, float]:
    """(met, the self-draft's acceptance): at least `SELF_ACCEPTANCE` of its drafted tokens accepted
    (none drafted: 0, not met), and greedy text unchanged by the draft in every pair."""
    rate = accepted / drafted if drafted else 0.0
    return rate >= SELF_ACCEPTANCE and unchanged == pairs, rate


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=48, help="tokens per completion (default 48)")
    parser.add_argument("--requests", type=int, default=2, help="completions per client (default 2)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    parser.add_argument("--ctx", type=int, default=4096, help="serve's --ctx (default 4096)")
    parser.add_argument("--draft-max", type=int, default=4, help="serve's --draft-max (default 4)")
    parser.add_argument("--no-q8", action="store_true", help="only the Q4_K_M pair")
    args = parser.parse_args()
    gemma = cached_path(GEMMA3_270M)
    load_before = load_average()
    pairs: list[tuple[str, dict[str, Any]]] = []
    q8_why = "not measured (--no-q8)"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        with servers(1, folder) as ports:
            inventory = local_inventory(folder, ports)
            print("Gemma 3 270M Q4_K_M drafting for itself", file=sys.stderr, flush=True)
            pairs.append(("Q4_K_M target, Q4_K_M draft", run_pair(inventory, gemma, gemma, folder, args)))
            if not args.no_q8:
                try:
                    target = q8_target(gemma)
                except Exception as exc:  # the pair is reported as impossible, with why
                    q8_why = f"not measured: making the Q8_0 target failed ({exc!r})"
                else:
                    q8_why = ""
                    print("Gemma 3 270M Q8_0 with the Q4_K_M draft", file=sys.stderr, flush=True)
                    pairs.append(
                        ("Q8_0 target, Q4_K_M draft", run_pair(inventory, target, gemma, folder, args))
                    )
    rows, notes = [], []
    for name, runs in pairs:
        got_rows, note = pair_rows(name, runs)
        rows += got_rows
        notes.append(note)
    accepted, drafted = acceptance(pairs[0][1])
    unchanged = [name for name, runs in pairs if same_text(runs)[1]]
    met, self_rate = draft_target(accepted, drafted, len(unchanged), len(pairs))
    target_line = (
        f"Target (the self-draft's acceptance at least {SELF_ACCEPTANCE}, greedy text the same with the "
        f"draft on every prompt): **{'met' if met else 'not met'}** (acceptance {self_rate:.3f}; the same "
        f"text on every prompt in {len(unchanged)} of {len(pairs)} pairs)."
    )
    if q8_why:
        notes.append(f"Q8_0 target, Q4_K_M draft: {q8_why}.")
    body = [
        f"## {SECTION}",
        "",
        f"{stamp()}; load average {load_before:.2f} at the start, {load_average():.2f} at the end. "
        f"`bench/speculative.py --tokens {args.tokens} --requests {args.requests} --rounds {args.rounds} "
        f"--ctx {args.ctx} --draft-max {args.draft_max}`: one loopback server, `rpcfleet serve --split "
        f"--parallel 4 --ctx {args.ctx}`, the draft on this machine's CPU (`--device-draft none`); per run "
        f"1 client, then 4 at once, {args.requests} completions each of {args.tokens} tokens (greedy, EOS "
        "ignored). Rounds alternate (without the draft first in odd rounds), serve restarted for each run. "
        "Tokens/s: medians of the runs, each run in brackets; verdict: faster or slower when every run of "
        "one beats every run of the other, else within the spread. Both pairs draft with a model as "
        "costly as its target (Gemma 3 270M for itself, and for its own Q8_0), so they measure the "
        "mechanism's cost, not speculation's gain: no draft several times cheaper than its target with the "
        "same vocabulary is at hand (the catalogue holds only Gemma 3 270M, and a random-weight draft "
        "accepts almost nothing).",
        "",
        "| pair | clients | tokens/s without | tokens/s with the draft | with / without | verdict |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        *(f"- {note}" for note in notes),
        "",
        target_line,
    ]
    text = "\n".join(body) + "\n"
    print(text)
    if args.write:
        write_section(args.write, SECTION, text)


if __name__ == "__main__":
    main()
