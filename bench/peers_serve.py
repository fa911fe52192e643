"""Benchmark (issue 45, the peers a user would pick): `rpcfleet serve --replicas auto` against the usual
stack, N llama-servers each on its own nodes (`--rpc`) behind a plain round robin (nginx, from Debian's
packages); and whether llama-server's own router mode could stand in for the round robin.

    .venv/bin/python bench/peers_serve.py                  # print the section
    .venv/bin/python bench/peers_serve.py --clients 3 --rounds 1   # shorter
    .venv/bin/python bench/peers_serve.py --write          # and replace its block in BENCHMARKS.md

A 3-node lab (network namespaces, real sshd, real `ggml-rpc-server`s deployed by `rpcfleet deploy`),
each node with its own CPU share (`lab up --cpus`, as bench/formations.py), the real Gemma 3 270M from
the catalogue's cache. serve `--replicas auto` makes one formation per node (the model fits one node):
three llama-servers behind serve's router. The stack gets the very argv each of serve's engines ran with
(read from the engine processes: the same binary, `--rpc` node, `-ts`/`-ngl`, context, slots, flags),
only their `--port` differs, behind nginx (`upstream` of the three, its default round robin, buffering
off so that streams pass as they come, `worker_processes auto`). Both get the same clients: at C clients,
each sends `--requests` streamed completions of `--tokens` tokens (greedy, ignore_eos, seed 0) one after
the other with the official `openai` client (bench/serve.py's `measure_stream`): aggregate tokens/s = all
completion tokens / the wall time; time to first token (TTFT) per request, p50 and p95 (over 20 requests
or more; over fewer, the largest, called max).

Router mode: the pinned llama-server's router (`--models-preset`) is started once with `--rpc` of one
node and a preset of the model; one request loads the model, and the child's argv is read to say whether
the router passed `--rpc` on. The router runs one child per model name, so one model's requests cannot
be spread over replicas on their own nodes behind it: it is named, not measured, as a peer of
`--replicas`.

serve runs with its default routing (affine) and with `--routing least-loaded`: three sides, each round
starting with the next one.

Targets, computed, for each routing: serve's tokens/s at least the round robin's less `TARGET` (5 %,
serve's front cost as bench/serve.py allows it) and its TTFT p50 at most the round robin's plus
`TARGET`, at every concurrency; the rounds' spread of each ratio says whether a difference is noise.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import (
    PROMPT,
    ROOT,
    arg_parser,
    free_port,
    get_json,
    load_average,
    median,
    ms,
    stamp,
    tail,
    write_section,
)
from serve import measure_stream

from orchestrator.lab.lifecycle import lab_down, lab_up, reap_stale
from orchestrator.lab.state import Lab
from orchestrator.models.catalogue import GEMMA3_270M, cached_path

SECTION = "peers: serve replicas vs round robin"
LAB_NAME = "peersserve"
NODES = 3
TARGET = 0.05  # serve's front within 5 % of the plain stack: tokens/s not under, TTFT p50 not over
TIMEOUT = 900.0  # seconds a client waits for one request
ROUTINGS = ("affine", "least-loaded")  # serve's default, then the plain one
NAMES = (*ROUTINGS, "nginx")


def deploy(lab: Lab) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "deploy", "-i", str(lab.inventory)],
        capture_output=True, text=True, timeout=900, check=False, cwd=ROOT,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"deploy failed: {done.stdout}{done.stderr}")


def wait_health(base: str, process: subprocess.Popen[bytes], ready: bool, limit: float = 600) -> Any:
    """`base`'s /health once it answers (serve: once it says ready; a llama-server: once it answers 200)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
        try:
            data = get_json(f"{base}/health", 30)
            if not ready or data.get("status") == "ready":
                return data
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{base} not ready within {limit} s")


def stop(process: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    process.send_signal(sig)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def serving(
    lab: Lab, model: Path, folder: Path, ctx: int, parallel: int, routing: str = "affine"
) -> Iterator[tuple[str, Any]]:
    """serve --replicas auto --routing `routing` on the lab: its base URL and its first ready /health."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "orchestrator", "serve", "-i", str(lab.inventory), "-m", str(model)]
    argv += ["--ctx", str(ctx), "--parallel", str(parallel), "--port", str(port), "--model-name", "bench"]
    argv += ["--replicas", "auto", "--seed", "0", "--rejoin-interval", "1", "--observe-interval", "0"]
    argv += ["--queue-timeout", str(int(TIMEOUT)), "--routing", routing]
    env = {**os.environ, "RPCFLEET_HOME": str(folder / "home")}
    env.pop("RPCFLEET_API_KEY", None)
    with (folder / "serve.log").open("ab") as log:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield base, wait_health(base, process, ready=True)
    finally:
        stop(process, signal.SIGINT)


def engine_argvs(health: Any) -> list[list[str]]:
    """The argv of each formation's engine (its llama-server), read from the process."""
    import psutil

    return [list(psutil.Process(f["engine_pid"]).cmdline()) for f in health["formations"]]


def on_port(argv: list[str], port: int) -> list[str]:
    """`argv` with its `--port` set to `port` (and on 127.0.0.1)."""
    at = argv.index("--port")
    return [*argv[: at + 1], str(port), *argv[at + 2 :]]


def nginx_conf(folder: Path, port: int, upstreams: list[int]) -> str:
    """A plain round robin of `upstreams` on 127.0.0.1:`port`: nginx's default balancing, a connection
    per request to the engines (with `keepalive` to them, bench/peers_affinity.py's chat workload got a
    502 Bad Gateway), streams passed unbuffered (HTTP/1.1, chunked), its files under `folder`."""
    servers = "\n".join(f"        server 127.0.0.1:{p};" for p in upstreams)
    return f"""user root;
worker_processes auto;
pid {folder}/nginx.pid;
error_log {folder}/nginx-error.log;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {folder}/body;
    proxy_temp_path {folder}/proxy;
    fastcgi_temp_path {folder}/fastcgi;
    uwsgi_temp_path {folder}/uwsgi;
    scgi_temp_path {folder}/scgi;
    upstream engines {{
{servers}
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engines;
            proxy_http_version 1.1;
            proxy_buffering off;
            proxy_read_timeout {int(TIMEOUT)}s;
        }}
    }}
}}
"""


@contextlib.contextmanager
def round_robin(engines: list[list[str]], folder: Path) -> Iterator[str]:
    """The engines started by hand, each on its own port, behind nginx: its base URL."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ports = []
        with (folder / "llama-servers.log").open("ab") as log:
            for argv in engines:
                ports.append(free_port())
                procs.append(subprocess.Popen(on_port(argv, ports[-1]), stdout=log, stderr=subprocess.STDOUT))
        for port, proc in zip(ports, procs, strict=True):
            wait_health(f"http://127.0.0.1:{port}", proc, ready=False)
            while _status(f"http://127.0.0.1:{port}") != 200:
                time.sleep(0.05)
        front = free_port()
        conf = folder / "nginx.conf"
        conf.write_text(nginx_conf(folder, front, ports))
        command = [nginx, "-c", str(conf), "-g", "daemon off;"]
        procs.append(subprocess.Popen(command, stderr=subprocess.DEVNULL))
        base = f"http://127.0.0.1:{front}"
        while _status(base) != 200:
            if procs[-1].poll() is not None:
                raise RuntimeError(f"nginx exited with {procs[-1].returncode}: {folder / 'nginx-error.log'}")
            time.sleep(0.05)
        yield base
    except Exception:
        log = folder / "nginx-error.log"  # the temporary folder goes with the error: show its reason
        print(log.read_text()[-2000:] if log.exists() else "no nginx error log", file=sys.stderr)
        raise
    finally:
        for proc in procs:
            stop(proc)


def _status(base: str) -> int:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as answer:
            return int(answer.status)
    except OSError:
        return 0


def router_check(lab: Lab, model: Path, folder: Path, engine: list[str]) -> str:
    """Start llama-server's router with `--rpc` of one node and a preset of the model, load it with one
    request, and say what the child's argv holds."""
    import openai
    import psutil

    preset = folder / "presets.ini"
    preset.write_text(f"[bench]\nmodel = {model}\n")
    port = free_port()
    endpoint = f"{lab.nodes[0].address}:50052"
    argv = [engine[0], "--models-preset", str(preset), "--rpc", endpoint, "-ngl", "99", "-c", "2048"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    with (folder / "router.log").open("ab") as log:
        router = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_health(f"http://127.0.0.1:{port}", router, ready=False)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=300)
        client.completions.create(model="bench", prompt=PROMPT, max_tokens=1, temperature=0)
        children = [list(c.cmdline()) for c in psutil.Process(router.pid).children(recursive=True)]
    finally:
        stop(router)
    with_rpc = [c for c in children if "--rpc" in c and endpoint in c[c.index("--rpc") + 1]]
    return router_words(len(children), len(with_rpc), endpoint)


def router_words(children: int, with_rpc: int, endpoint: str) -> str:
    """What the router check found, for the block."""
    if children == 0:
        return "the router started no child for the preset: its `--rpc` could not be checked"
    passed = (
        f"passed `--rpc {endpoint}` on to its child ({with_rpc} of {children} children)"
        if with_rpc
        else f"did not pass `--rpc` on to its child (0 of {children} children)"
    )
    return (
        f"the pinned llama-server's router (`--models-preset`, one preset of the model) {passed}; it runs "
        "one child per model name and sends a request to the child of the name it asks for, so one "
        "model's requests are not spread over replicas on their own nodes: no peer of `--replicas`, not "
        "measured"
    )


Runs = dict[str, dict[int, list[dict[str, Any]]]]  # side -> clients -> each round's figures


def ratio_verdict(
    serve: list[dict[str, Any]], stack: list[dict[str, Any]], target: float = TARGET
) -> tuple[float, float, bool]:
    """(serve / stack tokens/s of the medians, serve / stack TTFT p50 over every request, met): serve's
    tokens/s at least (1 - target) of the stack's and its TTFT p50 at most (1 + target) of it."""
    tps = median([r["tps"] for r in serve]) / median([r["tps"] for r in stack])
    first = median([t for r in serve for t in r["ttft"]]) / median([t for r in stack for t in r["ttft"]])
    return tps, first, tps >= 1 - target and first <= 1 + target


def round_spread(each: list[float]) -> str:
    """Each round's ratio and whether 1 lies inside their range (a difference within noise)."""
    if len(each) < 2:
        return "one round: no spread"
    where = "1 inside: noise" if min(each) <= 1 <= max(each) else "1 outside"
    return f"{', '.join(f'{x:.2f}' for x in each)} ({where})"


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--clients", default="1,3,6,12", help="concurrencies (default 1,3,6,12)")
    parser.add_argument("--requests", type=int, default=2, help="requests per client (default 2)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per completion (default 32)")
    parser.add_argument("--parallel", type=int, default=4, help="slots of each engine (default 4)")
    parser.add_argument("--ctx", type=int, default=2048, help="each engine's context (default 2048)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of each (default 2)")
    parser.add_argument("--cpus", type=float, default=0.6, help="each node's CPU share (default 0.6)")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.clients.split(",")]
    if shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
        parser.error("nginx is not installed: apt-get install -y nginx")
    model = cached_path(GEMMA3_270M)
    load_before = load_average()
    runs: Runs = {name: {c: [] for c in concurrencies} for name in NAMES}
    reap_stale()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        folder = Path(tmp)
        lab = lab_up(NODES, name=LAB_NAME, owner_pid=os.getpid(), cpus=args.cpus)
        stack.callback(lab_down, LAB_NAME)
        deploy(lab)
        print("serve: its engines' argv", file=sys.stderr, flush=True)
        with serving(lab, model, folder, args.ctx, args.parallel) as (_, health):
            engines = engine_argvs(health)
        for i in range(args.rounds):
            for name in NAMES[i % 3 :] + NAMES[: i % 3]:  # each round starts with the next side
                print(f"round {i + 1}: {name}", file=sys.stderr, flush=True)
                with contextlib.ExitStack() as side:
                    if name in ROUTINGS:
                        serve = serving(lab, model, folder, args.ctx, args.parallel, name)
                        base = side.enter_context(serve)[0]
                    else:
                        base = side.enter_context(round_robin(engines, folder))
                    for c in concurrencies:
                        runs[name][c].append(measure_stream(base, c, args.requests, args.tokens, PROMPT))
        print("router mode", file=sys.stderr, flush=True)
        router = router_check(lab, model, folder, engines[0])

    def figures(of: list[dict[str, Any]]) -> str:
        ttft = [t for r in of for t in r["ttft"]]
        name, value = tail(ttft)
        return f"{median([r['tps'] for r in of]):.1f} ({ms(median(ttft))} / {name} {ms(value)})"

    rows, missed = [], {routing: list[int]() for routing in ROUTINGS}
    for c in concurrencies:
        n = runs["nginx"][c]
        for routing in ROUTINGS:
            s = runs[routing][c]
            tps, first, met = ratio_verdict(s, n)
            if not met:
                missed[routing].append(c)
            each = [a["tps"] / b["tps"] for a, b in zip(s, n, strict=True)]
            rows.append(
                f"| {c} | {routing} | {figures(s)} | {figures(n)} | {tps:.2f} / {first:.2f} "
                f"| {round_spread(each)} | **{'met' if met else 'not met'}** |"
            )
    shown = [Path(engines[0][0]).name, *engines[0][1:]]
    shown[shown.index("-m") + 1] = Path(shown[shown.index("-m") + 1]).name
    shown = on_port(shown, 0)
    shown[shown.index("--port") + 1] = "PORT"
    body = [
        f"## {SECTION}",
        "",
        f"`bench/peers_serve.py --clients {args.clients} --requests {args.requests} --tokens {args.tokens} "
        f"--parallel {args.parallel} --ctx {args.ctx} --rounds {args.rounds} --cpus {args.cpus:g}`, "
        f"{stamp()}; load average {load_before:.2f} at the start. A {NODES}-node lab, each node "
        f"`--cpus {args.cpus:g}`, Gemma 3 270M Q4_K_M. serve = `rpcfleet serve --replicas auto "
        f"--parallel {args.parallel} --ctx {args.ctx} --routing R`: {len(engines)} formations, one per "
        "node, with its default routing (affine: a request goes to the formation whose slots hold its "
        "prefix, the least-loaded when that one is full) and with least-loaded. "
        f"Round robin = the same {len(engines)} llama-servers started by hand with the argv serve's engines "
        "ran with (their `--port` aside), behind nginx (Debian's package: `upstream`, its default round "
        "robin, `proxy_buffering off`). Each client streams "
        f"{args.requests} greedy completions of {args.tokens} tokens one after the other (each prompt "
        "starts with its own request number); each round starts with the next of the three sides. The "
        "first engine's argv (each differs in its `--rpc` node):",
        "",
        f"    {' '.join(shown)}",
        "",
        "| clients | serve --routing | serve --replicas auto: tok/s (TTFT p50 / p95 or max) "
        "| llama-servers + nginx round robin | serve / round robin: tok/s / TTFT p50 "
        f"| each round's tok/s ratio | target: within {TARGET * 100:.0f} % |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Target (serve's tokens/s at least the round robin's less {TARGET * 100:.0f} %, its TTFT p50 at "
        f"most {TARGET * 100:.0f} % over): "
        + "; ".join(
            f"{routing}: **{'met' if not missed[routing] else 'not met'}**"
            + (f" (missed at {', '.join(map(str, missed[routing]))} clients)" if missed[routing] else "")
            for routing in ROUTINGS
        )
        + ".",
        "",
        f"Router mode: {router}.",
    ]
    text = "\n".join(body) + "\n"
    print(text)
    if args.write:
        write_section(args.write, SECTION, text)


if __name__ == "__main__":
    main()
