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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def p95(xs: Sequence[float]) -> float:
    """Nearest-rank 95th percentile."""
    ordered = sorted(xs)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


FLAT, LINEAR = 0.3, 1.2  # log-log slopes: flat under 0.3, linear up to 1.2, worse above


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The slope of log(y) over log(x) between the first and the last point: 0 flat, 1 linear."""
    return math.log(ys[-1] / ys[0]) / math.log(xs[-1] / xs[0])


def shape(slope: float) -> str:
    """A curve's shape from its log-log slope (`loglog_slope`)."""
    return "flat" if slope < FLAT else "linear" if slope <= LINEAR else "worse than linear"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def measure(base: str, clients: int, requests: int, tokens: int, *, timeout: float) -> dict[str, float]:
    """`clients` OpenAI clients at once, each making `requests` completions of `tokens` tokens (EOS
    ignored) against serve at `base`: aggregate tokens/s and latency p50/p95 (seconds). `timeout`: the
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
    return {"tps": sum(r[1] for r in results) / wall, "p50": median(latencies), "p95": p95(latencies)}


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
    written whole; other sections stay as they are."""
    begin, end = markers(script or _main_script())
    heading, _, generated = body.strip("\n").partition("\n")
    if heading != f"## {section}":
        raise ValueError(f"the body must start with '## {section}', not {heading!r}")
    block = f"{begin}\n{generated.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    marked = re.compile(rf"^{re.escape(begin)}\n.*?^{re.escape(end)}$", re.S | re.M)
    whole = re.compile(rf"^## {re.escape(section)}\n.*?(?=^## |\Z)", re.S | re.M)
    found = whole.search(text)
    if found is not None and marked.search(found.group(0)):
        part = marked.sub(lambda _: block, found.group(0), count=1)
        text = text[: found.start()] + part + text[found.end() :]
    elif found is not None:
        text = text[: found.start()] + f"## {section}\n\n{block}\n\n" + text[found.end() :]
    else:
        text = text.rstrip("\n") + f"\n\n## {section}\n\n{block}\n"
    path.write_text(text.rstrip("\n") + "\n")


def arg_parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser (`doc` as its help) with the common `--write [PATH]`: also replace the
    benchmark's section of PATH (default: BENCHMARKS.md)."""
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
    return parser


def load_average() -> float:
    """1-minute load average: how busy the machine was when the measurement started."""
    return os.getloadavg()[0]


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
