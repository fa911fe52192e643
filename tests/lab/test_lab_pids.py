"""A lab node's pid file outlives its process: the faults and `node_exec` act on the node's holder only,
never on the process that took its pid once it died (this machine's pids wrap around: 32768 by default).

The taken pid is written into the file by hand: a real reuse cannot be forced, the rest is real (a
namespaced lab with its sshd, a real ggml-rpc-server outside it standing for another lab's server)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest

from orchestrator.core.errors import LabError
from orchestrator.lab.procs import proc_alive, wait_dead
from orchestrator.lab.state import Lab
from tests.plugins.servers import LocalServer

pytestmark = [pytest.mark.lab, pytest.mark.llama]


def test_a_dead_holders_pid_taken_by_an_rpc_server_is_neither_killed_nor_entered(
    make_lab: Callable[..., Lab], start_rpc_server: Callable[..., LocalServer]
) -> None:
    made = make_lab(1)
    node = made.nodes[0]
    holder = node.holder_pid()
    assert holder is not None
    made.node_exec(1, ["true"])  # the live holder is found and entered

    os.kill(holder, signal.SIGKILL)  # as a power cut does: the file stays
    wait_dead([holder], 5.0)
    stranger = start_rpc_server()
    node.holder_pid_file.write_text(f"{stranger.process.pid}\n")  # the holder's pid, taken by a server

    made.kill_node(1)
    assert made.node_pids(1) == []  # the node is down: its sshd went
    assert stranger.alive() and proc_alive(stranger.process.pid), "the power cut killed another process"
    assert node.holder_pid() is None
    with pytest.raises(LabError, match="no holder process"):
        made.node_exec(1, ["true"])  # never nsenter into the server's namespaces
