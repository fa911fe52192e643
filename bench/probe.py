"""Benchmark: `rpcfleet probe` against 1, 4 and 16 real rpc-servers on loopback, beside the native path.

    .venv/bin/python bench/probe.py            # print the results table
    .venv/bin/python bench/probe.py --write    # and replace the "probe" section of BENCHMARKS.md

Measured, each as the median (and max) of `--repeat` runs, every run with fresh connections:

* probe (RPC): `probe_fleet(hosts, facts=False)`: HELLO + DEVICE_COUNT + GET_DEVICE_MEMORY per endpoint,
  all endpoints at once (what the controller itself does; facts run on the remote hosts).
* probe (RPC + facts): `probe_fleet(hosts)` with `connection: local` hosts, so the facts are one local
  bash per host: on this machine that is process spawning on 2 cores, not network time.
* native: `ggml_backend_rpc_get_device_memory(endpoint, 0, ...)` per endpoint through llama-cpp-python
  (libllama's handle), in a fresh subprocess per run (a cold process-global connection cache, and the
  native client aborts the process on errors); timed inside the subprocess, import excluded.
* a dead endpoint: 16 live endpoints plus one that never completes a connect (a listener whose accept
  queue is full), with a timeout T: the probe should take about T, not more.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _common import arg_parser, busy_cpu_seconds, load_average, ms, servers, stamp, write_section
from _common import median as med

from orchestrator.core.log import configure_logging

configure_logging("text", "WARNING")  # before the modules below make their loggers

from orchestrator.inventory.model import Host
from orchestrator.probe.fleet import probe_fleet
from orchestrator.rpc.client import probe_endpoint

SIZES = (1, 4, 16)
SECTION = "probe"

NATIVE_SCRIPT = textwrap.dedent(
    """
    import ctypes, json, os, sys, time
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    import llama_cpp.llama_cpp as L

    lib = L._lib  # libllama's handle: the same ggml (and RPC registry) llama uses
    lib.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    lib.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    assert reg, "no RPC backend in this llama-cpp-python build"
    proto = ctypes.CFUNCTYPE(
        None, ctypes.c_char_p, ctypes.c_uint32,
        ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t),
    )
    # ggml-rpc.h: void ggml_backend_rpc_get_device_memory(const char * endpoint, uint32_t device,
    #                                                     size_t * free, size_t * total);
    # The RPC reg's get_proc_address knows only add_server/start_server (NULL here), so fall back to
    # the exported symbol, reached through libllama's handle (dlsym searches its dependencies).
    address = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_get_device_memory")
    via = "proc_address"
    if not address:
        address = ctypes.cast(lib.ggml_backend_rpc_get_device_memory, ctypes.c_void_p).value
        via = "dlsym"
    fn = proto(address)
    endpoints = sys.argv[1:]
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    out = []
    started = time.perf_counter()
    for ep in endpoints:
        fn(ep.encode(), 0, ctypes.byref(free), ctypes.byref(total))
        out.append((free.value, total.value))
    elapsed = time.perf_counter() - started
    print(json.dumps({"elapsed": elapsed, "via": via, "memory": out}))
    """
)


# A userspace delay proxy (netem is not available in this kernel): one process, one listening port per
# target, every chunk forwarded `delay` seconds after it arrived, order kept, EOF passed on after the data.
PROXY_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    delay = float(sys.argv[1])
    targets = [int(p) for p in sys.argv[2:]]

    async def pipe(reader, writer):
        queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def send():
            while True:
                when, chunk = await queue.get()
                await asyncio.sleep(max(0.0, when - loop.time()))
                if not chunk:
                    try:
                        writer.write_eof()
                    except OSError:
                        pass
                    return
                writer.write(chunk)
                await writer.drain()

        sender = asyncio.ensure_future(send())
        try:
            while True:
                chunk = await reader.read(65536)
                queue.put_nowait((loop.time() + delay, chunk))
                if not chunk:
                    break
            await sender
        except (ConnectionError, OSError):
            sender.cancel()
            writer.transport.abort()

    def handler(port):
        async def handle(r1, w1):
            try:
                r2, w2 = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                w1.transport.abort()
                return
            await asyncio.gather(pipe(r1, w2), pipe(r2, w1), return_exceptions=True)
            w1.close()
            w2.close()
        return handle

    async def main():
        servers = [await asyncio.start_server(handler(p), "127.0.0.1", 0) for p in targets]
        print(json.dumps([s.sockets[0].getsockname()[1] for s in servers]), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
    """
)


async def wait_all_ok(ports: list[int]) -> None:
    """A server takes the next client only once it noticed the previous one left."""
    for port in ports:
        for _ in range(100):
            if (await probe_endpoint(f"127.0.0.1:{port}", deadline=1.0, hello_only=True)).ok:
                break
            await asyncio.sleep(0.02)
        else:
            raise RuntimeError(f"server on port {port} stays busy")


@contextmanager
def delay_proxy(ports: list[int], delay: float) -> Iterator[list[int]]:
    """Ports that reach `ports` through the delay proxy (one-way delay `delay` s, each direction)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", PROXY_SCRIPT, str(delay), *map(str, ports)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        yield [int(p) for p in json.loads(proc.stdout.readline())]
    finally:
        proc.terminate()
        proc.wait(5)


def hosts_for(ports: list[int]) -> list[Host]:
    return [
        Host(name=f"n{i}", address="127.0.0.1", connection="local", rpc_host="127.0.0.1", rpc_port=port)
        for i, port in enumerate(ports)
    ]


async def time_probe(hosts: list[Host], repeat: int, *, facts: bool, limit_s: float = 3.0) -> list[float]:
    times: list[float] = []
    for _ in range(repeat):
        started = time.perf_counter()
        fleet = await probe_fleet(hosts, timeout=limit_s, facts=facts)
        times.append(time.perf_counter() - started)
        if not fleet.ok:
            raise RuntimeError(f"probe not ok: {[(n.host, n.state, n.rpc.message) for n in fleet.failed]}")
    return times


def time_native(ports: list[int], repeat: int) -> tuple[list[float], str]:
    times: list[float] = []
    via = "?"
    endpoints = [f"127.0.0.1:{p}" for p in ports]
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    for _ in range(repeat):
        asyncio.run(wait_all_ok(ports))
        out = subprocess.run(
            [sys.executable, "-c", NATIVE_SCRIPT, *endpoints],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )
        if out.returncode != 0:
            raise RuntimeError(f"native path failed ({out.returncode}): {out.stderr[-2000:]}")
        data = json.loads(out.stdout.strip().splitlines()[-1])
        if len(data["memory"]) != len(ports) or not all(total > 0 for _free, total in data["memory"]):
            raise RuntimeError(f"native path gave {data['memory']}")
        times.append(float(data["elapsed"]))
        via = str(data["via"])
    asyncio.run(wait_all_ok(ports))
    return times, via


@contextmanager
def blackhole() -> Iterator[int]:
    """A port whose accept queue is full: a new connect never completes (like a cut link)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = int(listener.getsockname()[1])
    fillers = []
    try:
        for _ in range(2):  # Linux queues backlog + 1 connections; later SYNs are dropped
            s = socket.socket()
            s.settimeout(0.5)
            try:
                s.connect(("127.0.0.1", port))
            except OSError:
                s.close()
                break
            fillers.append(s)
        yield port
    finally:
        for s in fillers:
            s.close()
        listener.close()


def servers_read(ports: list[int]) -> str:
    """What a probe of the servers reads: their protocols, backends and device counts (not assumed)."""
    fleet = asyncio.run(probe_fleet(hosts_for(ports), timeout=3.0, facts=False))
    versions = sorted({str(n.rpc.version) for n in fleet.nodes if n.rpc.version is not None})
    backends = sorted({d.backend for n in fleet.nodes for d in n.devices})
    counts = sorted({len(n.devices) for n in fleet.nodes})
    devices = (
        f"{counts[0]} device{'s' if counts[0] != 1 else ''} each"
        if len(counts) == 1
        else "devices " + "/".join(map(str, counts))
    )
    return f"protocol {', '.join(versions) or 'unknown'}, {', '.join(backends) or 'no backend'}, {devices}"


def native_version() -> str:
    """The llama-cpp-python the native path goes through, as installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"llama-cpp-python {version('llama_cpp_python')}"
    except PackageNotFoundError:
        return "llama-cpp-python (version unknown)"


def run(repeat: int, native_repeat: int, dead_timeout: float, lan_delays: list[float]) -> dict[str, Any]:
    results: dict[str, Any] = {"sizes": {}, "load": load_average(), "native_version": native_version()}
    with (
        tempfile.TemporaryDirectory(prefix="rpcfleet-bench-") as tmp,
        servers(max(SIZES), Path(tmp), "-t", "1") as ports,
    ):
        results["servers"] = servers_read(ports)
        sizes: dict[int, dict[str, object]] = {}
        for n in SIZES:
            hosts = hosts_for(ports[:n])
            asyncio.run(time_probe(hosts, 2, facts=False))  # warm-up (imports, first connects)
            busy = busy_cpu_seconds()
            rpc_times = asyncio.run(time_probe(hosts, repeat, facts=False))
            cpu = (busy_cpu_seconds() - busy) / repeat  # the machine's CPU work per probe
            facts_times = asyncio.run(time_probe(hosts, max(3, repeat // 3), facts=True))
            native_times, via = time_native(ports[:n], native_repeat)
            sizes[n] = {
                "rpc": rpc_times,
                "cpu": cpu,
                "facts": facts_times,
                "native": native_times,
                "via": via,
            }
        results["sizes"] = sizes
        results["lan"] = []
        for delay in lan_delays:
            lan: dict[int, list[float]] = {}
            lan_native: dict[int, list[float]] = {}
            lan_cpu: dict[int, float] = {}
            with delay_proxy(ports, delay) as proxied:
                for n in SIZES:
                    hosts = hosts_for(proxied[:n])
                    asyncio.run(time_probe(hosts, 1, facts=False))
                    busy = busy_cpu_seconds()
                    lan[n] = asyncio.run(time_probe(hosts, repeat, facts=False))
                    lan_cpu[n] = (busy_cpu_seconds() - busy) / repeat  # the proxy's relaying included
                    lan_native[n], _via = time_native(proxied[:n], native_repeat)
            results["lan"].append({"delay": delay, "sizes": lan, "native": lan_native, "cpu": lan_cpu})
        with blackhole() as dead:
            hosts = [*hosts_for(ports), *hosts_for([dead])]
            hosts[-1] = Host(
                name="dead", address="127.0.0.1", connection="local", rpc_host="127.0.0.1", rpc_port=dead
            )

            async def dead_run() -> tuple[float, str]:
                started = time.perf_counter()
                fleet = await probe_fleet(hosts, timeout=dead_timeout, facts=False)
                elapsed = time.perf_counter() - started
                states = {n.state for n in fleet.nodes if n.host != "dead"}
                if states != {"ok"}:
                    raise RuntimeError(f"live nodes not ok: {states}")
                return elapsed, fleet.nodes[-1].state

            dead_times = []
            dead_state = ""
            for _ in range(3):
                elapsed, dead_state = asyncio.run(dead_run())
                dead_times.append(elapsed)
        results["dead"] = {"times": dead_times, "state": dead_state, "timeout": dead_timeout}
    return results


def _row(label: str, probe: dict[int, list[float]], native: dict[int, list[float]]) -> list[str]:
    one = med(probe[1])
    rows = []
    for n in SIZES:
        p, q = med(probe[n]), med(native[n])
        rows.append(
            f"| {label} | {n} | {ms(p)} ({ms(max(probe[n]))}) | {p / one:.2f}x "
            f"| {ms(q)} ({ms(max(native[n]))}) | {q / p:.2f}x |"
        )
    return rows


def via_words(via: str) -> str:
    """How the native path reached the function, as the subprocess found it."""
    if via == "dlsym":
        return (
            "the RPC reg's get_proc_address returned NULL for it, so it was reached via dlsym on libllama's "
            "handle"
        )
    if via == "proc_address":
        return "reached through the RPC reg's get_proc_address"
    return f"reached via {via}"


def render(results: dict[str, Any], repeat: int, native_repeat: int) -> str:
    sizes, lans, dead = results["sizes"], results["lan"], results["dead"]
    loop_probe = {n: sizes[n]["rpc"] for n in SIZES}
    loop_native = {n: sizes[n]["native"] for n in SIZES}
    lines = [
        f"## {SECTION}",
        "",
        f"`bench/probe.py`, {stamp()}; 1-min load average "
        f"{results['load']:.1f} at the start. Real `ggml-rpc-server`s "
        f"({results['servers']}, as the probe read them) on loopback; the `+N ms` rows reach the same "
        f"servers through a userspace proxy (one Python process, on the same {os.cpu_count()} cores) adding "
        f"N ms each way, since netem is not available here. Median (max) of {repeat} runs for the probe "
        f"and of {native_repeat} fresh processes for the native path; every run opens fresh connections.",
        "",
        "- probe = `probe_fleet(hosts, facts=False)`: HELLO, DEVICE_COUNT, GET_DEVICE_MEMORY per endpoint, "
        "all endpoints at once.",
        "- native = `ggml_backend_rpc_get_device_memory(endpoint, 0, &free, &total)` per endpoint through "
        f"{results['native_version']} (`llama_cpp.llama_cpp._lib`), in a fresh subprocess per run, timed "
        f"inside it, import excluded; {via_words(str(sizes[16]['via']))}.",
        "",
        "| network | endpoints | probe | vs 1 endpoint | native | native / probe |",
        "|---|---:|---:|---:|---:|---:|",
        *_row("loopback", loop_probe, loop_native),
    ]
    for lan in lans:
        lines += _row(f"+{lan['delay'] * 1000:g} ms", lan["sizes"], lan["native"])
    facts = {n: sizes[n]["facts"] for n in SIZES}
    one = med(loop_probe[1])
    extra = med(loop_probe[16]) - one
    # The right baseline on loopback: the CPU work shares these cores, so max(one endpoint's time, the
    # 16-endpoint probe's CPU seconds / cores) is the least it can take here.
    cores = os.cpu_count() or 1
    cpu16 = float(sizes[16]["cpu"])
    limit = max(one, cpu16 / cores)
    verdicts = []
    for label, probe in [("loopback", loop_probe)] + [
        (f"+{x['delay'] * 1000:g} ms", x["sizes"]) for x in lans
    ]:
        ratio = med(probe[16]) / med(probe[1])
        verdicts.append(f"{label} {ratio:.2f}x ({'met' if ratio <= 1.5 else 'not met'})")
    natives = [med(loop_native[16]) / med(loop_probe[16])] + [
        med(x["native"][16]) / med(x["sizes"][16]) for x in lans
    ]
    # Where a delay did not hide the CPU cost: what 15 more endpoints added there.
    lan_misses = [
        f"at +{x['delay'] * 1000:g} ms they add {ms(med(x['sizes'][16]) - med(x['sizes'][1]))}, with "
        f"{ms(x['cpu'][16])} of CPU work per probe (the delaying proxy's relaying included): "
        f"{med(x['sizes'][16]) / max(med(x['sizes'][1]), x['cpu'][16] / cores):.2f}x the least time "
        "that work and one endpoint's round trips allow"
        for x in lans
        if med(x["sizes"][16]) / med(x["sizes"][1]) > 1.5
    ]
    lan_note = f" Where a delay still misses the target: {'; '.join(lan_misses)}." if lan_misses else ""
    dead_m = med(dead["times"])
    within = max(dead["times"]) <= dead["timeout"] * 1.1 + 0.05
    lines += [
        "",
        f"- 16 endpoints within 1.5x the time of one: {'; '.join(verdicts)}. On loopback nothing waits on "
        f"the network, so concurrency has nothing to overlap: 15 more endpoints add {ms(extra)}, and the "
        f"machine's cores did {ms(cpu16)} of CPU work per 16-endpoint probe (client and servers, from "
        f"/proc/stat), so on {cores} cores it cannot take less than {ms(limit)}: it took "
        f"{ms(med(loop_probe[16]))}, {med(loop_probe[16]) / limit:.2f}x that limit. The probes do run at "
        "once: with a network delay the 16-endpoint probe costs a fraction of 16 sequential ones, and the "
        "ratio falls as the delay grows." + lan_note,
        f"- Faster than the native path at 16 endpoints: native / probe = "
        f"{', '.join(f'{r:.2f}x' for r in natives)} (loopback, then each delay): "
        f"{'met' if all(r > 1 for r in natives) else 'NOT met'}. The native client queries one endpoint "
        "after another, and it aborts the process on a dead endpoint.",
        f"- A dead endpoint (a connect that never completes: full accept queue) among 16 live ones, timeout "
        f"{dead['timeout']:g} s: {ms(dead_m)} (max {ms(max(dead['times']))}), reported `{dead['state']}`, "
        f"the others `ok`: {'within' if within else 'OVER'} its timeout.",
        f"- probe with facts (`connection: local` hosts, so one local bash per host on {cores} cores): "
        + ", ".join(f"{n}: {ms(med(facts[n]))}" for n in SIZES)
        + ". On a fleet the facts run on each host over SSH, concurrently, bounded by the same timeout.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--repeat", type=int, default=21, help="probe runs per size (default 21)")
    parser.add_argument(
        "--native-repeat", type=int, default=7, help="native subprocess runs per size (default 7)"
    )
    parser.add_argument("--dead-timeout", type=float, default=1.0, help="timeout for the dead-endpoint run")
    parser.add_argument(
        "--lan-delay-ms",
        default="1,5",
        help="one-way delays of the proxy runs, ms, comma-separated (default 1,5)",
    )
    parser.add_argument("--json", action="store_true", help="also print the raw timings as JSON")
    args = parser.parse_args()
    delays = [float(x) / 1000 for x in args.lan_delay_ms.split(",") if x.strip()]
    results = run(args.repeat, args.native_repeat, args.dead_timeout, delays)
    section = render(results, args.repeat, args.native_repeat)
    print(section)
    if args.json:
        print(json.dumps(results, indent=2))
    if args.write:
        write_section(args.write, SECTION, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
