"""The planning options, declared once, and the typed options of a planning request built from them at a
front end's edge (argparse's namespace, a playbook step's arguments, serve's flags): no state travels on
the parser's namespace.

Each option (`Option`) is one declaration: its name (a playbook step's argument and the namespace's
attribute), its command-line flags (llama.cpp's own spellings where it has one: `-fa`, `-np`,
`--swa-full`), its parser (a field parser of `orchestrator.core.fields`: a value means the same in a flag
and in YAML), its default, its choices and its help. The command line's flags (`cli/_planning.py:
add_options`) and the playbook steps' arguments (`playbooks/args.py: option_arg`) are made from them.
Cheap to import (the command line reads it at start-up): the planner is imported where options are built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.core import fields
from orchestrator.planning.settings import (
    DEFAULT_MARGIN,
    FLASH_ATTN_MODES,
    KV_CACHE_TYPE_NAMES,
    MAX_SEQ,
    STRATEGIES,
)
from orchestrator.probe.settings import DEFAULT_TIMEOUT
from orchestrator.serve.settings import DEFAULT_PARALLEL

if TYPE_CHECKING:
    from orchestrator.planning.plan import PlanOptions


@dataclass(frozen=True)
class Option:
    """One option of a command (planning and probe here, serve's own in `serve_options`). `choices`: the
    words a flag takes (argparse lists them and suggests the closest); `parse` takes them too, and in a
    playbook YAML's forms (`flash_attn: true`). `bare`: the value of the flag given alone (`-fa` = on).
    `switch`: a flag without a value that sets the opposite of `default` (`--swa-full`, `--no-facts`); the
    playbook's argument is a boolean. `repeat`: the flag may be given several times, its values parsed
    and collected in a list (`serve -m A -m B`; None when never given)."""

    name: str
    flags: tuple[str, ...]
    parse: Callable[[Any], Any]
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    bare: str | None = None
    switch: bool = False
    repeat: bool = False


def flash_attn_mode(value: Any) -> str:
    """llama.cpp's -fa on|off|auto, or a YAML boolean (true = on)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return _FLASH_ATTN_WORDS(value)


_FLASH_ATTN_WORDS = fields.choice(FLASH_ATTN_MODES, {"true": "on", "yes": "on", "false": "off", "no": "off"})


def device_names(text: str) -> list[str]:
    """`--local-devices`: '' = none, 'CUDA0,CUDA1' = those in order."""
    return [name.strip() for name in text.split(",") if name.strip()]


def _kv_type(which: str) -> Option:
    return Option(
        f"type_{which}",
        (f"--type-{which}",),
        fields.choice(KV_CACHE_TYPE_NAMES),
        "f16",
        f"KV cache type of {which.upper()}: {', '.join(KV_CACHE_TYPE_NAMES)} (default: f16)",
        choices=KV_CACHE_TYPE_NAMES,
        metavar="TYPE",
    )


CTX = Option(
    "ctx",
    ("--ctx",),
    fields.context,
    4096,
    "context size: 8192, 8k, 128k (default: 4096; 0 = the model's training context)",
)
MARGIN = Option(
    "margin",
    ("--margin",),
    fields.size,
    None,  # None: the planner's DEFAULT_MARGIN
    f"headroom kept free per device (default: {DEFAULT_MARGIN >> 20}MiB)",
)
TYPE_K = _kv_type("k")
TYPE_V = _kv_type("v")
FLASH_ATTN = Option(
    "flash_attn",
    ("--flash-attn", "-fa"),
    flash_attn_mode,
    "auto",  # llama-server's -fa default
    "flash attention, llama.cpp's -fa (default: auto, llama-server's: on where the devices run it; the plan "
    "assumes on and passes -fa on, so that what is planned is what runs)",
    choices=FLASH_ATTN_MODES,
    metavar="|".join(FLASH_ATTN_MODES),
    bare="on",
)
SWA_FULL = Option(
    "swa_full",
    ("--swa-full",),
    fields.boolean,
    False,
    "full-context cache for sliding-window layers, as llama.cpp's C default (default: the small SWA cache, "
    "as llama-server)",
    switch=True,
)
PARALLEL = Option(
    "parallel",
    ("--parallel", "-np"),
    fields.integer(minimum=1, maximum=MAX_SEQ),
    1,
    "parallel sequences (n_seq_max; serve: llama-server's slots, served at once and batched together): "
    f"each gets --ctx/N unless --kv-unified (default: 1; serve: {DEFAULT_PARALLEL})",
    metavar="N",
)
KV_UNIFIED = Option(
    "kv_unified",
    ("--kv-unified",),
    fields.boolean,
    False,
    "one KV cache shared by all sequences (each may use the whole context)",
    switch=True,
)
N_CPU_MOE = Option(
    "n_cpu_moe",
    ("--n-cpu-moe",),
    fields.integer(minimum=0),
    0,
    "keep the expert (MoE) weights of the first N layers on this machine's CPU (default: 0)",
    metavar="N",
)
UBATCH = Option("ubatch", ("--ubatch",), fields.integer(minimum=1), 512, "n_ubatch (default: 512)")
STRATEGY = Option(
    "strategy",
    ("--strategy",),
    fields.choice(STRATEGIES),
    STRATEGIES[0],
    "layers proportional to usable memory (default), or on the fewest devices",
    choices=STRATEGIES,
)

# What a plan is made with (`plan_options`), in the order the command line lists them.
PLAN_OPTIONS = (
    CTX,
    MARGIN,
    TYPE_K,
    TYPE_V,
    FLASH_ATTN,
    SWA_FULL,
    PARALLEL,
    KV_UNIFIED,
    N_CPU_MOE,
    UBATCH,
    STRATEGY,
)

TRUST_RPC_MEMORY = Option(
    "trust_rpc_memory",
    ("--trust-rpc-memory",),
    fields.boolean,
    False,
    "plan on a CPU server's own memory figure (total RAM) when its host facts cannot be read (default: such "
    "a node is refused)",
    switch=True,
)
LOCAL_DEVICES = Option(
    "local_devices",
    ("--local-devices",),
    device_names,
    None,  # None: all
    "local GPUs after the RPC devices: absent = all, '' = none, 'CUDA0,CUDA1' = those in order",
    metavar="NAMES",
)
TIMEOUT = Option(
    "timeout",
    ("--timeout",),
    fields.seconds,
    DEFAULT_TIMEOUT,
    f"seconds per host for the RPC probe and the facts (default: {DEFAULT_TIMEOUT:g})",
    metavar="S",
)
FACTS = Option(
    "facts",
    ("--no-facts",),
    fields.boolean,
    True,
    "RPC only: no SSH (CPU devices then show the server's free figure, which is total RAM)",
    switch=True,
)

# How the fleet is probed for a plan (`ProbeSettings`, the local GPUs), in the command line's order.
PROBE_OPTIONS = (TRUST_RPC_MEMORY, LOCAL_DEVICES, TIMEOUT, FACTS)

OPTIONS: Mapping[str, Option] = {option.name: option for option in (*PLAN_OPTIONS, *PROBE_OPTIONS)}


@dataclass(frozen=True)
class ProbeSettings:
    """How a plan's probe runs: per-host timeout, host facts over SSH or RPC only, hosts at once, and
    whether a CPU server's own memory figure is trusted when its host facts cannot be read."""

    timeout: float = TIMEOUT.default
    facts: bool = FACTS.default
    forks: int | None = None
    trust_rpc_memory: bool = TRUST_RPC_MEMORY.default


@dataclass(frozen=True)
class ModelPlanning:
    """A model to plan, and how: the plan's options, the probe's settings, the local GPUs wanted (None:
    all, []: none)."""

    model: Path
    options: PlanOptions
    probe: ProbeSettings
    local_devices: Sequence[str] | None = None


def flash_attn_planned(value: bool | str) -> bool:
    """Whether the plan assumes flash attention for `-fa VALUE` (a playbook's boolean too). llama.cpp's
    `auto` turns it on unless a layer's device lacks the kernel (llama_context::resolve_fused_ops); the CPU,
    CUDA, Metal and Vulkan backends, and RPC servers of them, have it, so auto plans (and runs) it on."""
    if isinstance(value, str):
        return value != "off"
    return bool(value)


def plan_options(
    values: Mapping[str, Any], *, n_ctx: int | None = None, llama_server: bool = False
) -> PlanOptions:
    """The one builder of `PlanOptions` from the planning options by name (`PLAN_OPTIONS`' default for an
    absent or None one, `margin` None = the planner's default margin); `n_ctx` overrides "ctx" (the
    report plans several contexts); `llama_server`: the plan is for llama-server (serve, export, the
    llama-cli format), which reserves logits for one output per sequence, not n_batch of them."""
    from orchestrator.planning.plan import PlanOptions

    def get(name: str) -> Any:
        value = values.get(name)
        return OPTIONS[name].default if value is None else value

    margin = get("margin")
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
        n_outputs_max=get("parallel") if llama_server else 0,
        margin=DEFAULT_MARGIN if margin is None else margin,
        strategy=get("strategy"),
    )


def probe_settings(
    values: Mapping[str, Any], *, forks: int | None = None, facts: bool = True
) -> ProbeSettings:
    """The probe's settings from the probe options by name (`PROBE_OPTIONS`' default for an absent one);
    `facts=False` reads no host facts whatever the options say."""

    def get(name: str) -> Any:
        value = values.get(name)
        return OPTIONS[name].default if value is None else value

    return ProbeSettings(
        timeout=get("timeout"),
        facts=facts and bool(get("facts")),
        forks=forks,
        trust_rpc_memory=bool(get("trust_rpc_memory")),
    )
