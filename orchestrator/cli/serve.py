"""`rpcfleet serve`: an OpenAI-compatible endpoint on the fleet that survives losing a node.

Probe, plan, run llama-server on the plan (`orchestrator.serve.engine`, on loopback, `--parallel` slots)
and serve its OpenAI routes through serve's own front (`/v1/completions`, `/v1/chat/completions`,
streaming, `/v1/models`, `/v1/embeddings`, `/slots`), with `/health` and `/metrics` (`orchestrator.serve`).
SIGHUP or `POST /admin/reload` reloads: drain, unload, optionally a rolling restart of the fleet (the
step of `restart --rolling`), re-plan, load. Binds loopback by default; any other address needs an API key.
The key comes from `--api-key-file`, `RPCFLEET_API_KEY` or `--api-key` (which `ps` shows to every user).
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

from orchestrator.cli import _common, _planning
from orchestrator.cli._common import escape
from orchestrator.core import fields, signals
from orchestrator.core.errors import UsageError
from orchestrator.core.units import format_size

DEFAULT_PARALLEL = 4  # = orchestrator.serve.engine.DEFAULT_PARALLEL (not imported: the CLI starts fast)
KEY_ENV = "RPCFLEET_API_KEY"  # the key from the environment: argv is world-readable (`ps`), this is not


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
    parser.add_argument("--model", "-m", type=Path, required=True, help="the GGUF model (first shard)")
    _planning.add_plan_option_args(parser)
    # llama-server's slots are the plan's sequences: the plan sizes their KV and compute
    parser.set_defaults(parallel=DEFAULT_PARALLEL)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=_common.flag(fields.port), default=8080, help="port (default: 8080)")
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
        type=_common.flag(fields.integer(minimum=0)),
        default=8,
        help="requests that may wait for a slot beyond the --parallel served; more get 429 (default: 8)",
    )
    parser.add_argument(
        "--queue-timeout",
        type=_common.flag(fields.seconds),
        default=120.0,
        metavar="S",
        help="seconds a request may wait in the queue (default: 120)",
    )
    parser.add_argument(
        "--recover-timeout",
        type=_common.flag(fields.seconds),
        default=600.0,
        metavar="S",
        help="seconds to get serving again after a lost node before exiting with status 1 (default: 600)",
    )
    parser.add_argument(
        "--link-timeout",
        type=_common.flag(fields.seconds),
        default=10.0,
        metavar="S",
        help="seconds a cut link may stall llama-server before it is declared lost (default: 10)",
    )
    parser.add_argument(
        "--rejoin-interval",
        type=_common.flag(seconds_or_zero),
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
        type=_common.flag(seconds_or_zero),
        default=15.0,
        metavar="S",
        help="seconds between two probe rounds of the fleet exporter (the page at /, the fleet's series on "
        "/metrics); 0: off (default: 15)",
    )
    _common.add_inventory_args(parser)
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
        try:
            lines = args.api_key_file.read_text().splitlines()
        except OSError as exc:
            raise UsageError(f"--api-key-file {args.api_key_file}: {exc.strerror}") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise UsageError(f"--api-key-file {args.api_key_file}:1: the first line is empty")
        return key
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key is empty")
    if args.api_key:
        return str(args.api_key).strip()
    from_env = os.environ.get(KEY_ENV)
    if from_env is not None and not from_env.strip():
        raise UsageError(f"{KEY_ENV} is set but empty")
    return from_env.strip() if from_env else None


def handle(args: argparse.Namespace) -> int:
    from orchestrator.inventory.model import is_loopback
    from orchestrator.planning.profile import profile_model

    profile_model(_common.require_model(args.model))  # a file that is no model fails before the probe
    from orchestrator.serve.templates import model_chat_template

    template = model_chat_template(args.model, args.chat_template)  # a bad --chat-template: exit 2
    api_key = api_key_of(args)
    if api_key is None and not is_loopback(args.host):
        raise UsageError(
            f"--host {args.host} is not a loopback address: serving it without an API key is refused",
            hint=f"add --api-key-file or {KEY_ENV}, or bind 127.0.0.1",
        )
    import uvicorn

    from orchestrator.cli._progress import LoadBars
    from orchestrator.planning.plan import Plan
    from orchestrator.serve.app import create_app
    from orchestrator.serve.backend import Backend, ServeConfig
    from orchestrator.serve.fleet import ServeFleet

    _, hosts = _common.load_hosts(args)
    if not hosts:
        raise UsageError("no hosts selected")
    sock = _common.listen_socket(args.host, args.port)  # before the fleet is probed or the model loaded
    request = _planning.planning_args(args)
    fleet = ServeFleet(
        hosts,
        str(args.model),
        request.options,
        probe_timeout=request.probe.timeout,
        facts=request.probe.facts,
        trust_rpc_memory=request.probe.trust_rpc_memory,
        forks=request.probe.forks,
        local_devices=request.local_devices,
    )
    config = ServeConfig(
        parallel=args.parallel,
        queue_size=args.queue,
        queue_timeout=args.queue_timeout,
        recover_timeout=args.recover_timeout,
        link_timeout=args.link_timeout,
        rejoin_interval=args.rejoin_interval,
        seed=args.seed,
    )
    first = fleet.plan_round()  # a model that does not fit at start is an error, not a wait
    if first.plan is None:
        from orchestrator.core.errors import PlanError

        states = ", ".join(f"{ep} {state}" for ep, state in first.states.items())
        raise PlanError(
            f"cannot serve {args.model}: {first.reason} ({states})", hint="rpcfleet plan shows why"
        )
    from orchestrator.serve.engine import default_engines

    model_name = args.model_name or args.model.stem
    if template.warning:
        _common.err_console.print(f"[yellow]warning:[/yellow] {escape(template.warning)}", highlight=False)
    engines, _ = default_engines(
        str(args.model),
        model_name,
        parallel=args.parallel,
        link_timeout=args.link_timeout,
        chat_template=args.chat_template,
        progress=lambda line: _common.err_console.print(escape(line), highlight=False),
    )
    backend = Backend(fleet, config, engines)
    backend.template = {"source": template.source, "warning": template.warning}
    backend.nodes.update(first.states)  # a node down at start shows why until the watch probes it
    exporter = None
    # The fleet exporter (the page at /, the fleet's series on /metrics): its first round reads the nodes
    # before the load holds them.
    if args.observe_interval:
        from orchestrator.serve.observed import observe

        exporter = observe(
            backend,
            model_name,
            interval=args.observe_interval,
            timeout=_common.probe_timeout(args),
            forks=args.forks,
        )
        exporter.collector.start()
        exporter.collector.first_round.wait(_common.probe_timeout(args) * 4 + 5)
    app = create_app(backend, api_key=api_key, model_name=model_name, exporter=exporter)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
    )
    failed = False

    def on_failed() -> None:
        nonlocal failed
        failed = True
        server.should_exit = True

    backend.on_failed = on_failed
    bars = LoadBars(
        _common.err_console.is_terminal,
        names={h.endpoint: h.name for h in hosts},
    )

    loads = 0

    def on_loaded(plan: Plan, phases: dict[str, float]) -> None:
        nonlocal loads
        bars.finish()
        times = {"probe": first.probe_seconds, "plan": first.plan_seconds} if loads == 0 else {}
        loads += 1
        hits = sum(backend.skipped.values())
        cache = f" ({format_size(hits)} from the nodes' caches)" if hits else ""
        _common.err_console.print(
            f"{backend.state} on {len(plan.endpoints)} node(s): "
            + " · ".join(f"{k} {v:.2f} s" for k, v in {**times, **phases}.items())
            + cache,
            highlight=False,
        )

    backend.on_progress = bars
    backend.on_loaded = on_loaded
    hup = signals.handling(signal.SIGHUP, lambda *_: backend.reload(rolling_restart=args.reload_rolling))
    hup.__enter__()  # until serve ends: SIGHUP reloads
    _common.err_console.print(
        f"serving {escape(str(args.model))} on http://{escape(args.host)}:{args.port}/v1 "
        f"({len(first.plan.endpoints)} node(s), llama-server with {args.parallel} slot(s), loading...)",
        highlight=False,
    )
    backend.start(first.plan)
    try:
        with bars:
            server.run(sockets=[sock])
    finally:
        hup.__exit__(None, None, None)
        if exporter is not None:
            exporter.collector.stop()
        backend.stop()
    if failed:
        _common.err_console.print(f"[red]error:[/red] {escape(backend.reason)}", highlight=False)
        return 1
    return 0
