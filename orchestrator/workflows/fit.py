"""The one fit policy: whether a plan fits, and what a front end does when it does not.

Every front end refuses a plan that does not fit before anything is loaded: on CPU servers, with memory
overcommit, the allocation would succeed and the kernel's OOM killer would kill the rpc-server later, in
the middle of the load or of a generation. The refusal names the binding device, what it needs against
what it may use, and the shortfall; the hint names the largest context that fits in the front end's own
words (`--ctx` for the CLI and serve, `n_ctx` for `orchestrator.Llama`, `ctx` in a playbook). Only
the CLI's `--force` turns the refusal into a warning; serve keeps it as its reason to wait for the fleet
(or for a spare server). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.core.errors import PlanError
from orchestrator.core.units import format_size
from orchestrator.planning.plan import Plan


@dataclass(frozen=True)
class FitWords:
    """How a front end names the remedies: its context option and its way to load anyway (None: none)."""

    ctx: str = "--ctx"
    more: str = "more nodes"
    anyway: str | None = "--force to load it anyway"


CLI_WORDS = FitWords()
PLAYBOOK_WORDS = FitWords(ctx="ctx", anyway=None)
DROPIN_WORDS = FitWords(ctx="n_ctx", more="more servers", anyway="a tensor_split of your own")
SERVE_WORDS = FitWords(anyway=None)  # serve waits for the fleet (or a spare): no --force


def misfit_error(plan: Plan, words: FitWords = CLI_WORDS) -> PlanError | None:
    """None when `plan` fits; else the error that refuses it (naming the binding device's endpoint)."""
    fit = plan.fit
    if fit.fits:
        return None
    if fit.binding_device is None or not plan.devices:
        message = f"the model does not fit: the host is short by {format_size(fit.shortfall)}"
        endpoint = None
    else:
        dev = plan.devices[fit.binding_device]
        m = dev.memory
        message = (
            f"the model does not fit: {dev.label} needs {format_size(m.total)} (weights "
            f"{format_size(m.weights)}, KV {format_size(m.kv)}, compute {format_size(m.compute)}) plus a "
            f"margin of {format_size(m.margin)} but may use {format_size(m.usable)}: {dev.label} is short "
            f"by {format_size(fit.shortfall)}"
        )
        endpoint = dev.endpoint
    largest = fit.largest_n_ctx
    ctx = f"a smaller {words.ctx} (the largest that fits: {largest})" if largest else f"a smaller {words.ctx}"
    remedies = [ctx, words.more] + ([words.anyway] if words.anyway else [])
    hint = "use " + ", ".join(remedies[:-1]) + f", or {remedies[-1]}"
    return PlanError(message, host=endpoint, hint=hint)


def check_fit(plan: Plan, *, force: bool = False, words: FitWords = CLI_WORDS) -> str | None:
    """Raise the misfit's PlanError unless `force`; with `force`, return it as the warning to print
    (None when the plan fits)."""
    error = misfit_error(plan, words)
    if error is None:
        return None
    if not force:
        raise error
    return f"{error.message} (--force)"
