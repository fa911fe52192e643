"""Tier 2: a server whose bind fails (the `exit-status` patch of the servers rpcfleet builds: status 1,
not 0), under the process supervisor on a lab node.

- Its address is not up yet (a network that comes late at boot): the supervisor retries with its
  backoff, never counting it as a crash, and the server answers HELLO once the address appears, with
  no rpcfleet command run after it.
- Another program took its port while it restarted: a clear state (`exited`, the port named), never a
  loop of restarts.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from orchestrator.lab.lifecycle import lab_down, lab_up
from orchestrator.lab.state import Lab
from orchestrator.rpc.client import probe_endpoint
from tests.plugins.lab import require_lab_privileges, session_lab_name

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bind_lab() -> Iterator[Lab]:
    require_lab_privileges()
    name = session_lab_name("bd")
    made = lab_up(1, name=name, owner_pid=os.getpid())
    try:
        yield made
    finally:
        lab_down(name)


def rpcfleet(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *argv], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def hello(endpoint: str) -> str:
    return asyncio.run(
        probe_endpoint(endpoint, hello_only=True, connect_timeout=2, read_timeout=2, deadline=3)
    ).outcome.value


def supervisor_state(lab: Lab, install_dir: str) -> dict[str, str]:
    text = lab.node_exec(1, ["cat", f"{install_dir}/run/rpc-supervisor.state"]).stdout
    return dict(line.split(" ", 1) for line in text.splitlines() if " " in line)


def test_a_late_address_is_waited_for_and_a_taken_port_is_a_state_not_a_loop(
    bind_lab: Lab, tmp_path: Path
) -> None:
    node = bind_lab.nodes[0]
    assert node.namespace is not None
    late = node.address.rsplit(".", 1)[0] + ".250"  # on the node's network, not on the node yet
    device = bind_lab.node_exec(1, ["ip", "-o", "-4", "addr", "show", "to", node.address]).stdout.split()[1]
    document = yaml.safe_load(bind_lab.inventory.read_text())
    document["hosts"][node.name]["rpc_host"] = late
    document["hosts"][node.name]["supervisor"] = "process"
    inventory = tmp_path / "late.yml"
    inventory.write_text(yaml.safe_dump(document))
    user = document["vars"]["ssh_user"]
    home = bind_lab.node_exec(1, ["sh", "-c", f"getent passwd {user} | cut -d: -f6"]).stdout.strip()
    install_dir = f"{home}/rpcfleet"

    # 1. The address is not there: the start says so, the supervisor keeps trying.
    started = rpcfleet("deploy", "-i", str(inventory))
    assert started.returncode != 0 and "could not bind" in started.stderr, started.stderr
    time.sleep(8)  # past the start limit's pace: 1 + 2 + 4 s of backoff
    state = supervisor_state(bind_lab, install_dir)
    assert state["state"] in ("restarting", "running") and "not up yet" in state["last"], state
    bind_lab.node_exec(1, ["ip", "addr", "add", f"{late}/24", "dev", device])
    appeared = time.monotonic()
    while hello(f"{late}:50052") != "ok":  # no rpcfleet command from here on
        assert time.monotonic() - appeared < 45, supervisor_state(bind_lab, install_dir)
        time.sleep(1)
    assert supervisor_state(bind_lab, install_dir)["state"] == "running"
    status = json.loads(rpcfleet("status", "-i", str(inventory), "--json").stdout)[0]["result"]
    assert status["state"] == "running", status

    # 2. The server dies and another program takes its port before the restart: exited, no loop.
    taker = subprocess.Popen(
        [
            "ip", "netns", "exec", node.namespace, sys.executable, "-c",
            "import os, signal, socket, sys, time\n"
            "os.kill(int(sys.argv[1]), signal.SIGKILL)\n"
            "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            "while True:\n"
            "    try:\n"
            "        s.bind((sys.argv[2], 50052)); break\n"
            "    except OSError:\n"
            "        time.sleep(0.01)\n"
            "s.listen(); print('taken', flush=True); time.sleep(3600)\n",
            str(status["pid"]), late,
        ],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert taker.stdout is not None and taker.stdout.readline().strip() == "taken"
        killed = time.monotonic()
        while (state := supervisor_state(bind_lab, install_dir))["state"] != "exited":
            assert time.monotonic() - killed < 45, state  # the loop's restart (its backoff) meets the port
            time.sleep(1)
        assert "port 50052 is taken by another program" in state["last"], state
        restarts = state["restarts"]
        time.sleep(4)
        assert supervisor_state(bind_lab, install_dir)["restarts"] == restarts  # no loop
    finally:
        taker.kill()
        taker.wait()
        rpcfleet("stop", "-i", str(inventory), "--force")
        bind_lab.node_exec(1, ["ip", "addr", "del", f"{late}/24", "dev", device], check=False)
