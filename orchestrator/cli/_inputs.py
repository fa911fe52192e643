"""What a command reads before it works: the inventory (-i, -l, -f) and its hosts, a model file, the
socket `serve` and `exporter` listen on, and their keys (files and environment variables)."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.cli import _output
from orchestrator.cli._output import escape
from orchestrator.cli._parser import flag
from orchestrator.core import fields
from orchestrator.core.errors import UsageError
from orchestrator.workflows.serve_options import ADMIN_KEY_ENV, KEY_ENV, KEYS_EXCLUDES, OPTIONS

if TYPE_CHECKING:
    from orchestrator.inventory.model import Host, Inventory

DEFAULT_INVENTORY_ENV = "RPCFLEET_INVENTORY"


def add_inventory_args(
    parser: argparse.ArgumentParser, *, limit: bool = True, forks: bool = True, forks_short: bool = True
) -> None:
    """-i, -l (unless `limit` is false) and -f/--forks (for commands that work on hosts at once; only
    --forks where `-f` means something else: `logs -f` follows, as `tail -f` does)."""
    parser.add_argument(
        "-i",
        "--inventory",
        type=Path,
        default=None,
        help=f"inventory file, or slurm: / slurm:JOBID for a Slurm job's nodes (default: "
        f"${DEFAULT_INVENTORY_ENV}, else ./inventory.yml, else the lab's)",
    )
    parser.add_argument(
        "--slurm-job",
        default=None,
        metavar="JOBID",
        help="the Slurm job whose nodes are the hosts (with -i: a Slurm overlay file giving their variables)",
    )
    if limit:
        parser.add_argument(
            "-l", "--limit", default=None, help="host pattern: names, groups, globs, !exclude, &intersect"
        )
    if not forks:
        return
    parser.add_argument(
        *(("-f", "--forks") if forks_short else ("--forks",)),
        type=flag(fields.integer(minimum=1)),
        default=16,
        help="hosts worked on at once (default: 16)",
    )


def inventory_path(args: argparse.Namespace) -> Path:
    """The inventory to use: -i, then $RPCFLEET_INVENTORY, then ./inventory.yml, then the running lab's.
    `--slurm-job` without -i: the overlay $RPCFLEET_INVENTORY names when it names a Slurm overlay file (the
    job's nodes with its variables), else `slurm:JOBID` (the flag asks for Slurm: another default
    inventory, or a `slurm:` spec naming another job, gives way to it)."""
    return _choose_inventory(args)[0]


def _choose_inventory(args: argparse.Namespace) -> tuple[Path, str | None]:
    """`inventory_path`, and a note for the user when it is a lab's, which nothing on the command line
    named: with two labs up, a deploy must not land on the other fleet unannounced."""
    if args.inventory is not None:
        return Path(args.inventory), None
    if getattr(args, "slurm_job", None) is not None:
        default = _slurm_overlay(os.environ.get(DEFAULT_INVENTORY_ENV, ""))
        return (default if default is not None else Path(f"slurm:{args.slurm_job}")), None
    if os.environ.get(DEFAULT_INVENTORY_ENV):
        return Path(os.environ[DEFAULT_INVENTORY_ENV]), None
    if Path("inventory.yml").exists():
        return Path("inventory.yml"), None
    from orchestrator.core.errors import LabError
    from orchestrator.core.paths import DEFAULT_LAB
    from orchestrator.lab.lifecycle import default_lab_inventory, labs_up

    try:
        path: Path = default_lab_inventory()
    except LabError as exc:  # no inventory named and none found: the user's to give (exit status 2)
        raise UsageError(exc.message, hint=exc.hint) from None
    note = (
        f"using lab {DEFAULT_LAB!r}'s inventory {path} (no -i, ${DEFAULT_INVENTORY_ENV} or ./inventory.yml)"
    )
    others = [lab for lab in labs_up() if lab.name != DEFAULT_LAB]
    if others:
        note += "; also up: " + ", ".join(f"lab {lab.name!r} (-i {lab.inventory})" for lab in others)
    return path, note


def _slurm_overlay(name: str) -> Path | None:
    """`name` when it is a file holding a Slurm overlay (a `slurm:` section), else None."""
    if not name or name.startswith("slurm:"):
        return None
    from orchestrator.inventory.slurm import is_slurm_document

    try:
        text = Path(name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None  # not readable: not an overlay, and --slurm-job reads the job alone
    return Path(name) if is_slurm_document(text) else None


def load_inventory(args: argparse.Namespace) -> Inventory:
    """The inventory named by the flags (a file, or a Slurm job's nodes); its warnings are printed."""
    from orchestrator.cli._sources import read_inventory

    path, note = _choose_inventory(args)
    if note is not None:
        _output.err_console.print(f"note: {note}", highlight=False, markup=False)
    inventory = read_inventory(args, path)
    for warning in [*inventory.warnings, *key_file_warnings(inventory.hosts)]:
        _output.err_console.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False)
    return inventory


def key_file_warnings(hosts: Sequence[Host]) -> list[str]:
    """One warning per key file the hosts name (ssh_key, ssh_known_hosts) that other users may change:
    they could swap the client key, or add a host key and stand in for a node. A warning, not a refusal:
    a shared group's fleet may mean it."""
    from orchestrator.core.files import loose_write_mode

    named: dict[tuple[str, Path], list[str]] = {}
    for host in hosts:
        for variable in ("ssh_key", "ssh_known_hosts"):
            value = getattr(host, variable)
            if value:
                named.setdefault((variable, Path(value).expanduser()), []).append(host.name)
    warnings = []
    for (variable, path), names in named.items():
        mode = loose_write_mode(path)
        if mode is not None:
            whose = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            changed = f"may be changed by other users (mode {mode:o})"
            warnings.append(f"{path} ({variable} of {whose}) {changed}: chmod go-w {path}")
    return warnings


def load_hosts(args: argparse.Namespace, *, servers: bool = True) -> tuple[Inventory, list[Host]]:
    """The inventory named by the flags and what --limit selects (all when absent): every rpc-server
    as a host of its own (a host with `rpc_servers` is one per server, `HOST/SERVER`), or with
    `servers=False` the machines."""
    from orchestrator.inventory.model import select_servers

    inventory = load_inventory(args)
    pattern = getattr(args, "limit", None)
    if servers:
        return inventory, select_servers(inventory, pattern)
    if not pattern:
        return inventory, list(inventory.hosts)
    # `-l gpu1/second` names a server: its machine is selected (a pattern of hosts selects the same)
    machines = {server.node_name for server in select_servers(inventory, pattern)}
    return inventory, [host for host in inventory.hosts if host.name in machines]


def require_model(path: Path) -> Path:
    """`path` when it is a file; else the usage error every command that reads a model gives."""
    if not path.exists():
        raise UsageError(f"model {path} does not exist")
    if not path.is_file():
        raise UsageError(f"model {path} is not a file")
    return path


def listen_socket(host: str, port: int) -> socket.socket:
    """The socket `serve` and `exporter` hand to uvicorn, bound before anything is announced or loaded:
    a port another program holds is the user's to change (exit status 2), where uvicorn would log its
    own error after the announcement and exit 3 (this CLI's "locked" status)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds its own
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}", hint="choose another --host or --port"
        ) from None
    sock.set_inheritable(True)
    return sock


def api_key_of(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file, --api-key or RPCFLEET_API_KEY, in that order (None: no key)."""
    if args.api_key_file is not None:
        return _key_file("--api-key-file", args.api_key_file)
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key is empty")
    if args.api_key:
        return str(args.api_key).strip()
    return _key_env(KEY_ENV)


def listen_key_of(args: argparse.Namespace, serving: str) -> str | None:
    """The API key (`api_key_of`), which only a loopback --host may go without: `serving` (what is served)
    on another address without one is refused (a usage error)."""
    from orchestrator.inventory.model import is_loopback

    if getattr(args, "keys", None) is not None:  # per-user keys: the keys file guards every address
        keys_alone(args)
        return None
    api_key = api_key_of(args)
    if api_key is None and not is_loopback(args.host):
        raise UsageError(
            f"--host {args.host} is not a loopback address: serving {serving} without an API key is refused",
            hint=f"add --api-key-file or {KEY_ENV}, or bind 127.0.0.1",
        )
    return api_key


def keys_alone(args: argparse.Namespace) -> None:
    """--keys replaces every other key: one given beside it (a flag or the environment) is refused, so
    that no one believes it still opens something."""
    for name in KEYS_EXCLUDES:
        if getattr(args, name, None):
            raise UsageError(f"--keys excludes {OPTIONS[name].flags[0]}", hint=_KEYS_HINT)
    for env in (KEY_ENV, ADMIN_KEY_ENV):
        if os.environ.get(env):
            raise UsageError(f"--keys replaces {env}, which is set: unset it", hint=_KEYS_HINT)


_KEYS_HINT = "give each user a line in the keys file; an admin-scoped key reloads with POST /admin/reload"


def admin_key_of(args: argparse.Namespace, api_key: str | None) -> str | None:
    """The admin key from --admin-key-file or RPCFLEET_ADMIN_KEY (None: none); never the API key."""
    if getattr(args, "keys", None) is not None:
        return None
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
