"""Choosing the split: whole layers in proportion to memory left after fixed costs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from orchestrator.core.errors import PlanError
from orchestrator.core.search import first_true
from orchestrator.planning.architectures import unverified_note
from orchestrator.planning.memory import estimate_compute, kv_layer_bytes, predict, validate
from orchestrator.planning.placement import (
    largest_remainder,
    llama_cpp_assignment,
    pad_ctx,
    resolve_n_gpu_layers,
)
from orchestrator.planning.plan import (
    CTX_PAD,
    MAX_CTX,
    SCHEMA_VERSION,
    Fit,
    Plan,
    PlanDevice,
    PlannedDevice,
    PlanOptions,
)
from orchestrator.planning.profile import ModelProfile


def _counts_of(assignment: Sequence[int | None], n_devices: int) -> list[int]:
    counts = [0] * n_devices
    for dev in assignment:
        if dev is not None:
            counts[dev] += 1
    return counts


def _assignment_from_counts(counts: Sequence[int], n_layer: int, ngl: int) -> list[int | None]:
    start = n_layer + 1 - ngl
    out: list[int | None] = [None] * start
    for dev, c in enumerate(counts):
        out += [dev] * c
    return out


def _fewest_counts(
    profile: ModelProfile, devices: Sequence[PlanDevice], n_ctx_pad: int, opts: PlanOptions, ngl: int
) -> list[int]:
    """Fill devices in order with as many layers as fit (weights + KV + compute + margin)."""
    n_all = profile.n_layer
    start = n_all + 1 - ngl

    def fill(pipeline: bool) -> list[int]:
        counts = [0] * len(devices)
        il = start
        for di, dev in enumerate(devices):
            budget = dev.usable - opts.margin
            layers: list[int] = []
            while il <= n_all:
                trial = [*layers, il]
                w = sum(profile.layer_bytes_aligned(x, dev.alignment) for x in trial if x < n_all)
                if n_all in trial:
                    w += profile.output_layer_bytes_aligned(dev.alignment)
                kv = sum(
                    kv_layer_bytes(profile, x, n_ctx_pad, opts, dev.alignment) for x in trial if x < n_all
                )
                c = estimate_compute(profile, trial, n_ctx_pad, opts, pipeline_parallel=pipeline)
                if w + kv + c > budget:
                    break
                layers = trial
                il += 1
            counts[di] = len(layers)
            if il > n_all:
                break
        if il <= n_all:
            # Not everything fits: the rest goes to the last device so the verdict shows the shortfall.
            counts[-1] += n_all + 1 - il
        return counts

    # The compute estimate depends on pipeline parallelism, which more than one used device turns on
    # (with everything offloaded). Filling under that assumption is valid either way: if it ends up
    # on one device, pipeline parallelism is off and that device needs less.
    counts = fill(pipeline=False)
    if sum(1 for c in counts if c) > 1 and ngl > n_all:
        counts = fill(pipeline=True)
    return counts


PROPORTIONAL_ROUNDS = 4  # re-splits after today's; the counts settle after one or two in practice


@dataclass(frozen=True)
class SplitCandidate:
    """One split the proportional strategy considers: layer counts per device (0 = left out), the
    weights they are in proportion to, and the smallest headroom of the plan they make."""

    counts: tuple[int, ...]
    weights: tuple[int, ...]
    min_headroom: int


def _fixed_costs(
    profile: ModelProfile,
    devices: Sequence[PlanDevice],
    counts: Sequence[int],
    n_ctx_pad: int,
    opts: PlanOptions,
    ngl: int,
) -> tuple[int, list[int]]:
    """Predict `counts` as the plan would run them (devices without layers left out): the smallest
    headroom and, per device, its fixed costs (compute buffer + output layer; 0 for a device left out)."""
    kept = [i for i, c in enumerate(counts) if c > 0]
    devs = [devices[i] for i in kept]
    assignment = _assignment_from_counts([counts[i] for i in kept], profile.n_layer, ngl)
    pred = predict(profile, devs, assignment, n_ctx_pad, opts, ngl)
    fixed = [0] * len(devices)
    for j, i in enumerate(kept):
        output = assignment[-1] == j  # the last entry is the output layer
        fixed[i] = pred.memories[j].compute + (
            profile.output_layer_bytes_aligned(devices[i].alignment) if output else 0
        )
    return min((m.headroom for m in pred.memories), default=0), fixed


def proportional_candidates(
    profile: ModelProfile, devices: Sequence[PlanDevice], n_ctx_pad: int, opts: PlanOptions, ngl: int
) -> list[SplitCandidate]:
    """The splits the proportional strategy considers, in order; `make_plan` takes the one with the
    largest smallest headroom (the first on ties).

    The first is today's split, by usable - margin. Each next one is in proportion to the memory each
    device has for layers (weights + KV): usable - margin minus the fixed costs the previous split's
    prediction gives it (its compute buffer and, on the last device, the output layer), which it pays
    whatever its share. A device left without layers stays out (weight 0): rejoining would cost it its
    compute buffer. Stops when the counts repeat or after PROPORTIONAL_ROUNDS re-splits.
    """
    weights = [max(d.usable - opts.margin, 0) for d in devices]
    counts = largest_remainder(ngl, weights)
    score, fixed = _fixed_costs(profile, devices, counts, n_ctx_pad, opts, ngl) if ngl else (0, [])
    out = [SplitCandidate(tuple(counts), tuple(weights), score)]
    if ngl == 0 or len(devices) < 2:
        return out
    for _ in range(PROPORTIONAL_ROUNDS):
        weights = [
            max(d.usable - opts.margin - f, 0) if c else 0
            for d, f, c in zip(devices, fixed, counts, strict=True)
        ]
        if not any(weights):
            break
        counts = largest_remainder(ngl, weights)
        if any(tuple(counts) == c.counts for c in out):
            break
        score, fixed = _fixed_costs(profile, devices, counts, n_ctx_pad, opts, ngl)
        out.append(SplitCandidate(tuple(counts), tuple(weights), score))
    return out


def _largest_ctx(
    profile: ModelProfile,
    devices: Sequence[PlanDevice],
    assignment: Sequence[int | None],
    opts: PlanOptions,
    ngl: int,
    start: int,
) -> int:
    """The largest context (a multiple of CTX_PAD) that fits with this placement, 0 when none does.
    Up to `opts.n_ctx_cap` when set; otherwise the real largest, past the training context too:
    doubling from `start` until it no longer fits (at most MAX_CTX), then bisecting."""

    def fits(units: int) -> bool:
        pred = predict(profile, devices, assignment, units * CTX_PAD, opts, ngl)
        return all(m.headroom >= 0 for m in pred.memories)

    if not fits(1):
        return 0
    lo, limit = 1, MAX_CTX // CTX_PAD  # in units of CTX_PAD: lo fits, hi does not
    hi = max((opts.n_ctx_cap or start) // CTX_PAD, 1)
    if fits(hi):
        if opts.n_ctx_cap is not None:
            return hi * CTX_PAD
        while True:
            lo = hi
            if hi >= limit:
                return hi * CTX_PAD
            hi = min(hi * 2, limit)
            if not fits(hi):
                break
    return (first_true(lambda units: not fits(units), lo, hi) - 1) * CTX_PAD


def make_plan(
    devices: Sequence[PlanDevice], profile: ModelProfile, options: PlanOptions | None = None
) -> Plan:
    """Decide layers per device, predict memory and give a fit verdict. `devices` are already ordered
    (see `order_devices`).

    "proportional" weighs each device by usable - margin - (compute buffer + output layer), the fixed
    costs predicted for the previous split, starting from the split by usable - margin; the candidate
    with the largest smallest headroom wins. "fewest" fills devices in order; a given `tensor_split` is
    used as is."""
    opts = options or PlanOptions()
    devices = tuple(devices)
    validate(devices, profile, opts)
    for il in range(profile.n_layer):  # row_bytes raises on row widths a quantized cache cannot take
        kv_layer_bytes(profile, il, CTX_PAD, opts, 1)
    n_all = profile.n_layer
    ngl = resolve_n_gpu_layers(opts.n_gpu_layers, n_all) if devices else 0
    n_ctx = pad_ctx(opts.n_ctx or profile.n_ctx_train)
    notes: list[str] = [n for n in (unverified_note(profile.rules),) if n]  # never silently

    if opts.tensor_split is not None:
        split = tuple(float(x) for x in opts.tensor_split)
        if ngl == 0:
            assignment: list[int | None] = [None] * (n_all + 1)
        else:
            assignment = llama_cpp_assignment(split, n_all, ngl)
        counts = _counts_of(assignment, len(devices))
    else:
        if opts.strategy == "fewest":
            counts = _fewest_counts(profile, devices, n_ctx, opts, ngl) if devices else []
        else:
            weights = [max(d.usable - opts.margin, 0) for d in devices]
            if ngl and not any(weights):
                raise PlanError(
                    "no device has usable memory beyond the margin",
                    hint=f"lower the margin (now {opts.margin} bytes) or add devices",
                )
            candidates = proportional_candidates(profile, devices, n_ctx, opts, ngl)
            counts = list(max(candidates, key=lambda c: c.min_headroom).counts)  # first on ties
        # A device without layers still joins the model (a connection, and it turns pipeline
        # parallelism on): leave it out.
        unused = [d.label for d, c in zip(devices, counts, strict=True) if c == 0]
        if unused and ngl:
            notes.append("devices without layers left out: " + ", ".join(unused))
            kept = [i for i, c in enumerate(counts) if c > 0]
            devices = tuple(devices[i] for i in kept)
            counts = [counts[i] for i in kept]
        split = tuple(float(c) for c in counts)
        assignment = _assignment_from_counts(counts, n_all, ngl)
        if devices and ngl:
            ported = llama_cpp_assignment(split, n_all, ngl)
            if ported != assignment:
                raise PlanError(
                    f"internal error: tensor_split {list(split)} does not reproduce the intended layer "
                    f"counts {counts} in llama.cpp's arithmetic"
                )
    if not devices:
        split = ()
    main_gpu = opts.main_gpu if devices else 0

    pred = predict(profile, devices, assignment, n_ctx, opts, ngl)
    layers_of: list[list[int]] = [[] for _ in devices]
    for il, dev in enumerate(assignment):
        if dev is not None:
            layers_of[dev].append(il)
    planned = tuple(
        PlannedDevice(
            endpoint=d.endpoint,
            index=d.index,
            name=d.name,
            description=d.description,
            layers=tuple(layers_of[i]),
            memory=pred.memories[i],
            has_output=n_all in layers_of[i],
        )
        for i, d in enumerate(devices)
    )
    if planned:
        binding = min(range(len(planned)), key=lambda i: (planned[i].memory.headroom, i))
        shortfall = max(0, -planned[binding].memory.headroom)
    else:
        binding, shortfall = None, 0
    start = max(profile.n_ctx_train, n_ctx, CTX_PAD)
    largest = _largest_ctx(profile, devices, assignment, opts, ngl, start) if devices else start
    if opts.n_ctx > profile.n_ctx_train > 0:
        notes.append(
            f"n_ctx {opts.n_ctx} exceeds the model's training context ({profile.n_ctx_train}): "
            "output past it may degrade"
        )
    if ngl < n_all + 1:
        notes.append(f"{n_all + 1 - ngl} of {n_all + 1} layers stay on the CPU")
    fit = Fit(fits=shortfall == 0, binding_device=binding, shortfall=shortfall, largest_n_ctx=largest)
    return Plan(
        schema_version=SCHEMA_VERSION,
        model_path=str(profile.path),
        model_name=profile.name,
        n_layer=n_all,
        devices=planned,
        tensor_split=split,
        n_gpu_layers=ngl,
        split_mode="layer",
        main_gpu=main_gpu,
        n_ctx=n_ctx,
        pipeline_parallel=pred.pipeline_parallel,
        host=pred.host,
        fit=fit,
        options=replace(
            opts, tensor_split=tuple(opts.tensor_split) if opts.tensor_split is not None else None
        ),
        notes=tuple(notes),
    )
