"""A draft model for speculative decoding, planned in its formation's memory (pure, no I/O).

llama-server (`--spec-type draft-simple --spec-draft-model FILE`) loads the draft as a second model with
its own context: the target's context size (`cparams.n_ctx = llama_n_ctx(ctx_tgt)`), its sequences
(`--parallel`), ubatch, flash attention, SWA and unified-KV settings, but its own KV types (f16 unless
`-ctkd/-ctvd`) and devices (`--spec-draft-device`; `none` = this machine's CPU), one logits row per
sequence (`common_base_params_to_speculative`, common/speculative.cpp). The target's output buffer grows
to `parallel * (1 + n_max)` rows (at most n_batch: `server_output_limits`) since every drafted token is
verified. Its memory is the planner's own prediction (`memory.predict`) of the draft's profile on the
device it goes to; llama.cpp's vocabulary check (`common_speculative_are_compatible`) is `vocab_mismatch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from orchestrator.core.units import format_size
from orchestrator.planning.memory import predict
from orchestrator.planning.plan import DraftPlan, PlanDevice, PlanOptions
from orchestrator.planning.profile import ModelProfile, Vocab
from orchestrator.planning.settings import DRAFT_N_MAX, DRAFT_N_MIN

VOCAB_MAX_SIZE_DIFFERENCE = 128  # SPEC_VOCAB_MAX_SIZE_DIFFERENCE (common/speculative.cpp)
VOCAB_CHECK_START_TOKEN_ID = 5  # SPEC_VOCAB_CHECK_START_TOKEN_ID


@dataclass(frozen=True)
class DraftModel:
    """A draft model to plan with a target: where it goes ("none": this machine's CPU, llama-server's
    word; "first": the formation's first device), llama-server's draft lengths, and this machine's
    available memory (None: unknown, not checked) for a draft on its CPU."""

    profile: ModelProfile
    device: str = "none"
    n_max: int = DRAFT_N_MAX
    n_min: int = DRAFT_N_MIN
    host_available: int | None = None


def draft_options(opts: PlanOptions) -> PlanOptions:
    """The draft context's options: the target's context, sequences and attention settings, llama-server's
    draft KV types (f16), no tensor overrides or split of its own."""
    return replace(
        opts, type_k="f16", type_v="f16", n_cpu_moe=0, tensor_split=None, n_gpu_layers=-1, main_gpu=0
    )


def plan_draft(draft: DraftModel, device: PlanDevice | None, n_ctx: int, opts: PlanOptions) -> DraftPlan:
    """The draft's memory at the target's (padded) context `n_ctx`: every layer on `device` (its
    token_embd, inputs and logits on this machine), or everything on this machine's CPU (`device` None)."""
    profile = draft.profile
    dopts = draft_options(opts)
    n_all = profile.n_layer
    name = profile.name or profile.path.stem
    if device is None:
        pred = predict(profile, (), [None] * (n_all + 1), n_ctx, dopts, 0)
        h = pred.host
        return DraftPlan(
            str(profile.path), name, "none", draft.n_max, draft.n_min, h.weights, h.kv, h.compute, h.output
        )
    pred = predict(profile, (device,), [0] * (n_all + 1), n_ctx, dopts, n_all + 1)
    m, host = pred.memories[0], pred.host.total
    return DraftPlan(
        str(profile.path), name, "first", draft.n_max, draft.n_min, m.weights, m.kv, m.compute, host
    )


def target_output_rows(opts: PlanOptions, n_max: int) -> int:
    """Logits rows the target reserves with a draft: each sequence's sampled token and its drafted ones,
    at most n_batch (`common_speculative_get_output_limits`)."""
    return min(opts.n_batch, max(opts.parallel, 1) * (1 + max(0, n_max)))


def draft_note(draft: DraftPlan, first: str | None) -> str:
    """The plan's line about its draft: where it goes and what it takes there."""
    where = f"on {first}" if draft.device == "first" and first else "on this machine's CPU"
    parts = ", ".join(
        f"{what} {format_size(n)}"
        for what, n in (("weights", draft.weights), ("KV", draft.kv), ("compute", draft.compute))
    )
    return (
        f"draft {draft.model_name} {where}: {format_size(draft.total)} ({parts}); up to {draft.n_max} "
        f"tokens drafted (at least {draft.n_min})"
    )


def vocab_mismatch(target: Vocab, draft: Vocab) -> str | None:
    """Why llama-server would refuse `draft` as the draft of `target` ("the target and draft vocabs are
    not compatible", it then serves nothing), None when it accepts it: the same tokenizer type, the same
    BOS/EOS handling, at most 128 tokens more or fewer, and the same token texts from id 5 on."""
    if target.model != draft.model:
        return f"the tokenizers differ ({target.model or 'none'} and {draft.model or 'none'})"
    if target.add_bos != draft.add_bos or (target.add_bos and target.bos != draft.bos):
        return f"BOS differs (added {target.add_bos}, id {target.bos}; added {draft.add_bos}, id {draft.bos})"
    if target.add_eos != draft.add_eos or (target.add_eos and target.eos != draft.eos):
        return f"EOS differs (added {target.add_eos}, id {target.eos}; added {draft.add_eos}, id {draft.eos})"
    n_t, n_d = len(target.tokens), len(draft.tokens)
    if abs(n_t - n_d) > VOCAB_MAX_SIZE_DIFFERENCE:
        apart = VOCAB_MAX_SIZE_DIFFERENCE
        return f"the vocabularies have {n_t} and {n_d} tokens (llama.cpp allows {apart} apart)"
    first = _first_difference(target.tokens, draft.tokens)
    if first is not None:
        a, b = target.tokens[first], draft.tokens[first]
        return f"token {first} differs ({a.decode(errors='replace')!r} and {b.decode(errors='replace')!r})"
    return None


def _first_difference(a: Sequence[bytes], b: Sequence[bytes]) -> int | None:
    end = min(len(a), len(b))
    if a[VOCAB_CHECK_START_TOKEN_ID:end] == b[VOCAB_CHECK_START_TOKEN_ID:end]:
        return None
    return next(i for i in range(VOCAB_CHECK_START_TOKEN_ID, end) if a[i] != b[i])
