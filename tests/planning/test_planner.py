"""The pure planner: llama.cpp's layer arithmetic, proportional/fewest placement, memory, fit, renderers."""

from __future__ import annotations

import ast
import bisect
import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.core.errors import ModelError, PlanError
from orchestrator.planning.formats import cli_device_names, llama_cli_args, python_snippet
from orchestrator.planning.layer_assignment import (
    largest_remainder,
    llama_cpp_assignment,
    order_devices,
    pad_ctx,
)
from orchestrator.planning.memory import context_size, estimate_compute, kv_cells, kv_streams
from orchestrator.planning.plan import (
    DEFAULT_MARGIN,
    SCHEMA_VERSION,
    Plan,
    PlanDevice,
    PlannedDevice,
    PlanOptions,
)
from orchestrator.planning.profile import ModelProfile, TensorInfo, profile_model, swa_layers_of
from orchestrator.planning.strategy import make_plan, proportional_candidates

GiB = 1024**3
MiB = 1024**2


def rpc(endpoint: str, index: int = 0, usable: int = GiB, **kw: object) -> PlanDevice:
    return PlanDevice(endpoint, index, f"RPC-{endpoint}-{index}", usable=usable, **kw)  # type: ignore[arg-type]


def gpu(name: str, usable: int = GiB) -> PlanDevice:
    return PlanDevice(None, int(name[-1]), name, usable=usable, alignment=128)


def synthetic_profile(
    n_layer: int,
    *,
    n_embd: int = 256,
    n_head: int = 4,
    n_head_kv: int = 4,
    n_ff: int = 512,
    n_vocab: int = 300,
) -> ModelProfile:
    """A profile with the tensor table write_tiny_llama would produce (f16 matrices, f32 norms)."""
    hd = n_embd // n_head
    tensors = [TensorInfo("token_embd.weight", "F16", (n_embd, n_vocab), n_embd * n_vocab * 2)]
    for il in range(n_layer):
        for name, shape in (
            ("attn_q", (n_embd, n_head * hd)),
            ("attn_k", (n_embd, n_head_kv * hd)),
            ("attn_v", (n_embd, n_head_kv * hd)),
            ("attn_output", (n_head * hd, n_embd)),
            ("ffn_gate", (n_embd, n_ff)),
            ("ffn_up", (n_embd, n_ff)),
            ("ffn_down", (n_ff, n_embd)),
        ):
            tensors.append(TensorInfo(f"blk.{il}.{name}.weight", "F16", shape, shape[0] * shape[1] * 2))
        for name in ("attn_norm", "ffn_norm"):
            tensors.append(TensorInfo(f"blk.{il}.{name}.weight", "F32", (n_embd,), n_embd * 4))
    tensors += [
        TensorInfo("output_norm.weight", "F32", (n_embd,), n_embd * 4),
        TensorInfo("output.weight", "F16", (n_embd, n_vocab), n_embd * n_vocab * 2),
    ]
    layer = sum(t.n_bytes for t in tensors if t.name.startswith("blk.0."))
    return ModelProfile(
        paths=(Path(f"/models/synthetic-{n_layer}.gguf"),),
        architecture="llama",
        name=f"synthetic-{n_layer}",
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=(n_head,) * n_layer,
        n_head_kv=(n_head_kv,) * n_layer,
        head_dim_k=hd,
        head_dim_v=hd,
        n_ctx_train=4096,
        n_vocab=n_vocab,
        layer_bytes=(layer,) * n_layer,
        token_embd_bytes=n_embd * n_vocab * 2,
        output_bytes=n_embd * n_vocab * 2,
        output_norm_bytes=n_embd * 4,
        output_tied=False,
        rope_freqs_bytes=0,
        other_bytes=0,
        total_bytes=sum(t.n_bytes for t in tensors),
        file_size=0,
        tensors=tuple(tensors),
    )


# ---------------------------------------------------------------------------------------------- port


def test_assignment_facts_doc_example() -> None:
    # [1,1] on a 4-layer model: layers 0-2 on device 0, layer 3 and the output layer on device 1.
    assert llama_cpp_assignment([1, 1], 4, -1) == [0, 0, 0, 1, 1]
    assert llama_cpp_assignment([1.0, 1.0], 4, 99) == [0, 0, 0, 1, 1]


def test_assignment_hand_worked_cases() -> None:
    # Whole-layer counts as the split give exactly those counts.
    assert llama_cpp_assignment([3, 2], 4, -1) == [0, 0, 0, 1, 1]
    assert llama_cpp_assignment([1, 4], 4, -1) == [0, 1, 1, 1, 1]
    assert llama_cpp_assignment([2, 0, 3], 4, -1) == [0, 0, 2, 2, 2]
    assert llama_cpp_assignment([0, 5], 4, -1) == [1, 1, 1, 1, 1]
    assert llama_cpp_assignment([5, 0], 4, -1) == [0, 0, 0, 0, 0]
    # Partial offload keeps the first layers on the CPU: ngl 2 of 5 -> start 3; 0/2 -> dev 0, 1/2 -> dev 1.
    assert llama_cpp_assignment([1, 1], 4, 2) == [None, None, None, 0, 1]
    assert llama_cpp_assignment([1, 1], 4, 0) == [None] * 5
    assert llama_cpp_assignment([], 4, -1) == [None] * 5  # no devices: everything on the CPU
    # Proportions, not counts: [3, 1] over 5 layers: cum [0.75, 1]; 0, .2, .4, .6 < .75 -> dev 0.
    assert llama_cpp_assignment([3, 1], 4, -1) == [0, 0, 0, 0, 1]


def test_assignment_uses_float32_like_llama_cpp() -> None:
    # [0.1, 0.7] over 40 layers. In float32, 0.1f / (0.1f + 0.7f) rounds to exactly 0.125, and layer 5
    # (5/40 = 0.125) is not below it: upper_bound puts it on device 1, so device 0 gets 5 layers.
    # In double, 0.1 / 0.7999999999999999 = 0.12500000000000003 and device 0 would get 6.
    got = llama_cpp_assignment([0.1, 0.7], 39, -1)
    assert got.count(0) == 5 and got.count(1) == 35
    cum = [0.1 / (0.1 + 0.7), 1.0]
    double = [bisect.bisect_right(cum, il / 40) for il in range(40)]
    assert double.count(0) == 6  # the arithmetic the port must not use


def test_assignment_refuses_all_zero_split() -> None:
    with pytest.raises(PlanError, match="all-zero"):
        llama_cpp_assignment([0, 0], 4, -1)


@given(
    n_layer=st.integers(1, 200),
    counts_seed=st.lists(st.integers(0, 50), min_size=1, max_size=16),
    ngl_delta=st.integers(0, 3),
)
def test_integer_counts_are_reproduced_exactly(n_layer: int, counts_seed: list[int], ngl_delta: int) -> None:
    ngl = max(n_layer + 1 - ngl_delta, 1)
    counts = largest_remainder(ngl, [c + 1 for c in counts_seed])
    got = llama_cpp_assignment([float(c) for c in counts], n_layer, ngl)
    assert got[: n_layer + 1 - ngl] == [None] * (n_layer + 1 - ngl)
    assert [got.count(i) for i in range(len(counts))] == counts
    devices = [d for d in got if d is not None]
    assert devices == sorted(devices)  # contiguous, in device order


# ---------------------------------------------------------------------------------------- placement


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_layer=st.integers(1, 96),
    # Small enough that the fixed costs (compute buffer, output layer up to 32 MiB) move the split.
    usable_mib=st.lists(st.integers(16, 3000), min_size=1, max_size=8),
    ngl=st.integers(-1, 100),
    n_vocab=st.integers(300, 32000),
)
def test_proportional_properties(n_layer: int, usable_mib: list[int], ngl: int, n_vocab: int) -> None:
    profile = synthetic_profile(n_layer, n_vocab=n_vocab)
    devices = [rpc(f"10.0.0.{i}:50052", usable=u * MiB) for i, u in enumerate(usable_mib)]
    opts = PlanOptions(n_ctx=512, n_gpu_layers=ngl, margin=0)
    plan = make_plan(devices, profile, opts)
    n_off = n_layer + 1 if ngl < 0 else min(ngl, n_layer + 1)
    assert plan.n_gpu_layers == n_off
    assert sum(plan.layer_counts) == n_off
    if n_off:
        assert all(c > 0 for c in plan.layer_counts)  # devices without a layer are left out
    else:
        assert plan.layer_counts == (0,) * len(devices) and plan.tensor_split == (0.0,) * len(devices)
    # Each device is within one layer of its share of the memory it has for layers: usable - margin minus
    # the fixed costs (compute buffer, the output layer on the last device) predicted for the split it
    # was derived from. The splits considered start with today's (by usable - margin alone); the plan is
    # the one with the largest smallest headroom.
    candidates = proportional_candidates(profile, devices, pad_ctx(512), opts, n_off)
    assert candidates[0].counts == tuple(largest_remainder(n_off, usable_mib))
    assert candidates[0].weights == tuple(d.usable for d in devices)
    for k in range(1, len(candidates)):
        prev, cand = candidates[k - 1], candidates[k]
        # The fixed costs as make_plan predicts them when running prev's split.
        ran = run_counts(devices, profile, opts, prev.counts)
        fixed = [
            ran[d.endpoint].memory.compute
            + (profile.output_layer_bytes_aligned(d.alignment) if ran[d.endpoint].has_output else 0)
            if d.endpoint in ran
            else 0
            for d in devices
        ]
        assert cand.weights == tuple(
            max(d.usable - f, 0) if c else 0 for d, f, c in zip(devices, fixed, prev.counts, strict=True)
        )
        assert cand.counts not in [c.counts for c in candidates[:k]]  # stops when the counts repeat
    for cand in candidates:
        if n_off:
            ran = run_counts(devices, profile, opts, cand.counts)
            assert cand.min_headroom == min(d.memory.headroom for d in ran.values())
    chosen = max(candidates, key=lambda c: c.min_headroom)
    assert all(c.min_headroom < chosen.min_headroom for c in candidates[: candidates.index(chosen)])
    by_endpoint = {d.endpoint: d for d in plan.devices}
    counts = [by_endpoint[d.endpoint].n_layers if d.endpoint in by_endpoint else 0 for d in devices]
    assert tuple(counts) == chosen.counts
    for count, w in zip(counts, chosen.weights, strict=True):
        assert abs(count - n_off * w / sum(chosen.weights)) < 1  # within one layer of the exact share
    if n_off:
        # Never worse than today's split.
        assert min(d.memory.headroom for d in plan.devices) >= candidates[0].min_headroom
    # The plan's tensor_split reproduces its layers through llama.cpp's arithmetic.
    ported = llama_cpp_assignment(plan.tensor_split, n_layer, plan.n_gpu_layers)
    for i, d in enumerate(plan.devices):
        assert [il for il, dev in enumerate(ported) if dev == i] == list(d.layers)
    # The output layer is the last one: offloaded whenever anything is.
    assert sum(1 for d in plan.devices if d.has_output) == (1 if n_off else 0)
    if n_off:
        assert plan.devices[-1].has_output and plan.devices[-1].layers[-1] == n_layer


def run_counts(
    devices: list[PlanDevice], profile: ModelProfile, opts: PlanOptions, counts: tuple[int, ...]
) -> dict[str | None, PlannedDevice]:
    """The plan's devices when `counts` is given as tensor_split (devices without layers left out)."""
    kept = [(d, c) for d, c in zip(devices, counts, strict=True) if c]
    plan = make_plan(
        [d for d, _ in kept], profile, replace(opts, tensor_split=tuple(float(c) for _, c in kept))
    )
    return {d.endpoint: d for d in plan.devices}


def test_proportional_split_leaves_room_for_fixed_costs() -> None:
    # A 400 MiB device next to a 2 GiB one. By usable - margin alone (today's split) the small one gets
    # 2 of 33 layers and then pays its 115 MiB compute buffer on top: 4 MiB short. Weighing the memory
    # each has for layers (the compute buffers and the output layer taken off) gives it 1 layer.
    profile = synthetic_profile(32, n_embd=512, n_head=8, n_head_kv=8, n_ff=2048, n_vocab=32000)
    devices = [rpc("10.0.0.1:50052", usable=400 * MiB), rpc("10.0.0.2:50052", usable=2 * GiB)]
    opts = PlanOptions(n_ctx=4096)
    today = largest_remainder(33, [d.usable - DEFAULT_MARGIN for d in devices])
    assert today == [2, 31]
    old = make_plan(devices, profile, replace(opts, tensor_split=(2.0, 31.0)))
    assert not old.fit.fits and old.fit.binding_device == 0
    assert old.devices[0].memory.compute > 100 * MiB
    plan = make_plan(devices, profile, opts)
    assert plan.layer_counts == (1, 32)
    assert plan.fit.fits and plan.fit.shortfall == 0
    assert plan.fit.binding_device is not None
    assert plan.devices[plan.fit.binding_device].memory.headroom >= 0
    assert llama_cpp_assignment(plan.tensor_split, 32, plan.n_gpu_layers) == [0] + [1] * 32


@settings(max_examples=60, deadline=None)
@given(
    n_layer=st.integers(1, 40),
    usable_mib=st.lists(st.integers(20, 400), min_size=1, max_size=4),
    scale=st.integers(2, 4),
)
def test_largest_ctx_is_the_boundary_and_grows_with_memory(
    n_layer: int, usable_mib: list[int], scale: int
) -> None:
    profile = synthetic_profile(n_layer, n_embd=128, n_head=2, n_head_kv=1, n_ff=256)
    devices = [rpc(f"10.0.0.{i}:50052", usable=u * MiB) for i, u in enumerate(usable_mib)]
    opts = PlanOptions(n_ctx=256, margin=0, n_ctx_cap=65536)
    plan = make_plan(devices, profile, opts)
    largest = plan.fit.largest_n_ctx
    assert largest % 256 == 0 and 0 <= largest <= 65536
    if largest:  # a fixed point: planned at the largest context it offers, the plan fits
        assert make_plan(devices, profile, replace(opts, n_ctx=largest)).fit.fits
    fixed = replace(opts, tensor_split=plan.tensor_split)  # same placement, other contexts
    kept = plan_devices(plan, devices)
    pinned = make_plan(kept, profile, fixed).fit.largest_n_ctx
    if pinned:
        assert make_plan(kept, profile, replace(fixed, n_ctx=pinned)).fit.fits
    if pinned < 65536:
        assert not make_plan(kept, profile, replace(fixed, n_ctx=pinned + 256)).fit.fits
    # More memory, same placement (pinned: the default split weighs fixed costs, which do not scale).
    bigger = [replace(d, usable=d.usable * scale) for d in kept]
    plan2 = make_plan(bigger, profile, fixed)
    assert plan2.layer_counts == plan.layer_counts
    assert plan2.fit.largest_n_ctx >= pinned


def plan_devices(plan: Plan, devices: list[PlanDevice]) -> list[PlanDevice]:
    kept = {(d.endpoint, d.index) for d in plan.devices}
    return [d for d in devices if (d.endpoint, d.index) in kept]


def test_fewest_fills_in_order(tiny_model: Path, tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    profile = profile_model(tiny_model)
    devices = [rpc("10.0.0.1:50052", usable=4 * GiB), rpc("10.0.0.2:50052", usable=4 * GiB)]
    plan = make_plan(devices, profile, PlanOptions(strategy="fewest", margin=0))
    assert plan.layer_counts == (5,)  # everything fits on the first device
    assert [d.endpoint for d in plan.devices] == ["10.0.0.1:50052"]
    assert not plan.pipeline_parallel and plan.fit.fits
    assert "left out: 10.0.0.2:50052#0" in plan.notes[0]
    # A 12-layer model that does not fit on the first device: it takes as many layers as fit (4, with
    # room for 4.5 next to the pipeline-parallel compute buffer), the next device takes the rest.
    profile = profile_model(tiny_model_factory(n_layer=12))
    opts = PlanOptions(n_ctx=512, margin=0, strategy="fewest")
    compute = estimate_compute(profile, [0, 1], 512, opts, pipeline_parallel=True)
    per_layer = profile.layer_bytes[0] + 512 * profile.kv_bytes_per_token(0)
    small = rpc("10.0.0.1:50052", usable=compute + 4 * per_layer + per_layer // 2)
    plan = make_plan([small, devices[1]], profile, opts)
    assert plan.layer_counts == (4, 9)
    assert plan.pipeline_parallel and plan.fit.fits
    assert plan.devices[0].memory.total <= small.usable
    # One more layer would not have fitted on the first device.
    more = make_plan([small, devices[1]], profile, replace(opts, tensor_split=(5, 8)))
    assert not more.fit.fits and more.fit.binding_device == 0


# ------------------------------------------------------------------------------------------- memory


def test_memory_prediction_to_the_byte(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    profile = profile_model(tiny_model_factory(n_head=8, n_head_kv=2))
    devices = [rpc("127.0.0.1:50052"), rpc("127.0.0.1:50053")]
    plan = make_plan(devices, profile, PlanOptions(n_ctx=1000, tensor_split=(1, 1), margin=0))
    assert plan.n_ctx == 1024 == pad_ctx(1000)
    d0, d1 = plan.devices
    assert d0.layers == (0, 1, 2) and d1.layers == (3, 4) and d1.has_output and not d0.has_output
    assert d0.memory.weights == sum(profile.layer_bytes[:3])
    assert d1.memory.weights == profile.layer_bytes[3] + profile.output_bytes + profile.output_norm_bytes
    # KV: n_ctx_pad cells x (K + V rows), f16; n_embd_k_gqa = 2 heads x 32.
    assert d0.memory.kv == 1024 * 3 * (64 * 2 + 64 * 2)
    assert d1.memory.kv == 1024 * 1 * (64 * 2 + 64 * 2)
    assert plan.pipeline_parallel  # two devices, everything offloaded
    # token_embd stays on the host
    assert plan.host.weights == profile.token_embd_bytes and plan.host.kv == 0
    q8 = make_plan(
        devices,
        profile,
        PlanOptions(n_ctx=1000, tensor_split=(1, 1), type_k="q8_0", type_v="q8_0", flash_attn=True),
    )
    assert q8.devices[0].memory.kv == 1024 * 3 * 2 * (64 // 32 * 34)


def test_tied_output_puts_a_copy_of_token_embd_on_the_output_device(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    profile = profile_model(tiny_model_factory(tied_output=True))
    plan = make_plan([rpc("127.0.0.1:50052")], profile, PlanOptions(margin=0))
    (d,) = plan.devices
    assert d.memory.weights == sum(profile.layer_bytes) + profile.token_embd_bytes + profile.output_norm_bytes
    assert plan.host.weights == profile.token_embd_bytes  # the original stays on the host


def test_partial_offload_keeps_first_layers_on_the_host(tiny_model: Path) -> None:
    profile = profile_model(tiny_model)
    plan = make_plan([rpc("127.0.0.1:50052")], profile, PlanOptions(n_gpu_layers=2, n_ctx=512, margin=0))
    (d,) = plan.devices
    assert d.layers == (3, 4) and d.has_output
    assert not plan.pipeline_parallel
    assert plan.host.weights == profile.token_embd_bytes + sum(profile.layer_bytes[:3])
    assert plan.host.kv == 512 * 3 * profile.kv_bytes_per_token(0)
    assert "3 of 5 layers stay on the CPU" in plan.notes
    cpu_only = make_plan([], profile, PlanOptions(n_gpu_layers=0, n_ctx=512))
    assert cpu_only.devices == () and cpu_only.n_gpu_layers == 0 and cpu_only.fit.fits
    assert cpu_only.host.weights == profile.total_bytes
    assert llama_cli_args(cpu_only)[2:4] == ["--device", "none"]


def test_alignment_pads_each_tensor(tiny_model: Path) -> None:
    profile = profile_model(tiny_model)
    cuda = PlanDevice(None, 0, "CUDA0", usable=GiB, alignment=4096)
    plan = make_plan([cuda], profile, PlanOptions(margin=0))
    expected = sum(-(-t.n_bytes // 4096) * 4096 for t in profile.tensors if t.name != "token_embd.weight")
    assert plan.devices[0].memory.weights == expected


def test_compute_estimate_matches_measured_scale() -> None:
    # Measured with llama.cpp 0.3.36 (two loopback RPC servers): n_embd 512, 8 heads, n_ff 2048, 4 layers,
    # n_ctx 4096, ubatch 512 -> 78.0 MiB without flash attention, 19.0 MiB with it, 112.0 / 111.0 MiB per
    # device on two devices.
    profile = synthetic_profile(4, n_embd=512, n_head=8, n_head_kv=8, n_ff=2048)
    layers = [0, 1, 2, 3, 4]
    no_fa = estimate_compute(profile, layers, 4096, PlanOptions(), pipeline_parallel=False)
    fa = estimate_compute(profile, layers, 4096, PlanOptions(flash_attn=True), pipeline_parallel=False)
    pp = estimate_compute(profile, [0, 1], 4096, PlanOptions(), pipeline_parallel=True)
    assert 76 * MiB <= no_fa <= 82 * MiB
    assert 18 * MiB <= fa <= 22 * MiB
    assert 110 * MiB <= pp <= 118 * MiB
    assert estimate_compute(profile, [], 4096, PlanOptions(), pipeline_parallel=True) == 0


# ---------------------------------------------------------------------------------------------- fit


def test_fit_verdict_names_the_short_device_and_the_shortfall(tiny_model: Path) -> None:
    profile = profile_model(tiny_model)
    opts = PlanOptions(n_ctx=4096, tensor_split=(1, 1, 3), margin=10 * MiB)
    roomy = [rpc("10.0.0.1:50052"), rpc("10.0.0.2:50052"), rpc("10.0.0.3:50052")]
    baseline = make_plan(roomy, profile, opts)
    assert baseline.fit.fits and baseline.fit.shortfall == 0
    need = baseline.devices[2].memory.total + 10 * MiB
    tight = [*roomy[:2], rpc("10.0.0.3:50052", usable=need - 12345)]
    plan = make_plan(tight, profile, opts)
    assert not plan.fit.fits
    assert plan.fit.binding_device == 2
    assert plan.fit.shortfall == 12345
    assert plan.devices[2].memory.headroom == -12345
    assert plan.fit.largest_n_ctx < 4096
    shorter = make_plan(tight, profile, replace(opts, n_ctx=plan.fit.largest_n_ctx))
    assert shorter.fit.fits
    exact = make_plan([*roomy[:2], rpc("10.0.0.3:50052", usable=need)], profile, opts)
    assert exact.fit.fits and exact.fit.shortfall == 0 and exact.devices[2].memory.headroom == 0


def test_default_margin_is_applied(tiny_model: Path) -> None:
    profile = profile_model(tiny_model)
    plan = make_plan(
        [rpc("10.0.0.1:50052", usable=DEFAULT_MARGIN + 50 * MiB)], profile, PlanOptions(n_ctx=4096)
    )
    m = plan.devices[0].memory
    assert m.margin == DEFAULT_MARGIN
    assert m.headroom == DEFAULT_MARGIN + 50 * MiB - DEFAULT_MARGIN - m.total
    with pytest.raises(PlanError, match="no device has usable memory beyond the margin"):
        make_plan([rpc("10.0.0.1:50052", usable=DEFAULT_MARGIN)], profile, PlanOptions())


# -------------------------------------------------------------------------------------------- order


def test_order_devices_rules() -> None:
    a0, a1 = rpc("10.0.0.1:50052", 0), rpc("10.0.0.1:50052", 1)
    b0 = rpc("10.0.0.2:50052", 0)
    cuda0, cuda1 = gpu("CUDA0"), gpu("CUDA1")
    # Devices of each endpoint together, endpoints in first-seen order, devices by index; then local GPUs.
    assert order_devices([a1, b0, a0], [cuda0, cuda1]) == (a0, a1, b0, cuda0, cuda1)
    assert order_devices([a0, b0], [cuda0, cuda1], None) == (a0, b0, cuda0, cuda1)
    assert order_devices([a0, b0], [cuda0, cuda1], []) == (a0, b0)
    assert order_devices([a0], [cuda0, cuda1], ["CUDA1", "CUDA0"]) == (a0, cuda1, cuda0)
    assert order_devices([], [cuda0, cuda1], ["CUDA1"]) == (cuda1,)
    with pytest.raises(PlanError, match=r"local device 'CUDA7' not found \(local GPUs: CUDA0, CUDA1\)"):
        order_devices([a0], [cuda0, cuda1], ["CUDA7"])
    with pytest.raises(PlanError, match="CUDA0 twice"):
        order_devices([a0], [cuda0, cuda1], ["CUDA0", "CUDA0"])
    with pytest.raises(PlanError, match="index 0 twice"):
        order_devices([a0, a0], [])
    with pytest.raises(PlanError, match="has no endpoint"):
        order_devices([cuda0], [])


# ------------------------------------------------------------------------------------------- JSON


def test_json_round_trip(tiny_model: Path) -> None:
    profile = profile_model(tiny_model)
    devices = [rpc("10.0.0.1:50052"), rpc("10.0.0.1:50052", 1), gpu("CUDA0")]
    for opts in (
        PlanOptions(n_ctx=2048, margin=0),
        PlanOptions(
            n_ctx=300, tensor_split=(0.5, 0.25, 0.125), type_k="q8_0", type_v="q4_0", flash_attn=True
        ),
        PlanOptions(n_gpu_layers=2, strategy="fewest", main_gpu=0),
    ):
        plan = make_plan(devices, profile, opts)
        data = plan.to_json()
        assert isinstance(data, dict) and json.loads(json.dumps(data)) == data  # JSON data, not its text
        assert Plan.from_json(data) == plan
        text = plan.to_text()
        again = Plan.from_text(text)
        assert again == plan
        assert again.to_text() == text
    assert plan.schema_version == SCHEMA_VERSION


def test_json_rejects_unknown_schema_and_garbage(tiny_model: Path) -> None:
    plan = make_plan([rpc("10.0.0.1:50052")], profile_model(tiny_model), PlanOptions(margin=0))
    newer = plan.to_text().replace(f'"schema_version": {SCHEMA_VERSION}', '"schema_version": 99')
    with pytest.raises(PlanError, match="unsupported plan schema version 99"):
        Plan.from_text(newer)
    with pytest.raises(PlanError, match="unsupported plan schema version 99"):
        Plan.from_json({**plan.to_json(), "schema_version": 99})
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_text("{")
    with pytest.raises(PlanError, match="must be an object"):
        Plan.from_text("[]")
    with pytest.raises(PlanError, match="must be an object"):
        Plan.from_json([])
    with pytest.raises(PlanError, match="malformed"):
        Plan.from_json({"schema_version": SCHEMA_VERSION})


# ------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("devices", "opts", "message"),
    [
        ([rpc("a:1"), rpc("b:1"), rpc("a:1", 1)], PlanOptions(), "a:1 appears twice"),
        ([rpc("a:1"), rpc("a:1")], PlanOptions(), r"a:1#0 appears twice"),
        ([rpc(f"h{i}:1") for i in range(16)], PlanOptions(), "16 RPC devices"),
        (
            [gpu("CUDA0")] + [PlanDevice(None, i, f"GPU{i}", usable=GiB) for i in range(16)],
            PlanOptions(),
            "17 devices",
        ),
        ([rpc("a:1")], PlanOptions(split_mode="row"), "'row' is not supported"),
        ([rpc("a:1")], PlanOptions(split_mode="none"), "unknown split mode"),
        ([rpc("a:1"), rpc("b:1")], PlanOptions(main_gpu=2), r"main_gpu 2 is out of range \(0..1\)"),
        ([rpc("a:1"), rpc("b:1")], PlanOptions(main_gpu=-1), "main_gpu -1"),
        ([rpc("a:1"), rpc("b:1")], PlanOptions(tensor_split=(1.0,)), "1 values for 2 devices"),
        ([rpc("a:1"), rpc("b:1")], PlanOptions(tensor_split=(0.0, 0.0)), "all zeros"),
        ([rpc("a:1")], PlanOptions(tensor_split=(-1.0,)), "non-negative"),
        ([rpc("a:1", ok=False, state="unreachable")], PlanOptions(), "a:1#0 is not usable: unreachable"),
        ([rpc("a:1", state="protocol mismatch (server 6.1.0)")], PlanOptions(), "protocol mismatch"),
        ([], PlanOptions(), "no devices to offload to"),
        ([rpc("a:1")], PlanOptions(type_k="q3_k"), "unknown KV cache type_k"),
        ([rpc("a:1")], PlanOptions(type_v="q8_0"), "requires flash attention"),
        ([rpc("a:1")], PlanOptions(strategy="random"), "unknown strategy"),  # type: ignore[arg-type]
        ([rpc("a:1")], PlanOptions(n_ubatch=0), "n_ubatch"),
        ([rpc("a:1")], PlanOptions(margin=-1), "margin"),
    ],
)
def test_validation_errors(
    tiny_model: Path, devices: list[PlanDevice], opts: PlanOptions, message: str
) -> None:
    with pytest.raises(PlanError, match=message):
        make_plan(devices, profile_model(tiny_model), opts)


def test_kv_type_that_does_not_divide_the_rows(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    profile = profile_model(tiny_model_factory(n_embd=128, n_head=8, n_head_kv=1))  # n_embd_k_gqa = 16
    with pytest.raises(Exception, match="multiple of 32"):
        make_plan([rpc("a:1")], profile, PlanOptions(type_k="q8_0"))


# -------------------------------------------------------------------------------------- renderers


def test_llama_cli_args(tiny_model: Path) -> None:
    profile = profile_model(tiny_model)
    devices = [rpc("10.0.0.1:50052", 0), rpc("10.0.0.1:50052", 1), rpc("10.0.0.2:50052"), gpu("CUDA0")]
    plan = make_plan(
        devices, profile, PlanOptions(n_ctx=2048, tensor_split=(1, 1, 2, 1), main_gpu=3, margin=0)
    )
    assert cli_device_names(plan) == ["RPC0", "RPC1", "RPC2", "CUDA0"]
    assert llama_cli_args(plan) == [
        "-m", str(tiny_model),
        "--rpc", "10.0.0.1:50052,10.0.0.2:50052",
        "--device", "RPC0,RPC1,RPC2,CUDA0",
        "--split-mode", "layer",
        "--tensor-split", "1,1,2,1",
        "--main-gpu", "3",
        "-ngl", "5",
        "-c", "2048",
        "-ub", "512",
        "-ctk", "f16",
        "-ctv", "f16",
        "-fa", "off",
        "--fit", "off",
        "--parallel", "1",  # llama-server's own default is "auto": 4 slots, unified KV
    ]  # fmt: skip
    # the small SWA cache is llama-server's default; a full one, or a unified KV, is asked for
    other = replace(plan, options=replace(plan.options, swa_full=True, parallel=4, kv_unified=True))
    assert llama_cli_args(other)[-4:] == ["--parallel", "4", "--swa-full", "--kv-unified"]
    frac = make_plan(devices[:2], profile, PlanOptions(tensor_split=(0.25, 0.75), margin=0))
    assert "0.25,0.75" in llama_cli_args(frac, "/elsewhere/m.gguf")
    assert llama_cli_args(frac, "/elsewhere/m.gguf")[:2] == ["-m", "/elsewhere/m.gguf"]


def test_python_snippet(tiny_model: Path) -> None:
    plan = make_plan([rpc("10.0.0.1:50052")], profile_model(tiny_model), PlanOptions(margin=0))
    code = python_snippet(plan, "/models/x.gguf")
    ast.parse(code)
    assert "orchestrator.load_llama(plan, '/models/x.gguf')" in code


def test_free_memory_that_moves_a_little_between_probes_keeps_the_split() -> None:
    """Three CPU servers sharing one machine: each probe reads MemAvailable at a slightly different
    moment. A few MiB of difference must not move a layer (nor the tensors each node's cache holds)."""
    import random

    profile = synthetic_profile(6, n_embd=2560, n_head=20, n_head_kv=20, n_ff=6912, n_vocab=32000)
    rng = random.Random(3)
    splits = set()
    for _ in range(50):
        devices = [
            rpc(f"10.0.0.{i}:50052", usable=int(7.69 * GiB) + rng.randint(-3 * MiB, 3 * MiB))
            for i in range(1, 4)
        ]
        splits.add(make_plan(devices, profile, PlanOptions(n_ctx=512)).layer_counts)
    assert len(splits) == 1, splits
    eight = 8.0 * GiB
    assert largest_remainder(7, [eight, eight + 3 * MiB, eight - 2 * MiB]) == [3, 2, 2]  # a tie: the first
    assert largest_remainder(7, [eight, eight + 64 * MiB, eight - 2 * MiB]) == [2, 3, 2]  # a real lead


def test_which_layers_slide_follows_the_gguf_or_the_architectures_default() -> None:
    path = Path("m.gguf")
    # gemma3: every 6th layer is full by default, and nothing slides without a window
    assert swa_layers_of({"gemma3.attention.sliding_window": 512}, "gemma3", 7, path) == (
        512,
        (True, True, True, True, True, False, True),
    )
    assert swa_layers_of({}, "gemma3", 7, path) == (0, ())
    # gemma2: window 4096 by default, every other layer
    assert swa_layers_of({}, "gemma2", 4, path) == (4096, (True, False, True, False))
    # the pattern key: a period, or the per-layer flags as given
    meta = {"gpt-oss.attention.sliding_window": 128, "gpt-oss.attention.sliding_window_pattern": 3}
    assert swa_layers_of(meta, "gpt-oss", 4, path)[1] == (True, True, False, True)
    meta["gpt-oss.attention.sliding_window_pattern"] = [False, True, True, False]
    assert swa_layers_of(meta, "gpt-oss", 4, path)[1] == (False, True, True, False)
    # dense first (smallthinker): layer 0 of each period is full
    assert swa_layers_of({"smallthinker.attention.sliding_window": 64}, "smallthinker", 5, path)[1] == (
        False,
        True,
        True,
        True,
        False,
    )
    assert swa_layers_of({"llama.attention.sliding_window": 64}, "llama", 3, path) == (0, ())
    with pytest.raises(ModelError, match="sliding_window_pattern has 2 entries for 4 layers"):
        meta["gpt-oss.attention.sliding_window_pattern"] = [True, False]
        swa_layers_of(meta, "gpt-oss", 4, path)


def test_swa_cells_and_sequences_follow_llama_cpp() -> None:
    """llama-kv-cache-iswa.cpp: PAD(min(n_ctx_seq, n_swa * (unified ? n_seq : 1) + n_ubatch), 256) cells;
    llama-context.cpp: n_ctx_seq = PAD(n_ctx / n_seq, 256) per stream unless unified."""
    profile = replace(
        synthetic_profile(6, n_embd=128, n_head=2, n_head_kv=1, n_ff=256),
        n_swa=512,
        swa_layers=(True, True, True, True, True, False),
    )
    opts = PlanOptions(n_ctx=8192)
    assert kv_cells(profile, 5, 8192, opts) == 8192
    assert kv_cells(profile, 0, 8192, opts) == 1024  # 512 + 512, padded to 256
    assert kv_cells(profile, 0, 8192, replace(opts, swa_full=True)) == 8192
    assert kv_cells(profile, 0, 768, opts) == 768  # never more than the context
    assert kv_cells(profile, 0, 8192, replace(opts, n_ubatch=100)) == 768  # PAD(612, 256)
    four = replace(opts, parallel=4)
    assert (kv_streams(four), kv_cells(profile, 5, 8192, four), kv_cells(profile, 0, 8192, four)) == (
        4,
        2048,
        1024,
    )
    unified = replace(four, kv_unified=True)
    assert (
        kv_streams(unified),
        kv_cells(profile, 5, 8192, unified),
        kv_cells(profile, 0, 8192, unified),
    ) == (
        1,
        8192,
        2560,  # 512 * 4 + 512
    )
    assert context_size(4096, replace(opts, parallel=3)) == 4608  # 1365 -> 1536 cells each, llama.cpp's
    plan = make_plan([rpc("10.0.0.1:50052", usable=8 << 30)], profile, replace(opts, n_ctx=4096, parallel=3))
    assert plan.n_ctx == 4608 and plan.host.output == 3 * profile.n_vocab * 4
