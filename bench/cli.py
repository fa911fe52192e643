"""Benchmark: how long the `rpcfleet` command takes to start and finish, each run a fresh process.

    .venv/bin/python bench/cli.py            # print the results table
    .venv/bin/python bench/cli.py --write    # and replace the "cli start-up" section of BENCHMARKS.md
    .venv/bin/python bench/cli.py --baseline /work/main   # also time another checkout's code

Each command runs as `python -m orchestrator ...` with this checkout first on PYTHONPATH and bytecode
caching on (as an installed package has it; one warm-up run writes the caches), from a temporary
folder. Wall time from spawn to exit, median (max) of `--repeat` runs:

* `--version`, `--help`, `inventory list -i <the example Ansible inventory>` (no host is contacted);
* `probe` of one real `ggml-rpc-server` on loopback through a `connection: local` inventory
  (RPC HELLO, devices, memory, and the facts read by one local bash).

Targets (issue 15): the first three under 0.3 s, the probe under 0.5 s. The modules each command
imports are listed with `-X importtime` for the slowest ones.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, arg_parser, load_average, machine, servers, stamp, write_section
from _common import median as med

SECTION = "cli start-up"
EXAMPLE_INVENTORY = ROOT / "tests" / "data" / "inventory" / "fleet_ansible.yml"
TARGETS = {"--version": 0.3, "--help": 0.3, "inventory list": 0.3, "probe (loopback)": 0.5}


def _env(checkout: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")}
    env["PYTHONPATH"] = str(checkout)
    return env


def time_command(argv: list[str], checkout: Path, cwd: Path, repeat: int) -> list[float]:
    env = _env(checkout)
    command = [sys.executable, "-m", "orchestrator", *argv]
    subprocess.run(command, env=env, cwd=cwd, capture_output=True, check=False)  # writes the bytecode caches
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, check=False)
        times.append(time.perf_counter() - started)
        if done.returncode != 0:
            failed = f"`rpcfleet {shlex.join(argv)}` failed ({done.returncode})"
            raise SystemExit(f"{failed}: {done.stderr.decode()}")
    return times


def imported(argv: list[str], checkout: Path, cwd: Path) -> tuple[int, list[str]]:
    """How many modules `argv` imports, and the names of its three slowest top-level imports."""
    command = [sys.executable, "-X", "importtime", "-m", "orchestrator", *argv]
    out = subprocess.run(command, env=_env(checkout), cwd=cwd, capture_output=True, text=True, check=False)
    rows = [line.split("|") for line in out.stderr.splitlines() if line.startswith("import time:")]
    rows = [r for r in rows if r[1].strip().isdigit()]
    top = [(int(r[1]), r[2].strip()) for r in rows if not r[2].startswith("  ")]
    slow = [f"{name} {us / 1000:.0f} ms" for us, name in sorted(top, reverse=True)[:3]]
    return len(rows), slow


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--repeat", type=int, default=15, help="runs per command (default: 15)")
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout to time too")
    args = parser.parse_args()
    load = load_average()
    with tempfile.TemporaryDirectory() as tmp, servers(1, Path(tmp)) as ports:
        cwd = Path(tmp)
        inventory = cwd / "loopback.yml"
        inventory.write_text(
            "hosts:\n  node1:\n    connection: local\n    address: 127.0.0.1\n"
            f"    rpc_host: 127.0.0.1\n    rpc_port: {ports[0]}\n"
        )
        commands = {
            "--version": ["--version"],
            "--help": ["--help"],
            "inventory list": ["inventory", "list", "-i", str(EXAMPLE_INVENTORY)],
            "probe (loopback)": ["probe", "-i", str(inventory)],
        }
        rows = []
        for label, argv in commands.items():
            times = time_command(argv, ROOT, cwd, args.repeat)
            before = time_command(argv, args.baseline, cwd, 5) if args.baseline else None
            count, slow = imported(argv, ROOT, cwd)
            rows.append((label, times, before, count, slow))
    started = time.perf_counter()
    for _ in range(args.repeat):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    bare = (time.perf_counter() - started) / args.repeat

    lines = [
        f"## {SECTION}",
        "",
        f"`bench/cli.py`, {stamp()}; 1-min load average {load:.1f} at the start. Each command a fresh "
        f"`python -m orchestrator` process with bytecode caches written (as an installed package has "
        f"them), wall time from spawn to exit, median (max) of {args.repeat} runs. The probe reaches one "
        "real `ggml-rpc-server` on loopback through a `connection: local` host (RPC and the facts). "
        f"For scale: a bare `python -c pass` takes {bare * 1000:.0f} ms here.",
        "",
        "| command | time | target | modules imported | slowest imports |"
        + (" before |" if args.baseline else ""),
        "|---|---:|---:|---:|---|" + ("---:|" if args.baseline else ""),
    ]
    for label, times, before, count, slow in rows:
        target = TARGETS[label]
        verdict = "met" if med(times) < target else "NOT met"
        cells = [
            f"`{label}`",
            f"{med(times) * 1000:.0f} ms ({max(times) * 1000:.0f} ms)",
            f"{target:g} s, {verdict}",
            str(count),
            ", ".join(slow),
        ]
        if before is not None:
            cells.append(f"{med(before) * 1000:.0f} ms")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Only what a command needs is imported: the command modules register their flags without importing "
        "their stages, asyncssh is imported when an SSH connection opens, numpy/gguf when a model is read, "
        "structlog when the first log event passes the level, rich when something is printed.",
    ]
    if args.baseline:
        lines.append(f"`before` = the code in {args.baseline} (median of 5).")
    body = "\n".join(lines) + "\n"
    print(body)
    if args.write:
        write_section(args.write, SECTION, body)
    print(machine(), file=sys.stderr)


if __name__ == "__main__":
    main()
