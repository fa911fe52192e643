"""serve's engine: `llama-server`, built from the same llama.cpp source as the binding and the nodes'
servers, run on a plan's devices and listening on loopback only (serve's own front is the public side).

`Engine` is what the backend needs of an engine (start and load, the URL it answers on, its death, a stop),
so that the backend's state machine is tested with a fake one in milliseconds; `LlamaServer` is the real
one.

A node lost under llama-server: its native RPC client aborts the process (SIGABRT), as it does a worker.
A cut link could stall it for TCP's minutes, and llama-server sets no socket options of its own: serve
takes a duplicate of each of the engine's RPC connections (`pidfd_getfd`, Linux 5.6+; the child of this
process, so allowed) and sets keepalive and TCP_USER_TIMEOUT on it, as the worker does on its own. Data
unacknowledged for `link_timeout` then fails the engine's send or receive, llama-server aborts, and the
backend sees the process end. The same duplicates give each node's acknowledged bytes during the load
(the load's progress).

Engines are started by `engine.children.spawn_child` with `die_with_parent` (killed when serve dies);
their sockets are found, tuned and measured with `engine.children` too, as the worker's are.

Its port is picked free, then freed for llama-server to bind: another process may take it meanwhile.
So the server that answers `/health` must prove to be the engine before serve sends it a request or its
key: the port's listening socket is the engine process's own (`/proc`), and its `/props`, asked with its
key, names the model it was given. Else the engine is killed and the load fails, naming the port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from orchestrator.caches.manifest import engine_environment
from orchestrator.core.errors import RpcfleetError, tail
from orchestrator.core.log import get_logger
from orchestrator.core.target import Target, dial_addresses, targets_for
from orchestrator.engine.children import (
    child_log_path,
    connections_to,
    exit_description,
    peers_of,
    process_ended,
    socket_bytes_acked,
    spawn_child,
    tune_socket,
)
from orchestrator.llama.worker.load_progress import LoadProgress, ProgressTracker, planned_bytes
from orchestrator.planning.formats import llama_cli_args
from orchestrator.planning.plan import Plan
from orchestrator.rpc.client import probe_endpoints
from orchestrator.rpc.records import Outcome, ProbeResult, parse_endpoint
from orchestrator.serve.settings import DEFAULT_PARALLEL as DEFAULT_PARALLEL  # llama-server's slots
from orchestrator.serve.templates import ChatTemplate, model_chat_template
from orchestrator.serve.upstream import Upstream, UpstreamError

LOST_OUTCOMES = frozenset({Outcome.REFUSED, Outcome.TIMEOUT, Outcome.CLOSED})
KEY_ENV = "LLAMA_API_KEY"  # llama-server's --api-key, from its environment (owner-only in /proc)


class EngineError(RpcfleetError):
    """The engine could not start or load, or it died; `lost` names the endpoints that stopped answering."""

    def __init__(self, message: str, *, lost: tuple[str, ...] = (), **kw: Any) -> None:
        self.lost = lost
        super().__init__(message, **kw)


@dataclass(frozen=True)
class EngineOptions:
    binary: Path
    model_path: str
    model_name: str
    parallel: int = DEFAULT_PARALLEL
    template_args: tuple[str, ...] = ("--jinja",)
    link_timeout: float = 10.0
    probe_timeout: float = 2.0
    log_dir: Path | None = None
    extra_args: tuple[str, ...] = ()


class Engine(Protocol):
    """One engine process serving one plan (what the backend needs of it)."""

    @property
    def url(self) -> str: ...  # http://127.0.0.1:PORT

    @property
    def api_key(self) -> str | None:
        """The key the engine asks of every request but its /health (None: it asks none)."""
        ...

    @property
    def pid(self) -> int | None: ...

    @property
    def log_path(self) -> Path | None: ...

    async def load(
        self,
        limit: float,
        on_progress: Callable[[LoadProgress], None] | None,
        cache_hits: Mapping[str, int],
    ) -> float:
        """Start and wait until it serves (returns the seconds it took); EngineError naming lost nodes.
        Cancelled, it kills the process."""
        ...

    async def wait(self) -> str:
        """Until the process ends; how it ended ("signal SIGABRT", "exit status 1")."""
        ...

    async def diagnose(self) -> tuple[tuple[str, str], ...]:
        """(endpoint, probe outcome) of the plan's endpoints that no longer answer (bounded probes)."""
        ...

    async def kill(self) -> None: ...

    async def close(self) -> None:
        """Stop it (SIGTERM, then SIGKILL) and reap it. Idempotent."""
        ...

    def log_tail(self) -> str | None: ...


EngineFactory = Callable[[Plan, Mapping[str, Target]], Engine]


def engine_args(plan: Plan, targets: Mapping[str, Target], options: EngineOptions, port: int) -> list[str]:
    """llama-server's arguments for `plan` (its devices, split, layers, context, KV types: the arguments
    `plan --format llama-cli` prints, with the endpoints it dials), its slots and chat template, on
    127.0.0.1:`port`. The N slots split the plan's context (its KV cache, as planned): `c/N` each. Not
    `--kv-unified`: with `-fa off` a unified cache made every decode attend over the whole cache: on 3
    CPU nodes a second burst of 4 requests took 135 s instead of 8. Flash attention is the plan's (`-fa
    on` by default, llama-server's `auto` on these devices): with `-fa off` serve reached 0.31x of
    llama-server by hand at 8 clients (bench/serve.py)."""
    args = llama_cli_args(plan.with_endpoints(dial_addresses(targets.values())), options.model_path)
    args += ["-b", str(plan.options.n_batch)]  # the plan's own --parallel (its sequences) is in there
    args += ["--host", "127.0.0.1", "--port", str(port)]
    args += ["--alias", options.model_name, "--metrics", "--slots", "--no-webui"]
    args += [*options.template_args, *options.extra_args]
    return args


def lost_message(lost: tuple[tuple[str, str], ...], doing: str, how: str) -> str:
    """`lost HOST:PORT (refused) while generating: llama-server ended (signal SIGABRT)`, or without a
    lost node `llama-server ended (...) while ...; every node still answers`."""
    if lost:
        names = ", ".join(f"{ep} ({outcome})" for ep, outcome in lost)
        return f"lost {names} while {doing}: llama-server ended ({how})"
    return f"llama-server ended ({how}) while {doing}; every node still answers"


def listening_inodes(table: str, port: int) -> set[int]:
    """Pure: the inodes of the sockets listening on `port` in a `/proc/net/tcp` or `tcp6` table."""
    inodes = set()
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:
            inodes.add(int(fields[9]))  # state 0A: LISTEN
    return inodes


def port_held_by(port: int, pid: int) -> bool | None:
    """Whether every socket listening on loopback's `port` is process `pid`'s (None: cannot tell, /proc
    unreadable, or nothing listens)."""
    inodes: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            inodes |= listening_inodes(Path(table).read_text(), port)
    if not inodes:
        return None
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return None
    held = set()
    for fd in fds:
        with contextlib.suppress(OSError):  # closed since the listing
            link = str(fd.readlink())
            if link.startswith("socket:["):
                held.add(int(link[8:-1]))
    return inodes <= held


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_env(api_key: str) -> dict[str, str]:
    """llama-server's environment: ours, with its API key, no backtrace (no debugger attached on an
    abort), and the folder of the hash manifests its RPC client takes weight hashes from unless ours
    names one (caches.manifest)."""
    return {**engine_environment(), **os.environ, "GGML_NO_BACKTRACE": "1", KEY_ENV: api_key}


class LlamaServer:
    """llama-server on `plan`, dialing its endpoints' `targets` (SSH forwards), on a free loopback port."""

    SAMPLE_INTERVAL = 0.25  # seconds between two looks at the engine during its load (and its sockets)

    def __init__(
        self, plan: Plan, targets: Mapping[str, Target], options: EngineOptions, http: Upstream
    ) -> None:
        self.plan = plan
        self.http = http
        self.targets = {t.endpoint: t for t in targets_for(plan.endpoints, targets)}
        self.options = options
        self.port = _free_port()
        # Its own key, never on argv (`ps`): any local user can reach a loopback port, and llama-server's
        # routes (completions, /slots with the prompts, /props with the model path) would bypass serve's.
        self._api_key = secrets.token_urlsafe(32)
        self._log_path = (
            options.log_dir / f"engine-{int(time.time() * 1000)}.log"
            if options.log_dir
            else child_log_path("engine", unique=True)
        )
        self._process: subprocess.Popen[bytes] | None = None
        dialed = {ep: parse_endpoint(t.dial) for ep, t in self.targets.items()}  # a forward: its address
        self._peers = peers_of({ep: (address.host, address.port) for ep, address in dialed.items()})
        self._tuned: set[tuple[str, int, int]] = set()  # (address, port, local port) already tuned
        self._closing = False
        self._tuner: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_key(self) -> str:
        return self._api_key

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    @property
    def argv(self) -> list[str]:
        return [str(self.options.binary), *engine_args(self.plan, self.targets, self.options, self.port)]

    async def load(
        self,
        limit: float,
        on_progress: Callable[[LoadProgress], None] | None = None,
        cache_hits: Mapping[str, int] | None = None,
    ) -> float:
        started = time.monotonic()
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        get_logger().info("engine_start", argv=self.argv, log=str(self._log_path))
        process = self._process = spawn_child(
            self.argv,
            env=engine_env(self._api_key),
            log_path=self._log_path,
            stdin=subprocess.DEVNULL,
            die_with_parent=True,
        )
        tracker = ProgressTracker(planned_bytes(self.plan), dict(cache_hits or {}))
        to_send = sum(max(0, n - (cache_hits or {}).get(ep, 0)) for ep, n in planned_bytes(self.plan).items())
        try:
            while True:
                if process.poll() is not None:
                    raise await self._died("loading the model")
                if await self._ready():
                    await self._check_identity(process)
                    break
                if time.monotonic() - started > limit:
                    await self.kill()
                    raise EngineError(
                        f"llama-server did not serve within {limit:g} s (killed)", stderr=self.log_tail()
                    )
                sent = self.tune_and_count()  # a fresh process: every byte on its connections is this load's
                if on_progress is not None:
                    fraction = min(0.99, sum(sent.values()) / to_send) if to_send else 0.0
                    on_progress(tracker.update(fraction, time.monotonic() - started, sent))
                await asyncio.sleep(self.SAMPLE_INTERVAL)
        except asyncio.CancelledError:  # serve ends during the load: the process goes with it
            self._closing = True
            if process.poll() is None:
                process.kill()
            raise
        sent = self.tune_and_count()
        if on_progress is not None:  # the last sample: every byte of the load, 100%
            on_progress(tracker.update(1.0, time.monotonic() - started, sent))
        self._tuner = asyncio.create_task(self._keep_tuning(), name="engine-tuner")
        seconds = time.monotonic() - started
        get_logger().info("engine_ready", pid=self.pid, url=self.url, seconds=round(seconds, 3))
        return seconds

    async def _check_identity(self, process: subprocess.Popen[bytes]) -> None:
        """The server that answered /health is this engine (see the module's docstring), else it is killed
        and EngineError names the port."""
        where = f"127.0.0.1:{self.port}"
        if port_held_by(self.port, process.pid) is False:  # the key goes to no other process
            await self.kill()
            raise EngineError(
                f"{where} is another process's, not llama-server's (pid {process.pid}): it took the port "
                "picked for the engine before llama-server bound it; start again to pick another"
            )
        try:
            status, body = await self.http.get(self.url, "/props", 5.0, self._api_key)
            props = json.loads(body) if status == 200 else None
        except (UpstreamError, ValueError):
            status, props = 0, None
        model = str(self.options.model_path or self.plan.model_path)  # its -m (llama_cli_args)
        if not isinstance(props, dict) or props.get("model_path") != model:
            await self.kill()
            said = (
                f"/props answered {status}"
                if not isinstance(props, dict)
                else "its /props names another model"
            )
            raise EngineError(
                f"{where} is not the llama-server serve started (pid {process.pid}): {said} with its key",
                stderr=self.log_tail(),
            )

    async def _ready(self) -> bool:
        try:
            return (await self.http.get(self.url, "/health", 2.0, None))[0] == 200
        except UpstreamError:
            return False

    def tune_and_count(self) -> dict[str, int]:
        """Tune the engine's new RPC connections (keepalive, user timeout) and return, per plan endpoint,
        the bytes its server acknowledged on them."""
        sent = dict.fromkeys(self.targets, 0)
        if self._process is None or not self._peers:
            return sent
        for peer, sock in connections_to(set(self._peers), self._process.pid):
            with contextlib.suppress(OSError):
                key = (*peer, int(sock.getsockname()[1]))
                if key not in self._tuned:
                    tune_socket(sock, self.options.link_timeout)
                    self._tuned.add(key)
                sent[self._peers[peer]] += socket_bytes_acked(sock)
        return sent

    async def _keep_tuning(self) -> None:
        """While it serves: tune connections it opens later (ggml-rpc may reconnect)."""
        process = self._process
        while process is not None and process.poll() is None and not self._closing:
            await asyncio.sleep(1.0)
            with contextlib.suppress(Exception):
                self.tune_and_count()

    async def _died(self, doing: str) -> EngineError:
        assert self._process is not None
        how = exit_description(await process_ended(self._process))
        lost = await self.diagnose()
        return EngineError(
            lost_message(lost, doing, how), stderr=self.log_tail(), lost=tuple(ep for ep, _ in lost)
        )

    async def wait(self) -> str:
        assert self._process is not None
        return exit_description(await process_ended(self._process))

    async def probes(self) -> list[ProbeResult]:
        t = self.options.probe_timeout
        if not self.targets:
            return []
        return await probe_endpoints(self.targets.values(), connect_timeout=t, read_timeout=t, deadline=t + 1)

    async def diagnose(self) -> tuple[tuple[str, str], ...]:
        """(endpoint, outcome) of every plan endpoint that no longer answers."""
        return tuple((r.endpoint, str(r.outcome)) for r in await self.probes() if r.outcome in LOST_OUTCOMES)

    async def kill(self) -> None:
        self._closing = True
        process = self._process
        if process is not None:
            if process.poll() is None:
                process.kill()
            await process_ended(process)

    async def close(self) -> None:
        self._closing = True
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        if await process_ended(process, 5.0) is None:
            process.kill()
            await process_ended(process)

    def log_tail(self) -> str | None:
        try:
            with self._log_path.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return None
        telling = [
            line
            for line in text.splitlines()
            if any(w in line.lower() for w in ("error", "fail", "abort", "rpc", "exception"))
        ]
        return tail("\n".join(telling), 4) or tail(text, 4) or None


def llama_server_factory(options: EngineOptions, http: Upstream) -> EngineFactory:
    def make(plan: Plan, targets: Mapping[str, Target]) -> Engine:
        return LlamaServer(plan, targets, options, http)

    return make


def default_engines(
    model_path: str,
    model_name: str,
    http: Upstream,
    *,
    parallel: int = DEFAULT_PARALLEL,
    link_timeout: float = 10.0,
    chat_template: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[EngineFactory, ChatTemplate]:
    """llama-server engines for a model (built on first use from the binding's source; setup builds it),
    with the model's chat template (see `templates`); `http`: serve's one client to its engines."""
    from orchestrator.artifacts.build import llama_server_binary

    template = model_chat_template(model_path, chat_template)
    options = EngineOptions(
        binary=llama_server_binary(progress=progress),
        model_path=model_path,
        model_name=model_name,
        parallel=parallel,
        template_args=template.args,
        link_timeout=link_timeout,
    )
    return llama_server_factory(options, http), template
