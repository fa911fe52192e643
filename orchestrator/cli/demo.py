"""`rpcfleet demo`: the main job on an embedded default lab (what `make demo` runs).

Brings up an emulated lab (network namespaces with real sshd as root, a local-connection lab
otherwise), reaches every node, prints the recap, and brings the lab down again.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from orchestrator.cli import _common


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("demo", help="run the main job on an emulated lab on this machine")
    parser.add_argument("--nodes", type=int, default=3, help="lab nodes (default: 3)")
    parser.add_argument("--keep", action="store_true", help="leave the lab running afterwards")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from orchestrator import lab as lab_module
    from orchestrator.cli import ping

    local = os.geteuid() != 0
    name = "demo"
    _common.console.rule(f"lab up: {args.nodes} {'local' if local else 'namespaced'} nodes")
    lab = lab_module.lab_up(args.nodes, name=name, local=local)
    try:
        _common.console.rule("ping every node over " + ("a local connection" if local else "SSH"))
        ping_args = argparse.Namespace(inventory=lab.inventory, limit=None, forks=16, json=False)
        return ping.handle(ping_args)
    finally:
        if not args.keep:
            _common.console.rule("lab down")
            lab_module.lab_down(name)
