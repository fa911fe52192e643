"""Benchmark: `model push` to 6 nodes against 1 node, through the same shaped controller link.

    .venv/bin/python bench/push.py            # print the results section (needs root: network namespaces)
    .venv/bin/python bench/push.py --write    # and replace the "push" section of BENCHMARKS.md

A lab of 6 network-namespace nodes with real OpenSSH; each node's link shaped to `--rate` with `tc tbf` on
both veth ends, and the lab bridge's side (this machine's own link, which every byte it sends crosses) to
`--controller-rate` (default: the same). A random file of `--size` bytes (no model needs to be loaded: the
push copies bytes), in this machine's page cache (read once before). Alternated, `--rounds` times each:
the push to node 1 alone, and to all 6 (a chain: this machine sends to node 1, node 1 forwards to node 2,
...), every node's copy removed before each push. Timed: the whole of `push_fleet` (chunk hashes here,
the nodes' checks, the stream, each node's chunk check and rename); counted: the bytes this machine sent
into the lab (the bridge's `tx_bytes`; node-to-node traffic is switched inside the bridge). The wire
limit of the same bytes over the same path is measured in the same run: plain TCP from this machine to
a sink in node 1's namespace. Target (issue 41): 6 nodes in at most 1.3x the time of 1.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import ROOT, arg_parser, load_average, median, stamp, write_section

from orchestrator.core.log import configure_logging

configure_logging("text", "WARNING")

from orchestrator.inventory.load import load_inventory
from orchestrator.lab.lifecycle import lab_down, lab_up
from orchestrator.lab.netns import privileged
from orchestrator.operations.push import Pushed
from orchestrator.workflows.push import push_fleet

SECTION = "push"
LAB_NAME = "bpush"
SINK_PORT = 5998
SINK = (
    "import socket\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    f"s.bind(('0.0.0.0', {SINK_PORT})); s.listen(1); print('ready', flush=True)\n"
    "c, _ = s.accept()\n"
    "while c.recv(1 << 20):\n"
    "    pass\n"
    "c.close()\n"
)


def tbf(rate: str) -> list[str]:
    return ["root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]


def shape(lab: Any, rate: str, controller_rate: str) -> None:
    for node in lab.nodes:
        subprocess.run(["tc", "qdisc", "replace", "dev", node.veth, *tbf(rate)], check=True)
        inside = ["ip", "netns", "exec", node.namespace, "tc", "qdisc", "replace", "dev", "eth0", *tbf(rate)]
        subprocess.run(inside, check=True)
    subprocess.run(["tc", "qdisc", "replace", "dev", lab.bridge, *tbf(controller_rate)], check=True)


def tx(lab: Any) -> int:
    return int(Path(f"/sys/class/net/{lab.bridge}/statistics/tx_bytes").read_text())


def wire_limit(lab: Any, size: int) -> float:
    """Seconds to send `size` bytes over plain TCP from here to a sink in node 1's namespace."""
    node = lab.nodes[0]
    sink = subprocess.Popen(
        ["ip", "netns", "exec", node.namespace, sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True
    )
    try:
        assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
        chunk = b"\0" * (1 << 20)
        started = time.monotonic()
        with socket.create_connection((node.address, SINK_PORT), timeout=120) as conn:
            left = size
            while left > 0:
                conn.sendall(chunk[: min(left, len(chunk))])
                left -= min(left, len(chunk))
            conn.shutdown(socket.SHUT_WR)
            sink.wait(timeout=120)  # it exits once it has read everything
        return time.monotonic() - started
    finally:
        sink.kill()
        sink.wait()


def forget(lab: Any, name: str) -> None:
    for node in lab.nodes:
        folder = node.home / "rpcfleet" / "models"
        for path in (folder / name, folder / f"{name}.partial", folder / f".{name}.pushed"):
            path.unlink(missing_ok=True)


def timed_push(lab: Any, hosts: list[Any], model: Path) -> tuple[float, int]:
    forget(lab, model.name)
    before = tx(lab)
    started = time.monotonic()
    report = push_fleet(hosts, model)
    seconds = time.monotonic() - started
    sent = tx(lab) - before
    failed = [str(o) for o in report.run.outcomes.values() if not isinstance(o, Pushed)]
    if failed or {o.state for o in report.run.outcomes.values() if isinstance(o, Pushed)} != {"pushed"}:
        raise RuntimeError(f"the push failed: {failed}")
    for node in lab.nodes[: len(hosts)]:
        if (node.home / "rpcfleet" / "models" / model.name).stat().st_size != model.stat().st_size:
            raise RuntimeError(f"{node.name}: the pushed copy has the wrong size")
    return seconds, sent


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--rate", default="200mbit", help="tc tbf rate of each node's link (default 200mbit)")
    parser.add_argument(
        "--controller-rate", default=None, help="tc tbf rate of this machine's side (default: --rate)"
    )
    parser.add_argument("--size", type=int, default=256 << 20, help="bytes pushed (default 256 MiB)")
    parser.add_argument("--rounds", type=int, default=3, help="pushes of each kind, alternated (default 3)")
    args = parser.parse_args()
    if not privileged():
        sys.exit("bench/push.py needs root (network namespaces)")
    controller_rate = args.controller_rate or args.rate
    load = load_average()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-push-{os.getpid()}"
    work.mkdir(parents=True)
    model = work / "pushed.gguf"
    with model.open("wb") as fh:  # random bytes: nothing compresses or dedups them on the way
        for _ in range(args.size >> 20):
            fh.write(os.urandom(1 << 20))
    model.read_bytes()  # into the page cache: this machine's disk is not what is measured
    lab = lab_up(6, name=LAB_NAME, owner_pid=os.getpid())
    times: dict[int, list[float]] = {1: [], 6: []}
    sent: dict[int, list[int]] = {1: [], 6: []}
    try:
        shape(lab, args.rate, controller_rate)
        hosts = list(load_inventory(lab.inventory).hosts)
        limit = wire_limit(lab, args.size)
        timed_push(lab, hosts, model)  # the tools uploaded, the connections' first costs paid
        for k in range(args.rounds):
            for count in (1, 6) if k % 2 == 0 else (6, 1):
                seconds, bytes_sent = timed_push(lab, hosts[:count], model)
                times[count].append(seconds)
                sent[count].append(bytes_sent)
                print(
                    f"  round {k + 1}: {count} node(s) {seconds:.2f} s, {bytes_sent} bytes from here",
                    flush=True,
                )
    finally:
        lab_down(LAB_NAME)
        model.unlink(missing_ok=True)
        work.rmdir()
    one, six = median(times[1]), median(times[6])
    mib = args.size / 2**20
    spread = [f"{min(times[c]):.2f}-{max(times[c]):.2f} s" for c in (1, 6)]
    body = "\n".join(
        [
            f"## {SECTION}",
            "",
            f"{stamp()}, load average {load:.2f} before. `model push` of {mib:.0f} MiB of random bytes "
            "(in this machine's page cache) to lab nodes (network namespaces with OpenSSH, each link shaped "
            f"to {args.rate} with tbf on both ends, this machine's side of the bridge to {controller_rate}); "
            f"{args.rounds} pushes of each kind, alternated, every copy removed before each; "
            "median (spread):",
            "",
            "| nodes | push | from this machine (bridge tx) | per node |",
            "|---|---|---|---|",
            f"| 1 | {one:.2f} s ({spread[0]}) | {median(sent[1]) / args.size:.3f}x the file | "
            f"{mib / one:.1f} MiB/s |",
            f"| 6 | {six:.2f} s ({spread[1]}) | {median(sent[6]) / args.size:.3f}x the file | "
            f"{mib / six:.1f} MiB/s |",
            "",
            f"6 nodes against 1: **{six / one:.2f}x** (target: at most 1.3x). The wire limit of the same "
            f"bytes over the same path (plain TCP from here to node 1, measured in this run): {limit:.2f} s; "
            f"the push to 1 node took {one / limit:.2f}x it. A push hashes the file here by 64 MiB chunks, "
            "each node checks its copy by the same chunks and renames it; the nodes forward to each other "
            "in a chain, so this machine sends one copy whatever their number.",
        ]
    )
    print(body)
    if args.write:
        write_section(args.write, SECTION, body)
        print(f"wrote the {SECTION!r} section of {args.write.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
