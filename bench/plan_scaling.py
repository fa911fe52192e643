"""Benchmark: the planner's time from 2 to 64 devices, for every model family (the planner alone, no server).

    .venv/bin/python bench/plan_scaling.py            # print the curves
    .venv/bin/python bench/plan_scaling.py --write    # and replace its section of BENCHMARKS.md

Each family's tiny model (`rpcfleet model synth --arch FAMILY`) and the 70B-class sparse header (80 layers,
723 tensors) are profiled once. One engine takes at most 15 RPC devices (llama.cpp's 16 scheduler
backends less the CPU; the planner refuses more), so 64 devices are a fleet's, planned as formations:
- **one plan**: `make_plan` on 2, 4, 8 and 15 devices of equal size (each twice the model's bytes over
  the devices and 1 GiB, so that every device takes layers and the model fits), n_ctx 8192, with the
  default strategy and again with `--strategy fewest` (which searches for the fewest devices that hold
  the model);
- **formations**: `planning.formations.form` (`--replicas auto`, what `plan --replicas auto` and serve
  decide) on 2, 4, 8, 16, 32 and 64 nodes, each the smallest size (in 10% steps from 0.6x of what one
  device would need) on which the model needs two: the fleet makes n/2 formations, each with its plan
  (groups of equal nodes share one, renamed: `planning.formations.form`). Only the 70B-class header
  gets such a size: for the families' tiny models no size below what one node needs lets two hold them
  (each node keeps its 256 MiB margin), so they get that size and 64 MiB, and make n formations of one;
- **formations on unequal nodes**: the same, but node i has that size times 1 + i/1000 (up to 6.3 %
  more at 64, under the 10 % step, so a model that needs two nodes still does): no two nodes are equal,
  so no formation's plan is another's renamed, and every formation is planned.
The device counts are measured in turns (all of them, then again) so that a busy moment of the machine
falls on every point; each point is the median of `--runs`, with its p95 (from 20 runs; under 20, the
largest, called max).

Verdicts, computed: the target (under 50 ms at 64 devices, for every family: both formations' curves,
their tails) and each curve's shape, from a least-squares fit of log(time) over log(devices) through
every point, with its R^2 (`_common.SHAPE_RULE`).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path

from _common import (
    SHAPE_RULE,
    arg_parser,
    curve_shape,
    load_average,
    median,
    ms,
    stamp,
    tail,
    tail_name,
    write_section,
)

from orchestrator.core.log import configure_logging

configure_logging("text", "WARNING")  # before the modules below make their loggers

from orchestrator.core.errors import PlanError
from orchestrator.inventory.model import Host
from orchestrator.models.synth import write_sparse_70b_header
from orchestrator.models.synth_arch import ARCHES, write_arch_model
from orchestrator.planning.formations import ServedModel, form
from orchestrator.planning.plan import PlanDevice, PlanOptions
from orchestrator.planning.profile import ModelProfile, profile_model
from orchestrator.planning.strategy import make_plan

SECTION = "plan scaling"
ONE_PLAN = (2, 4, 8, 15)
FORMATIONS = (2, 4, 8, 16, 32, 64)
N_CTX = 8192
TARGET = 0.050  # seconds at 64 devices
MARGIN = 256 << 20  # the planner's default margin per device


def devices(n: int, usable: int, *, unequal: bool = False) -> list[PlanDevice]:
    """`n` CPU devices of `usable` bytes each; `unequal`: device i has `usable` x (1 + i/1000)."""
    sizes = [usable * (1000 + i) // 1000 if unequal else usable for i in range(n)]
    return [
        PlanDevice(
            endpoint=f"10.9.{i // 250}.{i % 250 + 1}:50052",
            index=0,
            name="CPU",
            description=f"node {i}",
            total=size,
            free=size,
            usable=size,
        )
        for i, size in enumerate(sizes)
    ]


def two_node_size(profile: ModelProfile, options: PlanOptions) -> int:
    """A node size on which the model needs two nodes (one if no size between makes it need two)."""
    needed = make_plan(devices(1, 1 << 40), profile, options).devices[0].memory.total + MARGIN
    size = needed * 6 // 10
    while size < needed:
        with contextlib.suppress(PlanError):
            if make_plan(devices(2, size), profile, options).fit.fits:
                return size
        size = size * 11 // 10
    return needed + (64 << 20)


def curve(
    title: str, counts: tuple[int, ...], times: dict[tuple[str, int], list[float]], names: list[str]
) -> tuple[list[str], dict[str, str], float]:
    """The table of one curve, each family's shape, and the worst tail (p95 or max) at its last point."""
    header = " | ".join(f"{n}" for n in counts)
    name_of_tail = tail_name(len(times[(names[0], counts[-1])]))
    rows = [
        f"| {title} | {header} | {name_of_tail} at {counts[-1]} | slope, R^2 (shape) |",
        "|---" * (len(counts) + 3) + "|",
    ]
    shapes: dict[str, str] = {}
    worst = 0.0
    for name in names:
        medians = [median(times[(name, n)]) for n in counts]
        slope, r2, shapes[name] = curve_shape(counts, medians)
        _, last = tail(times[(name, counts[-1])])
        worst = max(worst, last)
        cells = " | ".join(ms(m) for m in medians)
        rows.append(f"| {name} | {cells} | {ms(last)} | {slope:.2f}, {r2:.2f} ({shapes[name]}) |")
    return rows, shapes, worst


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument(
        "--runs", type=int, default=20, help="measurements per point (default 20: the least for a p95)"
    )
    args = parser.parse_args()
    load = load_average()
    with tempfile.TemporaryDirectory() as folder:
        models: dict[str, ModelProfile] = {
            arch: profile_model(write_arch_model(Path(folder) / f"{arch}.gguf", arch)) for arch in ARCHES
        }
        sparse = Path(folder) / "sparse70b.gguf"
        write_sparse_70b_header(sparse)
        models["70B sparse header"] = profile_model(sparse)
    options = PlanOptions(n_ctx=N_CTX)
    fewest = PlanOptions(n_ctx=N_CTX, strategy="fewest")
    sizes = {name: two_node_size(profile, options) for name, profile in models.items()}
    plans: dict[tuple[str, int], list[float]] = {}
    fewest_plans: dict[tuple[str, int], list[float]] = {}
    formations: dict[tuple[str, int], list[float]] = {}
    unequal: dict[tuple[str, int], list[float]] = {}
    made: dict[tuple[str, int], int] = {}
    made_unequal: dict[tuple[str, int], int] = {}
    for _ in range(args.runs):
        for n in ONE_PLAN:  # in turns: a busy moment falls on every point
            for name, profile in models.items():
                fleet = devices(n, profile.total_bytes * 2 // n + (1 << 30))
                for how, times in ((options, plans), (fewest, fewest_plans)):
                    started = time.perf_counter()
                    plan = make_plan(fleet, profile, how)
                    times.setdefault((name, n), []).append(time.perf_counter() - started)
                    # a plan that does not fit also searches its largest context
                    assert plan.fit.fits, (name, n, how.strategy)
        for n in FORMATIONS:
            for name, profile in models.items():
                served = ServedModel(str(profile.path), name, profile, options)
                for alike, times, count in ((False, formations, made), (True, unequal, made_unequal)):
                    fleet = devices(n, sizes[name], unequal=alike)
                    hosts = [
                        Host(name=f"n{i}", address=d.endpoint.split(":")[0], rpc_port=50052)
                        for i, d in enumerate(fleet)
                        if d.endpoint
                    ]
                    started = time.perf_counter()
                    formed, _ = form([served], hosts, fleet)
                    times.setdefault((name, n), []).append(time.perf_counter() - started)
                    count[(name, n)] = len(formed)
    names = list(models)
    one_rows, one_shapes, one_worst = curve("one plan: family / devices", ONE_PLAN, plans, names)
    few_rows, few_shapes, few_worst = curve(
        "one plan, fewest: family / devices", ONE_PLAN, fewest_plans, names
    )
    form_rows, form_shapes, equal_worst = curve("formations: family / nodes", FORMATIONS, formations, names)
    uneq_rows, uneq_shapes, uneq_worst = curve(
        "formations, unequal nodes: family / nodes", FORMATIONS, unequal, names
    )
    worst = max(equal_worst, uneq_worst)
    verdict = "met" if worst < TARGET else "not met"
    tail_said = tail_name(args.runs)
    at_64 = sorted({made[(name, FORMATIONS[-1])] for name in names})
    at_64_unequal = sorted({made_unequal[(name, FORMATIONS[-1])] for name in names})
    body = "\n".join(
        [
            f"## {SECTION}",
            "",
            f"{stamp()}, load average {load:.2f} at the start; `bench/plan_scaling.py`, {args.runs} "
            f"measurements per point, the counts in turns, n_ctx {N_CTX}.",
            "",
            *one_rows,
            "",
            *few_rows,
            "",
            *form_rows,
            "",
            *uneq_rows,
            "",
            f"At 64 nodes the formations' planning made {', '.join(map(str, at_64))} formation(s) per "
            f"family on equal nodes (groups of equal nodes share one plan, renamed) and "
            f"{', '.join(map(str, at_64_unequal))} on unequal ones (each planned). Target: every family "
            f"under {ms(TARGET)} at 64 devices, equal or not: **{verdict}** (worst {tail_said}: equal "
            f"{ms(equal_worst)}, unequal {ms(uneq_worst)}; one plan at 15 devices: worst {tail_said} "
            f"{ms(one_worst)}, fewest {ms(few_worst)}). Shapes ({SHAPE_RULE}): one plan "
            + ", ".join(f"{name} {s}" for name, s in one_shapes.items())
            + "; one plan, fewest "
            + ", ".join(f"{name} {s}" for name, s in few_shapes.items())
            + "; formations "
            + ", ".join(f"{name} {s}" for name, s in form_shapes.items())
            + "; formations on unequal nodes "
            + ", ".join(f"{name} {s}" for name, s in uneq_shapes.items())
            + ".",
        ]
    )
    print(body)
    if args.write is not None:
        write_section(args.write, SECTION, body)


if __name__ == "__main__":
    main()
