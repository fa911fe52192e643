"""The entry points the exported pods run (`rpcfleet lws worker|plan|serve|hello`).

- `run_worker`: the pod's rpc-server on every address, the pod's CPUs as its threads, SIGPIPE ignored
  (a client that resets its connection must not kill it: docs/llama-rpc.md).
- `plan_step` (the leader's init container): the group's servers from the LWS variables (`lws_env`),
  waited for and probed over RPC (`rpc.client.probe_endpoint`), their devices compared with the plan's
  assumption and planned again when they differ (the one planner, the one fit policy), and
  llama-server's arguments written for `serve_step`.
- `serve_step` (the leader's container): llama-server with those arguments, until it ends.
- `hello`: one HELLO, the startup probe: a server that answers, or is busy with its one client, is up.
- `rpc_server_alive`: the readiness and liveness probes' check: the rpc-server's process, from the pid
  file `run_worker` writes (it never connects: see the function).

The programs come from the image: `RPCFLEET_RPC_SERVER` and `RPCFLEET_LLAMA_SERVER` (deploy/Containerfile
sets them), else the image's paths. Children start through `engine.children`, as every child does.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.core.errors import InputError, PlanError, ProbeError, RpcfleetError
from orchestrator.core.files import write_atomic
from orchestrator.core.poll import poll_async
from orchestrator.engine.children import spawn_child
from orchestrator.kube.group import GroupSettings, differences, measured_devices, pod_index
from orchestrator.kube.lws_env import group_addresses, read_lws_env
from orchestrator.planning.formats import llama_cli_args
from orchestrator.planning.plan import Plan
from orchestrator.planning.profile import profile_model
from orchestrator.planning.strategy import make_plan
from orchestrator.rpc.client import probe_endpoint
from orchestrator.rpc.records import Outcome, ProbeResult
from orchestrator.serve.templates import model_chat_template
from orchestrator.workflows.fit import SERVE_WORDS, misfit_error

Say = Callable[[str], None]

RPC_SERVER_ENV = "RPCFLEET_RPC_SERVER"
LLAMA_SERVER_ENV = "RPCFLEET_LLAMA_SERVER"
IMAGE_RPC_SERVER = "/opt/rpcfleet/rpc-server/bin/ggml-rpc-server"
IMAGE_LLAMA_SERVER = "/opt/rpcfleet/engine/llama-server"
RETRY_SECONDS = 1.0
ALIVE = frozenset({Outcome.OK, Outcome.BUSY})


def program(env: Mapping[str, str], variable: str, default: str) -> Path:
    """The program `variable` names (else the image's `default`); InputError when it is not there."""
    path = Path(env.get(variable) or default)
    if not path.is_file():
        raise InputError(f"{path} does not exist (set {variable} to the program's path)")
    return path


def supervise(process: subprocess.Popen[bytes], grace: float = 30.0) -> int:
    """Wait for `process`; on an interrupt (SIGTERM from the kubelet, Ctrl-C) stop it first."""
    try:
        return process.wait()
    except KeyboardInterrupt:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        raise


def run_worker(
    port: int, env: Mapping[str, str], say: Say, pid_file: Path | None = None, threads: int | None = None
) -> int:
    """The pod's rpc-server on 0.0.0.0:`port` with `threads` threads (None: one per CPU the pod may run
    on), until it ends (its exit status); its process id and program in `pid_file` while it runs (what
    `rpc_server_alive` checks)."""
    binary = program(env, RPC_SERVER_ENV, IMAGE_RPC_SERVER)
    # a CPU limit is a quota, not an affinity: the manifests name the threads it pays for
    threads = threads or len(os.sched_getaffinity(0))
    argv = [str(binary), "-H", "0.0.0.0", "-p", str(port), "-t", str(threads)]
    say(f"rpc-server on 0.0.0.0:{port}, {threads} thread(s): {binary}")
    # bash only to ignore SIGPIPE before the exec (Popen gives children the default disposition); the
    # exec keeps the process id, so the pid file names rpc-server itself
    process = spawn_child(["bash", "-c", "trap '' PIPE; exec \"$@\"", "rpc-server", *argv], env=dict(env))
    try:
        if pid_file is not None:
            record = {"pid": process.pid, "program": str(binary)}
            try:
                write_atomic(pid_file, json.dumps(record) + "\n", parents=True)
            except RpcfleetError as exc:
                process.terminate()
                process.wait()
                raise InputError(exc.message) from None
        return supervise(process)
    finally:
        if pid_file is not None:
            pid_file.unlink(missing_ok=True)


# /proc/PID/stat's states of a process that does not serve: dead, a zombie, stopped (SIGSTOP, a tracer)
_NOT_SERVING = {"X": "dead", "x": "dead", "Z": "a zombie", "T": "stopped", "t": "stopped by a tracer"}


def rpc_server_alive(pid_file: Path) -> tuple[bool, str]:
    """Whether the rpc-server `run_worker` recorded in `pid_file` runs, and why not: the process exists,
    is that program (a process id reused after a restart is not) and is not stopped or a zombie.

    The probes' check once the server has started. It never connects: rpc-server serves one client and
    listens with a backlog of 1, so while llama-server holds it a HELLO is answered "busy" and then the
    next ones wait in the accept queue until they time out (a probe that fails on a healthy server)."""
    try:
        record = json.loads(pid_file.read_text(encoding="utf-8"))
        pid, binary = int(record["pid"]), str(record["program"])
    except FileNotFoundError:
        return False, f"{pid_file} does not exist: no rpc-server was started here (`rpcfleet lws worker`)"
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        return False, f"{pid_file}: not a pid file of `rpcfleet lws worker` ({exc})"
    proc = Path("/proc") / str(pid)
    try:
        stat = (proc / "stat").read_text(encoding="utf-8", errors="replace")
        argv0 = (proc / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return False, f"rpc-server (pid {pid}) is not running"
    state = stat.rpartition(")")[2].split()[0] if ")" in stat else "?"
    if state in _NOT_SERVING:
        return False, f"rpc-server (pid {pid}) is {_NOT_SERVING[state]}"
    if argv0 != binary:
        return False, f"pid {pid} is {argv0 or 'no program'}, not the rpc-server {binary}"
    return True, f"rpc-server (pid {pid}) is running (state {state})"


async def hello(host: str, port: int, limit: float = 5.0) -> ProbeResult:
    """One HELLO to `host:port` (the startup probe's check), in at most `limit` seconds."""
    return await probe_endpoint(
        f"{host}:{port}", connect_timeout=limit, read_timeout=limit, deadline=limit, hello_only=True
    )


@dataclass(frozen=True)
class LeaderArgs:
    """What the init step decided: llama-server's arguments, the plan they load, and why it was planned
    again (empty: the exported plan was kept)."""

    args: tuple[str, ...]
    plan: Plan
    endpoints: tuple[str, ...]
    replanned: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "args": list(self.args),
            "endpoints": list(self.endpoints),
            "replanned": list(self.replanned),
            "plan": self.plan.to_json(),
        }


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None


async def _resolve(host: str, port: int) -> str:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    address = str(infos[0][4][0])
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


async def wait_for_group(hosts: Sequence[str], port: int, seconds: float, say: Say) -> list[ProbeResult]:
    """Each host's server probed once it resolves and answers (in the hosts' order); ProbeError naming
    the pods still silent after `seconds`, RpcfleetError at once for a server of another protocol."""
    last: dict[int, str] = {}

    async def one(pod: int, host: str) -> ProbeResult:
        async def answered() -> ProbeResult | None:
            try:
                endpoint = await _resolve(host, port)
            except OSError as exc:
                last[pod] = f"{host} does not resolve ({exc})"
                return None
            result = await probe_endpoint(endpoint)
            if result.ok:
                say(f"pod {pod}: {host} -> {endpoint}: {result.message}")
                return result
            if result.outcome is Outcome.VERSION_MISMATCH:
                raise RpcfleetError(f"pod {pod} ({host}, {endpoint}): {result.message}", host=endpoint)
            last[pod] = f"{endpoint}: {result.outcome} ({result.message})"
            return None

        result = await poll_async(answered, limit=seconds, interval=RETRY_SECONDS)
        if result is None:
            raise ProbeError(f"pod {pod} did not answer within {seconds:g} s: {last[pod]}", host=host)
        return result

    return list(await asyncio.gather(*(one(pod, host) for pod, host in enumerate(hosts))))


def leader_args(plan: Plan, settings: GroupSettings, model: Path, say: Say) -> list[str]:
    """llama-server's arguments for `plan` on `model` (what `plan --format llama-cli` prints), its slots,
    on every address at the settings' port, with the model's chat template (its warning said), without
    the /slots endpoint (it shows every slot's prompt to whoever asks)."""
    template = model_chat_template(model, settings.chat_template)
    if template.warning:
        say(f"warning: {template.warning}")
    args = llama_cli_args(plan, model)
    args += ["-b", str(plan.options.n_batch), "--host", "0.0.0.0", "--port", str(settings.http_port)]
    args += ["--alias", settings.name, "--metrics", "--no-slots", "--no-webui", *template.args]
    return args


def plan_step(
    config: Path, models: Path, env: Mapping[str, str], say: Say, *, seconds: float | None = None
) -> LeaderArgs:
    """The leader's init step (see the module); `config` holds the ConfigMap's files, `models` the models
    volume."""
    from orchestrator.engine.runtime import run_once

    settings = GroupSettings.from_text(_read(config / "settings.json"), str(config / "settings.json"))
    exported = Plan.from_path(config / "plan.json")
    lws = read_lws_env(env)
    if not lws.is_leader:
        raise InputError(f"LWS_WORKER_INDEX={lws.worker_index}: the plan step runs in the leader (index 0)")
    if lws.group_size != settings.group_size:
        raise InputError(
            f"LWS_GROUP_SIZE={lws.group_size}, but {config / 'settings.json'} plans a group of "
            f"{settings.group_size}: apply the ConfigMap and the LeaderWorkerSet of one export"
        )
    model = models / settings.model
    if not model.is_file():
        raise InputError(f"model {model} does not exist in this pod (the models volume)")
    hosts = group_addresses(lws)
    say(f"waiting for {len(hosts)} rpc-server(s): {', '.join(hosts)} (port {settings.rpc_port})")
    results = run_once(wait_for_group(hosts, settings.rpc_port, seconds or settings.wait_seconds, say))
    endpoints = tuple(r.endpoint for r in results)
    devices = measured_devices(results, settings)
    changed = differences(devices, settings)
    if changed:
        say("the pods differ from the plan's assumption: " + "; ".join(changed))
        plan = make_plan(devices, profile_model(model), exported.options)
        misfit = misfit_error(plan, SERVE_WORDS)
        if misfit is not None:
            message = f"planned again on the pods: {misfit.message}"
            raise PlanError(message, host=misfit.host, hint=misfit.hint)
        say("planned again: layers " + ", ".join(f"{d.label} {d.layers_label}" for d in plan.devices))
    else:
        pods = {ep: pod_index(ep) for ep in exported.endpoints}
        plan = exported.with_endpoints(
            {ep: endpoints[i] for ep, i in pods.items() if i is not None and i < len(endpoints)}
        )
        say("the pods are as the plan assumed: the exported plan is kept")
    return LeaderArgs(tuple(leader_args(plan, settings, model, say)), plan, endpoints, tuple(changed))


def write_leader_args(path: Path, leader: LeaderArgs) -> None:
    try:
        write_atomic(path, json.dumps(leader.to_json(), indent=2) + "\n", parents=True)
    except RpcfleetError as exc:
        raise InputError(exc.message) from None


def read_leader_args(path: Path) -> list[str]:
    """The arguments `plan_step` wrote to `path`; InputError naming the file when they are not there."""
    text = _read(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not JSON: {exc.msg} at line {exc.lineno}") from None
    args = data.get("args") if isinstance(data, dict) else None
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise InputError(f"{path}: no list of arguments under 'args' (did the init step `lws plan` run?)")
    return args


def serve_step(args_file: Path, env: Mapping[str, str], say: Say, api_key_file: Path | None = None) -> int:
    """llama-server with the init step's arguments, and its keys from `api_key_file` (the Secret's,
    mounted in this container only), until it ends (its exit status)."""
    args = read_leader_args(args_file)
    if api_key_file is not None:
        if not api_key_file.is_file():
            raise InputError(f"{api_key_file} does not exist: the Secret holds no key 'api-key'")
        args += ["--api-key-file", str(api_key_file)]
    binary = program(env, LLAMA_SERVER_ENV, IMAGE_LLAMA_SERVER)
    say(f"llama-server: {binary} {' '.join(args)}")
    return supervise(spawn_child([str(binary), *args], env=dict(env), die_with_parent=True))
