"""Benchmark: replicas ready at the fleet's bandwidth (issue 41): `serve --replicas 3` on 6 nodes
against one formation of the same size, the weights through the controller (stock: every formation's
engine sends its weights over the controller's one link) and from the nodes' own copies
(`model_path_on_nodes`: each node warms its cache from its disk, the engines load from the caches).

    .venv/bin/python bench/replicas.py            # print the section (needs root: network namespaces)
    .venv/bin/python bench/replicas.py --write    # and replace its block in BENCHMARKS.md

A lab of 6 network-namespace nodes with real OpenSSH, each capped at `--cpus` CPU and `--memory` (a
cgroup's memory.max, which the probe counts as the node's free memory: a formation then needs 2 nodes of
the generated ~1 GB f16 llama), every link and the controller's side (the lab bridge) shaped to
`--rate`; CPU `ggml-rpc-server`s with `-c` deployed by `rpcfleet deploy`; each node holds a copy of the
GGUF in `~/models`. Each run starts `rpcfleet serve` in its own process on emptied caches, with this
machine's GGUF and every node's copy dropped from the page cache, and times it from its start to every
formation ready (`/health`); serve is then stopped. Four runs a round, the order reversed every other
round: three formations and one, through the controller (an inventory without `model_path_on_nodes`) and
from the copies. One formation runs on the nodes of the first formation `rpcfleet plan --replicas 3`
chooses (`-l`), so it is of the same size as each of the three. Medians over
`--rounds`, (min..max) beside them; the ratio is taken per round.

Target (issue 41): three formations ready in at most 1.3x the time of one, with the controller's side
shaped to the node links' rate; today's (through the controller) measured in the same run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import yaml
from _common import (
    ROOT,
    arg_parser,
    bridge_tx,
    busy_cpu_seconds,
    drop_page_cache,
    free_port,
    get_json,
    load_average,
    stamp,
    write_section,
)
from load import MODEL, shape

from orchestrator.core.units import parse_size
from orchestrator.lab.cgroups import usage_us
from orchestrator.lab.lifecycle import lab_down, lab_up, reap_stale
from orchestrator.lab.netns import privileged
from orchestrator.lab.state import Lab
from orchestrator.models.synth import write_tiny_llama

SECTION = "replicas"
LAB_NAME = "brepl"
REPLICAS = 3
THROUGH, COPIES = "through the controller", "from the nodes' copies (`model_path_on_nodes`)"
TARGET = 1.3  # three formations ready in at most this times one
MODEL_PATH = Path("/tmp/rpcfleet-bench-load/model.gguf")  # bench/load.py's model, shared


def inventory(lab: Lab, folder: Path, copies: bool) -> Path:
    """The lab's inventory with the servers' caches on, and the nodes' copies when `copies`."""
    data = yaml.safe_load(lab.inventory.read_text())
    data["vars"]["rpc_cache"] = True
    if copies:
        data["vars"]["model_path_on_nodes"] = "~/models"
    path = folder / ("inventory-copies.yml" if copies else "inventory.yml")
    path.write_text(yaml.safe_dump(data))
    return path


def rpcfleet(*argv: str, timeout: float = 900) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", *argv],
        capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"rpcfleet {' '.join(argv)} failed: {done.stdout}{done.stderr}")


def ready_in(inv: Path, model: Path, folder: Path, replicas: int, hosts: list[str] | None) -> dict[str, Any]:
    """Start serve; the seconds until every formation is ready, the formations' nodes, the bytes the
    controller sent into the lab meanwhile. Stops serve after."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "orchestrator", "serve", "-i", str(inv), "-m", str(model)]
    argv += ["--replicas", str(replicas), "--ctx", "512", "--parallel", "1", "--port", str(port)]
    argv += ["--observe-interval", "0", "--rejoin-interval", "0"]
    if hosts:
        argv += ["-l", ",".join(hosts)]
    env = {**os.environ, "RPCFLEET_HOME": str(folder / "home")}
    env.pop("RPCFLEET_API_KEY", None)
    started = time.monotonic()
    with (folder / f"serve-{replicas}.log").open("ab") as log:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = started + 900
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"serve exited with {process.returncode}: see {folder}/serve-{replicas}.log"
                )
            if time.monotonic() > deadline:
                raise RuntimeError("serve not ready in 900 s")
            try:
                health = get_json(f"{base}/health", 10)
            except OSError:
                health = {}
            formations = health.get("formations") or []
            if len(formations) == replicas and all(f["state"] == "ready" for f in formations):
                return {"seconds": time.monotonic() - started, "nodes": [f["nodes"] for f in formations]}
            time.sleep(0.1)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def first_formation(inv: Path, model: Path, lab: Lab) -> list[str]:
    """The nodes (inventory names) of the first formation `serve --replicas 3` would make
    (`rpcfleet plan --replicas`, as serve plans: no local device)."""
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "plan", "-i", str(inv), "-m", str(model), "--ctx", "512",
         "--replicas", str(REPLICAS), "--local-devices", "", "--json"],
        capture_output=True, text=True, timeout=300, check=False, cwd=ROOT,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"rpcfleet plan failed: {done.stdout}{done.stderr}")
    names = {n.address: n.name for n in lab.nodes}
    return [names[ep.rpartition(":")[0]] for ep in json.loads(done.stdout)["formations"][0]["endpoints"]]


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the four runs (default 2)")
    parser.add_argument("--rate", default="1gbit", help="each link's and the controller side's rate")
    parser.add_argument("--cpus", type=float, default=0.3, help="each node's CPU share (default 0.3)")
    parser.add_argument("--memory", default="1100MiB", help="each node's memory.max (default 1100MiB)")
    args = parser.parse_args()
    if not privileged():
        print("bench/replicas.py needs root (network namespaces)", file=sys.stderr)
        return 2
    model = MODEL_PATH
    if not model.exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        write_tiny_llama(model, **MODEL)
    size = model.stat().st_size
    reap_stale()
    load = load_average()
    folder = Path(tempfile.mkdtemp(prefix="rpcfleet-bench-replicas-"))
    lab = lab_up(2 * REPLICAS, name=LAB_NAME, owner_pid=os.getpid(), cpus=args.cpus,
                 memory=parse_size(args.memory))  # fmt: skip
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    try:
        shape(lab, args.rate, args.rate)
        copies = []
        for node in lab.nodes:  # each node's own copy on its disk (here: in its own home)
            (node.home / "models").mkdir(mode=0o755, exist_ok=True)
            copies.append(Path(shutil.copyfile(model, node.home / "models" / model.name)))
            copies[-1].chmod(0o644)
        inventories = {THROUGH: inventory(lab, folder, False), COPIES: inventory(lab, folder, True)}
        rpcfleet("deploy", "-i", str(inventories[THROUGH]))
        first = first_formation(inventories[THROUGH], model, lab)  # one formation runs on these nodes
        order = [(source, n) for source in (THROUGH, COPIES) for n in (REPLICAS, 1)]
        for i in range(args.rounds):
            for source, replicas in order if i % 2 == 0 else order[::-1]:
                rpcfleet("cache", "clear", "-i", str(inventories[THROUGH]))
                for path in (model, *copies):  # page caches cold: every copy is read from the disk
                    drop_page_cache(path)
                tx, busy = bridge_tx(lab.bridge), busy_cpu_seconds()
                nodes_cpu = {n.name: usage_us(n.namespace or n.name) for n in lab.nodes}
                print(f"round {i + 1}: {replicas} formation(s), {source}", file=sys.stderr, flush=True)
                run = ready_in(inventories[source], model, folder, replicas, first if replicas == 1 else None)
                run["sent"] = bridge_tx(lab.bridge) - tx
                # this machine's cores busy over the run (every node, serve, its engines, the rest), and
                # the busiest node's CPU seconds over its cap: the least time its share could take
                run["busy"] = (busy_cpu_seconds() - busy) / (run["seconds"] * (os.cpu_count() or 1))
                used = [(usage_us(n.namespace or n.name) - nodes_cpu[n.name]) / 1e6 for n in lab.nodes]
                run["capped"] = max(used) / args.cpus / run["seconds"]
                runs.setdefault((source, replicas), []).append(run)
    finally:
        lab_down(LAB_NAME)
        shutil.rmtree(folder, ignore_errors=True)
    section = render(runs, args, load, size)
    print(section)
    if args.write is not None:
        write_section(args.write, SECTION, section)
    return 0


def render(runs: dict[tuple[str, int], list[dict[str, Any]]], args: Any, load: float, size: int) -> str:
    def spread(xs: list[float], unit: str = "") -> str:
        return f"{median(xs):.2f}{unit} ({min(xs):.2f}..{max(xs):.2f})"

    lines = [
        f"## {SECTION}",
        "",
        f"`bench/replicas.py`, {stamp()}; 1-min load average {load:.1f} at the start. A lab of "
        f"{2 * REPLICAS} network-namespace nodes, each capped at {args.cpus:g} CPU and {args.memory} "
        f"(memory.max, the probe's free memory), every link and the controller's side shaped to {args.rate}; "
        f"CPU servers with `-c`; a generated f16 llama of {size / 1e9:.2f} GB, a copy in each node's "
        "`~/models`. Each run: caches emptied, page caches dropped, `rpcfleet serve --replicas N` started, "
        f"timed to every formation ready. {args.rounds} rounds, the order reversed every other round. "
        "Medians, (min..max) beside them.",
        "",
        "| weights | formations | nodes each | seconds to ready | x one formation "
        "| controller sent (bridge tx) |",
        "|---|---|---|---|---|---|",
    ]
    ratios: dict[str, list[float]] = {}
    for source in (THROUGH, COPIES):
        one, three = runs[(source, 1)], runs[(source, REPLICAS)]
        ratios[source] = [t["seconds"] / o["seconds"] for t, o in zip(three, one, strict=False)]
        for replicas, rs in ((1, one), (REPLICAS, three)):
            each = sorted({len(n) for r in rs for n in r["nodes"]})
            rel = "1" if replicas == 1 else spread(ratios[source], "x")
            seconds = spread([r["seconds"] for r in rs])
            lines.append(
                f"| {source} | {replicas} | {'/'.join(map(str, each))} | {seconds} | {rel} "
                f"| {spread([r['sent'] / 1e9 for r in rs], ' GB')} |"
            )
    verdict = "met" if median(ratios[COPIES]) <= TARGET else "**not met**"
    lines += [
        "",
        f"- Target: {REPLICAS} formations ready in at most {TARGET}x the time of one: "
        f"{spread(ratios[COPIES], 'x')} from the nodes' copies ({verdict}); "
        f"{spread(ratios[THROUGH], 'x')} through the controller (today's).",
        "- What the machine allows: the share of this machine's cores busy during each run (all work on it: "
        "the nodes, serve and its engines, other sessions), and the busiest node's CPU seconds over its cap "
        "as a share of the run (1: that node's share alone takes the whole run): "
        + "; ".join(
            f"{n} {'formation' if n == 1 else 'formations'} {source}: cores "
            f"{spread([r['busy'] for r in rs])}, node {spread([r['capped'] for r in rs])}"
            for source in (THROUGH, COPIES)
            for n, rs in ((1, runs[(source, 1)]), (REPLICAS, runs[(source, REPLICAS)]))
        )
        + ".",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
