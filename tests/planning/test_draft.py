"""Tier 1: a draft model for speculative decoding planned in its formation's memory (planning/draft.py):
its bytes are the planner's own prediction for the draft's profile, taken from the first device before the
layers are placed or checked against this machine's memory; llama-server's flags; llama.cpp's vocabulary
check."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from orchestrator.core.errors import PlanError
from orchestrator.planning.draft import DraftModel, target_output_rows, vocab_mismatch
from orchestrator.planning.formats import llama_cli_args
from orchestrator.planning.plan import Plan, PlanOptions
from orchestrator.planning.profile import ModelProfile, Vocab, profile_model, read_vocab
from orchestrator.planning.strategy import make_plan
from orchestrator.workflows.fit import misfit_error
from tests.plugins.llama import GiB, plan_devices
from tests.plugins.models import TinyModelFactory

MiB = 1 << 20
ENDPOINTS = ["10.0.0.1:50052", "10.0.0.2:50052"]


@pytest.fixture(scope="module")
def target(tiny_model_factory: TinyModelFactory) -> ModelProfile:
    return profile_model(tiny_model_factory(n_layer=12, n_embd=512, n_ff=1024, n_vocab=2000))


@pytest.fixture(scope="module")
def draft(tiny_model_factory: TinyModelFactory) -> ModelProfile:
    return profile_model(tiny_model_factory(n_layer=2, n_embd=256, n_vocab=2000, seed=1))


OPTIONS = PlanOptions(n_ctx=8192, parallel=4, flash_attn=True, type_k="q8_0", type_v="q8_0", n_batch=512)


def test_a_draft_on_the_cpu_is_the_planners_own_prediction_of_it_at_the_targets_context(
    target: ModelProfile, draft: ModelProfile
) -> None:
    plan = make_plan(plan_devices(ENDPOINTS), target, OPTIONS, DraftModel(draft, "none", 5, 1))
    assert plan.draft is not None and plan.draft.device == "none"
    # the draft alone on the CPU, as llama-server sizes its context: the target's context and sequences,
    # f16 KV whatever the target's types
    same = dataclasses.replace(OPTIONS, n_ctx=plan.n_ctx, type_k="f16", type_v="f16", n_gpu_layers=0)
    alone = make_plan([], draft, same)
    h = alone.host
    assert (plan.draft.weights, plan.draft.kv, plan.draft.compute, plan.draft.host) == (
        h.weights,
        h.kv,
        h.compute,
        h.output,
    )
    assert plan.draft.kv > 0 and plan.draft.total == h.total
    # the devices are the target's alone, and its logits hold each sequence's drafted tokens
    assert plan.layer_counts == make_plan(plan_devices(ENDPOINTS), target, OPTIONS).layer_counts
    assert target_output_rows(OPTIONS, 5) == 4 * 6
    assert plan.host.output == target.n_vocab * 24 * 4
    assert any(n.startswith("draft ") and "this machine's CPU" in n for n in plan.notes)


def test_a_draft_on_the_first_device_takes_its_memory_before_the_layers_are_placed(
    target: ModelProfile, draft: ModelProfile
) -> None:
    usable = 96 * MiB
    devices = plan_devices(ENDPOINTS, [usable, usable])
    opts = dataclasses.replace(OPTIONS, margin=8 * MiB)
    without = make_plan(devices, target, opts)
    plan = make_plan(devices, target, opts, DraftModel(draft, "first"))
    drafted = plan.draft
    assert drafted is not None and drafted.device == "first"
    # every draft layer and its output layer on that device; its token_embd stays on this machine
    assert drafted.weights == sum(draft.layer_bytes) + draft.output_layer_bytes
    assert plan.devices[0].memory.usable == usable - drafted.total
    assert plan.devices[1].memory.usable == usable
    assert plan.layer_counts[0] < without.layer_counts[0]
    assert sum(plan.layer_counts) == sum(without.layer_counts)
    args = llama_cli_args(plan)
    assert args[args.index("--spec-draft-device") + 1] == "RPC0"
    assert args[args.index("--spec-draft-ngl") + 1] == "all"
    assert args[args.index("--spec-type") + 1] == "draft-simple"
    assert args[args.index("--spec-draft-model") + 1] == str(draft.path)
    # a draft that leaves its device no room for the target's layers is refused, not placed elsewhere
    small = plan_devices(ENDPOINTS, [drafted.total + 4 * MiB, 8 * GiB])
    with pytest.raises(PlanError, match="left without layers"):
        make_plan(small, target, opts, DraftModel(draft, "first"))
    with pytest.raises(PlanError, match="there is none"):
        make_plan([], target, dataclasses.replace(opts, n_gpu_layers=0), DraftModel(draft, "first"))


def test_a_draft_on_the_cpu_is_checked_against_this_machines_available_memory(
    target: ModelProfile, draft: ModelProfile
) -> None:
    devices = plan_devices(ENDPOINTS)
    roomy = make_plan(devices, target, OPTIONS, DraftModel(draft, host_available=64 * GiB))
    assert roomy.fit.fits
    assert roomy.draft is not None
    need = roomy.host.total + roomy.draft.total + OPTIONS.margin
    short = make_plan(devices, target, OPTIONS, DraftModel(draft, host_available=need - MiB))
    assert not short.fit.fits and short.fit.binding_device is None and short.fit.shortfall == MiB
    error = misfit_error(short)
    assert error is not None and "the host is short by 1.00 MiB" in error.message
    assert make_plan(devices, target, OPTIONS, DraftModel(draft, host_available=need)).fit.fits
    args = llama_cli_args(roomy)
    assert args[args.index("--spec-draft-device") + 1] == "none" and "--spec-draft-ngl" not in args
    assert args[args.index("--spec-draft-n-max") + 1] == "3"


def test_a_plan_with_a_draft_reads_back_and_one_saved_before_drafts_still_does(
    target: ModelProfile, draft: ModelProfile
) -> None:
    plan = make_plan(plan_devices(ENDPOINTS), target, OPTIONS, DraftModel(draft, "first", 4, 2))
    assert Plan.from_text(plan.to_text()) == plan
    data = make_plan(plan_devices(ENDPOINTS), target, OPTIONS).to_json()
    del data["draft"]
    assert Plan.from_json(data).draft is None
    assert "--spec-type" not in llama_cli_args(Plan.from_json(data))


def _vocab(**changes: object) -> Vocab:
    tokens = tuple(f"t{i}".encode() for i in range(1000))
    return dataclasses.replace(Vocab("llama", tokens, 1, 2, True, False), **changes)  # type: ignore[arg-type]


def test_a_draft_with_another_vocabulary_is_named_as_llama_cpp_would_refuse_it(
    tiny_model: Path, gemma_model: Path
) -> None:
    base = _vocab()
    assert vocab_mismatch(base, base) is None
    # the first 5 tokens (special ones) are not compared; 128 tokens more or fewer are allowed
    assert vocab_mismatch(base, _vocab(tokens=(b"x", *base.tokens[1:]))) is None
    assert vocab_mismatch(base, _vocab(tokens=base.tokens[:-128])) is None
    assert "1000 and 871 tokens" in (vocab_mismatch(base, _vocab(tokens=base.tokens[:-129])) or "")
    changed = (*base.tokens[:7], b"other", *base.tokens[8:])
    assert vocab_mismatch(base, _vocab(tokens=changed)) == "token 7 differs ('t7' and 'other')"
    assert "tokenizers differ" in (vocab_mismatch(base, _vocab(model="gpt2")) or "")
    assert "BOS differs" in (vocab_mismatch(base, _vocab(bos=3)) or "")
    assert vocab_mismatch(base, _vocab(eos=9)) is None  # EOS is compared only where it is added
    assert "EOS differs" in (vocab_mismatch(base, _vocab(add_eos=True)) or "")
    gemma = read_vocab(gemma_model)
    assert len(gemma.tokens) == 262144 and gemma.model == "llama" and (gemma.bos, gemma.eos) == (2, 1)
    assert vocab_mismatch(gemma, read_vocab(gemma_model)) is None
    # checked in llama.cpp's order: the tiny model's BOS (1) is not Gemma's (2)
    assert "BOS differs" in (vocab_mismatch(gemma, read_vocab(tiny_model)) or "")
