"""A plan as other tools' arguments: llama-cli flags and a Python snippet."""

from __future__ import annotations

from pathlib import Path

from orchestrator.planning.plan import Plan


def _fmt_split(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def cli_device_names(plan: Plan) -> list[str]:
    """Device names a fresh llama.cpp process gives the plan's devices: RPC devices are `RPC<k>` with k a
    process-wide counter in registration order (ggml_backend_rpc_add_server); local GPUs keep theirs."""
    names: list[str] = []
    k = 0
    for d in plan.devices:
        if d.endpoint is not None:
            names.append(f"RPC{k}")
            k += 1
        else:
            names.append(d.name)
    return names


def llama_cli_args(plan: Plan, model_path: str | Path | None = None) -> list[str]:
    """Arguments for llama-cli / llama-server (same llama.cpp) that reproduce this plan.

    `--rpc` comes before `--device` because the RPC devices exist only once registered. `--fit off`
    keeps llama.cpp from adjusting the plan's values to its own fit.
    """
    args = ["-m", str(model_path or plan.model_path)]
    if plan.endpoints:
        args += ["--rpc", ",".join(plan.endpoints)]
    if plan.devices:
        args += ["--device", ",".join(cli_device_names(plan))]
        args += [
            "--split-mode",
            plan.split_mode,
            "--tensor-split",
            ",".join(map(_fmt_split, plan.tensor_split)),
        ]
        if plan.main_gpu:
            args += ["--main-gpu", str(plan.main_gpu)]
    else:
        args += ["--device", "none"]
    opts = plan.options
    args += [
        "-ngl",
        str(plan.n_gpu_layers),
        "-c",
        str(plan.n_ctx),
        "-ub",
        str(opts.n_ubatch),
        "-ctk",
        opts.type_k,
        "-ctv",
        opts.type_v,
        "-fa",
        "on" if opts.flash_attn else "off",
        "--fit",
        "off",
        "--parallel",
        str(opts.parallel),
    ]
    # llama-server's default is the small SWA cache (and no unified KV): say so only when different
    if opts.swa_full:
        args.append("--swa-full")
    if opts.kv_unified:
        args.append("--kv-unified")
    if opts.n_cpu_moe:
        args += ["--n-cpu-moe", str(opts.n_cpu_moe)]
    return args + draft_args(plan)


def draft_args(plan: Plan) -> list[str]:
    """llama-server's speculative decoding flags for the plan's draft model (none without one). A plain
    GGUF draft needs `--spec-type draft-simple`: llama-server infers a type only for MTP/DFlash drafts and
    otherwise loads the draft without using it. The device is always given: without `--spec-draft-device`
    the draft follows `--device` (split over the target's devices, unplanned)."""
    draft = plan.draft
    if draft is None:
        return []
    args = ["--spec-type", "draft-simple", "--spec-draft-model", draft.model_path]
    args += ["--spec-draft-n-max", str(draft.n_max), "--spec-draft-n-min", str(draft.n_min)]
    if draft.device == "first" and plan.devices:
        return [*args, "--spec-draft-device", cli_device_names(plan)[0], "--spec-draft-ngl", "all"]
    return [*args, "--spec-draft-device", "none"]


def python_snippet(
    plan: Plan, model_path: str | Path | None = None, plan_path: str | Path | None = None
) -> str:
    """A Python program that loads this plan through rpcfleet's loader: from `plan_path` when the plan
    was saved there, otherwise from the plan's JSON written into the program itself."""
    path = str(model_path or plan.model_path)
    if plan_path is not None:
        load = f"plan = orchestrator.Plan.from_path({str(plan_path)!r})\n"
    else:
        load = f"PLAN = {plan.to_text()!r}\nplan = orchestrator.Plan.from_text(PLAN)\n"
    return (
        "import orchestrator\n"
        "\n"
        f"{load}"
        f"llm = orchestrator.load_llama(plan, {path!r})\n"
        "try:\n"
        "    out = llm('The capital of France is', max_tokens=16)\n"
        "    print(out['choices'][0]['text'])\n"
        "finally:\n"
        "    llm.close()\n"
    )
