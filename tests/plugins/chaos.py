"""The chaos soak's harness, shared by tests/serve/test_chaos_lab.py (each fault once) and bench/chaos.py
(random faults for minutes): a lab, `rpcfleet serve` (real Gemma 3 270M) in its own process, clients streaming
through the official `openai` client without a pause, faults injected and healed one at a time, and the
checks that every request ends (answered, refused with 503 + Retry-After, or failed with 503 naming the
faulted node while in flight at its fault), that the fleet is whole again after each heal, and that serve
kept its pid, leaked no descriptor and left no orphan server: neither a node's `ggml-rpc-server` nor an
engine (serve's `llama-server`, restarted on every node loss: exactly one, serve's child, the one /health
names, after each heal and at the end).

Faults (`FAULTS`): `kill9` (SIGKILL of a node's server; the process supervisor restarts it), `cut` (the
node's veth down for `cut_seconds`, then up), `sshd` (the node's sshd killed; `rpcfleet lab repair`),
`reboot` (on a node that boots systemd: a reboot, and no rpcfleet command after it, as the server's
enabled unit starts it at boot; on a plain node: a power cut, `lab repair`, then `rpcfleet start` for it,
as the process supervisor died with the node), `rolling` (serve's `POST /admin/reload` with a rolling
restart), `deploy` (a second operator's `rpcfleet deploy` from another process: it must change nothing,
or refuse busy servers), `foreign` (the node's server killed, and a client on the next node takes it as
the supervisor restarts it, then vanishes: its packets dropped both ways, its process killed; the rule
stays `foreign_seconds`, longer than the server's keepalive, so no rpcfleet command and no FIN frees the
server: its own kernel must).

Availability is a rule: of the requests whose life (sent to ended) is clear of every fault's window (from
its injection to `recovery_s` after its heal, serve's target to serve again), at least `availability` are
answered.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import psutil

from orchestrator.inventory.model import Host
from orchestrator.lab.state import Lab
from tests.plugins.lab import hold_from, lab_hosts_of
from tests.plugins.servers import free_port

FAULTS = ("kill9", "cut", "sshd", "reboot", "rolling", "deploy", "foreign")
KEY = "chaos-key"
ADMIN_KEY = "chaos-admin-key"  # a rolling restart needs it (the API key may not)
MODEL_NAME = "gemma"
ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass
class Request:
    client: int
    sent: float  # monotonic
    ended: float = 0.0
    first: float | None = None  # seconds from sending to the first answer (a chunk or an error)
    outcome: str = ""  # answered, refused, failed, lost
    status: int | None = None
    message: str = ""
    pause: float = 0.0  # the longest silence between two chunks of its stream


@dataclass
class Fault:
    kind: str
    node: str | None
    endpoint: str | None
    injected: float  # monotonic
    healed: float = 0.0  # the heal's last step done
    window_end: float = 0.0  # requests sent before this may fail for this fault
    whole_after: float | None = None  # seconds from `healed` to /health showing the whole fleet
    failed: int = 0  # requests in flight that it ended (503 naming its node)
    survived: int = 0  # requests in flight at its injection that were answered whole (issue 42)
    pause: float = 0.0  # the longest silence inside those streams
    engine_replaced: bool = False  # serve's engine after the heal is not the one before the fault
    notes: list[str] = field(default_factory=list)


@dataclass
class Result:
    requests: list[Request]
    faults: list[Fault]
    violations: list[str]
    pid_kept: bool
    fds: tuple[int, int]
    orphans: list[str]
    seconds: float
    engines: int = 0  # llama-server processes serve started during the soak (one per load)
    stray_engines: list[int] = field(default_factory=list)  # others dialing the lab at the end
    available: tuple[int, int] = (0, 0)  # answered, all: the requests clear of every fault's window
    resumed: int = 0  # serve's rpcfleet_requests_resumed_total at the end

    def count(self, outcome: str) -> int:
        return sum(r.outcome == outcome for r in self.requests)

    @property
    def longest_wait(self) -> float:
        return max((r.first if r.first is not None else r.ended - r.sent) for r in self.requests)

    @property
    def passed(self) -> bool:
        return not self.violations


def _rpc_server_pid(lab: Lab, node: str) -> int | None:
    for pid in lab.node_pids(node):
        with contextlib.suppress(psutil.NoSuchProcess):
            if "rpc-server" in psutil.Process(pid).name():
                return pid
    return None


class Chaos:
    """One soak: `start()`, then `fault(kind, node)` as often as wanted, then `finish()`; `close()` always."""

    def __init__(
        self,
        lab: Lab,
        model: Path,
        workdir: Path,
        *,
        clients: int = 4,
        cut_seconds: float = 20.0,
        whole_limit: float = 120.0,
        request_timeout: float = 60.0,
        command_timeout: float = 180.0,
        max_tokens: int = 48,
        recovery_s: float = 60.0,
        availability: float = 0.9,
        foreign_seconds: float = 40.0,
        say: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.recovery_s, self.availability, self.foreign_seconds = recovery_s, availability, foreign_seconds
        self.lab, self.model, self.workdir = lab, model, workdir
        self.clients, self.cut_seconds, self.whole_limit = clients, cut_seconds, whole_limit
        self.request_timeout, self.command_timeout, self.max_tokens = (
            request_timeout,
            command_timeout,
            max_tokens,
        )
        self.say = say
        self.hosts: list[Host] = lab_hosts_of(lab)
        self.serve: subprocess.Popen[bytes] | None = None
        self.base = ""
        self.pid = 0
        self.fds_start = 0
        self.requests: list[Request] = []
        self.faults: list[Fault] = []
        self.violations: list[str] = []
        self.streaming = 0  # requests whose stream has begun and not ended (a node fault lands on them)
        self.health_log: list[tuple[float, str, int]] = []  # (monotonic, status, endpoints planned)
        self.engine_pids: set[int] = set()  # every llama-server pid /health named
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._started = 0.0

    # -- commands
    def violation(self, what: str) -> None:
        with self._lock:
            self.violations.append(what)
        self.say(f"VIOLATION: {what}")

    def rpcfleet(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`rpcfleet ARGV` in its own process, bounded by the command timeout (a hang is a violation)."""
        cmd = [sys.executable, "-m", "orchestrator", *argv]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=self.command_timeout, cwd=ROOT, check=False
            )
        except subprocess.TimeoutExpired:
            self.violation(f"`rpcfleet {' '.join(argv)}` hung past {self.command_timeout:g} s")
            raise
        if "Traceback" in done.stderr:
            self.violation(f"`rpcfleet {' '.join(argv)}` printed a traceback: {done.stderr[-1500:]}")
        if check and done.returncode != 0:
            raise RuntimeError(
                f"`rpcfleet {' '.join(argv)}` failed ({done.returncode}): {done.stderr[-2000:]}"
            )
        return done

    def inventory_args(self) -> list[str]:
        return ["-i", str(self.lab.inventory)]

    # -- serve
    def get(self, path: str, timeout: float = 10.0) -> tuple[int, Any]:
        request = urllib.request.Request(self.base + path, headers={"Authorization": f"Bearer {KEY}"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    def post(self, path: str, body: dict[str, Any]) -> int:
        key = ADMIN_KEY if path.startswith("/admin/") else KEY
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        data = json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as err:
            return int(err.code)

    def health(self) -> dict[str, Any]:
        data: dict[str, Any] = self.get("/health")[1]
        return data

    @staticmethod
    def whole(health: dict[str, Any]) -> bool:
        plan = health.get("plan") or {}
        return health.get("status") == "ready" and len(plan.get("endpoints", ())) == 3

    def wait_whole(self, limit: float) -> float | None:
        """Seconds until /health shows the whole fleet (ready on 3 nodes), None when not within `limit`."""
        started = time.monotonic()
        while time.monotonic() - started < limit:
            with contextlib.suppress(OSError, ValueError):
                if self.whole(self.health()):
                    return time.monotonic() - started
            assert self.serve is not None
            if self.serve.poll() is not None:
                self.violation(f"serve exited with status {self.serve.returncode}")
                return None
            time.sleep(0.2)
        return None

    def start(self) -> None:
        self.say("deploy")
        self.rpcfleet(*self.inventory_args(), "deploy")
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "orchestrator", "serve", *self.inventory_args(), "-m", str(self.model)]
        argv += ["--ctx", "1024", "--port", str(port), "--model-name", MODEL_NAME, "--split"]
        argv += ["--link-timeout", "4", "--timeout", "2", "--recover-timeout", "300"]
        log = (self.workdir / "serve.log").open("wb")
        env = {**os.environ, "RPCFLEET_API_KEY": KEY, "RPCFLEET_ADMIN_KEY": ADMIN_KEY}
        self.serve = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        log.close()
        self.say("serve: waiting for the whole fleet")
        deadline = time.monotonic() + 180
        while True:
            if self.serve.poll() is not None:
                raise RuntimeError(f"serve exited: {self.serve_log()[-3000:]}")
            with contextlib.suppress(OSError, ValueError):
                if self.whole(self.health()):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"serve not ready on 3 nodes in 180 s: {self.serve_log()[-3000:]}")
            time.sleep(0.2)
        health = self.health()
        self.pid = int(health["pid"])
        self.engine_pids.add(int(health["engine"]["pid"]))
        if self.pid != self.serve.pid:
            raise RuntimeError(f"/health says pid {self.pid}, serve is {self.serve.pid}")
        self.fds_start = self._pooled_fds()
        self._started = time.monotonic()
        self._threads = [threading.Thread(target=self._poll_health, name="chaos-health", daemon=True)]
        self._threads += [
            threading.Thread(target=self._client, args=(i,), name=f"chaos-client-{i}", daemon=True)
            for i in range(self.clients)
        ]
        for thread in self._threads:
            thread.start()

    def serve_log(self) -> str:
        path = self.workdir / "serve.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def fds(self) -> int:
        return sum(1 for _ in Path(f"/proc/{self.pid}/fd").iterdir())

    def _pooled_fds(self) -> int:
        """serve's descriptors after one request of its own: serve keeps idle connections to its engine
        (httpx's pool, closed once idle 5 s, at the pool's next request), so both counts hold the one
        this request used, and none idle longer."""
        time.sleep(5.5)
        status = self.post("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1})
        if status != 200:
            self.violation(f"serve answered a request of the harness {status}")
        return self.fds()

    def _poll_health(self) -> None:
        while not self._stop.is_set():
            try:
                health = self.health()
                planned = len((health.get("plan") or {}).get("endpoints", ()))
                engine = (health.get("engine") or {}).get("pid")
                with self._lock:
                    self.health_log.append((time.monotonic(), str(health.get("status")), planned))
                    if isinstance(engine, int):
                        self.engine_pids.add(engine)
            except (OSError, ValueError) as exc:
                self.violation(f"/health did not answer: {exc!r}")
            self._stop.wait(0.25)

    # -- the engine
    def engines(self) -> dict[int, int]:
        """pid -> parent pid of every live llama-server that dials this lab's nodes."""
        endpoints = {h.endpoint for h in self.hosts}
        found: dict[int, int] = {}
        for process in psutil.process_iter(["name", "cmdline", "ppid", "status"]):
            info = process.info
            if info["name"] != "llama-server" or info["status"] == psutil.STATUS_ZOMBIE:
                continue
            line = " ".join(info["cmdline"] or [])
            if any(endpoint in line for endpoint in endpoints):  # its --rpc list
                found[process.pid] = info["ppid"]
        return found

    def stray_engines(self, settle: float = 15.0) -> list[int]:
        """llama-server processes other than serve's one engine (its child, the one /health names), once
        a moment to settle has passed (an engine killed at a node's loss is reaped as serve goes on); []
        when there are none. Serve's engine missing is a stray too (pid 0)."""
        deadline = time.monotonic() + settle
        while True:
            current = None
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                current = int(self.health()["engine"]["pid"])
            live = self.engines()
            stray = sorted(pid for pid in live if pid != current)
            if current is None or live.get(current) != self.pid:
                stray.append(0)
            if not stray or time.monotonic() > deadline:
                return stray
            time.sleep(0.5)

    # -- clients
    def _client(self, index: int) -> None:
        client = openai.OpenAI(
            base_url=f"{self.base}/v1", api_key=KEY, max_retries=0, timeout=self.request_timeout
        )
        n = 0
        try:
            while not self._stop.is_set():
                n += 1
                request = Request(index, time.monotonic())
                pause = self._one(client, request, f"Chaos client {index}, request {n}: tell a story.")
                request.ended = time.monotonic()
                with self._lock:
                    self.requests.append(request)
                if pause:
                    self._stop.wait(pause)
        finally:
            client.close()

    @contextlib.contextmanager
    def _counted_while_streaming(self) -> Iterator[Callable[[], None]]:
        """Counts the request in `streaming` from the call of what it yields until the stream ends."""
        counted = False

        def began() -> None:
            nonlocal counted
            with self._lock:
                self.streaming += 1
            counted = True

        try:
            yield began
        finally:
            if counted:
                with self._lock:
                    self.streaming -= 1

    def engine_pid(self) -> int | None:
        """The pid of the engine serve's /health names (None while it has none or does not answer)."""
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            return int(self.health()["engine"]["pid"])
        return None

    def wait_streaming(self, limit: float) -> bool:
        """Wait (at most `limit` s) until a request is streaming, so that a node fault ends one in flight."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and not self._stop.is_set():
            with self._lock:
                if self.streaming:
                    return True
            time.sleep(0.05)
        return False

    def _one(self, client: openai.OpenAI, request: Request, prompt: str) -> float:
        """Send one streamed completion and record how it ended; returns the pause before the next."""
        finish = None
        try:
            stream = client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=self.max_tokens, temperature=0.8, stream=True
            )
            with stream, self._counted_while_streaming() as began:
                last = None
                for chunk in stream:
                    now = time.monotonic()
                    if request.first is None:
                        request.first = now - request.sent
                        began()
                    request.pause = max(request.pause, now - last) if last is not None else 0.0
                    last = now
                    finish = chunk.choices[0].finish_reason or finish
        except openai.APIStatusError as exc:  # refused at admission: 503 + Retry-After while not serving
            request.first = time.monotonic() - request.sent
            request.outcome, request.status, request.message = "refused", exc.status_code, exc.message
            retry = exc.response.headers.get("retry-after")
            if exc.status_code != 503 or retry is None:
                self.violation(
                    f"a request was refused with {exc.status_code} (Retry-After {retry}): {exc.message}"
                )
            return min(float(retry or 1), 2.0)
        except openai.APITimeoutError:
            request.outcome, request.message = "lost", f"no answer within {self.request_timeout:g} s"
            self.violation(f"client {request.client}: a request hung past its timeout")
            return 0.0
        except openai.APIConnectionError as exc:
            request.outcome, request.message = "lost", f"connection: {exc!r}"
            self.violation(f"client {request.client}: a request lost its connection: {exc!r}")
            return 1.0
        except openai.APIError as exc:  # the stream's error event: admitted, then not served
            if request.first is None:
                request.first = time.monotonic() - request.sent
            body = exc.body if isinstance(exc.body, dict) else {}
            request.outcome, request.message = "failed", exc.message
            request.status = body.get("code") if isinstance(body.get("code"), int) else None
            return 0.5
        if finish is None:
            request.outcome, request.message = "lost", "the stream ended without a finish reason"
            self.violation(f"client {request.client}: a stream ended without its end")
        else:
            request.outcome = "answered"
        return 0.0

    def pause(self, seconds: float) -> None:
        """Let the clients stream for `seconds`."""
        self._stop.wait(seconds)

    # -- faults
    def host(self, node: str) -> Host:
        return next(h for h in self.hosts if h.name == node)

    def fault(self, kind: str, node: str) -> Fault:
        """Inject `kind` (on `node` where it has one), heal it, and wait for the whole fleet."""
        endpoint = self.host(node).endpoint if kind in ("kill9", "cut", "reboot", "foreign") else None
        if endpoint is not None and not self.wait_streaming(60):
            self.say(f"{kind}: no request streaming after 60 s; the fault lands on none")
        engine_before = self.engine_pid()
        record = Fault(kind, node if kind not in ("rolling", "deploy") else None, endpoint, time.monotonic())
        self.say(f"fault {kind}" + (f" on {node}" if record.node else ""))
        try:
            getattr(self, f"_{kind}")(record, node)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:  # the heal failed: on to the check
            self.violation(f"{kind}: the fault or its heal failed: {exc}")
        record.healed = time.monotonic()
        record.window_end = max(record.window_end, record.healed)
        record.whole_after = self.wait_whole(self.whole_limit)
        if record.whole_after is None:
            health: dict[str, Any] = {}
            with contextlib.suppress(OSError, ValueError):
                health = self.health()
            self.violation(
                f"after {kind}: the fleet was not whole {self.whole_limit:g} s after the heal: "
                f"{health.get('status')} on {(health.get('plan') or {}).get('endpoints')}"
            )
        else:
            self.say(f"  healed; the whole fleet back {record.whole_after:.1f} s after the heal")
            record.engine_replaced = self.engine_pid() not in (None, engine_before)
            stray = self.stray_engines()
            if stray:
                self.violation(f"after {kind}: llama-server processes beside serve's engine: {stray}")
        self.faults.append(record)
        return record

    def _kill9(self, record: Fault, node: str) -> None:
        pid = _rpc_server_pid(self.lab, node)
        if pid is None:
            raise RuntimeError(f"no rpc-server on {node}")
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30  # the supervisor restarts it after 1 s
        while (again := _rpc_server_pid(self.lab, node)) in (None, pid):
            if time.monotonic() > deadline:
                self.violation(f"kill9: the process supervisor did not restart the server on {node} in 30 s")
                return
            time.sleep(0.1)
        record.notes.append(f"server {pid} -> {again}")

    def _cut(self, record: Fault, node: str) -> None:
        self.lab.cut_link(node)
        time.sleep(self.cut_seconds)
        self.lab.restore_link(node)

    def _sshd(self, record: Fault, node: str) -> None:
        server = _rpc_server_pid(self.lab, node)
        self.lab.kill_sshd(node)
        time.sleep(2)  # the fault lasts: no SSH to the node for 2 s
        self.rpcfleet("lab", "repair", "--name", self.lab.name)
        if _rpc_server_pid(self.lab, node) != server:
            self.violation(f"sshd: the server on {node} changed while only its sshd was killed")

    def _reboot(self, record: Fault, node: str) -> None:
        if self.lab.node(node).init == "systemd":  # the enabled unit starts the server at boot
            self.lab.reboot(node)
            record.notes.append("rebooted; no rpcfleet command after it")
            return
        self.lab.kill_node(node)
        time.sleep(2)  # the fault lasts: the node is down for 2 s
        self.rpcfleet("lab", "repair", "--name", self.lab.name)
        self.rpcfleet(*self.inventory_args(), "start", "-l", node)

    def _rolling(self, record: Fault, node: str) -> None:
        reloads = int(self.health()["reloads"])
        before = {h.name: _rpc_server_pid(self.lab, h.name) for h in self.hosts}
        code = self.post("/admin/reload", {"rolling_restart": True})
        if code != 202:
            self.violation(f"rolling: /admin/reload answered {code}")
            return
        deadline = time.monotonic() + self.whole_limit
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                health = self.health()
                if int(health["reloads"]) > reloads and health["status"] in ("ready", "degraded"):
                    break
            time.sleep(0.2)
        after = {h.name: _rpc_server_pid(self.lab, h.name) for h in self.hosts}
        kept = [n for n in before if after[n] == before[n]]
        if kept:
            self.violation(f"rolling: the servers of {kept} were not restarted")

    def _deploy(self, record: Fault, node: str) -> None:
        before = {h.name: _rpc_server_pid(self.lab, h.name) for h in self.hosts}
        done = self.rpcfleet(*self.inventory_args(), "deploy", "--json", check=False)
        results = json.loads(done.stdout) if done.stdout.strip() else []
        changed = [r for r in results if r.get("status") == "changed"]
        refused = [r for r in results if r.get("status") == "failed"]
        unclean = [r for r in refused if "busy" not in str(r.get("error"))]
        if changed or unclean or (done.returncode != 0 and not refused) or not results:
            self.violation(f"deploy by a second operator: exit {done.returncode}, {done.stdout[-1500:]}")
        record.notes.append(
            f"exit {done.returncode}: " + ", ".join(f"{r.get('host')} {r.get('status')}" for r in results)
        )
        after = {h.name: _rpc_server_pid(self.lab, h.name) for h in self.hosts}
        if after != before:
            self.violation(f"deploy by a second operator changed the servers: {before} -> {after}")

    def _foreign(self, record: Fault, node: str) -> None:
        target = self.host(node)
        names = [h.name for h in self.hosts]
        client_node = names[(names.index(node) + 1) % len(names)]
        pid = _rpc_server_pid(self.lab, node)
        if pid is None:
            raise RuntimeError(f"no rpc-server on {node}")
        os.kill(pid, signal.SIGKILL)  # the supervisor restarts it after 1 s: the client is there first
        client = hold_from(self.lab, client_node, target.address, target.rpc_port, seconds=10)
        if client is None:
            record.notes.append("serve took the server back first: no foreign client")
            return
        port = f"{target.rpc_port}"
        rules = [
            ["OUTPUT", "-p", "tcp", "-d", target.address, "--dport", port, "-j", "DROP"],
            ["INPUT", "-p", "tcp", "-s", target.address, "--sport", port, "-j", "DROP"],
        ]
        namespace = self.lab.node(client_node).namespace
        assert namespace is not None
        iptables = ["ip", "netns", "exec", namespace, "iptables", "-w"]
        for rule in rules:  # the client's node vanishes for this server: no FIN, no RST, no probe answer
            subprocess.run([*iptables, "-I", *rule], check=True)
        try:
            client.kill()
            client.wait()
            record.notes.append(f"held from {client_node}, then gone")
            time.sleep(self.foreign_seconds)
        finally:
            for rule in rules:
                subprocess.run([*iptables, "-D", *rule], check=False)

    # -- the end
    def finish(self) -> Result:
        """Stop the clients, let serve settle, and run the end's checks."""
        self._stop.set()
        for thread in self._threads:
            thread.join(self.request_timeout + 15)
            if thread.is_alive():
                self.violation(f"{thread.name} did not end within {self.request_timeout + 15:g} s")
        self._check_failures()
        self._count_survivors()
        available = self._availability()
        resumed = self._resumed()
        assert self.serve is not None
        pid_kept = self.serve.poll() is None and int(self.health()["pid"]) == self.pid == self.serve.pid
        if not pid_kept:
            self.violation(f"serve's pid changed or it exited ({self.serve.poll()})")
        fds = self._pooled_fds() if self.serve.poll() is None else -1
        deadline = time.monotonic() + 15  # closed client connections: give serve a moment
        while fds > self.fds_start and time.monotonic() < deadline:
            time.sleep(0.5)
            fds = self.fds()
        if fds > self.fds_start:
            self.violation(f"serve holds {fds} descriptors, {self.fds_start} at the start")
        orphans = self._orphans()
        stray = self.stray_engines()
        if stray:
            self.violation(f"at the end: llama-server processes beside serve's engine: {stray}")
        if not self.requests or not any(r.outcome == "answered" for r in self.requests):
            self.violation("no request was answered")
        return Result(
            list(self.requests),
            list(self.faults),
            list(self.violations),
            pid_kept,
            (self.fds_start, fds),
            orphans,
            time.monotonic() - self._started,
            len(self.engine_pids),
            stray,
            available,
            resumed,
        )

    def _count_survivors(self) -> None:
        """Each fault's requests in flight at its injection that were answered whole, and the longest
        silence inside them (the wait for a formation to serve again, issue 42)."""
        for fault in self.faults:
            survivors = [
                r for r in self.requests if r.outcome == "answered" and r.sent <= fault.injected <= r.ended
            ]
            fault.survived = len(survivors)
            fault.pause = max((r.pause for r in survivors), default=0.0)

    def _resumed(self) -> int:
        """serve's count of the requests that went on after their engine was lost."""
        request = urllib.request.Request(self.base + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(request, timeout=10) as answer:
            return sum(
                int(float(line.rsplit(" ", 1)[1]))
                for line in answer.read().decode().splitlines()
                if line.startswith("rpcfleet_requests_resumed_total{")
            )
        return 0

    def _availability(self) -> tuple[int, int]:
        """Answered and all among the requests clear of every fault's window; a violation below the
        rule."""
        windows = [(f.injected, f.healed + self.recovery_s) for f in self.faults]
        # Outside: its whole life (sent to ended) clear of every window, so one in flight at a fault is in.
        outside = [r for r in self.requests if not any(r.sent <= b and r.ended >= a for a, b in windows)]
        answered = sum(r.outcome == "answered" for r in outside)
        if outside and answered < self.availability * len(outside):
            self.violation(
                f"availability: {answered} of the {len(outside)} requests clear of the faults' windows "
                f"(each to {self.recovery_s:g} s after its heal) answered, under {self.availability:.0%}"
            )
        return answered, len(outside)

    def _check_failures(self) -> None:
        """Each failed request: a 503 naming the faulted node, in flight at that fault."""
        for request in self.requests:
            if request.outcome != "failed":
                continue
            cause = next(
                (
                    f
                    for f in self.faults
                    if f.endpoint is not None
                    and f.endpoint in request.message
                    and request.sent <= f.window_end
                    and request.ended >= f.injected
                ),
                None,
            )
            if cause is not None and request.status == 503:
                cause.failed += 1
            else:
                at = request.sent - self._started
                self.violation(
                    f"a request sent at {at:.1f} s failed outside a fault: {request.status} {request.message}"
                )

    def _orphans(self) -> list[str]:
        done = self.rpcfleet(*self.inventory_args(), "status", "--json", check=False)
        try:
            states = {r["host"]: r["result"]["state"] for r in json.loads(done.stdout)}
        except (ValueError, KeyError, TypeError):
            self.violation(
                f"`rpcfleet status --json` did not answer: {done.stdout[-500:]} {done.stderr[-1500:]}"
            )
            return []
        orphans = [host for host, state in states.items() if state == "orphan"]
        if orphans:
            self.violation(f"orphan servers at the end: {orphans}")
        wrong = {h: s for h, s in states.items() if s not in ("running", "busy")}
        if wrong:
            self.violation(f"servers not running at the end: {wrong}")
        return orphans

    def close(self) -> None:
        self._stop.set()
        if self.serve is not None and self.serve.poll() is None:
            self.serve.send_signal(signal.SIGINT)
            try:
                self.serve.wait(30)
            except subprocess.TimeoutExpired:
                self.serve.kill()
                self.serve.wait()
