"""Plans of every model family against what real servers allocate (tiny `model synth --arch` models).

Each family is loaded over the session's three GGML_RPC_DEBUG servers (loopback), with flash attention
off and on, and every device's allocations are compared with the plan: weights, KV cache and recurrent
state to the byte, the compute buffer within 10 %. The models are a few MB, so a load takes well under
a second. One sequence, and several (--parallel, unified KV or not) with the small SWA cache or --swa-full.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cli import main
from orchestrator.llama.native.loader import load_llama
from orchestrator.llama.observed_placement import placement_of
from orchestrator.models.synth_arch import ARCHES, write_arch_model
from orchestrator.planning.architectures import VERIFIED
from orchestrator.planning.plan import Plan, PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan
from tests.plugins.llama import DebugServer, plan_devices
from tests.plugins.servers import LocalServer, write_local_inventory

COMPUTE_TOLERANCE = 0.10


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("families")
    return {arch: write_arch_model(folder / f"{arch}.gguf", arch) for arch in ARCHES}


def _load_and_compare(
    servers: list[DebugServer],
    model: Path,
    flash_attn: bool,
    split: tuple[float, ...] | None = None,
    **options: Any,
) -> list[tuple[str, int, int, str]]:
    """Load `model` as planned, decode a few tokens, and return per device (label, predicted compute,
    allocated compute, diagnostics) after asserting weights and KV + state to the byte."""
    profile = profile_model(model)
    servers = servers[: len(split)] if split else servers
    opts = PlanOptions(flash_attn=flash_attn, tensor_split=split, **{"n_ctx": 1024, **options})
    plan = make_plan(plan_devices(servers), profile, opts)
    offsets = [s.log_offset() for s in servers]
    llm = load_llama(plan, model)
    try:
        allocations = [s.allocations_since(o).get(0, []) for s, o in zip(servers, offsets, strict=True)]
        tokens = []
        for token in llm.generate(llm.tokenize(b"hello world"), top_k=1, temp=0.0):
            tokens.append(token)
            if len(tokens) == 3:
                break
        assert len(tokens) == 3  # it decodes
        placement = placement_of(llm)
    finally:
        llm.close()
    assert placement.layers_as_planned
    out = []
    for dev, pdev, sizes in zip(plan.devices, placement.devices, allocations, strict=True):
        # A server allocates in order: weights, then the KV cache and/or the recurrent state (RS)
        # buffers, then the compute buffer.
        weights, *cache, compute = sizes
        m = dev.memory
        label = f"{dev.label} layers {dev.layers}"
        assert weights == m.weights, (label, weights, m.weights)
        assert sum(cache) == m.kv, (label, cache, m.kv)
        # The load log's KV + RS lines (0.01 MiB) agree with the servers.
        assert abs(pdev.actual.kv - m.kv) <= 0.01 * (1 << 20) * max(1, len(cache)), (label, pdev.actual)
        out.append((label, m.compute, compute, f"{sizes}"))
    return out


@pytest.mark.llama
@pytest.mark.parametrize("flash_attn", [False, True], ids=["fa-off", "fa-on"])
@pytest.mark.parametrize("arch", ARCHES)
def test_family_weights_kv_and_state_are_predicted_to_the_byte(
    debug_rpc_servers: list[DebugServer], family_models: dict[str, Path], arch: str, flash_attn: bool
) -> None:
    _load_and_compare(debug_rpc_servers, family_models[arch], flash_attn)


@pytest.mark.llama
@pytest.mark.parametrize("flash_attn", [False, True], ids=["fa-off", "fa-on"])
@pytest.mark.parametrize("arch", ARCHES)
def test_family_compute_is_predicted_within_the_tolerance(
    debug_rpc_servers: list[DebugServer], family_models: dict[str, Path], arch: str, flash_attn: bool
) -> None:
    for label, predicted, allocated, sizes in _load_and_compare(
        debug_rpc_servers, family_models[arch], flash_attn
    ):
        error = (predicted - allocated) / allocated
        assert abs(error) <= COMPUTE_TOLERANCE, (label, predicted, allocated, f"{error:+.1%}", sizes)


@pytest.mark.llama
@pytest.mark.parametrize(
    ("arch", "split"),
    [
        ("mamba2", (5.0,)),  # one device: no pipeline copies
        ("mamba2", (1.0, 1.0, 3.0)),  # two boundaries between recurrent layers
        ("mamba2", (4.0, 1.0)),  # the output layer alone
        ("granitehybrid", (1.0, 4.0)),  # recurrent | recurrent, attention: spill and the KQ mask
        ("granitehybrid", (2.0, 3.0)),  # recurrent | attention: no spill
    ],
)
def test_recurrent_compute_follows_the_split(
    debug_rpc_servers: list[DebugServer], family_models: dict[str, Path], arch: str, split: tuple[float, ...]
) -> None:
    # Where two recurrent layers meet at a device boundary, part of the earlier one runs on the later
    # device: the later device receives 2 x d_inner rows, the earlier one d_inner back (x 4 copies).
    for label, predicted, allocated, sizes in _load_and_compare(
        debug_rpc_servers, family_models[arch], False, split
    ):
        error = (predicted - allocated) / allocated
        assert abs(error) <= COMPUTE_TOLERANCE, (label, predicted, allocated, f"{error:+.1%}", sizes)


@pytest.mark.llama
@pytest.mark.parametrize(
    ("arch", "options"),
    [
        ("mamba2", {"parallel": 3}),  # the recurrent state: one row of r and s per sequence
        ("granitehybrid", {"parallel": 2}),  # state per sequence, KV in 2 streams
        ("granitehybrid", {"parallel": 2, "kv_unified": True}),
        ("gpt-oss", {"swa_full": True}),  # the default elsewhere: the small SWA cache, masks of two sizes
        ("gpt-oss", {"swa_full": False, "parallel": 2}),
        ("gemma3", {"swa_full": True, "parallel": 2, "kv_unified": True}),
        ("qwen3moe", {"parallel": 4}),
    ],
    ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()),
)
def test_families_with_sequences_and_the_swa_cache(
    debug_rpc_servers: list[DebugServer],
    family_models: dict[str, Path],
    arch: str,
    options: dict[str, Any],
) -> None:
    # --parallel reaches the recurrent state (n_seq_max rows) and the KV streams; the compute model
    # sees each cache's cells (small SWA cache, n_ctx / n_seq per stream).
    for label, predicted, allocated, sizes in _load_and_compare(
        debug_rpc_servers, family_models[arch], False, None, **options
    ):
        error = (predicted - allocated) / allocated
        assert abs(error) <= COMPUTE_TOLERANCE, (label, predicted, allocated, f"{error:+.1%}", sizes)


def test_the_sequences_reach_the_recurrent_state(tmp_path: Path) -> None:
    mamba = profile_model(write_arch_model(tmp_path / "m.gguf", "mamba2"))
    one, four = (
        make_plan(plan_devices(["127.0.0.1:1"]), mamba, PlanOptions(n_ctx=1024, parallel=n)) for n in (1, 4)
    )
    state = 4 * (3 * 288 + 16 * 256) * 4  # 4 layers, one r and one s row each
    assert (one.devices[0].memory.kv, four.devices[0].memory.kv) == (state, 4 * state)


def test_every_synthetic_family_is_verified_and_classified(tmp_path: Path) -> None:
    families = {}
    for arch in ARCHES:
        rules = profile_model(write_arch_model(tmp_path / f"{arch}.gguf", arch)).rules
        assert rules.verified and arch in VERIFIED
        families[arch] = rules.family
    assert families == {
        "llama": "dense",
        "qwen3": "dense",
        "qwen3moe": "MoE",
        "gemma3": "dense",
        "gpt-oss": "MoE",
        "deepseek2": "MLA + MoE",
        "granitehybrid": "hybrid (recurrent + attention)",
        "mamba2": "recurrent",
    }


def test_mla_caches_k_only_and_recurrent_layers_hold_state_not_kv(tmp_path: Path) -> None:
    ds = profile_model(write_arch_model(tmp_path / "ds.gguf", "deepseek2"))
    # K row: kv_lora_rank 64 + rope 32 = 96 f16 values; no V row.
    assert ds.rules.mla and ds.kv_bytes_per_token(0) == 96 * 2
    mamba = profile_model(write_arch_model(tmp_path / "m.gguf", "mamba2"))
    assert mamba.n_head == (0,) * 4 and mamba.kv_bytes_per_token(0) == 0
    # r: (d_conv - 1) x (d_inner + 2 groups x d_state) = 3 x 288; s: d_state x d_inner = 16 x 256; f32.
    assert mamba.rules.state_bytes_per_seq(0) == (3 * 288 + 16 * 256) * 4
    granite = profile_model(write_arch_model(tmp_path / "g.gguf", "granitehybrid"))
    assert [granite.rules.is_recurrent(il) for il in range(4)] == [True, True, False, True]
    assert [granite.kv_bytes_per_token(il) for il in range(4)] == [0, 0, 2 * 64 * 2, 0]


def test_an_unknown_architecture_is_planned_and_marked_unverified(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = write_arch_model(tmp_path / "x.gguf", "llama", architecture="frobnicator")
    profile = profile_model(model)
    assert profile.architecture == "frobnicator" and not profile.rules.verified
    assert main(["model", "info", str(model)]) == 0
    out = capsys.readouterr().out
    assert "family:           dense (unverified)" in out
    assert "unverified: architecture 'frobnicator' is planned with the generic rules" in out
    plan = make_plan(plan_devices(["127.0.0.1:1", "127.0.0.1:2"]), profile, PlanOptions(n_ctx=1024))
    assert plan.notes[0].startswith("unverified: architecture 'frobnicator'")
    assert "unverified: architecture 'frobnicator'" in plan.to_text()  # the JSON carries the note
    known = make_plan(
        plan_devices(["127.0.0.1:1"]), profile_model(write_arch_model(tmp_path / "l.gguf", "llama"))
    )
    assert not any("unverified" in n for n in known.notes)


def test_model_synth_arch_writes_each_family(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from orchestrator.cli.model import SYNTH_ARCHES

    assert SYNTH_ARCHES == ARCHES
    for arch in ("mamba2", "deepseek2"):
        out = tmp_path / f"{arch}.gguf"
        assert main(["model", "synth", "--arch", arch, "-o", str(out)]) == 0
        assert profile_model(out).architecture == arch and out.stat().st_size < 4 << 20
    assert main(["model", "synth", str(tmp_path / "a.gguf"), "-o", str(tmp_path / "b.gguf")]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
    # a shape flag with --arch was ignored without a word: the model had the family's own shape
    assert (
        main(["model", "synth", "--arch", "qwen3", "--layers", "8", "--tied", str(tmp_path / "a.gguf")]) == 2
    )
    assert "--layers, --tied does not apply with --arch" in capsys.readouterr().err
    assert not (tmp_path / "a.gguf").exists() and not (tmp_path / "b.gguf").exists()


@pytest.mark.llama
@pytest.mark.parametrize("flash_attn", [False, True], ids=["fa-off", "fa-on"])
def test_gemma_compute_is_predicted_within_the_tolerance_at_8k(
    debug_rpc_servers: list[DebugServer], gemma_model: Path, flash_attn: bool
) -> None:
    # The real Gemma 3 270M: measured 211.54 / 211.54 / 654.30 MiB without flash attention at 8k (the
    # generic estimate was 26 % short on the first devices, and 6 KiB per context token low).
    profile = profile_model(gemma_model)
    plan = make_plan(plan_devices(debug_rpc_servers), profile, PlanOptions(n_ctx=8192, flash_attn=flash_attn))
    offsets = [s.log_offset() for s in debug_rpc_servers]
    llm = load_llama(plan, gemma_model)
    try:
        allocations = [s.allocations_since(o)[0] for s, o in zip(debug_rpc_servers, offsets, strict=True)]
    finally:
        llm.close()
    for dev, sizes in zip(plan.devices, allocations, strict=True):
        error = (dev.memory.compute - sizes[-1]) / sizes[-1]
        assert abs(error) <= COMPUTE_TOLERANCE, (dev.label, dev.memory.compute, sizes[-1], f"{error:+.1%}")


def test_the_report_marks_an_unknown_architecture_unverified(tmp_path: Path) -> None:
    from orchestrator.report.build import build_report
    from orchestrator.report.data import render_json
    from orchestrator.report.html import render_html
    from orchestrator.report.text import render_markdown, render_text
    from tests.plugins.fleets import fleet_of, ok_node

    model = write_arch_model(tmp_path / "x.gguf", "qwen3", architecture="frobnicator")
    fleet = fleet_of(ok_node("a", "10.0.0.1:50052", [8 << 30]), ok_node("b", "10.0.0.2:50052", [8 << 30]))
    report = build_report(fleet, [("x.gguf", profile_model(model))], [4096])
    note = "unverified: architecture 'frobnicator' is planned with the generic rules"
    assert note in render_text(report) and note in render_json(report)
    assert note in render_markdown(report) and html.escape(note) in render_html(report)  # every format


def test_rs_buffer_lines_count_as_the_devices_kv_and_state() -> None:
    from orchestrator.llama.logs import parse_load_log

    log = parse_load_log(
        [
            "llama_kv_cache:   RPC0[127.0.0.1:5000] KV buffer size =     0.25 MiB",
            "llama_memory_recurrent:   RPC0[127.0.0.1:5000] RS buffer size =     0.02 MiB",
        ]
    )
    assert [(b.kind, b.endpoint, b.mib) for b in log.buffers] == [
        ("kv", "127.0.0.1:5000", 0.25),
        ("kv", "127.0.0.1:5000", 0.02),
    ]


def test_shared_kv_layers_and_sequences() -> None:
    from orchestrator.planning.architectures import arch_rules

    # gemma3n: layers from 20 on reuse earlier layers' cache (models/gemma3n.cpp).
    rules = arch_rules({}, "gemma3n", 30, 2048, 8, (2,) * 30)
    assert [rules.has_kv(il) for il in (0, 19, 20, 29)] == [True, True, False, False]
    rules = arch_rules({"gemma4.attention.shared_kv_layers": 4}, "gemma4", 10, 2048, 8, (2,) * 10)
    assert [rules.has_kv(il) for il in range(10)] == [True] * 6 + [False] * 4
    # Recurrent state: max(1, n_seq) rows of r and s, each tensor padded to the buffer's alignment.
    meta = {"mamba2.ssm.conv_kernel": 4, "mamba2.ssm.inner_size": 256, "mamba2.ssm.state_size": 16}
    meta |= {"mamba2.ssm.group_count": 1, "mamba2.ssm.time_step_rank": 4}
    rules = arch_rules(meta, "mamba2", 4, 128, 0, (0,) * 4)
    assert rules.state_bytes(0, 1, 32) == 3 * 288 * 4 + 16 * 256 * 4
    assert rules.state_bytes(0, 4, 32) == 4 * rules.state_bytes(0, 1, 32)
    assert rules.state_bytes(0, 0, 32) == rules.state_bytes(0, 1, 32)


def test_model_info_shows_experts_and_recurrent_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    moe = write_arch_model(tmp_path / "moe.gguf", "qwen3moe")
    assert main(["model", "info", str(moe), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["family"], data["experts"], data["experts_used"], data["expert_ff"]) == ("MoE", 8, 2, 64)
    assert data["verified"] and data["unverified_note"] is None and data["recurrent_layers"] == []
    ssm = write_arch_model(tmp_path / "ssm.gguf", "granitehybrid")
    assert main(["model", "info", str(ssm), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recurrent_layers"] == [0, 1, 3]
    assert data["state_bytes_per_sequence"] == 3 * (3 * 288 + 16 * 256) * 4
    assert main(["model", "info", str(ssm)]) == 0
    out = capsys.readouterr().out
    assert "recurrent state:  58.12 KiB per sequence (3 recurrent layers, f32)" in out
    ds = write_arch_model(tmp_path / "ds.gguf", "deepseek2")
    assert main(["model", "info", str(ds)]) == 0
    assert "MLA: a K cache only (kv_lora_rank + rope wide), no V" in capsys.readouterr().out


@pytest.mark.llama
def test_plan_cli_plans_a_pure_recurrent_model_and_notes_an_unknown_architecture(
    start_rpc_server: Callable[..., LocalServer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    servers = [start_rpc_server(), start_rpc_server()]
    hosts = {f"node{i}": {"rpc_port": s.port, "memory_limit": "1000MiB"} for i, s in enumerate(servers)}
    inventory = write_local_inventory(tmp_path / "inventory.yml", hosts)
    mamba = write_arch_model(tmp_path / "mamba.gguf", "mamba2")
    # A pure recurrent model has no attention.head_count: planned (it was refused), state in the KV column.
    assert main(["plan", "-i", str(inventory), "-m", str(mamba), "--ctx", "1024", "--json"]) == 0
    plan = Plan.from_text(capsys.readouterr().out)
    assert plan.fit.fits and sum(d.memory.kv for d in plan.devices) == 4 * (3 * 288 + 16 * 256) * 4
    assert plan.notes == ()
    unknown = write_arch_model(tmp_path / "x.gguf", "qwen3", architecture="frobnicator")
    assert main(["plan", "-i", str(inventory), "-m", str(unknown), "--ctx", "1024"]) == 0
    captured = capsys.readouterr()
    assert "fits" in captured.out
    assert "note: unverified: architecture 'frobnicator' is planned with the generic rules" in captured.err


MAMBA2_SHAPES = [  # n_embd (d_inner is twice it), d_state, SSM heads, groups: the tiny family's, then wider
    (128, 16, 4, 1),
    (256, 64, 8, 2),
    (256, 128, 16, 1),
    (512, 128, 8, 8),
]


@pytest.mark.llama
@pytest.mark.parametrize("parallel", [1, 4])
@pytest.mark.parametrize("shape", MAMBA2_SHAPES, ids=lambda s: "embd{}-state{}-heads{}-groups{}".format(*s))
def test_mamba2_compute_of_other_shapes_is_never_under(
    debug_rpc_servers: list[DebugServer],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    shape: tuple[int, int, int, int],
    parallel: int,
) -> None:
    """Mamba-2 models of shapes of their own at a 4k context over three servers: the compute buffer is
    never under what the servers allocate (the rule before was 30 % under with 8 groups of 128 states)."""
    from orchestrator.models import synth_arch

    embd, state, heads, groups = shape
    for name, value in (("_EMBD", embd), ("_D_INNER", 2 * embd), ("_D_STATE", state), ("_SSM_HEADS", heads),
                        ("_GROUPS", groups)):  # fmt: skip
        monkeypatch.setattr(synth_arch, name, value)
    model = write_arch_model(tmp_path / "mamba2.gguf", "mamba2")
    for label, predicted, allocated, sizes in _load_and_compare(
        debug_rpc_servers, model, False, None, n_ctx=4096, parallel=parallel
    ):
        error = (predicted - allocated) / allocated
        # one of these eight, 8 groups of 128 states at 4 sequences, is +12 % on its first device
        assert 0 <= error <= 0.15, (label, predicted, allocated, f"{error:+.1%}", sizes)


@pytest.mark.llama
@pytest.mark.parametrize("flash_attn", [False, True], ids=["fa-off", "fa-on"])
@pytest.mark.parametrize("split", [(2.0, 1.0, 2.0), (1.0, 4.0), (2.0, 3.0), (4.0, 1.0), (5.0,)], ids=str)
def test_hybrid_compute_is_never_under_on_any_split(
    debug_rpc_servers: list[DebugServer],
    family_models: dict[str, Path],
    split: tuple[float, ...],
    flash_attn: bool,
) -> None:
    """A hybrid's recurrent layers followed by FFNs, every way its four layers fall on 1-3 devices: the
    compute buffer is never under what the servers allocate (it was up to 6 % under where a recurrent
    layer ended on a device with pipeline copies) and within the tolerance over."""
    for label, predicted, allocated, sizes in _load_and_compare(
        debug_rpc_servers, family_models["granitehybrid"], flash_attn, split
    ):
        error = (predicted - allocated) / allocated
        assert 0 <= error <= COMPUTE_TOLERANCE, (label, predicted, allocated, f"{error:+.1%}", sizes)
