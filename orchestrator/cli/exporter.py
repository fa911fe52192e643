"""`rpcfleet exporter`: the fleet's Prometheus metrics and live page, for fleets that do not serve.

Probes the selected hosts every --interval seconds (the probe's rules: a server serving a client is
never connected to) and answers `/metrics` (Prometheus text), `/` (the live fleet page) and
`/fleet.json` from the last round: a scrape never waits on the fleet. `serve` gives the same routes.
Binds loopback by default; any other address needs an API key (serve's rules and flags).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from orchestrator.cli import _inputs, _output, _parser, _planning, _running
from orchestrator.cli._output import escape
from orchestrator.core import fields
from orchestrator.core.errors import UsageError
from orchestrator.workflows.options import TIMEOUT
from orchestrator.workflows.serve_options import KEY_ENV

DEFAULT_PORT = 9464  # the port Prometheus' registry of default ports lists for exporters of this kind


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "exporter",
        help="Prometheus metrics and a live page of the fleet: nodes, servers, memory, caches",
        description=(
            "Probe the selected hosts on a fixed interval and serve the last round as Prometheus text "
            "(/metrics), a live fleet page (/) and its JSON (/fleet.json). Servers serving a client are "
            "never probed over RPC; a scrape never waits on the fleet."
        ),
    )
    parser.add_argument(
        "--host", type=_parser.address, default="127.0.0.1", help="address to bind (default: 127.0.0.1)"
    )
    parser.add_argument(
        "--port", type=_parser.flag(fields.port), default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT})"
    )
    parser.add_argument(
        "--interval",
        type=_parser.flag(fields.seconds),
        default=15.0,
        metavar="S",
        help="seconds between two probe rounds (default: 15)",
    )
    key = parser.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        default=None,
        help=f"the key for /metrics, / and /fleet.json (visible in `ps`: prefer {KEY_ENV})",
    )
    key.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help=f"a file whose first line is the key (or set {KEY_ENV})",
    )
    parser.add_argument(
        "--no-cache", action="store_true", help="do not list the nodes' tensor caches each round"
    )
    _planning.add_options(
        parser,
        [TIMEOUT],
        helps={TIMEOUT.name: TIMEOUT.help.replace("the facts", "the SSH reads")},
    )
    _inputs.add_inventory_args(parser)
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    api_key = _inputs.listen_key_of(args, "the fleet's metrics")
    _, hosts = _inputs.load_hosts(args)
    if not hosts:
        raise UsageError("no hosts selected")
    sock = _inputs.listen_socket(args.host, args.port)
    import asyncio
    import contextlib

    from fastapi import FastAPI

    from orchestrator.observe.collect import Collector
    from orchestrator.observe.server import http_server
    from orchestrator.observe.web import Exporter, HttpGuard, mount

    collector = Collector(
        hosts,
        interval=args.interval,
        timeout=args.timeout,
        forks=args.forks,
        cache=not args.no_cache,
    )
    app = FastAPI(title="rpcfleet exporter", docs_url=None, redoc_url=None, openapi_url=None)
    mount(app, Exporter(collector), api_key=api_key, metrics=True)
    app.add_middleware(HttpGuard, check_host=api_key is None)
    server = http_server(app, args.host, args.port)
    _output.err_console.print(
        f"exporter on http://{escape(args.host)}:{args.port}/ "
        f"({len(hosts)} host(s), every {args.interval:g} s)",
        highlight=False,
    )

    async def serve_and_probe() -> None:
        # One loop for the command: uvicorn's server and the probe rounds beside it
        rounds = asyncio.create_task(collector.run(), name="observe")
        try:
            await server.serve(sockets=[sock])
        finally:
            rounds.cancel()  # a round in progress too (a silent host would hold it for its timeout)
            with contextlib.suppress(asyncio.CancelledError):
                await rounds  # its connections closed

    _running.run_async(serve_and_probe())
    return 0
