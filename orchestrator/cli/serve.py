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
import signal
import time
from pathlib import Path
from typing import Any

from orchestrator.cli import _common, _planning
from orchestrator.cli._common import escape
from orchestrator.core import fields, signals
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
        "--host", type=_common.address, default="127.0.0.1", help="address to bind (default: 127.0.0.1)"
    )
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


def model_entries(args: argparse.Namespace) -> list[Any]:
    """The models to serve (`models_file.ModelEntry`): the -m files, then the --models file's."""
    from orchestrator.serve.models_file import ModelEntry, parse_models_file

    entries = [ModelEntry(path) for path in args.model or ()]
    if args.models is not None:
        try:
            text = args.models.read_text()
        except OSError as exc:
            raise UsageError(f"--models {args.models}: {exc.strerror}") from None
        entries += parse_models_file(args.models, text)
    if not entries:
        raise UsageError("no model to serve", hint="give -m FILE (several: one per model) or --models FILE")
    if args.model_name is not None:
        if len(entries) > 1:
            raise UsageError("--model-name names one model; name several in a --models file")
        entries[0] = ModelEntry(entries[0].model, name=args.model_name)
    names: dict[str, Path] = {}
    for entry in entries:
        name = entry.name or entry.model.stem
        if name in names:
            raise UsageError(
                f"two models named {name!r} ({names[name]} and {entry.model})",
                hint="name them in a --models file (name: ...)",
            )
        names[name] = entry.model
    return entries


def handle(args: argparse.Namespace) -> int:
    from orchestrator.inventory.model import is_loopback
    from orchestrator.planning.profile import profile_model
    from orchestrator.serve.templates import model_chat_template

    entries = model_entries(args)
    profiles = []
    templates = []
    for entry in entries:
        where = f"{args.models}:{entry.line}: " if entry.line is not None else ""
        try:  # a file that is no model fails before the probe
            profiles.append(profile_model(_common.require_model(entry.model)))
        except UsageError as exc:
            raise UsageError(f"{where}{exc.message}") from None
        templates.append(model_chat_template(entry.model, args.chat_template))  # bad: exit 2
    api_key = api_key_of(args)
    if api_key is None and not is_loopback(args.host):
        raise UsageError(
            f"--host {args.host} is not a loopback address: serving it without an API key is refused",
            hint=f"add --api-key-file or {KEY_ENV}, or bind 127.0.0.1",
        )
    admin_key = admin_key_of(args, api_key)
    import dataclasses

    import uvicorn

    from orchestrator.cli._progress import LoadBars
    from orchestrator.core.errors import PlanError
    from orchestrator.planning.devices import to_plan_devices
    from orchestrator.planning.formations import ServedModel
    from orchestrator.serve.app import create_app
    from orchestrator.serve.backend import Backend, ServeConfig
    from orchestrator.serve.fleet import ServeFleet
    from orchestrator.serve.pool import SparePool
    from orchestrator.serve.router import Formation, Router
    from orchestrator.serve.spares import SpareWatch
    from orchestrator.workflows.plan import plan_formations, states_of

    inventory, hosts = _common.load_hosts(args)
    if not hosts:
        raise UsageError("no hosts selected")
    request = _planning.planning_args(args)
    options = request.options
    served: list[ServedModel] = []
    for entry, profile in zip(entries, profiles, strict=True):
        served.append(served_model(args, inventory, hosts, entry, profile, options))
    sock = _common.listen_socket(args.host, args.port)  # before the fleet is probed or the model loaded
    whole = ServeFleet(
        hosts,
        served[0].path,
        options,
        probe_timeout=request.probe.timeout,
        facts=request.probe.facts,
        trust_rpc_memory=request.probe.trust_rpc_memory,
        forks=request.probe.forks,
        local_devices=request.local_devices,
    )
    started = time.monotonic()
    probe = whole.probe()  # one probe of every server; the formations are chosen from it
    probe_seconds = time.monotonic() - started
    states = states_of(probe)
    try:  # a model that does not fit at start is an error, not a wait
        chosen = plan_formations(
            served,
            hosts,
            [*to_plan_devices(probe, failed="skip"), *whole.local_gpus()],
            "split" if args.split else str(args.replicas),
            local_devices=request.local_devices,
        )
    except PlanError as exc:
        listed = ", ".join(f"{ep} {state}" for ep, state in states.items())
        raise PlanError(f"cannot serve: {exc.message} ({listed})", hint="rpcfleet plan shows why") from None
    formed, spare_hosts = list(chosen.formed), list(chosen.spares)
    plan_seconds = time.monotonic() - started - probe_seconds
    from orchestrator.serve.engine import default_engines

    for model, template in zip(served, templates, strict=True):
        if template.warning:
            who = f"{model.name}: " if len(served) > 1 else ""
            _common.err_console.print(
                f"[yellow]warning:[/yellow] {escape(who + template.warning)}", highlight=False
            )
    from orchestrator.core.log import get_logger
    from orchestrator.engine.children import socket_access_denied

    denied = socket_access_denied()
    if denied:  # the link timeout is set on the engine's own sockets: without them, the stall detector
        _common.err_console.print(
            f"[yellow]warning:[/yellow] serve may not take the engine's sockets ({escape(denied)}): "
            f"--link-timeout {args.link_timeout:g} does nothing; a cut link is found when a request "
            f"gets nothing for {ServeConfig.event_timeout:g} s (the stall detector)",
            highlight=False,
        )
        get_logger().warning("serve_link_timeout_off", why=denied)
    engines = {
        model.name: default_engines(
            model.path,
            model.name,
            parallel=model.options.parallel,
            link_timeout=args.link_timeout,
            chat_template=args.chat_template,
            progress=lambda line: _common.err_console.print(escape(line), highlight=False),
        )[0]
        for model in served
    }
    spares = SparePool(spare_hosts, order=whole.endpoints)

    def make_formation(one: Any, name: str, local: bool = False) -> Formation:
        fleet = dataclasses.replace(
            whole,
            hosts=list(one.hosts),
            model_path=one.model.path,
            options=one.model.options,
            local_devices=whole.local_devices if local else [],
            spares=spares,
            borrowed=[],
            _profile=one.model.profile,
        )
        config = ServeConfig(
            parallel=one.model.options.parallel,
            queue_size=args.queue,
            queue_timeout=args.queue_timeout,
            recover_timeout=args.recover_timeout,
            link_timeout=args.link_timeout,
            rejoin_interval=args.rejoin_interval,
            seed=args.seed,
        )
        backend = Backend(fleet, config, engines[one.model.name])
        template = templates[served.index(one.model)]
        backend.template = {"source": template.source, "warning": template.warning}
        backend.nodes.update({ep: states.get(ep, "unknown") for ep in fleet.endpoints})
        return Formation(name, one.model.name, backend)

    formations: list[Formation] = []
    for i, one in enumerate(formed):
        name = one.model.name if len(formed) == 1 else one.choice.name
        formations.append(make_formation(one, name, local=i == 0))
    # one formation: the front counts on its backend's metrics, as before formations; unless the spare
    # watch may add formations (--replicas auto): the front's counters must then be its own
    growing = any(not m.split and m.replicas is None for m in served) and args.rejoin_interval > 0
    shared = len(formations) == 1 and not growing
    router = Router(formations, formations[0].backend.metrics if shared else None)
    router.spares = lambda: [h.endpoint for h in spares.snapshot()]
    model_name = served[0].name
    exporter = None
    # The fleet exporter (the page at /, the fleet's series on /metrics): its first round reads the nodes
    # before the load holds them.
    if args.observe_interval:
        from orchestrator.serve.observed import observe

        exporter = observe(
            router,
            hosts,
            interval=args.observe_interval,
            timeout=_common.probe_timeout(args),
            forks=args.forks,
        )
        exporter.collector.start()
        exporter.collector.first_round.wait(_common.probe_timeout(args) * 4 + 5)
    app = create_app(router, api_key=api_key, admin_key=admin_key, model_name=model_name, exporter=exporter)
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
        if all(f.backend.state == "failed" for f in router.formations):  # the others still serve
            failed = True
            server.should_exit = True

    bars = LoadBars(
        _common.err_console.is_terminal,
        names={h.endpoint: h.name for h in hosts},
    )

    def hooked(formation: Formation, several: bool, first: dict[str, float]) -> Formation:
        formation.backend.on_failed = on_failed
        formation.backend.on_loaded = loaded_printer(formation, several, bars, first)
        return formation

    for formation in formations:
        hooked(formation, len(formations) > 1, {"probe": probe_seconds, "plan": plan_seconds})
    # A node silent at start (or a spare given back) that answers again makes a new formation when the
    # answering spares hold a model served with --replicas auto (`serve.spares`).
    watch = SpareWatch(
        router,
        spares,
        served,
        whole.probe_spares,
        lambda one, name: hooked(make_formation(one, name), True, {}),  # the start's times are not its
        args.rejoin_interval,
    )
    if len(formations) == 1:  # one load's bars; several loads at once print a line each
        formations[0].backend.on_progress = bars
    hup = signals.handling(signal.SIGHUP, lambda *_: router.reload(rolling_restart=args.reload_rolling))
    hup.__enter__()  # until serve ends: SIGHUP reloads
    for line in formation_lines(formed, args.host, args.port):
        _common.err_console.print(line, highlight=False)
    router.start([one.plan for one in formed])
    watch.start()
    try:
        with bars:
            _common.run_async(server.serve(sockets=[sock]))  # the command's one loop
    finally:
        hup.__exit__(None, None, None)
        watch.stop()
        if exporter is not None:
            exporter.collector.stop()
        router.stop()
    if failed:
        reasons = "; ".join(f"{f.name}: {f.backend.reason}" for f in router.formations)
        _common.err_console.print(f"[red]error:[/red] {escape(reasons)}", highlight=False)
        return 1
    return 0


def served_model(
    args: argparse.Namespace, inventory: Any, hosts: list[Any], entry: Any, profile: Any, options: Any
) -> Any:
    """A models-file or -m entry as `planning.formations.ServedModel`: serve's flags where it sets nothing,
    its hosts among the selected ones (a pattern that selects none of them: exit 2, naming the line)."""
    import dataclasses

    from orchestrator.core.errors import InputError
    from orchestrator.inventory.model import select_servers
    from orchestrator.planning.formations import ServedModel

    where = f"{args.models}:{entry.line}: " if entry.line is not None else ""
    endpoints = None
    if entry.hosts is not None:
        try:
            picked = {h.endpoint for h in select_servers(inventory, entry.hosts)}
        except InputError as exc:  # a bad host pattern, or one that matches nothing
            raise UsageError(f"{where}hosts: {exc.message}") from None
        endpoints = tuple(h.endpoint for h in hosts if h.endpoint in picked)
        if not endpoints:
            raise UsageError(f"{where}hosts {entry.hosts!r} selects none of the selected servers")
    replicas = entry.replicas if entry.replicas is not None else args.replicas
    split = replicas == "split" or (entry.replicas is None and args.split)
    return ServedModel(
        path=str(entry.model),
        name=entry.name or entry.model.stem,
        profile=profile,
        options=dataclasses.replace(
            options,
            n_ctx=entry.context if entry.context is not None else options.n_ctx,
            parallel=entry.parallel if entry.parallel is not None else options.parallel,
        ),
        replicas=replicas if isinstance(replicas, int) else None,
        split=split,
        endpoints=endpoints,
    )


def formation_lines(formed: list[Any], host: str, port: int) -> list[str]:
    """What serve prints before loading: the URL, then each formation (model, nodes, slots)."""
    models = list(dict.fromkeys(one.model.name for one in formed))
    lines = [f"serving {escape(', '.join(models))} on http://{escape(host)}:{port}/v1 (loading...)"]
    for one in formed:
        lines.append(
            f"  {escape(one.choice.name)}: {len(one.choice.endpoints)} node(s) "
            f"({escape(', '.join(one.choice.endpoints))}), llama-server with "
            f"{one.model.options.parallel} slot(s)"
        )
    return lines


def loaded_printer(formation: Any, named: bool, bars: Any, first_times: dict[str, float]) -> Any:
    """The line printed after each load of `formation` (its first with the probe's and plan's times)."""
    loads = 0
    backend = formation.backend

    def on_loaded(plan: Any, phases: dict[str, float]) -> None:
        nonlocal loads
        bars.finish()
        times = first_times if loads == 0 else {}
        loads += 1
        hits = sum(backend.skipped.values())
        cache = f" ({format_size(hits)} from the nodes' caches)" if hits else ""
        who = f"{formation.name} " if named else ""
        _common.err_console.print(
            f"{escape(who)}{backend.state} on {len(plan.endpoints)} node(s): "
            + " · ".join(f"{k} {v:.2f} s" for k, v in {**times, **phases}.items())
            + cache,
            highlight=False,
        )

    return on_loaded
