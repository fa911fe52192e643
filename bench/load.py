"""Benchmark: model load time over RPC against the wire limit, with and without the servers' tensor cache.

    .venv/bin/python bench/load.py            # print the results section (needs root: network namespaces)
    .venv/bin/python bench/load.py --write    # and replace the "load" section of BENCHMARKS.md

A lab of 3 network-namespace nodes with real OpenSSH, each link shaped to `--rate` (default 1 Gbit/s) with
`tc tbf` on both veth ends, CPU `ggml-rpc-server`s deployed by `playbooks/deploy.yml`, a generated f16 llama
of about 1 GB whose matrices all exceed HASH_THRESHOLD (10 MiB). One run, in this order, each load in a fresh
worker process (`Worker.load`, what `rpcfleet run` does) from the same plan:
  1. no cache: servers without `-c`;
  2. cold: servers with `-c`, caches cleared (the load writes the files);
  3. warm: the same again (every big tensor a hit);
  4. pre-warmed: caches cleared, `cache warm` (all nodes in parallel), then the load;
  5. cold through rpcfleet: caches cleared, the phases of `rpcfleet run --warm auto` after its plan
     (`load_on_fleet` on the command's runtime, its SSH connections open as the probe leaves them): check
     each node's cache, warm the misses in parallel, load (beside the warm on the servers rpcfleet
     builds; alternated with the same on stock servers' terms: the load after the warm), timed to the
     model loaded.
Per node, the rate while its bytes moved comes from the load's own progress samples (bytes acknowledged),
from the sample where the node had 1% of its bytes to the one where it had 99% (a node's window opens
when its turn comes, not when the load starts). `cache warm` is also timed for the largest node alone.

The wire limit is measured, not read from `--rate`: in the same run, over the same shaped path, plain TCP
sends the same bytes from the controller to a sink in each node's namespace, one node after the other
(the path llama.cpp's load takes: one link at a time) and to all nodes at once (the path of a parallel
warm). `--controller-rate` shapes the lab bridge's side too (the controller's own link, which every
node's bytes cross); the limit that applies is then the slower of the links and that one.
Loads 1-4 are timed as `run` times its load phase: the worker was spawned before (its imports overlap with
the probe and the plan). Also: the native FNV-1a rate (what hashing every big tensor would cost a load;
the client takes their hashes from the model's hash manifest), the GGUF read rate from the page cache, and
the achieved link rate (bytes of the no-cache
load / its time).

    .venv/bin/python bench/load.py --manifest [--rounds N] [--size 1.8gb|4gb] [--write]

`--manifest`: the warm load with the hash manifest (docs/caches.md), over loopback (no lab, no root): two
real CPU servers on 127.0.0.1 without a cache and two with `-c`, the 1.8 GB f16 llama of
bench/load_scaling.py (or, `--size 4gb`, one of 4 GB with more layers). After the manifest is written
(the hashing `run`'s check does once) and a cold load has filled the caches, each round loads, in this
order: without a cache; warm (every tensor a hit) with the client hashing as stock
(`GGML_RPC_HASH_MANIFESTS=` empty); warm with the manifest. Each load in a fresh worker whose imports are
done. The client's own log (`GGML_RPC_HASH_LOG`) counts the tensors and bytes it hashed, and the worker
process's CPU seconds during each load are read from /proc; the ratios to the load without a cache are
taken per round (its spread given). Its own section per size: "warm load with the hash manifest (--size
1.8gb)" (or 4gb).

    .venv/bin/python bench/load.py --node-local [--size 4gb] [--nodes 3] [--cpus 0.6] [--rounds N] [--write]

`--node-local`: a lab of `--nodes` nodes, each capped at `--cpus` CPU (`lab up --cpus`), each link shaped to
`--rate`, the controller's side (the bridge) to `--controller-rate` (default 1gbit); each node holds a copy
of the GGUF in `~/models`. Each round, on emptied caches with every copy and this machine's GGUF dropped
from the page cache (posix_fadvise DONTNEED): a cold load through rpcfleet (`rpcfleet_cold`: check, warm
all nodes in parallel, the load beside the warm) with `model_path_on_nodes: ~/models`, then the same
without it (every byte through the controller). Measured beside: the controller-link limit (plain TCP,
the plan's bytes), the controller's bytes (the bridge's tx_bytes), each node's CPU seconds (its cgroup),
and the per-byte costs (FNV-1a per CPU second, a cold read of a copy, a write with fdatasync, a load from
full caches) from which a table projects a 318 GiB model on 8 nodes behind 10 GbE (computed, not
measured). Its own section, "load from node-local copies".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from statistics import median
from typing import Any

from _common import (
    CONDITIONS_RULE,
    ROOT,
    LoadConditions,
    arg_parser,
    bridge_tx,
    busy_cpu_seconds,
    controller_rate_arg,
    drop_page_cache,
    load_average,
    local_inventory,
    page_cache_resident,
    process_cpu,
    server_pids,
    servers,
    shape_controller,
    stamp,
    write_section,
)

from orchestrator.core.log import configure_logging

configure_logging("text", "WARNING")

from orchestrator.artifacts.build import cached_build
from orchestrator.artifacts.patches import CACHE_READ, HASH_LOG_ENV, HASH_MANIFEST_ENV
from orchestrator.caches.manifest import hash_log_counts
from orchestrator.caches.plan import HASH_THRESHOLD, RACY_NS, gguf_tensors, plan_cache
from orchestrator.caches.prep import warm_items
from orchestrator.core.fnv import hash_file_range
from orchestrator.engine.executor import HostContext, Session, StepOutcome
from orchestrator.engine.runtime import Runtime
from orchestrator.inventory.load import load_inventory
from orchestrator.inventory.model import Host
from orchestrator.lab.lifecycle import lab_down, lab_up, reap_stale
from orchestrator.lab.netns import privileged
from orchestrator.llama.worker.load_progress import LoadProgress, planned_bytes
from orchestrator.llama.worker.parent import Worker
from orchestrator.models.synth import write_tiny_llama
from orchestrator.operations.cache import cache_step, warm_step
from orchestrator.operations.layer import OperationOptions
from orchestrator.planning.devices import to_plan_devices
from orchestrator.planning.plan import Plan, PlanOptions
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan
from orchestrator.playbooks.reader import load_playbook
from orchestrator.playbooks.runner import run_playbook
from orchestrator.probe.fleet import probe_fleet
from orchestrator.workflows.load import load_on_fleet, prepare_load

SECTION = "load"
BESIDE = "cold through rpcfleet (`run --warm auto`: check, warm in parallel, the load beside the warm)"
AFTER = "cold through rpcfleet on stock servers (check, warm in parallel, then the load)"
LAB_NAME = "bload"
MODEL: dict[str, Any] = {"n_layer": 6, "n_embd": 2560, "n_head": 20, "n_head_kv": 20, "n_ff": 6912, "seed": 7}


def tbf(rate: str) -> list[str]:
    return ["root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]


def shape(lab: Any, rate: str, controller_rate: str | None) -> None:
    for node in lab.nodes:
        subprocess.run(["tc", "qdisc", "replace", "dev", node.veth, *tbf(rate)], check=True)
        subprocess.run(
            ["ip", "netns", "exec", node.namespace, "tc", "qdisc", "replace", "dev", "eth0", *tbf(rate)],
            check=True,
        )
    shape_controller(lab.bridge, controller_rate)  # what the controller sends into the bridge: its own link


SINK_PORT = 5999
SINK = (
    "import socket\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    f"s.bind(('0.0.0.0', {SINK_PORT})); s.listen(8); print('ready', flush=True)\n"
    "while True:\n"
    "    c, _ = s.accept()\n"
    "    while c.recv(1 << 20):\n"
    "        pass\n"
    "    c.close()\n"
)


def send_raw(address: str, count: int) -> float:
    """`count` bytes over plain TCP to the sink at `address`, until the sink has read them all: seconds."""
    chunk = b"\0" * (1 << 20)
    started = time.monotonic()
    with socket.create_connection((address, SINK_PORT), timeout=120) as conn:
        left = count
        while left > 0:
            conn.sendall(chunk[: min(left, len(chunk))])
            left -= min(left, len(chunk))
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # the sink closes once it has read everything
    return time.monotonic() - started


def wire_limits(lab: Any, per_node: dict[str, int], parallel: bool = True) -> tuple[float, float, float]:
    """The measured wire limits of these bytes: each node's bytes to it one node after the other (one link
    at a time), then to all nodes at once (seconds until the last is read), and the CPU seconds the
    machine spent on the latter (`parallel` False: the first only, the others 0)."""
    by_endpoint = {f"{n.address}:50052": n for n in lab.nodes}
    sinks = [
        subprocess.Popen(
            ["ip", "netns", "exec", node.namespace, sys.executable, "-c", SINK],
            stdout=subprocess.PIPE,
            text=True,
        )
        for node in lab.nodes
    ]
    try:
        for sink in sinks:
            assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
        addresses = {by_endpoint[ep].address: count for ep, count in per_node.items()}
        one_at_a_time = sum(send_raw(address, count) for address, count in addresses.items())
        if not parallel:
            return one_at_a_time, 0.0, 0.0
        busy = busy_cpu_seconds()
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(len(addresses)) as pool:
            list(pool.map(lambda item: send_raw(*item), addresses.items()))
        return one_at_a_time, time.monotonic() - started, busy_cpu_seconds() - busy
    finally:
        for sink in sinks:
            sink.kill()
            sink.wait()


async def deploy(hosts: list[Host]) -> None:
    async with Session(forks=8) as session:
        result = await run_playbook(load_playbook(ROOT / "playbooks" / "deploy.yml"), hosts, session=session)
    if not result.ok:
        raise RuntimeError(f"deploy failed: {[str(r.error) for s in result.steps for r in s.run.failed]}")


async def make_lab_plan(hosts: list[Host], model: Path) -> Plan:
    fleet = await probe_fleet(hosts)
    return make_plan(list(to_plan_devices(fleet)), profile_model(model), PlanOptions(n_ctx=512))


async def cache_op(hosts: list[Host], step: Any) -> Any:
    async with Session(forks=8) as session:
        run = await session.run(hosts, step, name="cache")
    if not run.ok:
        raise RuntimeError(f"cache step failed: {[str(r.error) for r in run.failed]}")
    return run


def timed_load(plan: Plan, model: Path, samples: list[LoadProgress] | None = None) -> float:
    """`Worker.load` in a fresh worker whose imports are done (`run` spawns it before it probes and plans,
    so they overlap): the load phase as `run` prints it."""
    with Worker.spawn() as worker:
        worker.wait_ready()
        started = time.monotonic()
        worker.load(plan, model, {"seed": 0}, on_progress=samples.append if samples is not None else None)
        return time.monotonic() - started


def node_rates(samples: list[LoadProgress]) -> dict[str, tuple[float, float, float]]:
    """Per node: its window (the first sample with 1% of its bytes acknowledged to the first with 99%: when
    its turn came, not the load's start) and the rate in it: (start s, end s, bytes/s)."""
    rates: dict[str, tuple[float, float, float]] = {}
    for endpoint in (n.endpoint for n in samples[-1].nodes):
        series = [(p.seconds, next(n.sent for n in p.nodes if n.endpoint == endpoint)) for p in samples]
        final = series[-1][1]
        opened = next((t, b) for t, b in series if b >= final * 0.01)
        closed = next((t, b) for t, b in series if b >= final * 0.99)
        if closed[0] > opened[0]:
            rates[endpoint] = (opened[0], closed[0], (closed[1] - opened[1]) / (closed[0] - opened[0]))
    return rates


def rpcfleet_cold(
    hosts: list[Host],
    plan: Plan,
    model: Path,
    *,
    beside: bool,
    first: bool = True,
    warmed: dict[str, Any] | None = None,
) -> dict[str, float]:
    """`rpcfleet run --warm auto` on empty caches, its phases after the plan (`load_on_fleet` on the
    command's runtime, whose session holds one SSH connection per node, as the probe leaves it), timed to
    the model loaded: check (nothing remembered: the model's mtime changes), warm, load. The worker was
    spawned before (its imports overlap with the probe). `beside`: as on servers with the `warm-wait`
    patch (the load runs beside the warm), else as on stock servers (the load starts when the warm has
    ended). `first` False: the model's hashes stay remembered (its memo and manifest), as on any load
    after its first. `warmed`: filled with each host's warm outcome (`CacheChange`). Returns the total and
    `load_on_fleet`'s phases."""
    if first:
        os.utime(model)  # no name remembered for this file: as on a first load
    with Runtime(forks=8) as runtime, Worker.spawn() as worker:
        runtime.run(connected(runtime.session, hosts))
        worker.wait_ready()
        busy = busy_cpu_seconds()
        started = time.monotonic()
        if beside:
            done = load_on_fleet(plan, hosts, worker, model, runtime=runtime)
        else:
            done = runtime.run(prepare_load(runtime.session, hosts, plan, model, warm="auto"))
            loaded = time.monotonic()
            worker.load(plan, model, {"seed": 0}, cache_hits=done.cache.hit_bytes if done.cache else None)
            done.phases["load"] = time.monotonic() - loaded
        total = time.monotonic() - started
        cpu = busy_cpu_seconds() - busy
    if done.warm is None or not done.warm.ok or done.cache is None or done.cache.misses:
        raise RuntimeError(f"warming failed: {done.warm and [str(r.error) for r in done.warm.failed]}")
    if done.overlapped is not beside:
        raise RuntimeError(f"the load ran {'beside' if done.overlapped else 'after'} the warm")
    if warmed is not None:
        warmed.update({r.host.name: r.value for r in done.warm.results})
    return {"total": total, **done.phases, "cpu": cpu}


async def connected(session: Session, hosts: list[Host]) -> None:
    """Open the session's connection to every host (what the probe does before a load)."""

    async def connect(ctx: HostContext) -> StepOutcome[None]:
        await ctx.connection()
        return StepOutcome(None)

    run = await session.run(hosts, connect, name="connect")
    if not run.ok:
        raise RuntimeError(f"cannot connect: {[str(r.error) for r in run.failed]}")


# --manifest: bench/load_scaling.py's 1.8 GB f16 llama, and a 4 GB one with the same layers, more of them.
MANIFEST_MODELS: dict[str, dict[str, Any]] = {
    "1.8gb": {"n_layer": 8, "n_embd": 3072, "n_head": 24, "n_head_kv": 24, "n_ff": 8192, "seed": 9},
    "4gb": {"n_layer": 18, "n_embd": 3072, "n_head": 24, "n_head_kv": 24, "n_ff": 8192, "seed": 9},
}
MANIFEST_SECTION = "warm load with the hash manifest"
NO_CACHE, WARM_HASHED, WARM_MANIFEST = "no cache", "warm, the client hashes", "warm, hashes from the manifest"


@dataclasses.dataclass(frozen=True)
class ManifestLoad:
    seconds: float
    cpu: float  # the worker process's CPU seconds during the load (user + system)
    server_cpu: float  # the servers' CPU seconds during the load, all together
    server_system: float  # of which in the kernel
    server_faults: int  # the servers' minor page faults during the load
    counts: Counter[str]  # the client's log: tensors from the manifest, tensors hashed (by reason)
    hashed_bytes: int


def logged_load(plan: Plan, model: Path, log: Path, manifests: bool, server: list[int]) -> ManifestLoad:
    """`timed_load` with the client's hash log and the CPU seconds of the worker and of the servers
    (`server`: their pids); `manifests` False: the lookup off (`GGML_RPC_HASH_MANIFESTS` empty: the client
    hashes as stock), True: rpcfleet's default folder (the loader sets it)."""
    import psutil

    log.unlink(missing_ok=True)
    saved = {k: os.environ.get(k) for k in (HASH_LOG_ENV, HASH_MANIFEST_ENV)}
    os.environ[HASH_LOG_ENV] = str(log)
    if manifests:
        os.environ.pop(HASH_MANIFEST_ENV, None)
    else:
        os.environ[HASH_MANIFEST_ENV] = ""
    try:
        with Worker.spawn() as worker:
            worker.wait_ready()
            process = psutil.Process(worker.pid)
            before, servers_before = process.cpu_times(), process_cpu(server)
            started = time.monotonic()
            worker.load(plan, model, {"seed": 0})
            seconds = time.monotonic() - started
            after, servers_after = process.cpu_times(), process_cpu(server)
        user, system, faults = (a - b for a, b in zip(servers_after, servers_before, strict=True))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    text = log.read_text() if log.exists() else ""
    hashed = sum(int(line.split()[2]) for line in text.splitlines() if line.startswith("hashed "))
    cpu = (after.user - before.user) + (after.system - before.system)
    return ManifestLoad(seconds, cpu, user + system, system, int(faults), hash_log_counts(text), hashed)


def server_patched(name: str) -> bool:
    """Whether the servers this bench runs (the cached CPU artifact's) were built with patch `name`."""
    artifact = cached_build("cpu")
    return artifact is not None and artifact.manifest.has_patch(name)


def read_rate(folder: Path) -> tuple[int, float]:
    """(bytes, seconds) to read every file under `folder` from the page cache into one reused buffer: the
    kernel's copy that a server's cache hit makes."""
    files = [f for f in folder.rglob("*") if f.is_file()]
    for f in files:  # into the page cache first
        f.read_bytes()
    buffer = bytearray(64 << 20)
    total = 0
    started = time.monotonic()
    for f in files:
        with f.open("rb", buffering=0) as fh:
            while n := fh.readinto(buffer):
                total += n
    return total, time.monotonic() - started


def manifest_main(args: Any) -> int:
    """`--manifest`: see the module's doc."""
    model = (
        args.model
        if args.model != DEFAULT_MODEL
        else Path(f"/tmp/rpcfleet-bench-load/model-{args.size}.gguf")
    )
    spec = MANIFEST_MODELS[args.size]
    if not model.exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        write_tiny_llama(model, **spec)
        time.sleep(2 * RACY_NS / 1e9)  # the memo is not kept for a file changed within its racy window
    tensors = gguf_tensors([model])
    total = sum(t.size for t in tensors)
    big = sum(t.size for t in tensors if t.size > HASH_THRESHOLD)
    profile = profile_model(model)
    for t in tensors:  # brings the file into the page cache: every load reads it from there
        hash_file_range(t.path, t.offset, t.size)
    cpu_started = time.process_time()  # CPU seconds: the load of a shared machine does not count
    for t in tensors:
        hash_file_range(t.path, t.offset, t.size)
    hash_rate = total / (time.process_time() - cpu_started)
    load = load_average()
    work = Path(f"/tmp/rpcfleet-bench-load/manifest-{os.getpid()}")
    (work / "logs").mkdir(parents=True, exist_ok=True)
    os.environ["LLAMA_CACHE"] = str(work / "cache")  # the servers' cache folder (`-c`)
    log = work / "hash.log"
    runs: dict[str, list[ManifestLoad]] = {NO_CACHE: [], WARM_HASHED: [], WARM_MANIFEST: []}
    resident: list[float] = []
    try:
        with servers(2, work / "logs") as plain_ports, servers(2, work / "logs", "-c") as cached_ports:
            plans = {}
            for name, ports in (("plain", plain_ports), ("cached", cached_ports)):
                (work / name).mkdir()
                hosts = list(load_inventory(local_inventory(work / name, ports)).hosts)
                plans[name] = asyncio.run(make_lab_plan(hosts, model))
            pids = {"plain": server_pids(plain_ports), "cached": server_pids(cached_ports)}
            started = time.monotonic()
            per_endpoint = plan_cache(plans["cached"], [model])  # the memo and the manifest: once per file
            named_s = time.monotonic() - started
            listed = len({(c.tensor.offset, c.tensor.size) for cs in per_endpoint.values() for c in cs})
            cold = logged_load(plans["cached"], model, log, True, pids["cached"])  # fills the cache files
            for _ in range(args.rounds):
                for name, plan_name, manifests in (
                    (NO_CACHE, "plain", True),
                    (WARM_HASHED, "cached", False),
                    (WARM_MANIFEST, "cached", True),
                ):
                    resident.append(page_cache_resident(model))
                    runs[name].append(logged_load(plans[plan_name], model, log, manifests, pids[plan_name]))
            cache_bytes, cache_read_s = read_rate(work / "cache")
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    plan = plans["cached"]
    per_node = planned_bytes(plan)
    section_name = f"{MANIFEST_SECTION} (--size {args.size})"  # a figure in a heading would be hand-written
    conditions = {
        NO_CACHE: LoadConditions("loopback (unshaped)", "warm", "none"),
        WARM_HASHED: LoadConditions("loopback (unshaped)", "warm", "full"),
        WARM_MANIFEST: LoadConditions("loopback (unshaped)", "warm", "full"),
    }

    def ratios(name: str) -> list[float]:
        return [r.seconds / b.seconds for r, b in zip(runs[name], runs[NO_CACHE], strict=True)]

    def spread(xs: list[float], unit: str = "", digits: int = 2) -> str:
        return f"{median(xs):.{digits}f}{unit} ({min(xs):.{digits}f}..{max(xs):.{digits}f})"

    def counts(r: ManifestLoad) -> str:
        said = ", ".join(f"{k} {v}" for k, v in sorted(r.counts.items()))
        return said or "none"

    lines = [
        f"## {section_name}",
        "",
        f"`bench/load.py --manifest --size {args.size}`, {stamp()}; 1-min load average {load:.1f} at the "
        f"start. Loopback: 2 CPU servers without a cache and 2 with `-c` on 127.0.0.1 (this machine's "
        f"{os.cpu_count()} cores shared by the servers, the worker and the rest); a generated f16 llama of "
        f"{total / 1e9:.2f} GB ({profile.n_layer} layers, n_embd {profile.n_embd}; {big / total:.0%} of its "
        f"bytes in tensors over 10 MiB), plan {'/'.join(str(d.n_layers) for d in plan.devices)} layers, "
        f"{sum(per_node.values()) / 1e9:.2f} GB of weights on the servers; the GGUF in the page cache "
        f"({min(resident):.0%} of its pages or more before each load). {args.rounds} rounds, each in this "
        "order: no cache, warm with the client hashing (stock), warm from the manifest; each load in a "
        "fresh worker whose imports are done. Medians over the rounds, (min..max) beside them; the ratio "
        "is taken per round.",
        "",
        "| load | conditions | seconds | x no cache | worker CPU s | servers' CPU s | tensors hashed "
        "| GB hashed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, loads in runs.items():
        rel = "1" if name == NO_CACHE else spread(ratios(name), "x")
        n_hashed = [sum(v for k, v in r.counts.items() if k.startswith("hashed")) for r in loads]
        lines.append(
            f"| {name} | {conditions[name].text()} | {spread([r.seconds for r in loads])} | {rel} | "
            f"{spread([r.cpu for r in loads])} | {spread([r.server_cpu for r in loads])} | {max(n_hashed)} | "
            f"{max(r.hashed_bytes for r in loads) / 1e9:.2f} |"
        )
    manifest, hashed = ratios(WARM_MANIFEST), ratios(WARM_HASHED)
    hashed_before = max(r.hashed_bytes for r in runs[WARM_HASHED])
    hashed_after = max(r.hashed_bytes for r in runs[WARM_MANIFEST])
    hashing_cpu = [h.cpu - m.cpu for h, m in zip(runs[WARM_HASHED], runs[WARM_MANIFEST], strict=True)]
    warm = runs[WARM_MANIFEST]
    server_share = [r.server_cpu / r.seconds for r in warm]
    system_share = [r.server_system / r.server_cpu for r in warm]
    fault_bytes = [r.server_faults * 4096 / 1e9 for r in warm]
    plain_fault_bytes = [r.server_faults * 4096 / 1e9 for r in runs[NO_CACHE]]
    plain_system = [r.server_system / r.server_cpu for r in runs[NO_CACHE]]
    verdict = "met" if median(manifest) <= 0.25 else "**not met**"
    hit_path = (
        "The servers take the `cache-read` patch (their manifest): a hit reads its cache file straight "
        "into the weights' buffer."
        if server_patched(CACHE_READ)
        else "The servers lack the `cache-read` patch (their manifest): a hit allocates and zero-fills a "
        "vector of the tensor's size, reads its cache file into it and copies that into the buffer "
        "(stock `get_cached_file`, `set_tensor_hash`)."
    )
    lines += [
        "",
        f"- Target: a warm load at most 0.25x the load without a cache: {spread(manifest, 'x')} with the "
        f"manifest ({verdict}); {spread(hashed, 'x')} when the client hashes (today's stock client).",
        f"- The controller's CPU seconds hashing per warm load (the worker's CPU, client hashing minus "
        f"manifest, per round): {spread(hashing_cpu, ' s')} for {hashed_before / 1e9:.2f} GB hashed "
        f"({hashed_before / median(hashing_cpu) / 1e6:.0f} MB per CPU second; rpcfleet's own native FNV-1a "
        f"here {hash_rate / 1e6:.0f} MB per CPU second). With the manifest: {hashed_after / 1e9:.2f} GB "
        f"hashed, so none (the client's log, last round: {counts(warm[-1])}; the manifest lists {listed} "
        "tensors).",
        f"- Once per model file: naming the plan's tensors for the memo and the manifest {named_s:.2f} s "
        f"(read from the memo when an earlier run hashed this file); the cold load that filled the caches "
        f"{cold.seconds:.2f} s (its client: {counts(cold)}).",
        f"- What is left of a warm load with the manifest, measured: the servers were busy "
        f"{spread([r.server_cpu for r in warm], ' CPU s')} of its "
        f"{spread([r.seconds for r in warm], ' s')} ({spread(server_share, 'x')} of the wall time; the "
        f"worker {spread([r.cpu for r in warm], ' CPU s')}), {spread(system_share, 'x')} of it in the "
        f"kernel, with {spread(fault_bytes, ' GB')} of fresh pages first touched (minor faults x 4 KiB; "
        f"without a cache {spread(plain_fault_bytes, ' GB')}, the servers {spread(plain_system, 'x')} in the "
        f"kernel). {hit_path} The weights' buffers are new at each load: reading the "
        f"{cache_bytes / 1e9:.2f} GB of cache files from the page cache into one reused buffer takes only "
        f"{cache_read_s:.2f} s here ({cache_bytes / cache_read_s / 1e9:.2f} GB/s), so the servers' time is "
        f"the fresh memory (faults, the kernel's zero-fill), not the reads. The SET_TENSOR_HASH requests go "
        f"one at a time ({listed}, a loopback round trip each); the tensors under 10 MiB are sent. Over "
        "loopback the no-cache load pays for fresh memory twice (receive into a new vector, copy into the "
        "buffer) and for the socket copies; the ratio falls further where the wire, not memory, bounds the "
        "load without a cache.",
        "",
        CONDITIONS_RULE,
        "",
    ]
    section = "\n".join(lines)
    print(section)
    if args.write is not None:
        write_section(args.write, section_name, section)
    return 0


# --node-local: nodes that hold the model (`model_path_on_nodes`) against loads through the controller.
NODE_LOCAL_SECTION = "load from node-local copies"
LOCAL_LAB = "h41local"
FROM_NODES = "cold from the nodes' own copies (`model_path_on_nodes`)"
FROM_CONTROLLER = "cold through the controller (no copies on the nodes)"


@dataclasses.dataclass(frozen=True)
class LocalRun:
    phases: dict[str, float]  # `rpcfleet_cold`'s: total, its phases, the machine's busy CPU
    sent: int  # the controller's bytes into the lab (the bridge's tx_bytes)
    node_cpu: dict[str, float]  # CPU seconds per node (its cgroup)
    via: list[str]  # how the warm's bytes went
    local_bytes: int  # bytes the nodes copied from their own files
    warnings: list[str]

    @property
    def total(self) -> float:
        return self.phases["total"]


@dataclasses.dataclass(frozen=True)
class ByteCosts:
    """Seconds per byte, each measured in the run: `hash` FNV-1a on one core (per CPU second), `wire` the
    measured controller link's (its achieved share of its nominal rate is `efficiency`), `read` a node's
    cold read of its copy, `write` a node writing a file to its disk (fdatasync), `from_cache` a load whose
    every tensor is in the servers' caches (llama.cpp's load: one tensor, one node after another)."""

    hash: float
    efficiency: float
    read: float
    write: float
    from_cache: float


PROJECTED_GIB, PROJECTED_NODES, PROJECTED_LINK_BPS, AIM_S = 318, 8, 10e9, 45.0


def projection(size: float, nodes: int, link_bps: float, costs: ByteCosts) -> dict[str, tuple[float, str]]:
    """Pure: seconds until a model of `size` bytes is loaded on `nodes` nodes behind a controller link of
    `link_bps` bits/s, from the measured per-byte costs, with how each is made up. Every load ends with the
    servers putting each tensor into their buffers one after another (llama.cpp's load), at least as
    long as a load from full caches (`from_cache`; bench/load.py --manifest measures the servers' CPU
    about the same whether the bytes come from the socket or the cache):
    - today (stock client, through the controller): the client hashes each tensor, then sends it, every
      byte through the one link;
    - with the manifest, through the controller: the hashes read, every byte still through the link;
    - from node-local copies: each node copies its share from its disk, hashes it and writes its cache
      file (in series on the node, all nodes at once), the load beside it."""
    wire = size * 8 / (link_bps * costs.efficiency)
    hashed = size * costs.hash
    share = size / nodes
    node_side = share * (costs.read + costs.hash + costs.write)
    servers = size * costs.from_cache
    return {
        "today: the client hashes, then sends (stock)": (
            hashed + max(wire, servers),
            f"hash {hashed:.0f} s + the larger of wire {wire:.0f} s and servers {servers:.0f} s",
        ),
        "the manifest, through the controller": (
            max(wire, servers),
            f"the larger of wire {wire:.0f} s and servers {servers:.0f} s",
        ),
        "the manifest, from node-local copies": (
            max(node_side, servers),
            f"the larger of per node read {share * costs.read:.0f} s + hash {share * costs.hash:.0f} s + "
            f"write {share * costs.write:.0f} s = {node_side:.0f} s and servers {servers:.0f} s",
        ),
    }


def write_rate(folder: Path, size: int = 1 << 30) -> float:
    """Bytes per second writing `size` bytes to a new file in `folder`, fdatasync included (a node
    writing its cache file); the file is removed after."""
    path = folder / f".bench-write-{os.getpid()}"
    block = os.urandom(1 << 20)  # not zeros: nothing may skip them
    started = time.monotonic()
    try:
        with path.open("wb", buffering=0) as fh:
            for _ in range(size // len(block)):
                fh.write(block)
            os.fdatasync(fh.fileno())
        return size / (time.monotonic() - started)
    finally:
        path.unlink(missing_ok=True)


def cold_read_rate(path: Path) -> float:
    """Bytes per second reading `path` whole after dropping it from the page cache."""
    drop_page_cache(path)
    buffer = bytearray(16 << 20)
    total = 0
    started = time.monotonic()
    with path.open("rb", buffering=0) as fh:
        while n := fh.readinto(buffer):
            total += n
    return total / (time.monotonic() - started)


def node_local_main(args: Any) -> int:
    """`--node-local`: see the module's doc."""
    from orchestrator.lab.cgroups import usage_us

    if not privileged():
        print("bench/load.py --node-local needs root (network namespaces)", file=sys.stderr)
        return 2
    model = (
        args.model
        if args.model != DEFAULT_MODEL
        else Path(f"/tmp/rpcfleet-bench-load/model-{args.size}.gguf")
    )
    if not model.exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        write_tiny_llama(model, **MANIFEST_MODELS[args.size])
        time.sleep(2 * RACY_NS / 1e9)  # the memo is not kept for a file changed within its racy window
    controller_rate = args.controller_rate or "1gbit"
    tensors = gguf_tensors([model])
    total = sum(t.size for t in tensors)
    reap_stale()
    load = load_average()
    lab = lab_up(args.nodes, name=LOCAL_LAB, owner_pid=os.getpid(), cpus=args.cpus)
    runs: dict[str, list[LocalRun]] = {FROM_NODES: [], FROM_CONTROLLER: []}
    try:
        shape(lab, args.rate, controller_rate)
        base = [dataclasses.replace(h, rpc_cache=True) for h in load_inventory(lab.inventory).hosts]
        local = [dataclasses.replace(h, model_path_on_nodes="~/models") for h in base]
        copies = []
        for node in lab.nodes:  # each node's own copy on its disk (here: in its own home)
            (node.home / "models").mkdir(mode=0o755, exist_ok=True)
            copies.append(Path(shutil.copyfile(model, node.home / "models" / model.name)))
            copies[-1].chmod(0o644)
        asyncio.run(deploy(base))
        plan = asyncio.run(make_lab_plan(base, model))
        per_node = planned_bytes(plan)
        limit, _, _ = wire_limits(lab, per_node, parallel=False)  # every byte through the controller's link
        started = time.monotonic()
        plan_cache(plan, [model])  # the model's memo and manifest: once per file (read back if known)
        named_s = time.monotonic() - started
        # Per-byte costs for the projection, each measured here: FNV-1a per CPU second (the file in the
        # page cache), a cold read of a node's copy, a 1 GiB write with fdatasync in a node's home.
        for t in tensors:
            hash_file_range(t.path, t.offset, t.size)
        cpu_started = time.process_time()
        for t in tensors:
            hash_file_range(t.path, t.offset, t.size)
        hash_rate = total / (time.process_time() - cpu_started)
        read_bps = cold_read_rate(copies[0])
        write_bps = write_rate(lab.nodes[0].home / "models")
        options = OperationOptions()
        for _ in range(args.rounds):
            for name, hosts in ((FROM_NODES, local), (FROM_CONTROLLER, base)):
                asyncio.run(cache_op(base, cache_step("clear", options)))
                for path in (model, *copies):  # page cache cold: every copy is read from the disk
                    drop_page_cache(path)
                cpu = {n.name: usage_us(n.namespace or n.name) for n in lab.nodes}
                tx = bridge_tx(lab.bridge)
                warmed: dict[str, Any] = {}
                phases = rpcfleet_cold(hosts, plan, model, beside=True, first=False, warmed=warmed)
                runs[name].append(
                    LocalRun(
                        phases,
                        bridge_tx(lab.bridge) - tx,
                        {n.name: (usage_us(n.namespace or n.name) - cpu[n.name]) / 1e6 for n in lab.nodes},
                        sorted({str(c.via) for c in warmed.values()}),
                        sum(c.bytes_local for c in warmed.values()),
                        [w for c in warmed.values() for w in c.warnings],
                    )
                )
        # Apart, once: the warm from the copies alone (no load beside it), then a load from the full caches.
        asyncio.run(cache_op(base, cache_step("clear", options)))
        for path in (model, *copies):
            drop_page_cache(path)
        cpu = {n.name: usage_us(n.namespace or n.name) for n in lab.nodes}
        started = time.monotonic()
        alone = asyncio.run(cache_op(local, warm_step(warm_items(plan_cache(plan, [model]), local), options)))
        warm_alone = time.monotonic() - started
        warm_alone_cpu = {n.name: (usage_us(n.namespace or n.name) - cpu[n.name]) / 1e6 for n in lab.nodes}
        warm_alone_via = sorted({str(r.value.via) for r in alone.results})
        from_cache = timed_load(plan, model)  # the caches full now: every big tensor a hit
    finally:
        lab_down(LOCAL_LAB)
    transport = "/".join(sorted({h.rpc_transport for h in base}))
    said = LoadConditions(controller_rate, "cold", "empty", transport).text()

    def spread(xs: list[float], unit: str = "") -> str:
        return f"{median(xs):.2f}{unit} ({min(xs):.2f}..{max(xs):.2f})"

    lines = [
        f"## {NODE_LOCAL_SECTION}",
        "",
        f"`bench/load.py --node-local --size {args.size}`, {stamp()}; 1-min load average {load:.1f} at the "
        f"start. A lab of {args.nodes} network-namespace nodes, each capped at {args.cpus:g} CPU (`lab up "
        f"--cpus`: {args.nodes} nodes, the controller and other work share this machine's {os.cpu_count()} "
        f"cores, one disk and one page cache), each link shaped to {args.rate}, the controller's side (the "
        f"bridge) to {controller_rate}; CPU servers with `-c`; a generated f16 llama of "
        f"{total / 1e9:.2f} GB, "
        f"plan {'/'.join(str(d.n_layers) for d in plan.devices)} layers "
        f"({', '.join(f'{v / 1e9:.2f}' for v in per_node.values())} GB per node); each node holds a whole "
        "copy of the GGUF in `~/models` (`model_path_on_nodes`). Each load is `rpcfleet run --warm auto`'s "
        "after the plan (check, warm all nodes in parallel, the load beside the warm; bench/load.py's "
        "`rpcfleet_cold`) on emptied caches, with this machine's GGUF and every node's copy dropped from the "
        "page cache just before; the model's hashes remembered (its memo and manifest, as on every load "
        f"after its first; naming them took {named_s:.2f} s here). {args.rounds} rounds, each: from the "
        "nodes' copies, then through the controller. Medians, (min..max) beside them.",
        "",
        "| load | conditions | seconds | x the controller-link limit | controller sent (bridge tx) | CPU s "
        "per node | warm's bytes via |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rs in runs.items():
        cpus = " / ".join(f"{n} {spread([r.node_cpu[n] for r in rs])}" for n in rs[0].node_cpu)
        lines.append(
            f"| {name} | {said} | {spread([r.total for r in rs])} | "
            f"{spread([r.total / limit for r in rs], 'x')} | {spread([r.sent / 1e9 for r in rs], ' GB')} | "
            f"{cpus} | {', '.join(sorted({v for r in rs for v in r.via}))} |"
        )
    ours = [r.total / limit for r in runs[FROM_NODES]]
    theirs = [r.total / limit for r in runs[FROM_CONTROLLER]]
    best = min(runs[FROM_NODES], key=lambda r: r.total)
    capped = [max(r.node_cpu.values()) / args.cpus for r in runs[FROM_NODES]]
    warnings = sorted({w for r in runs[FROM_NODES] for w in r.warnings})
    verdict = "met" if median(ours) <= 0.5 else "**not met**"
    busy = [r.phases["cpu"] / r.total / (os.cpu_count() or 1) for r in runs[FROM_NODES]]
    nominal = {"gbit": 1e9, "mbit": 1e6}[controller_rate[-4:]] * float(controller_rate[:-4])
    efficiency = sum(per_node.values()) * 8 / limit / nominal
    costs = ByteCosts(1 / hash_rate, efficiency, 1 / read_bps, 1 / write_bps, from_cache / total)
    projected = projection(PROJECTED_GIB * 2**30, PROJECTED_NODES, PROJECTED_LINK_BPS, costs)
    local_s, _ = projected["the manifest, from node-local copies"]
    node_side = PROJECTED_GIB * 2**30 / PROJECTED_NODES * (costs.read + costs.hash + costs.write)
    bound = "the nodes' read, hash and write" if node_side >= local_s else "the servers' load from the caches"
    aim = (
        f"met ({local_s:.0f} s)"
        if local_s <= AIM_S
        else f"**not met** ({local_s:.0f} s, {local_s / AIM_S:.1f}x; bound by {bound} at these rates)"
    )
    best_phases = ", ".join(f"{k} {v:.2f} s" for k, v in best.phases.items() if k not in ("total", "cpu"))
    lines += [
        "",
        f"- Controller-link limit, measured in this run: the plan's {sum(per_node.values()) / 1e9:.2f} GB "
        f"over plain TCP through the same shaped path, node after node: {limit:.2f} s.",
        f"- Target: a cold load from node-local copies at most 0.5x that limit: {spread(ours, 'x')} "
        f"({verdict}); through the controller {spread(theirs, 'x')}. From the copies the controller sent "
        f"{spread([r.sent / 1e9 for r in runs[FROM_NODES]], ' GB')} into the lab (commands, the tensors "
        f"under 10 MiB, the load's requests); the nodes copied "
        f"{spread([r.local_bytes / 1e9 for r in runs[FROM_NODES]], ' GB')} from their own files"
        + (f"; warnings: {'; '.join(warnings)}" if warnings else "; no node fell back to the controller")
        + ".",
        f"- Against the caps: the busiest node's CPU seconds over its {args.cpus:g}-CPU cap, "
        f"{spread(capped, ' s')}, is the least time its share could take at that cap "
        f"({spread([c / r.total for c, r in zip(capped, runs[FROM_NODES], strict=True)], 'x')} of the "
        f"load). Phases of the fastest load from the copies: {best_phases}. This machine's "
        f"{os.cpu_count()} cores were busy {spread(busy, 'x')} of each load from the copies (all work on "
        "the machine, the other sessions' included).",
        f"- Apart, once (caches emptied, page caches dropped): the warm from the copies alone "
        f"{warm_alone:.2f} s (via {', '.join(warm_alone_via)}; CPU s per node "
        f"{', '.join(f'{n} {c:.2f}' for n, c in warm_alone_cpu.items())}), then the load from the full "
        f"caches {from_cache:.2f} s: {warm_alone + from_cache:.2f} s one after the other, against "
        f"{median([r.total for r in runs[FROM_NODES]]):.2f} s beside each other.",
        f"- Per-byte costs measured here: FNV-1a {hash_rate / 1e9:.2f} GB per CPU second; a node's copy "
        f"read cold {read_bps / 1e9:.2f} GB/s; a 1 GiB write with fdatasync {write_bps / 1e9:.2f} GB/s; "
        f"the controller link carried {efficiency:.0%} of its nominal {controller_rate}; the load once the "
        f"caches are full (the manifest's hashes) {from_cache:.2f} s, {total / from_cache / 1e9:.2f} GB/s.",
        "",
        f"Projection, computed from those costs (not measured): a {PROJECTED_GIB} GiB model on "
        f"{PROJECTED_NODES} nodes behind a {PROJECTED_LINK_BPS / 1e9:g} GbE controller link, each cost at "
        f"this machine's rate (aim: ready in {AIM_S:.0f} s from node-local copies).",
        "",
        "| load | seconds | made of |",
        "|---|---|---|",
        *(f"| {name} | {seconds:.0f} | {parts} |" for name, (seconds, parts) in projected.items()),
        "",
        f"- The aim of {AIM_S:.0f} s from node-local copies: {aim}.",
        "",
        CONDITIONS_RULE,
        "",
    ]
    section = "\n".join(lines)
    print(section)
    if args.write is not None:
        write_section(args.write, NODE_LOCAL_SECTION, section)
    return 0


DEFAULT_MODEL = Path("/tmp/rpcfleet-bench-load/model.gguf")


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--rate", default="1gbit", help="tc tbf rate per link (default 1gbit)")
    controller_rate_arg(parser)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument(
        "--manifest", action="store_true", help="the warm load with the hash manifest, over loopback (no lab)"
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="--manifest, --node-local: rounds (each alternates its loads)"
    )
    parser.add_argument(
        "--size", choices=sorted(MANIFEST_MODELS), default="1.8gb", help="--manifest, --node-local: model"
    )
    parser.add_argument(
        "--node-local",
        action="store_true",
        help="a cold load from the nodes' own copies (model_path_on_nodes) against one through this machine",
    )
    parser.add_argument("--nodes", type=int, default=3, help="--node-local: lab nodes (default 3)")
    parser.add_argument(
        "--cpus", type=float, default=0.6, help="--node-local: CPU cap per node (default 0.6)"
    )
    args = parser.parse_args()
    if args.manifest:
        return manifest_main(args)
    if args.node_local:
        return node_local_main(args)
    if not privileged():
        print("bench/load.py needs root (network namespaces)", file=sys.stderr)
        return 2
    if not args.model.exists():
        write_tiny_llama(args.model, **MODEL)
    model = args.model
    tensors = gguf_tensors([model])
    total = sum(t.size for t in tensors)
    big = sum(t.size for t in tensors if t.size > HASH_THRESHOLD)
    # Native hash and page-cache read rates on this machine (the file was just written or read).
    started = time.monotonic()
    for t in tensors:
        hash_file_range(t.path, t.offset, t.size)
    hash_rate = total / (time.monotonic() - started)
    started = time.monotonic()
    with model.open("rb") as fh:
        while fh.read(64 << 20):
            pass
    read_rate = model.stat().st_size / (time.monotonic() - started)

    reap_stale()
    load = load_average()
    lab = lab_up(3, name=LAB_NAME, owner_pid=os.getpid())
    results: dict[str, float] = {}
    sent_by: dict[str, int] = {}  # the controller's bytes into the lab (the bridge's tx_bytes) per load
    try:
        shape(lab, args.rate, args.controller_rate)
        base = list(load_inventory(lab.inventory).hosts)
        plain = [dataclasses.replace(h, rpc_cache=False) for h in base]
        cached = [dataclasses.replace(h, rpc_cache=True) for h in base]
        asyncio.run(deploy(plain))
        plan = asyncio.run(make_lab_plan(plain, model))
        wire, wire_parallel, wire_cpu = wire_limits(lab, planned_bytes(plan))
        samples: list[LoadProgress] = []
        tx = bridge_tx(lab.bridge)
        results["no cache"] = timed_load(plan, model, samples)
        sent_by["no cache"], tx = bridge_tx(lab.bridge) - tx, bridge_tx(lab.bridge)
        asyncio.run(deploy(cached))
        options = OperationOptions()
        asyncio.run(cache_op(cached, cache_step("clear", options)))
        tx = bridge_tx(lab.bridge)
        results["cold (-c, empty cache)"] = timed_load(plan, model)
        sent_by["cold (-c, empty cache)"] = bridge_tx(lab.bridge) - tx
        busy, tx = busy_cpu_seconds(), bridge_tx(lab.bridge)
        results["warm (-c, every big tensor a hit)"] = timed_load(plan, model)
        warm_load_cpu = busy_cpu_seconds() - busy
        sent_by["warm (-c, every big tensor a hit)"] = bridge_tx(lab.bridge) - tx
        asyncio.run(cache_op(cached, cache_step("clear", options)))
        started = time.monotonic()
        per_endpoint = plan_cache(plan, [model], memo=False)
        hash_s = time.monotonic() - started
        items = warm_items(per_endpoint, cached)
        busy = busy_cpu_seconds()
        started = time.monotonic()
        run = asyncio.run(cache_op(cached, warm_step(items, options)))
        warm_s = time.monotonic() - started
        warm_cpu = busy_cpu_seconds() - busy
        node_warm = {r.host.name: (r.value.bytes_sent, r.value.seconds) for r in run.results}
        warm_via = sorted({str(r.value.via) for r in run.results})
        tx = bridge_tx(lab.bridge)
        results["pre-warmed first load"] = timed_load(plan, model)
        sent_by["pre-warmed first load"] = bridge_tx(lab.bridge) - tx
        asyncio.run(cache_op(cached, cache_step("clear", options)))
        largest = max(items, key=lambda name: sum(i.size for i in items[name]))
        started = time.monotonic()
        asyncio.run(
            cache_op([h for h in cached if h.name == largest], warm_step({largest: items[largest]}, options))
        )
        alone_s = time.monotonic() - started
        # Beside the warm (servers with `warm-wait`) and after it (stock servers), alternated.
        throughs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for beside in (True, False, True, False):
            asyncio.run(cache_op(cached, cache_step("clear", options)))
            tx = bridge_tx(lab.bridge)
            throughs[beside].append(rpcfleet_cold(cached, plan, model, beside=beside))
            throughs[beside][-1]["sent"] = bridge_tx(lab.bridge) - tx
        for beside, name in ((True, BESIDE), (False, AFTER)):
            results[name] = min(r["total"] for r in throughs[beside])
            sent_by[name] = int(min(throughs[beside], key=lambda r: r["total"])["sent"])
    finally:
        lab_down(LAB_NAME)
    per_node = planned_bytes(plan)
    sent = sum(per_node.values())
    controller = "" if args.controller_rate is None else f", the controller's side {args.controller_rate}"
    cold = results["cold (-c, empty cache)"]
    warm = results["warm (-c, every big tensor a hit)"]
    lines = [
        f"## {SECTION}",
        "",
        f"`bench/load.py`, {stamp()}; 1-min load average {load:.1f} at the start. A lab of 3 "
        f"network-namespace nodes, each link shaped to {args.rate} (tbf, both ends){controller}, CPU "
        f"servers; a generated f16 llama of {total / 1e6:.0f} MB ({MODEL['n_layer']} layers, n_embd "
        f"{MODEL['n_embd']}, n_ff {MODEL['n_ff']}; {100 * big / total:.0f}% of its bytes in tensors over "
        f"10 MiB), plan {'/'.join(str(d.n_layers) for d in plan.devices)} layers; {sent / 1e6:.0f} MB of "
        f"weights sent ({', '.join(f'{v / 1e6:.0f}' for v in per_node.values())} MB per node). One run; "
        "each load in a fresh worker process whose imports are done (`Worker.load`: the load phase "
        "`rpcfleet run` prints).",
        "",
        "| load | conditions | seconds | links at once | x the measured wire limit of those links | MB/s "
        "(all nodes) | controller sent (bridge tx) |",
        "|---|---|---|---|---|---|---|",
    ]
    side = args.controller_rate or "unshaped"
    transport = "/".join(sorted({h.rpc_transport for h in cached}))
    caches = {
        "no cache": "none",
        "cold (-c, empty cache)": "empty",
        "warm (-c, every big tensor a hit)": "full",
        "pre-warmed first load": "full",
        BESIDE: "empty",
        AFTER: "empty",
    }
    # Each load is judged against the links it uses: llama.cpp sends to one node after another (one link
    # at a time); rpcfleet's warming fills every node's link at once, so its limit is the busiest link's.
    for name, seconds in results.items():
        links, limit = (len(per_node), wire_parallel) if name in (BESIDE, AFTER) else (1, wire)
        said = LoadConditions(side, "warm", caches[name], transport).text()
        lines.append(
            f"| {name} | {said} | {seconds:.2f} | {links} | {seconds / limit:.2f} | "
            f"{sent / seconds / 1e6:.0f} | {sent_by[name] / 1e9:.2f} GB |"
        )
    prewarmed = results["pre-warmed first load"]
    ours = results[BESIDE]
    cores = os.cpu_count() or 1
    best = {b: min(runs, key=lambda r: r["total"]) for b, runs in throughs.items()}

    def spread(beside: bool) -> str:
        return " and ".join(f"{r['total']:.2f}" for r in throughs[beside])

    def phases(run: dict[str, float]) -> str:
        cpu = f"; the {cores} cores busy {run['cpu'] / run['total'] / cores:.0%}"
        return ", ".join(f"{k} {v:.2f} s" for k, v in run.items() if k not in ("total", "cpu", "sent")) + cpu

    per_node_text = ", ".join(
        f"{n} {b / 1e6:.0f} MB in {s:.2f} s ({b / s / 1e6:.0f} MB/s)" for n, (b, s) in node_warm.items()
    )
    names = {h.endpoint: h.name for h in cached}
    rates = node_rates(samples)
    rates_text = ", ".join(
        f"{names.get(ep, ep)} {r / 1e6:.0f} MB/s from {a:.2f} s to {b:.2f} s"
        for ep, (a, b, r) in rates.items()
    )
    windows = sum(b - a for a, b, _ in rates.values())
    nominal = {"gbit": 1e9, "mbit": 1e6}[args.rate[-4:]] * float(args.rate[:-4]) / 8
    no_cache = results["no cache"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "**not met**"

    lines += [
        "",
        f"- Wire limit, measured in this run (plain TCP, the same bytes, the same path): {wire:.2f} s one "
        f"node after the other (llama.cpp's load: one link at a time), {wire_parallel:.2f} s to all "
        f"{len(per_node)} nodes at once (a parallel warm's path); from the nominal {args.rate} they would be "
        f"{sent / nominal:.2f} s and {max(per_node.values()) / nominal:.2f} s. Achieved in the no-cache "
        f"load: {sent * 8 / no_cache / 1e9:.2f} Gbit/s; per node in its own window (1% to 99% of its "
        f"bytes, the load's progress samples): {rates_text}; the windows add up to {windows:.2f} s of a "
        f"{no_cache:.2f} s load.",
        f"- Targets: a cold load through rpcfleet within 1.5x the measured limit of the links it uses: "
        f"{ours:.2f} s, the best of {spread(True)} s (phases from the start: {phases(best[True])}; the "
        f"check hashes only the tensors a cached file could be, none on empty caches, and the warm names "
        f"the others as it sends them; the warm's phase ends after the load) is "
        f"{ours / wire_parallel:.2f}x the {len(per_node)}-link limit: {verdict(ours / wire_parallel <= 1.5)} "
        f"({ours / wire:.2f}x the one-link limit). Alternated with it, the load after the warm (stock "
        f"servers): {results[AFTER]:.2f} s, the best of {spread(False)} s ({phases(best[False])}), "
        f"{results[AFTER] / wire_parallel:.2f}x. llama.cpp's own "
        f"cold load (-c, empty cache) {cold / wire:.2f}x the one-link limit. A warm load at least 4x faster "
        f"than a load without a cache: {no_cache / warm:.1f}x ({verdict(no_cache / warm >= 4.0)}; "
        f"{cold / warm:.1f}x faster than the -c cold load). The pre-warmed first load takes "
        f"{prewarmed / warm:.2f}x a warm load (target at most 1.2x: {verdict(prewarmed / warm <= 1.2)}).",
        f"- `cache warm`: hashing the plan's tensors here {hash_s:.2f} s (once per model file: "
        f"remembered under $RPCFLEET_HOME/hashes), upload {warm_s:.2f} s for all nodes in parallel; per node "
        f"{per_node_text}; the largest node ({largest}) warmed alone {alone_s:.2f} s (target: all nodes in "
        f"parallel about the largest alone, within 1.2x: {verdict(warm_s <= 1.2 * alone_s)}).",
        f"- Where time goes: native FNV-1a here {hash_rate / 1e6:.0f} MB/s; the client takes each tensor's "
        f"hash over 10 MiB from the model's hash manifest, written once per model file (docs/caches.md), "
        f"and hashes only one it lacks: hashing them all would take {big / hash_rate:.2f} s a load. GGUF "
        f"read from the page cache {read_rate / 1e6:.0f} MB/s ({model.stat().st_size / read_rate:.2f} s). "
        "The rest of a warm load is the servers reading their cache files and copying them into their "
        "buffers, plus the worker's start and context set-up; of a cold one, the wire and the servers "
        "hashing and writing their files (on a miss, each server hashes the tensor again before it writes).",
        f"- CPU work measured in this run (the machine's busy core-seconds): the plain-TCP send to all "
        f"nodes at once {wire_cpu:.1f}, `cache warm` of all nodes {warm_cpu:.1f} (its bytes over "
        f"{' and '.join(warm_via)}), a warm load {warm_load_cpu:.1f}, the cold load "
        f"beside the warm {best[True]['cpu']:.1f}: on {cores} cores at least "
        f"{best[True]['cpu'] / cores:.2f} s, {best[True]['cpu'] / cores / wire_parallel:.2f}x the "
        f"{len(per_node)}-link limit.",
        "- What limits it on 2 cores: llama.cpp's load is sequential: per tensor the client takes its hash "
        "(from the manifest, else hashing it on one core), asks the server, sends, and the server (on a miss "
        "with -c) hashes and writes its file before it answers the next request, so a cold load adds the "
        "server's hash and the write to the wire time; the "
        "three servers, the tbf shapers, the worker and sshd share the 2 cores. Warming streams each node's "
        "files in one stream of its own (a plain TCP link the node opens back with a one-time token for "
        "`rpc_transport: tcp` nodes, an OpenSSH session for `ssh` ones), so the three links fill at once, "
        "which llama.cpp never does; and the servers rpcfleet builds wait for a file while their cache is "
        "being warmed, so the load runs beside the warm, each tensor read from the cache as it lands.",
        "",
        CONDITIONS_RULE,
        "",
    ]
    section = "\n".join(lines)
    print(section)
    if args.write is not None:
        write_section(args.write, SECTION, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
