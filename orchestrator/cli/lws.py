"""`rpcfleet lws worker|plan|serve|hello|alive`: the entry points of the pods `rpcfleet export lws` describes
(orchestrator/kube/pods.py). They read LeaderWorkerSet's variables (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE,
LWS_WORKER_INDEX) and the ConfigMap the export wrote."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from orchestrator.cli import _parser, _running
from orchestrator.core import fields
from orchestrator.kube.constants import PID_FILE, RPC_PORT


def _say(line: str) -> None:
    sys.stderr.write(f"rpcfleet: {line}\n")
    sys.stderr.flush()


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "lws", help="the entry points of the pods of `export lws` (LeaderWorkerSet)"
    )
    sub = parser.add_subparsers(dest="lws_command", metavar="STEP", required=True)
    port = _parser.flag(fields.port)

    worker = sub.add_parser("worker", help="run this pod's rpc-server (every pod)")
    worker.add_argument("--port", type=port, default=RPC_PORT, help=f"its port (default: {RPC_PORT})")
    worker.add_argument(
        "--threads",
        type=_parser.flag(fields.integer(minimum=1, maximum=1024)),
        default=None,
        metavar="N",
        help="its threads (default: one per CPU this process may run on; the manifests: the pod's CPU limit)",
    )
    worker.add_argument(
        "--pid-file",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"where its process id goes while it runs, for `lws alive` (the manifests: {PID_FILE})",
    )
    worker.set_defaults(handler=handle_worker)

    plan = sub.add_parser(
        "plan",
        help="the leader's init step: wait for the group, probe, plan again if needed, write the arguments",
    )
    plan.add_argument("--config", type=Path, required=True, help="the ConfigMap's folder")
    plan.add_argument(
        "--models", type=Path, default=Path("/models"), help="the models volume (default: /models)"
    )
    plan.add_argument("--out", type=Path, required=True, help="where llama-server's arguments go (JSON)")
    plan.add_argument(
        "--wait",
        type=_parser.flag(fields.seconds),
        default=None,
        metavar="SECONDS",
        help="how long to wait for the group's servers (default: the settings', 600 s)",
    )
    plan.set_defaults(handler=handle_plan)

    serve = sub.add_parser("serve", help="run llama-server with the init step's arguments (the leader)")
    serve.add_argument("--args", type=Path, required=True, help="the file `lws plan --out` wrote")
    serve.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="llama-server's keys, one a line (the manifests: the Secret of `export lws --api-key-secret`)",
    )
    serve.set_defaults(handler=handle_serve)

    alive = sub.add_parser(
        "alive",
        help="whether `lws worker`'s rpc-server runs (its pid file; never connects): the probes' check",
    )
    alive.add_argument(
        "--pid-file", type=Path, default=Path(PID_FILE), help=f"the worker's pid file (default: {PID_FILE})"
    )
    alive.set_defaults(handler=handle_alive)

    hello = sub.add_parser("hello", help="one HELLO to an rpc-server: exit 0 when it answers or is busy")
    hello.add_argument("--host", default="127.0.0.1", help="its address (default: 127.0.0.1)")
    hello.add_argument("--port", type=port, default=RPC_PORT, help=f"its port (default: {RPC_PORT})")
    hello.set_defaults(handler=handle_hello)


def handle_worker(args: argparse.Namespace) -> int:
    from orchestrator.kube.pods import run_worker

    return run_worker(args.port, os.environ, _say, args.pid_file, args.threads)


def handle_plan(args: argparse.Namespace) -> int:
    from orchestrator.kube.pods import plan_step, write_leader_args

    leader = plan_step(args.config, args.models, os.environ, _say, seconds=args.wait)
    write_leader_args(args.out, leader)
    _say(f"wrote {args.out}")
    return 0


def handle_serve(args: argparse.Namespace) -> int:
    from orchestrator.kube.pods import serve_step

    return serve_step(args.args, os.environ, _say, args.api_key_file)


def handle_hello(args: argparse.Namespace) -> int:
    from orchestrator.kube.pods import ALIVE, hello

    result = _running.run_async(hello(args.host, args.port))
    _say(f"{args.host}:{args.port}: {result.outcome}: {result.message}")
    return 0 if result.outcome in ALIVE else 1


def handle_alive(args: argparse.Namespace) -> int:
    from orchestrator.kube.pods import rpc_server_alive

    alive, why = rpc_server_alive(args.pid_file)
    _say(why)
    return 0 if alive else 1
