"""Small helpers shared by the benchmarks: statistics, machine/commit info, BENCHMARKS.md sections and real
`ggml-rpc-server`s on loopback. Importing it puts the repository root on `sys.path` (the scripts run from
`bench/`), so `orchestrator` imports after it."""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


P95_MIN = 20  # nearest-rank p95 of fewer samples is the largest one: below this count a tail is a "max"


def p95(xs: Sequence[float]) -> float:
    """Nearest-rank 95th percentile (of fewer than `P95_MIN` samples, the largest: say so with `tail`)."""
    ordered = sorted(xs)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def tail_name(count: int) -> str:
    """What a tail over `count` samples is: "p95" from `P95_MIN` samples, otherwise "max" (the nearest-rank
    p95 of 19 or fewer samples is their largest, and calling it a p95 suggests a tail that was not seen)."""
    return "p95" if count >= P95_MIN else "max"


def tail(xs: Sequence[float]) -> tuple[str, float]:
    """(`tail_name`, value): the p95 of enough samples, else their maximum."""
    return tail_name(len(xs)), p95(xs) if len(xs) >= P95_MIN else max(xs)


# Log-log slopes: y grows k**s-fold when x grows k-fold. Over the benches' ranges (x 8x to 32x) a slope of
# 0.1 is y 1.2x-1.4x, inside the run-to-run spread seen on these shared machines: flat. The old 0.3 was y
# 1.9x-2.8x over those ranges, a growth, not flat, and it made 0.31 "linear". Linear is 0.8 to 1.2 (y 1.7x
# to 2.3x per doubling of x); between flat and linear a curve grows, but sublinearly.
FLAT, LINEAR_FROM, LINEAR = 0.1, 0.8, 1.2
R2_MIN = 0.9  # below it the points do not follow a power law well enough to name a slope's shape
FLAT_SPREAD = 1.5  # a flat curve's largest point at most this times its smallest


def loglog_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(slope, R^2) of the least-squares line through every (log x, log y): 0 flat, 1 linear. R^2 is 1
    when all points lie on the line; with two points it is 1 by construction."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("a fit needs two points or more, as many x as y")
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    sxx = sum((x - mx) ** 2 for x in lx)
    syy = sum((y - my) ** 2 for y in ly)
    sxy = sum((x - mx) * (y - my) for x, y in zip(lx, ly, strict=True))
    if sxx == 0:
        raise ValueError("a fit needs two different x")
    slope = sxy / sxx
    r2 = 1.0 if syy == 0 else sxy * sxy / (sxx * syy)
    return slope, r2


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The slope of the least-squares fit of log(y) over log(x), every point counted: 0 flat, 1 linear."""
    return loglog_fit(xs, ys)[0]


def shape(slope: float) -> str:
    """A slope's band (`loglog_slope`), the fit's quality aside: `curve_shape` judges a curve."""
    if slope < -FLAT:
        return "falls"
    if slope < FLAT:
        return "flat"
    if slope < LINEAR_FROM:
        return "sublinear"
    return "linear" if slope <= LINEAR else "worse than linear"


def curve_shape(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, str]:
    """(slope, R^2, shape) of a curve from all its points. "flat" needs a flat slope and every point within
    `FLAT_SPREAD` of each other; a sloped shape needs R^2 >= `R2_MIN`; otherwise "irregular": the points
    follow no power law (1.3, 17.5, 3.2 ms is not linear, whatever its end points say)."""
    slope, r2 = loglog_fit(xs, ys)
    band = shape(slope)
    if band == "flat":
        steady = max(ys) <= FLAT_SPREAD * min(ys)
        return slope, r2, "flat" if steady else "irregular"
    return slope, r2, band if r2 >= R2_MIN else "irregular"


def shape_text(xs: Sequence[float], ys: Sequence[float]) -> str:
    """`slope 0.98, R^2 0.99: linear`, for a block."""
    slope, r2, name = curve_shape(xs, ys)
    return f"slope {slope:.2f}, R^2 {r2:.2f}: {name}"


SHAPE_RULE = (
    f"log-log least-squares slope over every point; flat: |slope| < {FLAT} and all points within "
    f"{FLAT_SPREAD}x; sublinear < {LINEAR_FROM}; linear {LINEAR_FROM}-{LINEAR}; a sloped shape only at "
    f"R^2 >= {R2_MIN}, else irregular"
)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def measure(base: str, clients: int, requests: int, tokens: int, *, timeout: float) -> dict[str, float]:
    """`clients` OpenAI clients at once, each making `requests` completions of `tokens` tokens (EOS
    ignored) against serve at `base`: aggregate tokens/s and latency p50/p95 (seconds; "p95" is the
    largest under `P95_MIN` requests: `tail_name(int(result["samples"]))` says which). `timeout`: the
    client's, per request."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=timeout)

    def one(i: int) -> list[tuple[float, int]]:
        done = []
        for j in range(requests):
            started = time.monotonic()
            answer = client.completions.create(
                model="bench",
                prompt=f"{PROMPT} ({i}.{j})",
                max_tokens=tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert answer.usage is not None
            done.append((time.monotonic() - started, answer.usage.completion_tokens))
        return done

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(one, range(clients)) for r in rs]
    wall = time.monotonic() - started
    latencies = [r[0] for r in results]
    return {
        "tps": sum(r[1] for r in results) / wall,
        "p50": median(latencies),
        "p95": p95(latencies),
        "samples": float(len(latencies)),
    }


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({model or platform.machine()}), {platform.system()} {platform.release()}"


def commit() -> str:
    def git(*args: str) -> str:
        command = ["git", "-C", str(ROOT), *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=10, check=True).stdout

    try:
        head = git("rev-parse", "--short", "HEAD").strip()
        changed = git("status", "--porcelain", "--untracked-files=no").splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    # The documents the benchmarks write do not count; any other change makes the figure not HEAD's.
    code_changed = [line for line in changed if line[3:] not in ("BENCHMARKS.md", "README.md")]
    return head + (" with uncommitted changes" if code_changed else "")


def stamp() -> str:
    """`date, machine, commit X` for a section's first line (with the load average, which each script
    reads at its start: every generated section carries all four)."""
    return f"{datetime.date.today().isoformat()}, {machine()}, commit `{commit()}`"


def markers(script: str) -> tuple[str, str]:
    """The lines around what `script` (`bench/x.py`) generates in BENCHMARKS.md: text between them is
    replaced by the next `--write`, text outside them is hand-written and kept."""
    return f"<!-- {script}: generated, do not edit -->", f"<!-- end {script} -->"


def _main_script() -> str:
    return f"bench/{Path(sys.modules['__main__'].__file__ or 'bench').name}"


def write_section(path: Path, section: str, body: str, script: str | None = None) -> None:
    """Put `body` (which starts with its own `## <section>` heading) into `path` as `script`'s generated
    block (default: the running script). Only the block between the script's markers is replaced: the
    heading and any hand-written text after the block stay. A section without markers (or a new one) is
    written whole; other sections stay as they are. The block ends with this process's load line
    (`load_note`, unless `body` has one) and the earlier runs the replaced block named (`history`)."""
    begin, end = markers(script or _main_script())
    heading, _, generated = body.strip("\n").partition("\n")
    if heading != f"## {section}":
        raise ValueError(f"the body must start with '## {section}', not {heading!r}")
    generated = generated.strip()
    if _run is not None and LOAD_NOTE not in generated:
        generated += "\n\n" + load_note()
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    marked = re.compile(rf"^{re.escape(begin)}\n(.*?)^{re.escape(end)}$", re.S | re.M)
    whole = re.compile(rf"^## {re.escape(section)}\n.*?(?=^## |\Z)", re.S | re.M)
    found = whole.search(text)
    previous = marked.search(found.group(0)) if found is not None else None
    earlier = history(previous.group(1)) if previous is not None else []
    if earlier:
        generated += "\n\n" + EARLIER + "; ".join(earlier) + "."
    block = f"{begin}\n{generated}\n{end}"
    if found is not None and marked.search(found.group(0)):
        part = marked.sub(lambda _: block, found.group(0), count=1)
        text = text[: found.start()] + part + text[found.end() :]
    elif found is not None:
        text = text[: found.start()] + f"## {section}\n\n{block}\n\n" + text[found.end() :]
    else:
        text = text.rstrip("\n") + f"\n\n## {section}\n\n{block}\n"
    path.write_text(text.rstrip("\n") + "\n")


def arg_parser(doc: str | None, *, quiet_wait: float | None = None) -> argparse.ArgumentParser:
    """A benchmark's parser (`doc` as its help) with the common `--write [PATH]`: also replace the
    benchmark's section of PATH (default: BENCHMARKS.md), and `--quiet-wait SECONDS` (default
    `quiet_wait`, else `QUIET_WAIT`)."""
    global QUIET_WAIT
    if quiet_wait is not None:
        QUIET_WAIT = quiet_wait
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--write",
        type=Path,
        nargs="?",
        const=ROOT / "BENCHMARKS.md",
        default=None,
        metavar="PATH",
        help="replace this benchmark's section of PATH (default BENCHMARKS.md); otherwise print only",
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=QUIET_WAIT,
        action=_QuietWait,
        metavar="SECONDS",
        help=f"wait at most this long for a 1-minute load under {QUIET_UNDER:g} before measuring "
        f"(default {QUIET_WAIT:g}; env RPCFLEET_BENCH_QUIET_WAIT); the block says whether it got one",
    )
    return parser


class _QuietWait(argparse.Action):
    """--quiet-wait sets the bound `load_average`'s first call waits for."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        global QUIET_WAIT
        if not isinstance(values, float) or values < 0:
            parser.error(f"{option_string} must be a number of seconds, 0 or more")
        QUIET_WAIT = values
        setattr(namespace, self.dest, values)


def one_minute_load() -> float:
    return os.getloadavg()[0]


QUIET_UNDER = 1.0  # a 1-minute load under one runnable task: the 2 cores mostly the benchmark's own
QUIET_WAIT = float(os.environ.get("RPCFLEET_BENCH_QUIET_WAIT", "120"))  # seconds; --quiet-wait


@dataclass(frozen=True)
class Quiet:
    """How quiet the machine was when a measurement began: the 1-minute load then, after how long a wait
    for one under `under`, bounded by `limit` seconds."""

    start: float
    waited: float
    limit: float
    under: float = QUIET_UNDER

    @property
    def quiet(self) -> bool:
        return self.start < self.under


def wait_quiet(
    limit: float,
    *,
    under: float = QUIET_UNDER,
    read: Callable[[], float] = one_minute_load,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    poll: float = 5.0,
) -> Quiet:
    """Wait until the 1-minute load (`read`) is under `under`, at most `limit` seconds; the last reading
    is the start's load, quiet or not (the block then says it was not)."""
    began = clock()
    while True:
        load = read()
        waited = clock() - began
        if load < under or waited >= limit:
            return Quiet(load, waited, limit, under)
        sleep(max(0.0, min(poll, limit - waited)))


LOAD_NOTE = "1-minute load average"  # how a block's load line starts


def load_words(quiet: Quiet, end: float) -> str:
    """The line a block carries about the machine's load: at the start (after the wait), and at the end."""
    waited = f"after {quiet.waited:.0f} s of waiting" if quiet.waited >= 0.5 else "without waiting"
    if quiet.quiet:
        start = f"{quiet.start:.2f} at the start (quiet: under {quiet.under:g} {waited})"
    else:
        start = (
            f"{quiet.start:.2f} at the start (**not quiet**: still {quiet.under:g} or more after waiting "
            f"{quiet.limit:.0f} s: other work shared the cores)"
        )
    return f"{LOAD_NOTE} {start}, {end:.2f} at the end."


_run: Quiet | None = None  # this process's measurement: set by its first load_average()


def begin_measurement(limit: float | None = None, **wait: Any) -> Quiet:
    """Start this process's measurement: `wait_quiet` (`limit` default `--quiet-wait`; `wait` its other
    arguments), remembered for the load line `write_section` adds to the block."""
    global _run
    _run = wait_quiet(QUIET_WAIT if limit is None else limit, **wait)
    return _run


def load_average() -> float:
    """1-minute load average. The first call in a process starts the measurement (`begin_measurement`:
    a bounded wait for a load under 1) and returns the load it started at; later calls read the load now."""
    if _run is None:
        return begin_measurement().start
    return one_minute_load()


def load_note() -> str:
    """`load_words` for this process's measurement (started by `load_average`), its end now."""
    run = _run if _run is not None else begin_measurement()
    return load_words(run, one_minute_load())


EARLIER = "Earlier runs, replaced by this one (their blocks are in git history): "
_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
_COMMIT = re.compile(r"commit `([0-9a-f]{7,40})`")
_NOTE_LOAD = re.compile(rf"{LOAD_NOTE} (\d+(?:\.\d+)?)")
_LOAD = re.compile(r"load(?: average)?(?: before)?:? (\d+(?:\.\d+)?)")
HISTORY = 8  # earlier runs a block names


def history(block: str) -> list[str]:
    """The runs a replaced block names, its own first (date, commit, load at the start), then its own
    history, at most `HISTORY`: a re-run does not silently drop the figures it replaces."""
    own, _, before = block.partition(EARLIER)
    date, sha = _DATE.search(own), _COMMIT.search(own)
    if date is None or sha is None:
        return []
    load = _NOTE_LOAD.search(own) or _LOAD.search(own)
    entry = f"{date.group(0)} at `{sha.group(1)}`" + (f" (load {load.group(1)})" if load else "")
    older = [e.strip() for e in before.strip().rstrip(".").split("; ") if e.strip()] if before else []
    return [entry, *older][:HISTORY]


# --- real servers on loopback -------------------------------------------------------------------------------


def busy_cpu_seconds() -> float:
    """CPU seconds this machine's cores have spent on work since boot (all but idle and iowait). The
    difference over a run is the CPU work it cost on a quiet machine, and that work over the core count
    is the least time the run can take here: a limit no concurrency can beat."""
    import psutil

    times = psutil.cpu_times()._asdict()
    # guest time is counted in user time already (Linux's /proc/stat)
    left_out = ("idle", "iowait", "guest", "guest_nice")
    return float(sum(v for k, v in times.items() if k not in left_out))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_binary() -> Path:
    try:
        from orchestrator.artifacts.build import local_server_binary

        return local_server_binary()
    except Exception:  # no artifact built yet: the development server
        return Path.home() / ".cache" / "rpcfleet" / "dev-server" / "ggml-rpc-server"


def server_command(binary: Path, port: int, *extra: str) -> list[str]:
    """argv running `binary` on 127.0.0.1:`port` with SIGPIPE ignored (a client that goes away mid-reply
    would otherwise kill the server)."""
    line = shlex.join([str(binary), "-H", "127.0.0.1", "-p", str(port), *extra])
    return ["bash", "-c", f"trap '' PIPE; exec {line}"]


def wait_listening(port: int, proc: subprocess.Popen[bytes] | None = None, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while True:
        # Connect and close without a byte: harmless to the server (an unread HELLO is not).
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
                raise RuntimeError(f"rpc-server on port {port} did not start") from None
            time.sleep(0.02)


def wait_healthy(port: int, proc: subprocess.Popen[bytes], limit: float) -> bool:
    """Until llama-server on 127.0.0.1:`port` answers /health with 200 (True), or `proc` has ended or
    `limit` seconds have passed (False)."""
    deadline = time.monotonic() + limit
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                if reply.status == 200:
                    return True
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.2)


@contextmanager
def servers(n: int, log_dir: Path, *extra: str) -> Iterator[list[int]]:
    """The ports of `n` real servers on 127.0.0.1 (`extra`: more server arguments), logs in `log_dir`;
    always stopped on exit."""
    binary = server_binary()
    procs: list[subprocess.Popen[bytes]] = []
    ports: list[int] = []
    try:
        for _ in range(n):
            port = free_port()
            with (log_dir / f"rpc-{port}.log").open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        server_command(binary, port, *extra), stdout=log, stderr=subprocess.STDOUT
                    )
                )
            ports.append(port)
        for port, proc in zip(ports, procs, strict=True):
            wait_listening(port, proc)
        yield ports
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def get_json(url: str, timeout: float = 10.0) -> Any:
    """A GET's JSON answer (OSError when the server does not answer)."""
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return json.loads(answer.read())


def local_inventory(folder: Path, ports: Sequence[int]) -> Path:
    """An inventory of `connection: local` hosts, one per server on 127.0.0.1 (`servers`' ports)."""
    hosts = {
        f"n{i}": {"connection": "local", "address": "127.0.0.1", "rpc_host": "127.0.0.1", "rpc_port": port}
        for i, port in enumerate(ports)
    }
    inventory = folder / "inventory.yml"
    inventory.write_text(json.dumps({"hosts": hosts}))
    return inventory


# --- the conditions every load figure names (issue 41, item 3) ---------------------------------------------


@dataclass(frozen=True)
class LoadConditions:
    """What a load figure depends on beyond the model and the nodes: the controller side's rate (its own
    link; "loopback" or "unshaped" when none is set), the GGUF in this machine's page cache or dropped
    from it (`drop_page_cache`), the servers' caches (none: servers without `-c`; empty, partly warm or
    full) and the RPC transport (tcp or ssh)."""

    controller: str
    page_cache: str  # "cold" | "warm"
    caches: str  # "none" | "empty" | "partly warm" | "full"
    transport: str = "tcp"

    def text(self) -> str:
        return (
            f"controller {self.controller}, page cache {self.page_cache}, caches {self.caches}, "
            f"{self.transport}"
        )


CONDITIONS_RULE = (
    "Conditions beside each load: the controller side's rate (tbf on the lab bridge: what this machine "
    "sends into it; unshaped when no `--controller-rate`), the GGUF's page cache here (cold: dropped with "
    "posix_fadvise(DONTNEED) just before; warm: read before), the servers' caches (none: servers without "
    "`-c`; empty; partly warm; full: every big tensor a hit) and the RPC transport."
)


def controller_rate_arg(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """The common `--controller-rate RATE`: tc tbf on the lab bridge's side, the controller's own link."""
    parser.add_argument(
        "--controller-rate",
        default=default,
        metavar="RATE",
        help="tc tbf rate of the lab bridge's side: the controller's own link, which every node's bytes "
        f"cross (default: {default or 'unshaped'})",
    )


def shape_controller(bridge: str | None, rate: str | None) -> None:
    """Shape what this machine sends into the lab's bridge to `rate` (tbf); None leaves it unshaped."""
    if rate is not None:
        if bridge is None:
            raise RuntimeError("--controller-rate needs a lab with a bridge (network namespaces)")
        tbf = ["root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
        subprocess.run(["tc", "qdisc", "replace", "dev", bridge, *tbf], check=True)


def bridge_tx(bridge: str | None) -> int:
    """Bytes this machine has sent into the lab's bridge (its `tx_bytes`; node-to-node traffic is switched
    inside the bridge and not counted): the controller's bytes."""
    if bridge is None:
        raise RuntimeError("counting the controller's bytes needs a lab with a bridge (network namespaces)")
    return int(Path(f"/sys/class/net/{bridge}/statistics/tx_bytes").read_text())


def drop_page_cache(path: Path) -> None:
    """Drop `path`'s pages from this machine's page cache (posix_fadvise DONTNEED, after a sync of the
    file: dirty pages are not dropped), so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def page_cache_resident(path: Path) -> float:
    """The share of `path`'s pages in the page cache now (mincore over a read-only mapping)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    if size == 0:
        return 1.0
    page = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = (size + page - 1) // page
    vec = ctypes.create_string_buffer(pages)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw) / pages


def process_cpu(pids: Sequence[int]) -> tuple[float, float, int]:
    """(user CPU seconds, system CPU seconds, minor page faults) the processes `pids` have spent so far,
    all together (those gone count 0). System time and faults name a copy into fresh memory: each first
    touch of a page is a fault the kernel serves."""
    import psutil

    user = system = 0.0
    faults = 0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (psutil.NoSuchProcess, OSError):
            continue
        user, system = user + times.user, system + times.system
        faults += int(stat.rpartition(")")[2].split()[7])  # minflt: the 10th field, the 8th after comm
    return user, system, faults


def server_pids(ports: Sequence[int]) -> list[int]:
    """The pids of the loopback servers (`servers`) listening on `ports`, in that order."""
    import psutil

    wanted = {str(p): p for p in ports}
    found: dict[int, int] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        argv = proc.info["cmdline"] or []
        if "-p" in argv and argv.index("-p") + 1 < len(argv) and argv[argv.index("-p") + 1] in wanted:
            found[wanted[argv[argv.index("-p") + 1]]] = proc.info["pid"]
    missing = [p for p in ports if p not in found]
    if missing:
        raise RuntimeError(f"no server process found on port(s) {missing}")
    return [found[p] for p in ports]
