"""Benchmark: rpcfleet's largest context that fits against llama.cpp's own fit (`llama-fit-params`), both
checked by a real load at the context each offers.

    .venv/bin/python bench/fit.py            # print the table
    .venv/bin/python bench/fit.py --write    # and replace the "fit" section of BENCHMARKS.md
    .venv/bin/python bench/fit.py --fit-params PATH   # another llama-fit-params binary

Three real `ggml-rpc-server`s on loopback (GGML_RPC_DEBUG=1: their logs record every buffer to the byte)
stand for a fleet whose devices may each use LIMIT bytes. LIMIT is per model, a quarter and half of the
way from what the busiest device needs at context 1024 to what it needs at the training context (as
rpcfleet predicts on unlimited devices), so that neither tool can simply take the training context.
rpcfleet plans with `--margin 0` on LIMIT; `llama-fit-params` (built from the same llama.cpp as the
server) gets `--fit-target` = each server's reported free memory - LIMIT, the same budget. Both with flash
attention off and on, n_batch = n_ubatch = 512, one sequence, the small SWA cache. The truth: each
answer is loaded as it says and every device's allocations (weights, KV + state, compute) are read from
its server's log and compared with LIMIT: rpcfleet's plan through its loader, llama-fit-params' printed
arguments (context, -ngl, -ts and its -ot tensor overrides) through `llama-server` from the same build
(`-np 1 --fit off`: one sequence, no fit of its own). On sliding-window models rpcfleet's largest context
with `--swa-full` (the full-size cache) is given too. A model whose need does not grow with the context
(a recurrent one: its state is per sequence) gets one limit, so one row per flash-attention setting.

Targets, computed: rpcfleet's answer loads within the limit on every model (the planner's promise: what
it says fits, fits), and its context is at least llama-fit-params' wherever llama-fit-params' own answer
loaded within the limit (llama.cpp's own fit is what a user would otherwise run; where its answer does
not load within the limit there is nothing sound to be at least).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import tempfile
import time
from dataclasses import dataclass
from itertools import product
from pathlib import Path

from _common import (
    arg_parser,
    free_port,
    load_average,
    server_binary,
    server_command,
    stamp,
    wait_healthy,
    wait_listening,
)
from _common import write_section as write_md_section

from orchestrator.core.log import configure_logging

configure_logging("text", "WARNING")  # before the modules below make their loggers

from orchestrator.llama.logs import model_allocations, parse_server_log
from orchestrator.llama.native.loader import load_llama
from orchestrator.models.catalogue import CATALOGUE, cached_path, is_fetched
from orchestrator.models.synth_arch import write_arch_model
from orchestrator.planning.formats import llama_cli_args
from orchestrator.planning.plan import Plan, PlanDevice, PlanOptions
from orchestrator.planning.profile import ModelProfile, profile_model
from orchestrator.planning.strategy import make_plan
from orchestrator.rpc.client import probe_endpoints

SECTION = "fit"
MiB = 1 << 20
N_SERVERS = 3
SYNTH = ("gemma3", "qwen3moe", "mamba2")
# The low end of each model's limit: not below n_ubatch, where llama.cpp shrinks the batch (and with it
# the logits buffer: 512 MiB for Gemma 3's vocabulary) to the context.
LOW_CTX = 1024
FRACTIONS = (0.25, 0.5)  # where each model's limit lies between its need at LOW_CTX and at n_ctx_train


def fit_params_binary() -> Path:
    """llama-fit-params from the engine build: `cached_tools()` where the build module has it, else the
    newest one in the engine cache."""
    try:
        from orchestrator.artifacts import build

        tools = getattr(build, "cached_tools", None)
        if tools is not None:
            found = Path(tools()) / "llama-fit-params"
            if found.is_file():
                return found
    except Exception:  # no engine built through the module: fall back to the cache folder
        pass
    found_all = sorted(
        (Path.home() / ".cache" / "rpcfleet" / "engine").glob("*/llama-fit-params"),
        key=lambda p: p.stat().st_mtime,
    )
    if not found_all:
        raise SystemExit("no llama-fit-params built (~/.cache/rpcfleet/engine/*/); give --fit-params PATH")
    return found_all[-1]


@dataclass
class Fleet:
    ports: list[int]
    logs: list[Path]

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]


def _options(n_ctx: int, fa: bool, **kw: object) -> PlanOptions:
    return PlanOptions(n_ctx=n_ctx, margin=0, flash_attn=fa, n_batch=512, n_ubatch=512, **kw)  # type: ignore[arg-type]


def _devices(fleet: Fleet, limit: int) -> list[PlanDevice]:
    return [PlanDevice(e, 0, "CPU", total=limit, free=limit, usable=limit) for e in fleet.endpoints]


def _limit(profile: ModelProfile, fleet: Fleet, fa: bool, frac: float) -> int:
    """`frac` of the way from what the busiest device needs at LOW_CTX to at the training context
    (unlimited devices), in whole MiB (llama-fit-params' unit)."""
    big = 1 << 40
    devices = [PlanDevice(e, 0, "CPU", total=big, free=big, usable=big) for e in fleet.endpoints]
    need = [
        max(d.memory.total for d in make_plan(devices, profile, _options(n_ctx, fa)).devices)
        for n_ctx in (LOW_CTX, profile.n_ctx_train)
    ]
    return max(MiB, int(need[0] + frac * (need[1] - need[0])) // MiB * MiB)


def _reported_free(fleet: Fleet) -> list[int]:
    results = asyncio.run(probe_endpoints(fleet.endpoints))
    return [r.free for r in results]


def _llama_fit(binary: Path, model: Path, fleet: Fleet, limit: int, fa: bool) -> tuple[int, str]:
    """llama-fit-params' answer: (n_ctx, its printed arguments), n_ctx 0 when it gave none."""
    targets = [max(0, free - limit) // MiB for free in _reported_free(fleet)]
    argv = [
        str(binary),
        "-m",
        str(model),
        "--rpc",
        ",".join(fleet.endpoints),
        "-fa",
        "on" if fa else "off",
        "-b",
        "512",
        "-ub",
        "512",
        "-fitc",
        "256",  # its smallest context (default 4096): let it go as low as rpcfleet's search
        "-fitt",
        ",".join(str(t) for t in targets),
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if out.returncode != 0 or not line.startswith("-c "):
        return 0, f"failed (exit {out.returncode})"
    words = line.split()
    return int(words[words.index("-c") + 1]), line


def _read_allocations(fleet: Fleet, offsets: list[int]) -> list[int]:
    """Bytes each server allocated since `offsets` of its log (the last connection that allocated)."""
    totals = []
    for log, offset in zip(fleet.logs, offsets, strict=True):
        with log.open("rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", "replace")
        totals.append(sum(model_allocations(parse_server_log(text)).get(0, [])))
    return totals


def _allocated(plan: Plan, model: Path, fleet: Fleet) -> list[int]:
    """Bytes each server allocated for a real load of `plan`."""
    offsets = [log.stat().st_size for log in fleet.logs]
    llm = load_llama(plan, model)
    try:
        return _read_allocations(fleet, offsets)
    finally:
        llm.close()


def _fit_params_argv(model: Path, fleet: Fleet, answer: str, fa: bool) -> list[str]:
    """llama-server's arguments for llama-fit-params' `answer` (its printed arguments, -ot included): the
    answer exactly as a user would pass it on, one sequence, no fit of llama-server's own."""
    argv = ["-m", str(model), "--rpc", ",".join(fleet.endpoints), *shlex.split(answer)]
    return [*argv, "-fa", "on" if fa else "off", "-b", "512", "-ub", "512", "-np", "1", "--fit", "off"]


def _server_allocated(binary: Path, fleet: Fleet, args: list[str]) -> list[int]:
    """Bytes each server allocated for a load by the llama-server beside `binary` with `args`."""
    port = free_port()
    argv = [str(binary.with_name("llama-server")), *args, "--host", "127.0.0.1", "--port", str(port)]
    answer = shlex.join(args)
    offsets = [log.stat().st_size for log in fleet.logs]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        if not wait_healthy(port, server, 300):
            tail = (server.stderr.read() if server.stderr else b"").decode("utf-8", "replace")[-300:]
            raise RuntimeError(f"llama-server did not load {answer!r}: {tail}")
        return _read_allocations(fleet, offsets)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        time.sleep(0.5)  # the servers free the closed connections' buffers


Seen = set[tuple[str, bool, int]]


def _measure(
    binary: Path, model: Path, label: str, fleet: Fleet, fa: bool, frac: float, seen: Seen
) -> dict[str, object] | None:
    """One row, or None when this model and setting was measured at the same limit already."""
    profile = profile_model(model)
    limit = _limit(profile, fleet, fa, frac)
    if (label, fa, limit) in seen:
        return None
    seen.add((label, fa, limit))
    devices = _devices(fleet, limit)
    ours = make_plan(devices, profile, _options(0, fa)).fit.largest_n_ctx
    ours_plan = make_plan(devices, profile, _options(ours, fa))
    ours_alloc = _allocated(ours_plan, model, fleet)
    # One step past the answer (as rpcfleet would split it there): within the limit means rpcfleet was
    # conservative by at least that step.
    past = ours + 256
    past_alloc = (
        _allocated(make_plan(devices, profile, _options(past, fa)), model, fleet)
        if ours < profile.n_ctx_train
        else []
    )
    full = (
        make_plan(devices, profile, _options(0, fa, swa_full=True)).fit.largest_n_ctx
        if profile.swa_layer_ids
        else None
    )
    theirs, args = _llama_fit(binary, model, fleet, limit, fa)
    theirs_alloc = (
        _server_allocated(binary, fleet, _fit_params_argv(model, fleet, args, fa)) if theirs else []
    )
    # rpcfleet's own plan through the same llama-server (`plan --format llama-cli`'s arguments): both
    # answers loaded by one program, so that a difference between the loaders is not taken for the fit's
    ours_server = _server_allocated(binary, fleet, [*llama_cli_args(ours_plan, model), "-b", "512"])
    return {
        "model": label,
        "fa": fa,
        "family": profile.rules.family + (", SWA" if profile.swa_layer_ids else ""),
        "train": profile.n_ctx_train,
        "limit": limit,
        "ours": ours,
        "ours_fits": ours_plan.fit.fits,
        "ours_alloc": ours_alloc,
        "ours_server_alloc": ours_server,
        "past": past,
        "past_alloc": past_alloc,
        "full": full,
        "theirs": theirs,
        "theirs_args": args,
        "theirs_alloc": theirs_alloc,
    }


def _mib(n: int) -> str:
    return f"{n / MiB:,.1f}"


def _within(alloc: list[int], limit: int) -> str:
    if not alloc:
        return "-"
    worst = max(alloc)
    return f"{'yes' if worst <= limit else 'NO'} ({_mib(worst)} MiB)"


def _table(rows: list[dict[str, object]]) -> list[str]:
    out = [
        "| model (family) | flash attn | training ctx | limit per device (MiB) | rpcfleet largest ctx "
        "| its load within the limit (busiest device) | a load 256 past it | llama-fit-params "
        "| its load within the limit (busiest device) | rpcfleet / llama.cpp | rpcfleet with --swa-full "
        "| rpcfleet's answer loaded by llama-server (busiest device) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ours, theirs, full = r["ours"], r["theirs"], r["full"]
        assert isinstance(ours, int) and isinstance(theirs, int) and isinstance(r["limit"], int)
        ratio = f"{ours / theirs:.2f}x" if theirs else "-"
        swa = f"{full} (small cache: {ours / full:.1f}x)" if isinstance(full, int) and full else "-"
        args = f"`{r['theirs_args']}`"
        if " -ngl 0" in args:
            args += " (nothing on the devices)"
        limit, mine, past, their = r["limit"], r["ours_alloc"], r["past_alloc"], r["theirs_alloc"]
        by_server = r["ours_server_alloc"]
        assert isinstance(mine, list) and isinstance(past, list) and isinstance(their, list)
        assert isinstance(by_server, list)
        out.append(
            f"| {r['model']} ({r['family']}) | {'on' if r['fa'] else 'off'} | {r['train']} "
            f"| {_mib(limit)} | {ours} | {_within(mine, limit)} | {_within(past, limit)} | {args} "
            f"| {_within(their, limit)} | {ratio} | {swa} | {_within(by_server, limit)} |"
        )
    return out


def within(row: dict[str, object], key: str) -> bool:
    """The load `key` ("ours_alloc", "theirs_alloc") was made and its busiest server stayed in the limit."""
    alloc, limit = row[key], row["limit"]
    assert isinstance(alloc, list) and isinstance(limit, int)
    return bool(alloc) and max(alloc) <= limit


def at_least_theirs(row: dict[str, object]) -> bool:
    ours, theirs = row["ours"], row["theirs"]
    assert isinstance(ours, int) and isinstance(theirs, int)
    return ours >= theirs


def fit_target(rows: list[dict[str, object]]) -> bool:
    """rpcfleet's answer loads within the limit on every row, and its context is at least llama-fit-params'
    on every row where that answer loaded within the limit."""
    safe = all(within(r, "ours_alloc") for r in rows)
    return safe and all(at_least_theirs(r) for r in rows if within(r, "theirs_alloc"))


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--fit-params", type=Path, default=None, help="the llama-fit-params binary")
    args = parser.parse_args()
    binary: Path = args.fit_params or fit_params_binary()
    load = load_average()
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="bench-fit-") as tmp:
        folder = Path(tmp)
        env = {**os.environ, "GGML_RPC_DEBUG": "1"}
        procs: list[subprocess.Popen[bytes]] = []
        fleet = Fleet([], [])
        try:
            for _ in range(N_SERVERS):
                port = free_port()
                log = folder / f"rpc-{port}.log"
                with log.open("wb") as out:
                    argv = ["stdbuf", "-oL", *server_command(server_binary(), port)]
                    procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env))
                fleet.ports.append(port)
                fleet.logs.append(log)
            for port, proc in zip(fleet.ports, procs, strict=True):
                wait_listening(port, proc)
            seen: Seen = set()
            models: list[tuple[Path, str]] = []
            gemma = CATALOGUE["gemma3-270m"]
            if is_fetched(gemma):
                models.append((cached_path(gemma), "Gemma 3 270M Q4_K_M"))
            models += [(write_arch_model(folder / f"{a}.gguf", a), f"synth {a}") for a in SYNTH]
            for (model, label), fa, frac in product(models, (False, True), FRACTIONS):
                row = _measure(binary, model, label, fleet, fa, frac, seen)
                if row is not None:
                    rows.append(row)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(10)

    ours_ok = sum(within(r, "ours_alloc") for r in rows)
    theirs_ok = sum(within(r, "theirs_alloc") for r in rows)
    at_least = sum(at_least_theirs(r) for r in rows)
    sound = [r for r in rows if within(r, "theirs_alloc")]
    sound_at_least = sum(at_least_theirs(r) for r in sound)
    ours_server_ok = sum(within(r, "ours_server_alloc") for r in rows)
    verdict = "met" if fit_target(rows) else "not met"
    lines = [
        f"## {SECTION}",
        "",
        f"{stamp()}; load average {load:.2f} at the start. `bench/fit.py` with `{binary.name}` from the "
        f"engine build: {N_SERVERS} `ggml-rpc-server`s on loopback, each limited to LIMIT (a quarter or half "
        f"of the way from the busiest device's need at context {LOW_CTX} to its need at the training "
        "context); rpcfleet plans with `--margin 0`, llama-fit-params gets `--fit-target` = reported free "
        "- LIMIT; both answers loaded (rpcfleet's plan through its loader and through llama-server, "
        "llama-fit-params' printed arguments, `-ot` included, through the same build's `llama-server -np 1 "
        "--fit off`), allocations "
        "read from the servers' logs. A model whose need does not grow with the context gets one limit: "
        "one row per flash-attention setting.",
        "",
        f"rpcfleet's largest context loaded within the limit on {ours_ok} of {len(rows)} models, "
        f"llama-fit-params' on {theirs_ok} of {len(rows)}; rpcfleet's context at least llama.cpp's on "
        f"{at_least} of {len(rows)}, and on {sound_at_least} of the {len(sound)} where llama-fit-params' "
        "answer loaded within the limit. rpcfleet's answer loaded by llama-server as well (its "
        f"`plan --format llama-cli` arguments): within the limit on {ours_server_ok} of {len(rows)}; where "
        "the two loads of one answer differ, the loaders allocate differently at the same arguments.",
        "",
        f"Target (rpcfleet's answer loads within the limit on every model, and its context is at least "
        f"llama-fit-params' wherever that answer loads within the limit): **{verdict}** (within the limit: "
        f"{ours_ok} of {len(rows)}; at least llama.cpp's: {sound_at_least} of {len(sound)}).",
        "",
        *_table(rows),
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_md_section(args.write, SECTION, text)


if __name__ == "__main__":
    main()
