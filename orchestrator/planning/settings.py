"""What a front end may set on the planner, by name: the KV cache types, the split strategies, flash
attention's modes, the sequences' limit and the default margin. Constants that import nothing of rpcfleet,
so that the command line lists them at start-up without loading the planner (gguf, numpy); the planner,
the declared options (`orchestrator.workflows.options`) and the playbooks all read them here."""

from __future__ import annotations

from typing import Literal, get_args

# KV cache types llama.cpp accepts for --cache-type-k/-v (common/arg.cpp kv_cache_types), in its order;
# `planning.profile.KV_CACHE_TYPES` maps each to its ggml type.
KV_CACHE_TYPE_NAMES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


Strategy = Literal["proportional", "fewest"]
STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)  # the first is the default


FLASH_ATTN_MODES = ("on", "off", "auto")  # llama.cpp's -fa values


MAX_SEQ = 256  # LLAMA_MAX_SEQ (llama-cparams.h): n_seq_max above it is refused


# Headroom kept free on every device on top of its usable bytes: covers the compute-buffer estimate's
# error and small backend allocations. llama.cpp's own fitting (common_fit_params) keeps 1 GiB; usable
# already excludes the inventory's memory_reserve, so a smaller default is enough.
DEFAULT_MARGIN = 256 * 1024 * 1024


# Where a draft model for speculative decoding goes: llama-server's `--spec-draft-device none` (not
# offloaded: this machine's CPU, the default), or the formation's first device.
DRAFT_DEVICES = ("none", "first")
DRAFT_N_MAX = 3  # llama-server's --spec-draft-n-max default (common/common.h)
DRAFT_N_MIN = 0  # llama-server's --spec-draft-n-min default
