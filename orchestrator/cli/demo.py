"""`rpcfleet demo`: the main job on an embedded default lab (what `make demo` runs).

Brings up an emulated lab (network namespaces with real sshd as root, a local-connection lab
otherwise), then runs the pipeline a user runs on real machines, each step through its own
command: ping → deploy → probe → plan → run (load over RPC, generate, placement predicted vs
actual), and brings the lab down again. The model is a real one, Gemma 3 270M (fetched once by
`make setup`, or here when it is not cached yet), so the text generated is real text.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from orchestrator.cli import _inputs, _output
from orchestrator.cli.lab import lab_name, lab_nodes

DEMO_LAB = "demo"
PROMPT = "The capital of France is the city of"  # Gemma 3 270M, greedy: " Paris. It is the most visited..."


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo", help="run the whole pipeline on an emulated lab on this machine (make demo)"
    )
    parser.add_argument("--nodes", type=lab_nodes, default=3, help="lab nodes (default: 3)")
    parser.add_argument("--keep", action="store_true", help="leave the lab and its servers running")
    parser.add_argument(
        "--lab-name", type=lab_name, default=DEMO_LAB, help=f"name of the lab (default: {DEMO_LAB})"
    )
    parser.add_argument(
        "--model", "-m", type=Path, default=None, help="GGUF model (default: Gemma 3 270M, fetched once)"
    )
    parser.set_defaults(handler=handle)


def demo_model() -> Path:
    """Gemma 3 270M from the cache, fetched first (sha256 checked) when `make setup` has not done it."""
    from orchestrator.models.catalogue import GEMMA3_270M, is_fetched
    from orchestrator.models.fetch import fetch_model

    if not is_fetched(GEMMA3_270M):
        _output.console.rule(f"model fetch {GEMMA3_270M.name}: once, into the cache")

    def say(line: str) -> None:
        _output.console.print(line, highlight=False, markup=False, soft_wrap=True)

    return fetch_model(GEMMA3_270M, say=say).path


def handle(args: argparse.Namespace) -> int:
    from orchestrator.cli import main
    from orchestrator.lab.lifecycle import lab_down, lab_up

    local = os.geteuid() != 0
    if args.model is not None:  # a model that cannot be planned fails here, not after the lab is up
        from orchestrator.planning.profile import profile_model

        profile_model(_inputs.require_model(args.model))
    model = args.model or demo_model()
    kind = "local-connection (not root)" if local else "network-namespace"
    _output.console.rule(f"lab up: {args.nodes} {kind} nodes")
    lab = lab_up(args.nodes, name=args.lab_name, local=local)
    inventory = ["-i", str(lab.inventory)]
    steps: list[tuple[str, list[str]]] = [
        ("ping: reach every node over " + ("a local shell" if local else "SSH"), ["ping", *inventory]),
        ("deploy: install the pinned rpc-server, start it, wait for HELLO", ["deploy", *inventory]),
        ("probe: protocol, devices and usable memory of every server", ["probe", *inventory]),
        (
            "plan: where every layer of the model goes",
            ["plan", *inventory, "-m", str(model), "--ctx", "2048"],
        ),
        (
            "run: load through the plan, generate, placement predicted vs actual",
            ["run", *inventory, "-m", str(model), "--ctx", "2048", "-p", PROMPT, "-n", "24"],
        ),
    ]
    try:
        for title, argv in steps:
            _output.console.rule(title)
            status = main(argv)
            if status != 0:
                _output.err_console.print(f"[red]demo stopped: `rpcfleet {' '.join(argv)}` failed[/red]")
                return status
        return 0
    finally:
        if args.keep:
            _output.console.print(
                f"lab kept: rpcfleet -i {lab.inventory} ...; `rpcfleet lab down --name {args.lab_name}`"
            )
        else:
            _output.console.rule("lab down")
            lab_down(args.lab_name)
