"""Benchmark (issue 45, the peers a user would pick): `rpcfleet restart --serial 1` against an Ansible play
with `serial: 1`, a systemd restart and a `wait_for` on the port, on the same lab.

    .venv/bin/python bench/peers_rolling.py                  # print the section
    .venv/bin/python bench/peers_rolling.py --rounds 1       # shorter
    .venv/bin/python bench/peers_rolling.py --write          # and replace its block in BENCHMARKS.md

A lab of `--nodes` network-namespace nodes booting systemd (`lab up --init systemd`), reached as root, the
servers deployed by `rpcfleet deploy` with `supervisor: systemd` (a system unit per server:
`rpcfleet-home-rpcfleet.service`). Both sides restart that unit one node at a time, timed from the command
line (the spawn of the command to its exit, each interpreter's start and fresh SSH connections included):

- rpcfleet: `rpcfleet restart -i LAB --serial 1`: per node it reads the state, stops the server (refusing a
  busy one), starts it and waits until it answers HELLO with its memory back.
- Ansible: ansible-core (bench/deploy.py's venv, `$RPCFLEET_HOME/bench/ansible-venv`), pipelining, no
  facts, `serial: 1`, per node `ansible.builtin.systemd: state=restarted` then `ansible.builtin.wait_for`
  on the node's port 50052 (a TCP connect: the port open, which a server does before it can answer HELLO).

After each run every node's server is checked to answer HELLO (a probe of the lab). Rounds alternate
(rpcfleet first in odd rounds, Ansible in even ones).

Target, computed: rpcfleet's median whole rolling restart at most Ansible's plus `EXTRA` (10 %): its
readiness check (HELLO and memory, not an open port) and its busy-server check may cost a little, not more.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, arg_parser, load_average, median, stamp, write_section

from deploy import ansible_venv
from orchestrator.inventory.load import load_inventory
from orchestrator.lab.lifecycle import lab_down, lab_up, reap_stale
from orchestrator.lab.state import Lab
from orchestrator.operations.systemd import unit_name
from orchestrator.probe.fleet import probe_fleet

SECTION = "peers: rolling restart vs Ansible"
LAB_NAME = "peersroll"
EXTRA = 0.10  # rpcfleet's whole rolling restart at most 10 % over Ansible's
PORT = 50052

PLAYBOOK = """\
- hosts: lab
  gather_facts: false
  serial: 1
  max_fail_percentage: 0
  tasks:
    - name: restart the server's unit
      ansible.builtin.systemd: {{name: "{unit}", state: restarted}}
    - name: wait for its port
      ansible.builtin.wait_for: {{host: "{{{{ ansible_host }}}}", port: {port}, timeout: 30}}
"""


def deploy(lab: Lab) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "deploy", "-i", str(lab.inventory)],
        capture_output=True, text=True, timeout=900, check=False, cwd=ROOT,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"deploy failed: {done.stdout}{done.stderr}")


def rpcfleet_rolling(lab: Lab) -> float:
    argv = [sys.executable, "-m", "orchestrator", "restart", "-i", str(lab.inventory), "--serial", "1"]
    started = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    elapsed = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"rpcfleet restart failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return elapsed


def ansible_rolling(venv: Path, lab: Lab, workdir: Path) -> float:
    inventory = workdir / "hosts.ini"
    lines = ["[lab]"]
    for node in lab.nodes:
        lines.append(
            f"{node.name} ansible_host={node.address} ansible_user=root "
            f"ansible_ssh_private_key_file={lab.client_key} ansible_python_interpreter=/usr/bin/python3"
        )
    inventory.write_text("\n".join(lines) + "\n")
    playbook = workdir / "rolling.yml"
    playbook.write_text(PLAYBOOK.format(unit=unit_name("~/rpcfleet"), port=PORT))
    control = Path(tempfile.mkdtemp(prefix="cp", dir="/tmp"))  # fresh connections, as rpcfleet's
    env = {
        **os.environ,
        "ANSIBLE_HOST_KEY_CHECKING": "False",
        "ANSIBLE_SSH_ARGS": (
            f"-o ControlMaster=auto -o ControlPersist=60s -o UserKnownHostsFile={lab.known_hosts}"
        ),
        "ANSIBLE_SSH_CONTROL_PATH_DIR": str(control),
        "ANSIBLE_PIPELINING": "True",
        "ANSIBLE_LOCAL_TEMP": str(workdir / "ansible-tmp"),
        "ANSIBLE_STDOUT_CALLBACK": "default",
    }
    argv = [str(venv / "bin" / "ansible-playbook"), "-i", str(inventory), str(playbook)]
    started = time.monotonic()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
    elapsed = time.monotonic() - started
    shutil.rmtree(control, ignore_errors=True)
    if done.returncode != 0:
        raise RuntimeError(f"ansible-playbook failed:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}")
    return elapsed


def all_ready(lab: Lab) -> int:
    """How many of the lab's servers answer HELLO now."""
    hosts = list(load_inventory(Path(lab.inventory)).hosts)
    fleet = asyncio.run(probe_fleet(hosts, facts=False))
    return sum(1 for node in fleet.nodes if node.ok)


def rolling_target(ours: list[float], theirs: list[float], extra: float = EXTRA) -> tuple[float, bool]:
    """(median of ours / median of theirs, met): rpcfleet's whole rolling restart at most `extra` over
    Ansible's."""
    ratio = median(ours) / median(theirs)
    return ratio, ratio <= 1 + extra


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--nodes", type=int, default=4, help="lab nodes (default 4)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of each (default 5)")
    args = parser.parse_args()
    venv = ansible_venv()
    load_before = load_average()
    ours: list[float] = []
    theirs: list[float] = []
    ready: list[int] = []
    reap_stale()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        folder = Path(tmp)
        variables = {"supervisor": "systemd", "ssh_user": "root"}
        lab = lab_up(args.nodes, name=LAB_NAME, owner_pid=os.getpid(), init="systemd", variables=variables)
        stack.callback(lab_down, LAB_NAME)
        deploy(lab)
        for i in range(args.rounds):
            for side in ("rpcfleet", "ansible") if i % 2 == 0 else ("ansible", "rpcfleet"):
                print(f"round {i + 1}: {side}", file=sys.stderr, flush=True)
                if side == "rpcfleet":
                    ours.append(rpcfleet_rolling(lab))
                else:
                    theirs.append(ansible_rolling(venv, lab, folder))
                ready.append(all_ready(lab))
    ratio, met = rolling_target(ours, theirs)

    def cell(xs: list[float]) -> str:
        return f"{median(xs):.2f} s (min {min(xs):.2f}, max {max(xs):.2f})"

    body = [
        f"## {SECTION}",
        "",
        f"`bench/peers_rolling.py --nodes {args.nodes} --rounds {args.rounds}`, {stamp()}; load average "
        f"{load_before:.2f} at the start. A lab of {args.nodes} network-namespace nodes booting systemd, "
        f"reached as root, servers deployed by `rpcfleet deploy` as the system unit "
        f"`{unit_name('~/rpcfleet')}`. Both restart it one node at a time, timed from the command line "
        "(interpreter start and fresh SSH connections included), alternating (rpcfleet first in odd "
        "rounds). rpcfleet: `rpcfleet restart -i LAB --serial 1` (state read, busy check, stop, start, "
        "HELLO with memory back). Ansible: ansible-core, pipelining, no facts, `serial: 1`, "
        f"`ansible.builtin.systemd: state=restarted` then `ansible.builtin.wait_for` on port {PORT} (the "
        "port open). Median (min, max).",
        "",
        f"| side | whole rolling restart of {args.nodes} nodes | per node |",
        "|---|---|---|",
        f"| rpcfleet restart --serial 1 | {cell(ours)} | {median(ours) / args.nodes:.2f} s |",
        f"| Ansible serial: 1 | {cell(theirs)} | {median(theirs) / args.nodes:.2f} s |",
        "",
        f"After every run the nodes' servers answering HELLO: {min(ready)} to {max(ready)} of "
        f"{args.nodes}. Target (rpcfleet at most {EXTRA * 100:.0f} % over Ansible): {ratio:.2f}x, "
        f"**{'met' if met else 'not met'}**; Ansible's `wait_for` checks an open port, rpcfleet a HELLO "
        "with the memory back.",
    ]
    text = "\n".join(body) + "\n"
    print(text)
    if args.write:
        write_section(args.write, SECTION, text)


if __name__ == "__main__":
    main()
