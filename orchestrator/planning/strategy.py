"""Choosing the split: whole layers in proportion to memory left after fixed costs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from orchestrator.core.errors import PlanError
from orchestrator.core.units import format_size
from orchestrator.planning.architectures import backend_notes, unverified_note
from orchestrator.planning.draft import DraftModel, draft_note, plan_draft, target_output_rows
from orchestrator.planning.layer_assignment import (
    largest_remainder,
    llama_cpp_assignment,
    pad_ctx,
    resolve_n_gpu_layers,
)
from orchestrator.planning.memory import (
    context_size,
    estimate_compute,
    kv_cells,
    kv_layer_bytes,
    kv_streams,
    predict,
    validate,
)
from orchestrator.planning.plan import (
    CTX_PAD,
    MAX_CTX,
    SCHEMA_VERSION,
    DraftPlan,
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


@dataclass(frozen=True)
class _Split:
    devices: tuple[PlanDevice, ...]  # the devices that get layers (the others left out)
    assignment: list[int | None]  # device index (into `devices`) or None (CPU) per layer, output last
    left_out: tuple[str, ...]


def _choose_split(
    profile: ModelProfile, devices: tuple[PlanDevice, ...], n_ctx: int, opts: PlanOptions, ngl: int
) -> _Split:
    """The layers per device the strategy (or the given tensor_split) picks at context `n_ctx`."""
    n_all = profile.n_layer
    if opts.tensor_split is not None:
        split = tuple(float(x) for x in opts.tensor_split)
        if ngl == 0:
            return _Split(devices, [None] * (n_all + 1), ())
        return _Split(devices, llama_cpp_assignment(split, n_all, ngl), ())
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
    left_out: tuple[str, ...] = ()
    if ngl and any(c == 0 for c in counts):
        left_out = tuple(d.label for d, c in zip(devices, counts, strict=True) if c == 0)
        kept = [i for i, c in enumerate(counts) if c > 0]
        devices = tuple(devices[i] for i in kept)
        counts = [counts[i] for i in kept]
    assignment = _assignment_from_counts(counts, n_all, ngl)
    if devices and ngl:
        ported = llama_cpp_assignment(tuple(float(c) for c in counts), n_all, ngl)
        if ported != assignment:
            raise PlanError(
                f"internal error: tensor_split {[float(c) for c in counts]} does not reproduce the intended "
                f"layer counts {counts} in llama.cpp's arithmetic"
            )
    return _Split(devices, assignment, left_out)


def context_cap(profile: ModelProfile, n_ctx: int, opts: PlanOptions) -> int | None:
    """Where the largest-context search stops: `opts.n_ctx_cap` when given; else the model's training
    context per sequence (llama.cpp warns past it), unless the plan asks for more (rope scaling): None."""
    if opts.n_ctx_cap is not None:
        return opts.n_ctx_cap
    if profile.n_ctx_train <= 0:
        return None
    cap = context_size(profile.n_ctx_train * kv_streams(opts), opts)
    return None if n_ctx > cap else cap


def _largest_ctx(
    profile: ModelProfile,
    devices: tuple[PlanDevice, ...],
    opts: PlanOptions,
    ngl: int,
    start: int,
    cap: int | None,
    known: int = 0,
) -> int:
    """The largest context that fits, 0 when none does: a fixed point, since each context is tried as
    `make_plan` would plan it (the strategy re-splits the layers at that context), and the answer is
    one that was tried and fits. Up to `cap`; without one, doubling from `start` (at most MAX_CTX),
    then bisecting between a context that fits and one that does not. `known`: a context known to fit
    (the plan's own, when it fits), where the search may start."""

    def fits(units: int) -> bool:
        n_ctx = context_size(units * CTX_PAD, opts)
        try:
            split = _choose_split(profile, devices, n_ctx, opts, ngl)
        except PlanError:
            return False
        pred = predict(profile, split.devices, split.assignment, n_ctx, opts, ngl)
        return all(m.headroom >= 0 for m in pred.memories)

    limit = MAX_CTX // CTX_PAD  # in units of CTX_PAD: lo fits, hi does not
    lo = known // CTX_PAD if known else 0
    if cap is not None:
        hi = max(cap // CTX_PAD, 1)
        if lo == hi or fits(hi):
            return context_size(hi * CTX_PAD, opts)
    else:
        hi = max(start // CTX_PAD, 1, lo)
        if hi == lo:
            hi = min(hi * 2, limit)
        while fits(hi):
            lo = hi
            if hi >= limit:
                return context_size(hi * CTX_PAD, opts)
            hi = min(hi * 2, limit)
    if not lo:
        if not fits(1):
            return 0
        lo = 1
    while hi - lo > 1:  # not first_true: the answer must be one that fits even where fits is not monotone
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return context_size(lo * CTX_PAD, opts)


def kv_notes(profile: ModelProfile, n_ctx: int, opts: PlanOptions) -> list[str]:
    """What the plan assumes about the KV cache where llama.cpp's front ends differ: the SWA cache size
    and the sequences."""
    notes: list[str] = []
    swa = profile.swa_layer_ids
    if swa:
        cells = kv_cells(profile, swa[0], n_ctx, opts)
        which = f"{len(swa)} of {profile.n_layer} layers slide (window {profile.n_swa})"
        if opts.swa_full:
            notes.append(f"{which}: full-size SWA cache (--swa-full), {cells} cells per sequence")
        else:
            notes.append(
                f"{which}: small SWA cache, {cells} cells per sequence (llama-server's default; "
                "--swa-full for full-size)"
            )
    if opts.parallel > 1:
        if opts.kv_unified:
            notes.append(
                f"{opts.parallel} parallel sequences share one KV cache of {n_ctx} cells (--kv-unified)"
            )
        else:
            notes.append(f"{opts.parallel} parallel sequences of {n_ctx // opts.parallel} cells each")
    return notes


def _draft_on_first(
    draft: DraftModel, devices: tuple[PlanDevice, ...], n_ctx: int, opts: PlanOptions
) -> tuple[tuple[PlanDevice, ...], DraftPlan]:
    """The draft planned on the first device, and the devices with its bytes taken from that one's usable
    memory (before the target's layers are placed)."""
    if not devices:
        raise PlanError(
            "the draft model goes on the formation's first device, and there is none",
            hint="put it on this machine's CPU (--device-draft none)",
        )
    first = devices[0]
    drafted = plan_draft(draft, first, n_ctx, opts)
    return (replace(first, usable=max(0, first.usable - drafted.total)), *devices[1:]), drafted


def fits(
    devices: Sequence[PlanDevice],
    profile: ModelProfile,
    options: PlanOptions | None = None,
    draft: DraftModel | None = None,
) -> bool:
    """`make_plan(...).fit.fits` without the rest of the plan (the search for the largest context, eight
    trial splits or more): the verdict that choosing formations asks of many groups of nodes. With a
    draft model, the whole plan's verdict (the draft changes the devices and the host's share)."""
    if draft is not None:
        try:
            return make_plan(devices, profile, options, draft).fit.fits
        except PlanError:
            return False
    opts = options or PlanOptions()
    all_devices = tuple(devices)
    try:
        validate(all_devices, profile, opts)
        for il in range(profile.n_layer):
            kv_layer_bytes(profile, il, CTX_PAD, opts, 1)
        ngl = resolve_n_gpu_layers(opts.n_gpu_layers, profile.n_layer) if all_devices else 0
        n_ctx = context_size(pad_ctx(opts.n_ctx or profile.n_ctx_train), opts)
        chosen = _choose_split(profile, all_devices, n_ctx, opts, ngl)
    except PlanError:
        return False
    pred = predict(profile, chosen.devices, chosen.assignment, n_ctx, opts, ngl)
    return all(m.headroom >= 0 for m in pred.memories)


def make_plan(
    devices: Sequence[PlanDevice],
    profile: ModelProfile,
    options: PlanOptions | None = None,
    draft: DraftModel | None = None,
) -> Plan:
    """Decide layers per device, predict memory and give a fit verdict. `devices` are already ordered
    (see `order_devices`).

    "proportional" weighs each device by usable - margin - (compute buffer + output layer), the fixed
    costs predicted for the previous split, starting from the split by usable - margin; the candidate
    with the largest smallest headroom wins. "fewest" fills devices in order; a given `tensor_split` is
    used as is.

    With a `draft` model (speculative decoding, `planning.draft`): on the first device, its weights, KV
    and compute are taken from that device's usable memory before the layers are placed (at the plan's
    context: the largest-context search keeps that figure); on this machine's CPU, the host's total
    (target and draft) is checked against `draft.host_available` when known."""
    opts = options or PlanOptions()
    if draft is not None:  # only llama-server drafts: its logits rows, the target's outputs per ubatch
        opts = replace(opts, n_outputs_max=target_output_rows(opts, draft.n_max))
    all_devices = tuple(devices)
    validate(all_devices, profile, opts)
    for il in range(profile.n_layer):  # row_bytes raises on row widths a quantized cache cannot take
        kv_layer_bytes(profile, il, CTX_PAD, opts, 1)
    n_all = profile.n_layer
    ngl = resolve_n_gpu_layers(opts.n_gpu_layers, n_all) if all_devices else 0
    n_ctx = context_size(pad_ctx(opts.n_ctx or profile.n_ctx_train), opts)
    notes: list[str] = [n for n in (unverified_note(profile.rules),) if n]  # never silently
    notes += backend_notes(profile.rules, [d.backend for d in all_devices])
    drafted: DraftPlan | None = None
    if draft is not None and draft.device == "first":
        all_devices, drafted = _draft_on_first(draft, all_devices, n_ctx, opts)
    elif draft is not None:
        drafted = plan_draft(draft, None, n_ctx, opts)
    chosen = _choose_split(profile, all_devices, n_ctx, opts, ngl)
    devices = chosen.devices
    assignment = chosen.assignment
    if drafted is not None and drafted.device == "first" and devices[:1] != all_devices[:1]:
        raise PlanError(
            f"the draft model's device {all_devices[0].label} is left without layers of the target "
            f"(the draft takes {format_size(drafted.total)} of it)",
            hint="put the draft on this machine's CPU (--device-draft none), or add memory",
        )
    if chosen.left_out:
        notes.append("devices without layers left out: " + ", ".join(chosen.left_out))
    if opts.tensor_split is not None:
        split = tuple(float(x) for x in opts.tensor_split)
    else:
        split = tuple(float(c) for c in _counts_of(assignment, len(devices)))
    if not devices:
        split = ()
    main_gpu = opts.main_gpu if devices else 0

    pred = predict(profile, devices, assignment, n_ctx, opts, ngl)
    host = pred.host
    if drafted is not None:  # the target verifies each drafted token: one more logits row for each
        host = replace(host, output=profile.n_vocab * target_output_rows(opts, drafted.n_max) * 4)
        notes.append(draft_note(drafted, devices[0].label if devices else None))
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
    if drafted is not None and drafted.device == "none" and draft is not None and draft.host_available:
        # this machine holds the target's host part and the whole draft: its available memory bounds them
        host_need = host.total + drafted.total + opts.margin
        if host_need > draft.host_available and shortfall == 0:
            binding, shortfall = None, host_need - draft.host_available
            notes.append(
                f"this machine needs {format_size(host.total + drafted.total)} (the target's host part and "
                f"the draft) plus a margin of {format_size(opts.margin)} but has "
                f"{format_size(draft.host_available)} available"
            )
    cap = context_cap(profile, n_ctx, opts)
    start = max(profile.n_ctx_train, n_ctx, CTX_PAD)
    known = n_ctx if shortfall == 0 and n_ctx % CTX_PAD == 0 else 0
    largest = (
        _largest_ctx(profile, all_devices, opts, ngl, start, cap, known) if all_devices else (cap or start)
    )
    n_ctx_seq = n_ctx // kv_streams(opts)
    if n_ctx_seq > profile.n_ctx_train > 0:
        notes.append(
            f"n_ctx {n_ctx_seq} per sequence exceeds the model's training context ({profile.n_ctx_train}): "
            "output past it may degrade"
        )
    if ngl < n_all + 1:
        notes.append(f"{n_all + 1 - ngl} of {n_all + 1} layers stay on the CPU")
    if opts.n_cpu_moe:
        moved = sum(profile.expert_bytes_aligned(il) for il in range(min(opts.n_cpu_moe, n_all)))
        notes.append(
            f"--n-cpu-moe {opts.n_cpu_moe}: the experts of layers 0-{min(opts.n_cpu_moe, n_all) - 1} "
            f"({format_size(moved)}) stay on the CPU; no pipeline parallelism"
        )
    notes += kv_notes(profile, n_ctx, opts)
    fit = Fit(
        fits=shortfall == 0,
        binding_device=binding,
        shortfall=shortfall,
        largest_n_ctx=largest,
        ctx_cap=cap or 0,
    )
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
        host=host,
        fit=fit,
        options=replace(
            opts, tensor_split=tuple(opts.tensor_split) if opts.tensor_split is not None else None
        ),
        notes=tuple(notes),
        draft=drafted,
    )
