"""The pods' entry points without a lab: the LWS variables and the workers' names they imply, the
decision to plan again, and the leader's init step against a real rpc-server on loopback (a group of
one: the leader's own server, which a pod reaches at 127.0.0.1)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from orchestrator.core.errors import InputError
from orchestrator.kube.export import ExportRequest, export_lws
from orchestrator.kube.group import GroupSettings, differences, measured_devices
from orchestrator.kube.lws_env import group_addresses, read_lws_env, worker_address
from orchestrator.kube.pods import plan_step, read_leader_args, rpc_server_alive
from orchestrator.rpc.records import DeviceMemory, Outcome, ProbeResult
from orchestrator.workflows.options import plan_options
from tests.plugins.servers import LocalServer, free_port

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30
LWS = {"LWS_LEADER_ADDRESS": "gemma-2.gemma.llm", "LWS_GROUP_SIZE": "3", "LWS_WORKER_INDEX": "0"}


def test_the_workers_are_named_as_the_lws_headless_service_names_them() -> None:
    lws = read_lws_env(LWS)
    assert lws.is_leader and lws.group_size == 3
    assert group_addresses(lws) == ["127.0.0.1", "gemma-2-1.gemma.llm", "gemma-2-2.gemma.llm"]
    assert worker_address("solo-0", 4) == "solo-0-4"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"LWS_LEADER_ADDRESS": ""}, "LWS_LEADER_ADDRESS is not set"),
        ({"LWS_GROUP_SIZE": "three"}, "LWS_GROUP_SIZE='three' is not a whole number"),
        ({"LWS_WORKER_INDEX": "3"}, "LWS_WORKER_INDEX=3 is not below LWS_GROUP_SIZE=3"),
        ({"LWS_LEADER_ADDRESS": "10.0.0.1:80"}, "is not a DNS name"),
    ],
)
def test_a_bad_lws_variable_is_named(change: dict[str, str], says: str) -> None:
    with pytest.raises(InputError, match=says.replace("(", r"\(")):
        read_lws_env({**LWS, **change})


def _result(endpoint: str, *free: int) -> ProbeResult:
    devices = tuple(DeviceMemory(i, f, f) for i, f in enumerate(free))
    return ProbeResult(endpoint, Outcome.OK, None, devices, "ok", 0.0)


def test_a_cpu_pod_is_capped_at_its_limit_and_a_gpu_pod_differs_by_its_own_figure() -> None:
    cpu = GroupSettings("m", 2, "cpu", 8 * GiB, "m.gguf")
    devices = measured_devices([_result("a:1", 64 * GiB), _result("b:1", 64 * GiB)], cpu)
    assert [d.usable for d in devices] == [8 * GiB, 8 * GiB]  # the node's RAM, within the pod's limit
    assert differences(devices, cpu) == []
    small = measured_devices([_result("a:1", 64 * GiB), _result("b:1", 6 * GiB)], cpu)
    assert differences(small, cpu) == ["b:1#0 may use 6.00 GiB, the plan assumed 8.00 GiB"]
    gpu = dataclasses.replace(cpu, backend="cuda", node_memory=24 * GiB)
    found = measured_devices([_result("a:1", 22 * GiB), _result("b:1", 24 * GiB, 24 * GiB)], gpu)
    assert differences(found, gpu) == [
        "a:1#0 may use 22.00 GiB, the plan assumed 24.00 GiB",
        "b:1 reports 2 devices, the plan assumed 1",
    ]
    assert differences(found[:1], gpu)[0] == "1 server(s) answer, the plan assumed 2"


def test_a_settings_file_that_is_wrong_is_named() -> None:
    with pytest.raises(InputError, match=r"cfg/settings.json: invalid group_size=0"):
        GroupSettings.from_text(
            json.dumps(GroupSettings("m", 0, "cpu", GiB, "m.gguf").to_json()), "cfg/settings.json"
        )
    with pytest.raises(InputError, match=r"s.json: not JSON"):
        GroupSettings.from_text("{", "s.json")
    with pytest.raises(InputError, match=r"invalid model='../m.gguf'"):
        GroupSettings.from_text(json.dumps(GroupSettings("m", 1, "cpu", GiB, "../m.gguf").to_json()), "s")


def _config(model: Path, tmp_path: Path, node_memory: int, port: int) -> Path:
    """The ConfigMap's files of an export of `model` for one pod, its server on `port`."""
    result = export_lws(
        ExportRequest(
            model,
            plan_options({"ctx": 512, "parallel": 3}),
            node_memory,
            tmp_path / "k8s",
            image="i",
            name="m",
        )
    )
    import yaml

    data = yaml.safe_load((tmp_path / "k8s" / "configmap.yaml").read_text())["data"]
    config = tmp_path / "config"
    config.mkdir()
    (config / "plan.json").write_text(data["plan.json"])
    settings = dataclasses.replace(result.spec.settings, rpc_port=port, wait_seconds=10)
    (config / "settings.json").write_text(settings.to_text())
    return config


@pytest.mark.llama
@pytest.mark.parametrize(("memory", "replanned"), [(GiB, False), (1 << 50, True)])
def test_the_init_step_probes_the_group_and_plans_again_only_when_it_differs(
    tiny_model: Path,
    tmp_path: Path,
    start_rpc_server: Callable[..., LocalServer],
    memory: int,
    replanned: bool,
) -> None:
    """A CPU server reports the machine's RAM: a 1 GiB pod (less than the RAM) is as the plan assumed and
    the exported plan is kept; a 1 PiB one is not there, so the init step plans on what is."""
    server = start_rpc_server()
    config = _config(tiny_model, tmp_path, memory, server.port)
    said: list[str] = []
    env = {"LWS_LEADER_ADDRESS": "m-0.m.default", "LWS_GROUP_SIZE": "1", "LWS_WORKER_INDEX": "0"}
    leader = plan_step(config, tiny_model.parent, env, said.append)
    assert bool(leader.replanned) is replanned, said
    assert leader.endpoints == (f"127.0.0.1:{server.port}",)
    args = list(leader.args)
    assert args[args.index("--rpc") + 1] == f"127.0.0.1:{server.port}"
    assert args[args.index("-m") + 1] == str(tiny_model)
    assert args[args.index("--host") + 1] == "0.0.0.0" and args[args.index("--port") + 1] == "8080"
    assert args[args.index("--parallel") + 1] == "3"  # the export's slots
    assert "--no-slots" in args  # /slots would show every slot's prompt to whoever asks
    assert ("planned again" in " ".join(said)) is replanned, said


def test_the_init_step_refuses_a_group_of_another_size_and_a_silent_server(
    tiny_model: Path, tmp_path: Path
) -> None:
    config = _config(tiny_model, tmp_path, GiB, 9)  # nothing listens on port 9
    env = {"LWS_LEADER_ADDRESS": "m-0.m.default", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0"}
    with pytest.raises(InputError, match=r"LWS_GROUP_SIZE=2, but .*settings.json plans a group of 1"):
        plan_step(config, tiny_model.parent, env, print)
    argv = [sys.executable, "-m", "orchestrator", "lws", "plan", "--config", str(config)]
    argv += ["--models", str(tiny_model.parent), "--out", str(tmp_path / "args.json"), "--wait", "2"]
    done = subprocess.run(
        argv,
        env={**os.environ, **env, "LWS_GROUP_SIZE": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "pod 0 did not answer within 2 s" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    with pytest.raises(InputError, match=r"args\.json: no list of arguments"):
        (tmp_path / "args.json").write_text("{}")
        read_leader_args(tmp_path / "args.json")


def test_a_program_the_image_lacks_is_named(tmp_path: Path) -> None:
    from orchestrator.kube.pods import run_worker

    with pytest.raises(InputError, match=r"nosuch does not exist \(set RPCFLEET_RPC_SERVER"):
        run_worker(50052, {"RPCFLEET_RPC_SERVER": str(tmp_path / "nosuch")}, print)


def test_the_leader_address_must_be_a_name_not_an_ip_address() -> None:
    """Workers are named from the leader's first label: `10.0.0.1` would give `10-1.0.0.1`, found only when
    the init step's wait runs out; it is refused at once."""
    with pytest.raises(InputError, match=r"LWS_LEADER_ADDRESS='10.0.0.1' is an address, not the leader's"):
        read_lws_env({**LWS, "LWS_LEADER_ADDRESS": "10.0.0.1"})
    assert read_lws_env({**LWS, "LWS_LEADER_ADDRESS": "m1-0.m1.llm"}).leader_address == "m1-0.m1.llm"


def test_a_settings_files_chat_template_must_be_a_name() -> None:
    data = GroupSettings("m", 1, "cpu", GiB, "m.gguf").to_json()
    with pytest.raises(InputError, match=r"s.json: invalid chat_template=\['chatml'\]"):
        GroupSettings.from_text(json.dumps({**data, "chat_template": ["chatml"]}), "s.json")
    assert (
        GroupSettings.from_text(json.dumps({**data, "chat_template": "chatml"}), "s").chat_template
        == "chatml"
    )


def lws_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "lws", *argv],
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.llama
def test_the_probes_check_follows_the_rpc_server_process_and_never_connects(
    rpc_server_binary: Path, tmp_path: Path
) -> None:
    """`lws alive` (the readiness and liveness probes) passes while a client holds the server, as
    llama-server does (a HELLO then waits in the accept queue), and fails once the server is stopped or
    gone, or the pid file names another program."""
    pid_file = tmp_path / "run" / "rpc-server.pid"
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "orchestrator",
        "lws",
        "worker",
        "--port",
        str(port),
        "--pid-file",
        str(pid_file),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RPCFLEET_RPC_SERVER": str(rpc_server_binary)}
    worker = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not rpc_server_alive(pid_file)[0] and time.monotonic() < deadline:
            assert worker.poll() is None, worker.stderr.read() if worker.stderr else ""
            time.sleep(0.1)
        pid = json.loads(pid_file.read_text())["pid"]
        while True:  # its pid file comes before it listens: on a busy machine, a connect was refused
            try:
                holder = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "the server never listened"
                time.sleep(0.05)
        with holder:
            time.sleep(0.3)  # accepted: the server now serves this client only
            for _ in range(3):
                alive, why = rpc_server_alive(pid_file)
                assert alive and why.startswith(f"rpc-server (pid {pid}) is running"), why
            done = lws_cli("alive", "--pid-file", str(pid_file))
            assert done.returncode == 0, done.stderr
        os.kill(pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 10  # the signal stops it once it is scheduled
            while rpc_server_alive(pid_file)[0] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert rpc_server_alive(pid_file) == (False, f"rpc-server (pid {pid}) is stopped")
        finally:
            os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
        worker.wait(30)
        assert not pid_file.exists()  # the worker removes it when its server ends
        done = lws_cli("alive", "--pid-file", str(pid_file))
        assert done.returncode == 1 and "does not exist: no rpc-server was started here" in done.stderr
        assert "Traceback" not in done.stderr
        pid_file.write_text(json.dumps({"pid": os.getpid(), "program": str(rpc_server_binary)}))
        alive, why = rpc_server_alive(pid_file)
        assert not alive and why.endswith(f"not the rpc-server {rpc_server_binary}"), why
    finally:
        if worker.poll() is None:
            worker.terminate()
            worker.wait(30)


def contained(argv: list[str], writable: list[Path], read_only: list[Path]) -> list[str]:
    """`argv` as the manifests' securityContext runs a container: in a mount namespace of its own whose
    root filesystem is read-only (readOnlyRootFilesystem) except the volumes' folders, writable or
    read-only as mounted, with no capability (drop ALL) and no new privileges (allowPrivilegeEscalation:
    false). Stricter than the pod in one way: /tmp stays read-only (the pods mount an emptyDir there), so
    a program that wrote there would fail here. Not emulated: the user 65532 (this checkout, its venv and
    the cached builds are root's, under /root); a root without capabilities still meets the files' modes."""
    script = ["set -e"]
    for folder in writable:
        script.append(f"mount --bind {shlex.quote(str(folder))} {shlex.quote(str(folder))}")
    for folder in read_only:
        quoted = shlex.quote(str(folder))
        script += [f"mount --bind {quoted} {quoted}", f"mount -o remount,bind,ro {quoted}"]
    script += [
        "mount -o remount,bind,ro /",
        'exec setpriv --no-new-privs --inh-caps=-all --ambient-caps=-all --bounding-set=-all -- "$@"',
    ]
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        "\n".join(script),
        "sh",
        *argv,
    ]


def _http(url: str, key: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


@pytest.mark.llama
@pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root")
def test_the_leaders_containers_run_with_a_read_only_root_no_capabilities_and_the_secrets_key(
    tiny_model: Path, tmp_path: Path, rpc_server_binary: Path
) -> None:
    """The exported leader of a group of one pod, each container run from the manifests (command, env,
    volumes, read-only as mounted) under its securityContext (`contained`): the rpc-server sidecar, the
    init step, then llama-server with the key of its Secret. Everything they write goes to the `run`
    volume; llama-server serves /health without a key and the API only with it, and no /slots."""
    from orchestrator.artifacts.build import cached_tools

    tools = cached_tools()
    assert tools is not None, "llama-server is not built: run `make setup`"
    out = tmp_path / "k8s"
    result = export_lws(
        ExportRequest(
            tiny_model,
            plan_options({"ctx": 512, "parallel": 2}),
            GiB,
            out,
            image="i",
            name="m",
            api_key_secret="m-keys",
        )
    )
    import yaml

    (lws,) = yaml.safe_load_all((out / "leaderworkerset.yaml").read_text())
    spec = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]  # a group of one: the leader
    sidecar, init = spec["initContainers"]
    (engine,) = spec["containers"]
    rpc_port, http_port = free_port(), free_port()
    volumes = {name: tmp_path / name for name in ("config", "run", "tmp", "api-key")}
    for folder in volumes.values():
        folder.mkdir()
    volumes["models"] = tiny_model.parent
    (config_map,) = yaml.safe_load_all((out / "configmap.yaml").read_text())
    (volumes["config"] / "plan.json").write_text(config_map["data"]["plan.json"])
    settings = dataclasses.replace(
        result.spec.settings, rpc_port=rpc_port, http_port=http_port, wait_seconds=30
    )
    (volumes["config"] / "settings.json").write_text(settings.to_text())
    (volumes["api-key"] / "api-key").write_text("# llama-server's keys\nsecret-key\n")
    names = {v["name"] for v in spec["volumes"]}
    assert names == set(volumes), names

    def paths(container: dict[str, Any]) -> dict[str, tuple[Path, bool]]:
        return {
            m["mountPath"]: (volumes[m["name"]], bool(m.get("readOnly"))) for m in container["volumeMounts"]
        }

    def local(word: str, mounts: dict[str, tuple[Path, bool]]) -> str:
        for mount, (folder, _) in mounts.items():
            if word == mount or word.startswith(mount + "/"):
                return str(folder) + word[len(mount) :]
        return word

    def argv(container: dict[str, Any], command: list[str] | None = None) -> list[str]:
        mounts = paths(container)
        words = [local(w, mounts) for w in (command or container["command"])]
        words = [str(rpc_port) if w == "50052" else w for w in words]  # a free port, not the pods' own
        assert words[0] == "rpcfleet", words
        writable = [f for f, ro in mounts.values() if not ro]
        read_only = [f for f, ro in mounts.values() if ro]
        return contained([sys.executable, "-m", "orchestrator", *words[1:]], writable, read_only)

    def env(container: dict[str, Any]) -> dict[str, str]:
        mounts = paths(container)
        return {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "RPCFLEET_RPC_SERVER": str(rpc_server_binary),
            "RPCFLEET_LLAMA_SERVER": str(tools / "llama-server"),
            **{e["name"]: local(e["value"], mounts) for e in container["env"]},
            "LWS_LEADER_ADDRESS": "m-0.m.default",
            "LWS_GROUP_SIZE": "1",
            "LWS_WORKER_INDEX": "0",
        }

    def run(container: dict[str, Any], command: list[str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv(container, command), env=env(container), capture_output=True, text=True, timeout=120
        )

    started: list[subprocess.Popen[bytes]] = []
    logs = tmp_path / "logs"
    logs.mkdir()
    try:
        with (logs / "rpc-server.log").open("wb") as log:
            started.append(subprocess.Popen(argv(sidecar), env=env(sidecar), stdout=log, stderr=log))
        deadline = time.monotonic() + 30
        while run(sidecar, sidecar["readinessProbe"]["exec"]["command"]).returncode != 0:
            assert started[0].poll() is None, (logs / "rpc-server.log").read_text()
            assert time.monotonic() < deadline, (logs / "rpc-server.log").read_text()
            time.sleep(0.5)
        pid = json.loads((volumes["run"] / "rpc-server.pid").read_text())["pid"]
        server_argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        assert server_argv[server_argv.index(b"-t") + 1] == b"4"  # the pod's CPU limit, not the node's CPUs
        status = (Path("/proc") / str(pid) / "status").read_text()
        assert "\nCapEff:\t0000000000000000\n" in status and "\nNoNewPrivs:\t1\n" in status, status
        planned = run(init)
        assert planned.returncode == 0, planned.stdout + planned.stderr
        args = json.loads((volumes["run"] / "llama-server.json").read_text())["args"]
        assert "--no-slots" in args
        with (logs / "llama-server.log").open("wb") as log:
            started.append(subprocess.Popen(argv(engine), env=env(engine), stdout=log, stderr=log))
        base = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 180
        while True:
            assert started[1].poll() is None, (logs / "llama-server.log").read_text()[-4000:]
            with contextlib.suppress(OSError):
                if _http(base + "/health") == 200:  # the probes' path needs no key
                    break
            assert time.monotonic() < deadline, (logs / "llama-server.log").read_text()[-4000:]
            time.sleep(1)
        assert _http(base + "/v1/models") == 401
        assert _http(base + "/v1/models", "wrong") == 401
        assert _http(base + "/v1/models", "secret-key") == 200
        assert _http(base + "/slots", "secret-key") != 200  # --no-slots
        assert run(sidecar, sidecar["livenessProbe"]["exec"]["command"]).returncode == 0
    finally:
        for process in reversed(started):
            if process.poll() is None:
                process.terminate()
        for process in started:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
