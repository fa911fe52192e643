"""`rpcfleet serve`: an OpenAI-compatible endpoint on the fleet that survives losing a node.

Probe, choose the formations (`--replicas auto|N`, `--split`; several models: `-m` repeated or `--models`;
`orchestrator.planning.formations`), and for each: plan, run llama-server on the plan
(`orchestrator.serve.engine`, on loopback, `--parallel` slots) and serve its OpenAI routes through serve's
own front (`/v1/completions`, `/v1/chat/completions`, streaming, `/v1/models`, `/v1/embeddings`, `/slots`),
with `/health` and `/metrics` (`orchestrator.serve`). SIGHUP or `POST /admin/reload` reloads: drain, unload,
optionally a rolling restart of the fleet (the step of `restart --rolling`), re-plan, load. Binds loopback
by default; any other address needs an API key. The key comes from `--api-key-file`, `RPCFLEET_API_KEY` or
`--api-key` (which `ps` shows to every user), or per-user keys from `--keys FILE` (`orchestrator.serve.keys`).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from orchestrator.cli import _inputs, _output, _planning
from orchestrator.cli._output import escape
from orchestrator.workflows.serve_options import EXCLUSIVE, SERVE_OPTIONS, serve_config

if TYPE_CHECKING:
    from orchestrator.workflows.serve import ServeRequest


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over the fleet: OpenAI API, /health, /metrics; survives a lost node",
        description=(
            "Probe the selected servers, plan the model, run llama-server on the plan (on loopback, with "
            "--parallel slots) and serve its OpenAI API (completions, chat, streaming, models) behind "
            "serve's API key, /health and /metrics. At a lost node the model is re-planned on the nodes that "
            "answer and llama-server restarted there; the requests in flight go on once a formation of the "
            "model serves again (a stream from where it stopped), else get 503 naming the node. "
            "SIGHUP or POST /admin/reload reloads (drain, unload, [rolling restart], plan, load)."
        ),
    )
    _planning.add_options(parser, SERVE_OPTIONS, exclusive=EXCLUSIVE)  # declared in workflows/serve_options
    _inputs.add_inventory_args(parser)
    parser.set_defaults(handler=handle)


def serve_request(args: argparse.Namespace) -> ServeRequest:
    """serve's flags as the typed request, read once: the keys, the planning, the limits, and the socket
    (bound last, before the fleet is probed or a model loaded)."""
    from orchestrator.workflows.serve import ServeRequest, SpeculativeRequest

    api_key = _inputs.listen_key_of(args, "it")
    admin_key = _inputs.admin_key_of(args, api_key)
    planning = _planning.planning_args(args)
    return ServeRequest(
        model_paths=args.model or (),
        models_file=args.models,
        model_name=args.model_name,
        hosts=lambda: _inputs.load_hosts(args),
        options=planning.options,
        probe=planning.probe,
        local_devices=planning.local_devices,
        replicas="split" if args.split else str(args.replicas),
        listen=_inputs.listen_socket(args.host, args.port),
        host=args.host,
        port=args.port,
        api_key=api_key,
        admin_key=admin_key,
        keys_file=args.keys,
        chat_template=args.chat_template,
        limits=serve_config(vars(args)),
        reload_rolling=args.reload_rolling,
        observe_interval=args.observe_interval,
        draft=SpeculativeRequest(args.draft, args.draft_max, args.draft_min, args.device_draft),
    )


def handle(args: argparse.Namespace) -> int:
    from orchestrator.cli._progress import LoadBars
    from orchestrator.cli._serve_screen import ServeScreen
    from orchestrator.workflows.serve import serve_fleet

    request = serve_request(args)
    with LoadBars(_output.err_console.is_terminal, names={}) as bars:
        outcome = serve_fleet(request, ServeScreen(bars).events())
    if outcome.failed:
        _output.err_console.print(f"[red]error:[/red] {escape(outcome.reasons)}", highlight=False)
        return 1
    return 0
