"""The typed options of a planning request, built once at a front end's edge (argparse's namespace, a
playbook step's arguments, serve's flags): no state travels on the parser's namespace."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.planning.plan import DEFAULT_MARGIN, PlanOptions
from orchestrator.probe.host import DEFAULT_TIMEOUT


@dataclass(frozen=True)
class ProbeSettings:
    """How a plan's probe runs: per-host timeout, host facts over SSH or RPC only, hosts at once, and
    whether a CPU server's own memory figure is trusted when its host facts cannot be read."""

    timeout: float = DEFAULT_TIMEOUT
    facts: bool = True
    forks: int | None = None
    trust_rpc_memory: bool = False


@dataclass(frozen=True)
class ModelPlanning:
    """A model to plan, and how: the plan's options, the probe's settings, the local GPUs wanted (None:
    all, []: none)."""

    model: Path
    options: PlanOptions
    probe: ProbeSettings
    local_devices: Sequence[str] | None = None


# The planning options by the CLI's flag names (`--ctx` -> "ctx"), with the CLI's defaults; a playbook
# step's arguments use the same names.
PLAN_OPTION_DEFAULTS: Mapping[str, Any] = {
    "ctx": 4096,
    "type_k": "f16",
    "type_v": "f16",
    "ubatch": 512,
    "flash_attn": "auto",  # llama-server's -fa default
    "swa_full": False,
    "parallel": 1,
    "kv_unified": False,
    "n_cpu_moe": 0,
    "margin": None,
    "strategy": "proportional",
}


def flash_attn_planned(value: bool | str) -> bool:
    """Whether the plan assumes flash attention for `-fa VALUE` (a playbook's boolean too). llama.cpp's
    `auto` turns it on unless a layer's device lacks the kernel (llama_context::resolve_fused_ops); the CPU,
    CUDA, Metal and Vulkan backends, and RPC servers of them, have it, so auto plans (and runs) it on."""
    if isinstance(value, str):
        return value != "off"
    return bool(value)


def plan_options(values: Mapping[str, Any], *, n_ctx: int | None = None) -> PlanOptions:
    """The one builder of `PlanOptions` from the planning flags by name (`PLAN_OPTION_DEFAULTS` for an
    absent or None one, `margin` None = the default margin); `n_ctx` overrides "ctx" (the report plans
    several contexts)."""

    def get(name: str) -> Any:
        value = values.get(name)
        return PLAN_OPTION_DEFAULTS[name] if value is None else value

    return PlanOptions(
        n_ctx=get("ctx") if n_ctx is None else n_ctx,
        type_k=get("type_k"),
        type_v=get("type_v"),
        n_ubatch=get("ubatch"),
        flash_attn=flash_attn_planned(get("flash_attn")),
        swa_full=bool(get("swa_full")),
        parallel=get("parallel"),
        kv_unified=bool(get("kv_unified")),
        n_cpu_moe=get("n_cpu_moe"),
        margin=values["margin"] if values.get("margin") is not None else DEFAULT_MARGIN,
        strategy=get("strategy"),
    )


def local_device_selection(text: str | None) -> list[str] | None:
    """`--local-devices`: absent = all (None), '' = none, 'CUDA0,CUDA1' = those in order."""
    if text is None:
        return None
    return [name.strip() for name in text.split(",") if name.strip()]
