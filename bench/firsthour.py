"""The figures of the README's first lines, as measured: the set-up time of a fresh machine (`make setup`
records every run of scripts/setup.sh), the whole suite's time (the test session records every full run),
and `rpcfleet demo` once set up (timed here).

The set-up figure is the newest record of a run that built llama-cpp-python from an empty cache;
`--cold-setup` makes one now: a clone of this checkout runs `make demo` (set-up, then the demo) with an empty
`$RPCFLEET_HOME` (every build, the venv and the model download; Debian packages are already there), and
its record, with the whole `make demo` time, joins this machine's. On a machine that has never been set up,
`--fresh-machine` runs `make demo` in this checkout itself (Debian packages too), with the system's Python
since there is no venv yet. The suite figure is the newest record
of a whole-suite run (`make test` / `.ci/run`). Each says its date, commit, machine and the 1-minute load
average at its start. `--write` replaces the block between the README's `<!-- bench/firsthour.py -->` markers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, arg_parser, commit, load_average, machine, median

from orchestrator.core.paths import rpcfleet_home

BEGIN = "<!-- bench/firsthour.py: generated, do not edit -->"
END = "<!-- end bench/firsthour.py -->"


def records(name: str) -> list[dict[str, Any]]:
    path = rpcfleet_home() / "timings" / name
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a record cut by a killed run
    return out


def minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s} s" if m else f"{s} s"


def timed_make_demo(checkout: Path, home: Path, env: dict[str, str]) -> None:
    """Run `make demo` in `checkout` and add the whole command's time to the set-up record it wrote in `home`,
    as the newest record of this machine's."""
    started = time.monotonic()
    subprocess.run(["make", "-C", str(checkout), "demo"], check=True, env=env)
    make_demo_seconds = time.monotonic() - started
    source = home / "timings" / "setup.jsonl"
    lines = source.read_text().splitlines()
    record = {**json.loads(lines[-1]), "make_demo_seconds": round(make_demo_seconds, 1)}
    target = rpcfleet_home() / "timings" / "setup.jsonl"
    if source == target:
        lines[-1] = json.dumps(record)
        target.write_text("\n".join(lines) + "\n")
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("a") as sink:
            sink.write(json.dumps(record) + "\n")


def fresh_machine() -> None:
    """`make demo` here, on a machine with an empty cache (refused otherwise: the figure would not be one)."""
    home = rpcfleet_home()
    if (home / "venv").exists():
        sys.exit(f"{home} already holds a venv: this machine is not fresh (use --cold-setup)")
    timed_make_demo(ROOT, home, dict(os.environ))


def cold_setup() -> None:
    """Run the README's `make demo` from an empty cache in a clone (so this checkout's .venv stays as it
    is), keep set-up's record with the whole command's time added, then put the `rpcfleet` shim back on
    this checkout."""
    with tempfile.TemporaryDirectory(prefix="rpcfleet-cold-") as tmp:
        clone, home = Path(tmp) / "clone", Path(tmp) / "home"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        # Nothing from this machine's caches: llama-server is otherwise found in the default one.
        env = {**os.environ, "RPCFLEET_HOME": str(home), "RPCFLEET_ENGINE_CACHE": "own"}
        timed_make_demo(clone, home, env)
    subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], check=True, capture_output=True)


def time_demo(runs: int) -> tuple[list[float], float]:
    load = load_average()
    times = []
    for _ in range(runs):
        started = time.monotonic()
        subprocess.run(
            [str(ROOT / ".venv" / "bin" / "rpcfleet"), "demo", "--lab-name", f"fh{os.getpid()}"],
            check=True,
            capture_output=True,
        )
        times.append(time.monotonic() - started)
    return times, load


def section(runs: int) -> str:
    lines = [BEGIN]
    # A fresh machine's set-up builds serve's engine too: a record from before it did is not the figure.
    # ... and the Vulkan artifact too (set-up builds it since GPU nodes came): older records are not it.
    cold = [
        r
        for r in records("setup.jsonl")
        if "llama-cpp-python" in r.get("built", [])
        and "llama-server" in r.get("built", [])
        and "rpc-server-vulkan" in r.get("steps", {})
    ]
    if cold:
        r = cold[-1]
        built = ", ".join(r["built"])
        apt = (
            f"; Debian packages installed first: {', '.join(r['apt'])}"
            if r.get("apt")
            else "; the Debian packages were already installed (their download and install not included)"
        )
        names = {
            "llama-server": "llama-server and llama-fit-params",
            "rpc-server-vulkan": "the Vulkan rpc-server",
        }
        steps = [f"{names.get(k, k)}: {minutes(v)}" for k, v in r.get("steps", {}).items()]
        of_it = f" ({'; '.join(steps)} of it)" if steps else ""
        whole = (
            f"; `make demo` from its start to its end: **{minutes(r['make_demo_seconds'])}**"
            if "make_demo_seconds" in r
            else ""
        )
        lines.append(
            f"- Set-up on a fresh machine (`make setup` from an empty cache): **{minutes(r['seconds'])}**"
            f"{of_it}, building {built}{apt}{whole}. Measured {r['date']}, commit `{r['commit']}`, "
            f"{r['machine']}, load average {r['load1']:.1f} at its start."
        )
    else:
        lines.append("- Set-up on a fresh machine: no record yet of a `make setup` from an empty cache here.")
    warm = [r for r in records("setup.jsonl") if not r.get("built")]
    if warm:
        lines.append(f"- `make setup` with everything cached: {warm[-1]['seconds']:.1f} s.")
    suites = records("suite.jsonl")
    if suites:
        r = suites[-1]
        workers = int(r.get("workers") or 0)
        how = f"on {workers} pytest-xdist workers" if workers else "in one process"
        lines.append(
            f"- The whole suite (`make test`): **{minutes(r['seconds'])}**, {r['passed']} passed, "
            f"{r['failed']} failed, {r['skipped']} skipped, {how}. Measured {r['date']}, commit "
            f"`{r['commit']}`, {r['machine']}, load average {r['load1']:.1f} at its start."
        )
    else:
        lines.append("- The whole suite: no record yet of a full `make test` run here.")
    if runs:
        times, load = time_demo(runs)
        lines.append(
            f"- `rpcfleet demo` once set up: **{median(times):.1f} s** (median of {runs}; "
            f"min {min(times):.1f} s, max {max(times):.1f} s). Measured "
            f"{time.strftime('%Y-%m-%d')}, commit `{commit()}`, {machine()}, load average {load:.1f} at "
            "its start."
        )
    lines.append(END)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--demo-runs", type=int, default=3, help="times to run `rpcfleet demo` (default 3)")
    parser.add_argument(
        "--cold-setup", action="store_true", help="first measure a set-up from an empty cache (minutes)"
    )
    parser.add_argument(
        "--fresh-machine",
        action="store_true",
        help="on a machine never set up: time `make demo` here (minutes)",
    )
    args = parser.parse_args()
    if args.fresh_machine:
        fresh_machine()
    if args.cold_setup:
        cold_setup()
    text = section(args.demo_runs)
    print(text)
    if args.write is not None:
        target = ROOT / "README.md" if args.write.name == "BENCHMARKS.md" else args.write
        readme = target.read_text()
        pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END) + r"\n", re.S)
        if not pattern.search(readme):
            sys.exit(f"{target}: no {BEGIN!r} block to replace")
        target.write_text(pattern.sub(lambda _: text, readme, count=1))


if __name__ == "__main__":
    main()
