"""`rpcfleet serve`: an OpenAI-compatible endpoint on the fleet that survives losing a node.

Probe, choose the formations (`--replicas auto|N`, `--split`; several models: `-m` repeated or `--models`;
`orchestrator.planning.formations`), and for each: plan, run llama-server on the plan
(`orchestrator.serve.engine`, on loopback, `--parallel` slots) and serve its OpenAI routes through serve's
own front (`/v1/completions`, `/v1/chat/completions`, streaming, `/v1/models`, `/v1/embeddings`, `/slots`),
with `/health` and `/metrics` (`orchestrator.serve`). SIGHUP or `POST /admin/reload` reloads: drain, unload,
optionally a rolling restart of the fleet (the step of `restart --rolling`), re-plan, load. Binds loopback
by default; any other address needs an API key. The key comes from `--api-key-file`, `RPCFLEET_API_KEY` or
`--api-key` (which `ps` shows to every user).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from orchestrator.cli import _inputs, _output, _parser, _planning
from orchestrator.cli._output import escape
from orchestrator.core import fields
from orchestrator.core.errors import UsageError
from orchestrator.core.units import format_size

DEFAULT_PARALLEL = 4  # = orchestrator.serve.engine.DEFAULT_PARALLEL (not imported: the CLI starts fast)
KEY_ENV = "RPCFLEET_API_KEY"  # the key from the environment: argv is world-readable (`ps`), this is not
ADMIN_KEY_ENV = "RPCFLEET_ADMIN_KEY"  # the admin routes' own key (`--admin-key-file`)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over the fleet: OpenAI API, /health, /metrics; survives a lost node",
        description=(
            "Probe the selected servers, plan the model, run llama-server on the plan (on loopback, with "
            "--parallel slots) and serve its OpenAI API (completions, chat, streaming, models) behind "
            "serve's API key, /health and /metrics. A lost node ends the requests in flight with 503 naming "
            "it; the model is re-planned on the nodes that answer and llama-server restarted there. "
            "SIGHUP or POST /admin/reload reloads (drain, unload, [rolling restart], plan, load)."
        ),
    )
    parser.add_argument(
        "--model",
        "-m",
        type=Path,
        action="append",
        default=None,
        help="a GGUF model (first shard); several -m serve several models, each on its own servers",
    )
    parser.add_argument(
        "--models",
        type=Path,
        default=None,
        metavar="FILE",
        help="a YAML file of models to serve (model, name, context, parallel, replicas, hosts, groups)",
    )
    _planning.add_replicas_args(parser)
    _planning.add_plan_option_args(parser)
    # llama-server's slots are the plan's sequences: the plan sizes their KV and compute
    parser.set_defaults(parallel=DEFAULT_PARALLEL)
    parser.add_argument(
        "--host", type=_parser.address, default="127.0.0.1", help="address to bind (default: 127.0.0.1)"
    )
    parser.add_argument("--port", type=_parser.flag(fields.port), default=8080, help="port (default: 8080)")
    key = parser.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        default=None,
        help=f"the key clients send as `Authorization: Bearer KEY` (visible in `ps`: prefer --api-key-file "
        f"or {KEY_ENV})",
    )
    key.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help=f"a file whose first line is the key (or set {KEY_ENV})",
    )
    parser.add_argument(
        "--admin-key-file",
        type=Path,
        default=None,
        help=f"a file whose first line is the admin key (or set {ADMIN_KEY_ENV}): /admin/* then takes only "
        "it; without one the API key may reload, never with a rolling restart of the fleet",
    )
    parser.add_argument(
        "--model-name", default=None, help="the model's id in the API (default: the file's stem)"
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="NAME|FILE",
        help="the chat format: one of llama-server's template names (gemma, chatml, llama3...) or a jinja "
        "file (default: the GGUF's template; without one, its architecture's known template)",
    )
    parser.add_argument(
        "--queue",
        type=_parser.flag(fields.integer(minimum=0)),
        default=8,
        help="requests that may wait for a slot beyond the --parallel served; more get 429 (default: 8)",
    )
    parser.add_argument(
        "--queue-timeout",
        type=_parser.flag(fields.seconds),
        default=120.0,
        metavar="S",
        help="seconds a request may wait in the queue (default: 120)",
    )
    parser.add_argument(
        "--recover-timeout",
        type=_parser.flag(fields.seconds),
        default=600.0,
        metavar="S",
        help="seconds to get serving again after a lost node before exiting with status 1 (default: 600)",
    )
    parser.add_argument(
        "--link-timeout",
        type=_parser.flag(fields.seconds),
        default=10.0,
        metavar="S",
        help="seconds a cut link may stall llama-server before it is declared lost (default: 10)",
    )
    parser.add_argument(
        "--rejoin-interval",
        type=_parser.flag(seconds_or_zero),
        default=5.0,
        metavar="S",
        help="while degraded, seconds between two probes of the nodes left out; one that answers again "
        "is taken back after the request being served (re-plan and load, as a reload); 0: never (default: 5)",
    )
    parser.add_argument(
        "--reload-rolling",
        action="store_true",
        help="a SIGHUP reload also restarts the fleet's servers one at a time (restart --rolling)",
    )
    parser.add_argument("--seed", type=int, default=0, help="default sampling seed (default: 0)")
    parser.add_argument(
        "--observe-interval",
        type=_parser.flag(seconds_or_zero),
        default=15.0,
        metavar="S",
        help="seconds between two probe rounds of the fleet exporter (the page at /, the fleet's series on "
        "/metrics); 0: off (default: 15)",
    )
    _inputs.add_inventory_args(parser)
    parser.set_defaults(handler=handle)


def seconds_or_zero(value: str) -> float:
    """A number of seconds, or 0 (off)."""
    try:
        return 0.0 if float(value) == 0 else fields.seconds(value)
    except ValueError:
        raise ValueError(f"expected 0 (never) or a positive number of seconds, got {value!r}") from None


def api_key_of(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file, --api-key or RPCFLEET_API_KEY, in that order (None: no key)."""
    if args.api_key_file is not None:
        return _key_file("--api-key-file", args.api_key_file)
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key is empty")
    if args.api_key:
        return str(args.api_key).strip()
    return _key_env(KEY_ENV)


def admin_key_of(args: argparse.Namespace, api_key: str | None) -> str | None:
    """The admin key from --admin-key-file or RPCFLEET_ADMIN_KEY (None: none); never the API key."""
    path = args.admin_key_file
    key = _key_file("--admin-key-file", path) if path is not None else _key_env(ADMIN_KEY_ENV)
    if key is not None and key == api_key:
        raise UsageError("the admin key is the API key: give the admin routes a key of their own")
    return key


def _key_file(flag: str, path: Path) -> str:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise UsageError(f"{flag} {path}: {exc.strerror}") from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise UsageError(f"{flag} {path}:1: the first line is empty")
    return key


def _key_env(name: str) -> str | None:
    from_env = os.environ.get(name)
    if from_env is not None and not from_env.strip():
        raise UsageError(f"{name} is set but empty")
    return from_env.strip() if from_env else None


def handle(args: argparse.Namespace) -> int:
    from orchestrator.cli._progress import LoadBars
    from orchestrator.inventory.model import is_loopback
    from orchestrator.serve.backend import ServeConfig
    from orchestrator.workflows.serve import ServeRequest, serve_fleet

    api_key = api_key_of(args)
    if api_key is None and not is_loopback(args.host):
        raise UsageError(
            f"--host {args.host} is not a loopback address: serving it without an API key is refused",
            hint=f"add --api-key-file or {KEY_ENV}, or bind 127.0.0.1",
        )
    planning = _planning.planning_args(args)
    limits = ServeConfig(
        queue_size=args.queue,
        queue_timeout=args.queue_timeout,
        recover_timeout=args.recover_timeout,
        link_timeout=args.link_timeout,
        rejoin_interval=args.rejoin_interval,
        seed=args.seed,
    )
    request = ServeRequest(
        model_paths=args.model or (),
        models_file=args.models,
        model_name=args.model_name,
        hosts=lambda: _inputs.load_hosts(args),
        options=planning.options,
        probe=planning.probe,
        local_devices=planning.local_devices,
        replicas="split" if args.split else str(args.replicas),
        listen=_inputs.listen_socket(args.host, args.port),  # before the fleet is probed or a model loaded
        host=args.host,
        port=args.port,
        api_key=api_key,
        admin_key=admin_key_of(args, api_key),
        chat_template=args.chat_template,
        limits=limits,
        reload_rolling=args.reload_rolling,
        observe_interval=args.observe_interval,
    )
    bars = LoadBars(_output.err_console.is_terminal, names={})
    with bars:
        outcome = serve_fleet(request, ServeScreen(bars).events())
    if outcome.failed:
        _output.err_console.print(f"[red]error:[/red] {escape(outcome.reasons)}", highlight=False)
        return 1
    return 0


class ServeScreen:
    """What serve shows on stderr: warnings, the formations chosen, one load's bars, a line per load."""

    def __init__(self, bars: Any) -> None:
        self.bars = bars

    def events(self) -> Any:
        from orchestrator.workflows.serve import ServeEvents

        return ServeEvents(
            warning=lambda text: self.say(f"[yellow]warning:[/yellow] {escape(text)}"),
            formed=self.formed,
            progress=self.bars,
            loaded=self.loaded,
            engine_build=lambda line: self.say(escape(line)),
        )

    def say(self, markup: str) -> None:
        _output.err_console.print(markup, highlight=False)

    def formed(self, formed: Any, url: str) -> None:
        self.bars.names = {h.endpoint: h.name for one in formed for h in one.hosts}
        models = list(dict.fromkeys(one.model.name for one in formed))
        self.say(f"serving {escape(', '.join(models))} on {escape(url)} (loading...)")
        for one in formed:
            self.say(
                f"  {escape(one.choice.name)}: {len(one.choice.endpoints)} node(s) "
                f"({escape(', '.join(one.choice.endpoints))}), llama-server with "
                f"{one.model.options.parallel} slot(s)"
            )

    def loaded(self, loaded: Any) -> None:
        self.bars.finish()
        cache = f" ({format_size(loaded.cache_hits)} from the nodes' caches)" if loaded.cache_hits else ""
        who = f"{loaded.formation} " if loaded.formation else ""
        self.say(
            f"{escape(who)}{loaded.state} on {loaded.nodes} node(s): "
            + " · ".join(f"{k} {v:.2f} s" for k, v in loaded.phases.items())
            + escape(cache)
        )
