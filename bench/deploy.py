"""Benchmark: `rpcfleet deploy` against Ansible on 1, 2, 4 and 8 lab nodes (needs root for the lab).

For each size: a fresh deploy (nothing installed) and a no-op re-deploy, each with new connections,
by rpcfleet (`rpcfleet deploy --artifact ID --json`, a fresh process) and by ansible-core (its own venv
under `$RPCFLEET_HOME/bench/ansible-venv`, created on first use) running a playbook that does the same
work: copy the archive, check its sha256, unpack it, switch a link, start the server detached. Both are
timed from the command line, from the spawn of their command to its exit (interpreter start included),
and they alternate: rpcfleet first in odd rounds, Ansible first in even ones, so that a drift of the
machine's load favours neither. Results go to stdout and, with `--write`, to the "deploy" section of
BENCHMARKS.md.

    .venv/bin/python bench/deploy.py [--sizes 1,2,4,8] [--repeat 3] [--no-ansible] [--write [PATH]]
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

from _common import ROOT, arg_parser, busy_cpu_seconds, load_average, median, stamp, write_section

from orchestrator.artifacts.build import default_artifact
from orchestrator.artifacts.manifest import Artifact
from orchestrator.core.paths import rpcfleet_home
from orchestrator.lab.lifecycle import lab_down, lab_up, reap_stale
from orchestrator.lab.netns import privileged
from orchestrator.lab.state import Lab

SECTION = "deploy"

PLAYBOOK = """\
- hosts: lab
  gather_facts: false
  vars:
    d: "{{ ansible_env_home | default('/home/' + ansible_user) }}/rpcfleet-ansible"
  tasks:
    - name: folders
      ansible.builtin.file: {path: "{{ d }}/{{ item }}", state: directory}
      loop: [tmp, versions, run, log, cache]
    - name: upload the archive
      ansible.builtin.copy: {src: "{{ archive }}", dest: "{{ d }}/tmp/{{ id }}.tar.gz", mode: "0600"}
    - name: sha256 of the upload
      ansible.builtin.stat: {path: "{{ d }}/tmp/{{ id }}.tar.gz", checksum_algorithm: sha256}
      register: uploaded
    - name: check it
      ansible.builtin.assert: {that: "uploaded.stat.checksum == sha256", quiet: true}
    - name: version folder
      ansible.builtin.file: {path: "{{ d }}/versions/{{ id }}", state: directory}
    - name: unpack
      ansible.builtin.unarchive:
        src: "{{ d }}/tmp/{{ id }}.tar.gz"
        dest: "{{ d }}/versions/{{ id }}"
        remote_src: true
        creates: "{{ d }}/versions/{{ id }}/bin/ggml-rpc-server"
    - name: current
      ansible.builtin.file: {src: "versions/{{ id }}", dest: "{{ d }}/current", state: link}
    - name: start detached
      ansible.builtin.shell: >-
        cd ~; trap '' PIPE; setsid nohup stdbuf -oL {{ d }}/current/bin/ggml-rpc-server
        -H {{ ansible_host }} -p 50052 </dev/null >>{{ d }}/log/rpc-server.log 2>&1 &
        echo $! > {{ d }}/run/rpc-server.pid
      args: {creates: "{{ d }}/run/rpc-server.pid"}
"""


def ansible_venv() -> Path:
    venv = rpcfleet_home() / "bench" / "ansible-venv"
    if not (venv / "bin" / "ansible-playbook").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "ansible-core"], check=True, timeout=900)
    return venv


def kill_servers(lab: Lab) -> None:
    """Kill every server this benchmark started (by pid file) and remove both install folders."""
    for node in lab.nodes:
        for folder in ("rpcfleet", "rpcfleet-ansible"):
            pid_file = node.home / folder / "run" / "rpc-server.pid"
            if pid_file.exists():
                pid = int(pid_file.read_text().split()[0])
                cmdline = Path(f"/proc/{pid}/cmdline")
                if cmdline.exists() and b"ggml-rpc-server" in cmdline.read_bytes():
                    os.kill(pid, signal.SIGKILL)
                    deadline = time.monotonic() + 5
                    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                        time.sleep(0.01)
            shutil.rmtree(node.home / folder, ignore_errors=True)


def rpcfleet_deploy(lab: Lab, artifact: Artifact) -> tuple[float, int, float]:
    """Seconds for one `rpcfleet deploy` from the command line (a fresh process: its interpreter's start
    and new connections included), how many hosts changed, and the CPU seconds the machine spent
    meanwhile (controller, sshd and the nodes' work: all on these cores)."""
    argv = [sys.executable, "-m", "orchestrator", "deploy", "-i", str(lab.inventory)]
    argv += ["--artifact", artifact.id, "--forks", "16", "--json"]
    started, busy = time.monotonic(), busy_cpu_seconds()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    elapsed, cpu = time.monotonic() - started, busy_cpu_seconds() - busy
    if done.returncode != 0:
        raise SystemExit(
            f"rpcfleet deploy failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    results = json.loads(done.stdout)
    return elapsed, sum(r["status"] == "changed" for r in results), cpu


def ansible_deploy(venv: Path, lab: Lab, artifact: Artifact, workdir: Path) -> float:
    inventory = workdir / "hosts.ini"
    lines = ["[lab]"]
    for node in lab.nodes:
        lines.append(
            f"{node.name} ansible_host={node.address} ansible_user={lab.user} "
            f"ansible_ssh_private_key_file={lab.client_key} ansible_python_interpreter=/usr/bin/python3"
        )
    inventory.write_text("\n".join(lines) + "\n")
    (workdir / "deploy.yml").write_text(PLAYBOOK)
    control = Path(tempfile.mkdtemp(prefix="cp", dir="/tmp"))  # fresh connections, like rpcfleet's run
    env = {
        **os.environ,
        "ANSIBLE_HOST_KEY_CHECKING": "False",
        "ANSIBLE_SSH_ARGS": (
            f"-o ControlMaster=auto -o ControlPersist=60s -o UserKnownHostsFile={lab.known_hosts}"
        ),
        "ANSIBLE_SSH_CONTROL_PATH_DIR": str(control),
        "ANSIBLE_PIPELINING": "True",
        "ANSIBLE_FORKS": "16",
        "ANSIBLE_LOCAL_TEMP": str(workdir / "ansible-tmp"),
        "ANSIBLE_STDOUT_CALLBACK": "default",
    }
    argv = [
        str(venv / "bin" / "ansible-playbook"),
        "-i", str(inventory), str(workdir / "deploy.yml"),
        "-e", f"archive={artifact.archive} id={artifact.id} sha256={artifact.archive_sha256}",
        "-e", f"ansible_env_home=/home/{lab.user}",
    ]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
    elapsed = time.monotonic() - started
    subprocess.run(["rm", "-rf", str(control)], check=False)
    if done.returncode != 0:
        raise SystemExit(f"ansible-playbook failed:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}")
    return elapsed


def measure(size: int, repeat: int, venv: Path | None, artifact: Artifact) -> dict[str, float]:
    name = f"bd{size}"
    lab_down(name)
    lab = lab_up(size, name=name, owner_pid=os.getpid())
    try:
        results: dict[str, list[float]] = {
            "fresh": [],
            "fresh_cpu": [],
            "noop": [],
            "a_fresh": [],
            "a_noop": [],
        }

        def rpcfleet() -> None:
            kill_servers(lab)
            fresh, changed, fresh_cpu = rpcfleet_deploy(lab, artifact)
            assert changed == size, f"a fresh deploy changed {changed} of {size} hosts"
            noop, changed, _ = rpcfleet_deploy(lab, artifact)
            assert changed == 0, f"a no-op deploy changed {changed} hosts"
            results["fresh"].append(fresh)
            results["fresh_cpu"].append(fresh_cpu)
            results["noop"].append(noop)
            kill_servers(lab)

        def ansible() -> None:
            if venv is None:
                return
            kill_servers(lab)
            with tempfile.TemporaryDirectory() as work:
                results["a_fresh"].append(ansible_deploy(venv, lab, artifact, Path(work)))
                results["a_noop"].append(ansible_deploy(venv, lab, artifact, Path(work)))
            kill_servers(lab)

        for i in range(repeat):  # rpcfleet first in odd rounds, Ansible first in even ones
            for tool in (rpcfleet, ansible) if i % 2 == 0 else (ansible, rpcfleet):
                tool()
        return {key: median(values) for key, values in results.items() if values}
    finally:
        kill_servers(lab)
        lab_down(name)


def markdown(rows: dict[int, dict[str, float]], repeat: int, load: float) -> str:
    has_ansible = all("a_fresh" in r for r in rows.values())
    out = [
        f"## {SECTION}",
        "",
        f"`bench/deploy.py`, {stamp()}: lab nodes (network namespaces, real OpenSSH) on this machine, "
        f"1-min load average {load:.1f} at the start; "
        f"median of {repeat} runs; every run opens new connections. Fresh = nothing installed (upload "
        "the ~1 MB archive, sha256 on the node, unpack, switch `current`, start, wait for HELLO); "
        "no-op = the same deploy again. Both timed from the command line, spawn to exit (`rpcfleet "
        "deploy --json` and `ansible-playbook`, each interpreter's start included), alternating (rpcfleet "
        "first in odd rounds, Ansible first in even ones). Ansible: ansible-core, pipelining, no fact "
        "gathering, forks 16.",
        "",
    ]
    header = "| nodes | rpcfleet fresh (s) | rpcfleet no-op (s) |"
    rule = "|---:|---:|---:|"
    if has_ansible:
        header += " ansible fresh (s) | ansible no-op (s) | speed-up fresh | speed-up no-op |"
        rule += "---:|---:|---:|---:|"
    out += [header, rule]
    for size, r in sorted(rows.items()):
        line = f"| {size} | {r['fresh']:.2f} | {r['noop']:.2f} |"
        if has_ansible:
            line += (
                f" {r['a_fresh']:.2f} | {r['a_noop']:.2f} | {r['a_fresh'] / r['fresh']:.1f}x |"
                f" {r['a_noop'] / r['noop']:.1f}x |"
            )
        out.append(line)
    sizes = sorted(rows)
    if len(sizes) > 1:
        first, last = rows[sizes[0]], rows[sizes[-1]]
        scaling = last["fresh"] / first["fresh"]
        # The right baseline on one machine: the nodes' and the controller's CPU work share its cores,
        # so no deploy of N nodes can beat max(one node's time, its CPU seconds / cores).
        cores = os.cpu_count() or 1
        limit = max(first["fresh"], last["fresh_cpu"] / cores)
        out += [
            "",
            f"Scaling: {sizes[-1]} nodes take {scaling:.2f}x the time of {sizes[0]} (fresh; target <= 1.5x, "
            f"for nodes on separate machines: {'met' if scaling <= 1.5 else 'not met'}); a no-op re-deploy "
            f"of {sizes[-1]} nodes takes {last['noop']:.2f} s (target < 2 s: "
            f"{'met' if last['noop'] < 2 else 'not met'}).",
            "",
            f"Against what this machine allows: the fresh deploy of {sizes[-1]} nodes kept its {cores} cores "
            f"busy for {last['fresh_cpu']:.2f} CPU-s (controller, sshd and nodes alike, from /proc/stat), so "
            f"it cannot take less than {limit:.2f} s here; it took {last['fresh']:.2f} s, "
            f"{last['fresh'] / limit:.2f}x that limit ({sizes[0]} node: "
            f"{first['fresh_cpu']:.2f} CPU-s in {first['fresh']:.2f} s).",
        ]
    return "\n".join(out) + "\n"


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-ansible", action="store_true")
    args = parser.parse_args()
    if not privileged():
        print("the lab needs root (network namespaces)", file=sys.stderr)
        return 2
    reap_stale()
    load = load_average()
    artifact = default_artifact("cpu")
    venv = None if args.no_ansible else ansible_venv()
    rows: dict[int, dict[str, float]] = {}
    for size in (int(s) for s in args.sizes.split(",")):
        rows[size] = measure(size, args.repeat, venv, artifact)
        print(size, {k: round(v, 3) for k, v in rows[size].items()}, flush=True)
    text = markdown(rows, args.repeat, load)
    print(text)
    if args.write is not None:
        write_section(args.write, SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
