"""Tier-2 fixtures: an emulated lab of network namespaces with real OpenSSH (needs root).

- `lab`: one 3-node lab for the whole session (stale labs of killed runs are reaped first, under
  pytest-xdist once by the controller; the lab is owned by this process, a worker's by that worker, so a
  killed session's lab is reaped by the next one).
- `healthy_lab`: that lab, healed after the test (links up, firewalls cleared, sshd running).
- `lab_hosts`: the session lab's inventory hosts, in node order.
- `make_lab`: a factory for a fresh small lab a test may break as it likes; torn down after the test.
- `leftovers(lab)`: what of a lab is still on the machine, found without the lab module (teardown checks).

Without root these skip with a reason, except in CI (`CI` set), where they fail: CI runs as root.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from orchestrator.inventory.load import load_inventory
from orchestrator.inventory.model import Host
from orchestrator.lab.lifecycle import lab_down, lab_up, reap_stale
from orchestrator.lab.netns import privileged
from orchestrator.lab.state import Lab, LabNode, NodeInit

_counter = itertools.count(1)


def require_lab_privileges() -> None:
    """Skip (locally) or fail (in CI) when network namespaces cannot be made."""
    if privileged():
        return
    reason = "tier-2 lab tests need root with CAP_NET_ADMIN and CAP_SYS_ADMIN (network namespaces, sshd)"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run them as root")
    pytest.skip(reason)


def session_lab_name(suffix: str = "") -> str:
    """A lab name unique to this test session (pid based), so parallel sessions never collide."""
    return f"t{os.getpid()}{suffix}"


def lab_hosts_of(lab: Lab) -> list[Host]:
    hosts = {host.name: host for host in load_inventory(lab.inventory).hosts}
    return [hosts[node.name] for node in lab.nodes]


@contextlib.contextmanager
def own_lab(
    nodes: int,
    suffix: str = "",
    *,
    init: NodeInit = "none",
    node_init: Mapping[int, NodeInit] | None = None,
    memory: int | None = None,
) -> Iterator[Lab]:
    """A namespaced lab owned by this test session (reaped if the session dies), down on exit; `memory`:
    each node's memory limit in bytes (`lab up --memory`)."""
    require_lab_privileges()
    name = session_lab_name(suffix)
    made = lab_up(nodes, name=name, owner_pid=os.getpid(), init=init, node_init=node_init, memory=memory)
    try:
        yield made
    finally:
        lab_down(name)


def _xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist the controller reaps stale labs, once, before it starts the workers: a worker's
    reap could take a lab that a test of the other worker made stale on purpose (tests/plugins/schedule.py
    keeps those tests in one worker)."""
    workers = int(getattr(config.option, "numprocesses", 0) or 0)
    labs = "not lab" not in str(config.getoption("markexpr") or "")  # `make unit` leaves labs alone
    if workers and labs and not _xdist_worker(config) and privileged():
        reap_stale()


@pytest.fixture(scope="session")
def lab(request: pytest.FixtureRequest) -> Iterator[Lab]:
    require_lab_privileges()
    if not _xdist_worker(request.config):
        reap_stale()
    with own_lab(3) as made:
        yield made


@pytest.fixture
def healthy_lab(lab: Lab) -> Iterator[Lab]:
    """The session lab; whatever faults the test injects are undone afterwards."""
    yield lab
    lab.heal()


@pytest.fixture(scope="session")
def lab_hosts(lab: Lab) -> list[Host]:
    return lab_hosts_of(lab)


@pytest.fixture
def make_lab(request: pytest.FixtureRequest) -> Iterator[Callable[..., Lab]]:
    """Factory: `make_lab(nodes=2, local=False, memory=None)` -> a fresh lab of this session, down after
    the test (`memory`: each node's memory limit in bytes, `lab up --memory`). A
    namespaced lab needs the test's `lab` mark (a local one does not: tests/plugins/tiers.py leaves this
    fixture to say so when it is called)."""
    made: list[str] = []

    def make(nodes: int = 2, *, local: bool = False, memory: int | None = None) -> Lab:
        if not local:
            if request.node.get_closest_marker("lab") is None:
                pytest.fail(f"{request.node.nodeid} makes a namespaced lab: mark it @pytest.mark.lab")
            require_lab_privileges()
        name = session_lab_name(f"x{next(_counter)}")
        made.append(name)
        return lab_up(nodes, name=name, local=local, owner_pid=os.getpid(), memory=memory)

    yield make
    for name in made:
        lab_down(name)


def leftovers(lab: Lab) -> list[str]:
    """Everything of `lab` still on the machine, found independently of the lab module."""
    found: list[str] = []
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    found += [
        f"netns {line.split()[0]}" for line in namespaces.splitlines() if line.startswith(f"rfl{lab.slot}-")
    ]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    found += [f"link {m}" for m in re.findall(rf"^\d+: (rfl{lab.slot}(?:br|v\d+))[@:]", links, re.M)]
    if lab.user and subprocess.run(["getent", "passwd", lab.user], capture_output=True).returncode == 0:
        found.append(f"user {lab.user}")
    if lab.home_mount and lab.home_mount.exists():
        found.append(f"mount point {lab.home_mount}")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(lab.dir) in cmdline and int(entry.name) != os.getpid():
            found.append(f"process {entry.name}: {cmdline.strip()}")
    if lab.dir.exists():
        found.append(f"state dir {lab.dir}")
    cgroup = Path("/sys/fs/cgroup")  # a node's own cgroups (systemd nodes, --cpus), in every hierarchy
    found += [f"cgroup {p}" for p in [*cgroup.glob(f"rfl{lab.slot}-*"), *cgroup.glob(f"*/rfl{lab.slot}-*")]]
    return found


# A client that connects, completes HELLO (protocol 7: 9-byte header, 24 zero bytes of capabilities),
# reads the reply and then holds the connection without a byte more, printing "held". A server busy
# with another client answers no HELLO: it tries again until `seconds` have passed ("busy" then).
_HOLD = """
import socket, struct, sys, time
deadline = time.monotonic() + float(sys.argv[3])
while True:
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1)
        s.sendall(struct.pack("<BQ", 14, 24) + bytes(24))
        got = b""
        while len(got) < 8 + 28:
            chunk = s.recv(64)
            if not chunk:
                raise OSError("closed")
            got += chunk
        break
    except OSError:
        if time.monotonic() > deadline:
            print("busy", flush=True)
            sys.exit(1)
        time.sleep(0.05)
print("held", flush=True)
time.sleep(3600)
"""


def hold_from(
    lab: Lab, node: str | int, address: str, port: int, seconds: float = 10
) -> subprocess.Popen[str] | None:
    """A client in node `node`'s network namespace holding the server at `address:port` (None: it did
    not get the server within `seconds`). Kill it to let go."""
    namespace = lab.node(node).namespace
    assert namespace is not None
    argv = ["ip", "netns", "exec", namespace, sys.executable, "-c", _HOLD, address, str(port)]
    proc = subprocess.Popen([*argv, str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() == "held":
        return proc
    proc.wait()
    return None


def connect_from_controller(address: str, port: int) -> str:
    """ "connected", "refused" or "timeout": a TCP connect from this machine."""
    with socket.socket() as sock:
        sock.settimeout(3)
        try:
            sock.connect((address, port))
        except ConnectionRefusedError:
            return "refused"
        except TimeoutError:
            return "timeout"
    return "connected"


_CONNECT = (
    "import socket,sys\ns=socket.socket();s.settimeout(3)\n"
    "try:\n s.connect((sys.argv[1],int(sys.argv[2])));print('connected')\n"
    "except ConnectionRefusedError: print('refused')\nexcept TimeoutError: print('timeout')\n"
)


def connect_from_node(lab: Lab, node: str | int | LabNode, address: str, port: int) -> str:
    """`connect_from_controller`, from inside lab node `node`'s network namespace."""
    namespace = lab.node(node).namespace
    assert namespace is not None
    argv = ["ip", "netns", "exec", namespace, sys.executable, "-c", _CONNECT, address, str(port)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
