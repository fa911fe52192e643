"""`rpcfleet export lws` (issue 35, item 1): the manifests validate offline against Kubernetes' schemas
(kubernetes-validate, strict: an unknown field fails) and the vendored LeaderWorkerSet CRD's
openAPIV3Schema (jsonschema, made as strict); the checks fail on a broken manifest; bad input is a clear
error with exit status 2.

kubernetes-validate finds schemas only among its own (by kind and apiVersion), so it cannot take a CRD's:
the LeaderWorkerSet is checked with jsonschema against the CRD, and its two pod templates, wrapped as
core PodTemplates, with kubernetes-validate too."""

from __future__ import annotations

import copy
import hashlib
import math
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from orchestrator.core.units import MiB
from orchestrator.planning.plan import Plan
from tests.plugins.kube import (
    CRD,
    CRD_SHA256,
    GiB,
    export,
    pod_templates,
    rpcfleet,
    validate_all,
    validate_core,
    validate_lws,
)


def test_the_vendored_crd_is_lws_v0_10_0_with_its_licence() -> None:
    assert hashlib.sha256(CRD.read_bytes()).hexdigest() == CRD_SHA256
    assert "Apache License" in (CRD.parent / "LICENSE").read_text()
    assert "v0.10.0" in (CRD.parent / "README.md").read_text()


def test_a_cpu_export_validates_and_says_what_the_pods_run(tiny_model: Path, tmp_path: Path) -> None:
    objects = export(tiny_model, tmp_path, node_memory=GiB, nodes_per_group=3, replicas=2)
    validate_all(objects)
    lws = objects["leaderworkerset.yaml"]
    template = lws["spec"]["leaderWorkerTemplate"]
    assert lws["spec"]["replicas"] == 2 and template["size"] == 3
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    leader = template["leaderTemplate"]["spec"]
    sidecar, init = leader["initContainers"]
    assert sidecar["restartPolicy"] == "Always" and sidecar["command"][:3] == ["rpcfleet", "lws", "worker"]
    assert init["command"][:3] == ["rpcfleet", "lws", "plan"]
    (engine,) = leader["containers"]
    assert engine["command"][:3] == ["rpcfleet", "lws", "serve"]
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
    (worker,) = template["workerTemplate"]["spec"]["containers"]
    for container in (sidecar, worker):
        pid_file = ["--pid-file", "/run/rpcfleet/rpc-server.pid"]
        assert container["command"][-2:] == pid_file
        # HELLO only as the startup probe; the later probes check the process and never connect (a busy
        # rpc-server holds HELLOs in its accept queue until they time out)
        assert container["startupProbe"]["exec"]["command"][:3] == ["rpcfleet", "lws", "hello"]
        for kind in ("readinessProbe", "livenessProbe"):
            assert container[kind]["exec"]["command"] == ["rpcfleet", "lws", "alive", *pid_file]
        assert {"name": "run", "mountPath": "/run/rpcfleet"} in container["volumeMounts"]
    assert "nvidia.com/gpu" not in str(objects)
    config = objects["configmap.yaml"]["data"]
    assert '"group_size": 3' in config["settings.json"] and '"n_layer"' in config["plan.json"]
    service = objects["service.yaml"]
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"


@pytest.mark.parametrize(("backend", "resource"), [("cuda", "nvidia.com/gpu"), ("rocm", "amd.com/gpu")])
def test_a_gpu_export_asks_for_the_backends_gpu_resource(
    tiny_model: Path, tmp_path: Path, backend: str, resource: str
) -> None:
    objects = export(
        tiny_model, tmp_path, node_memory=8 * GiB, backend=backend, namespace="llm", nodes_per_group=2
    )
    validate_all(objects)
    template = objects["leaderworkerset.yaml"]["spec"]["leaderWorkerTemplate"]
    sidecar = template["leaderTemplate"]["spec"]["initContainers"][0]
    (worker,) = template["workerTemplate"]["spec"]["containers"]
    for container in (sidecar, worker):
        assert container["resources"]["limits"][resource] == "1"
    everything = [
        obj for found in objects.values() for obj in (found if isinstance(found, list) else [found])
    ]
    assert len(everything) == 5 and all(obj["metadata"]["namespace"] == "llm" for obj in everything)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_an_rpc_servers_memory_holds_the_largest_tensor_it_receives(
    sparse_or_tiny: Path, tmp_path: Path, backend: str
) -> None:
    """rpc-server reads a whole SET_TENSOR message into memory of its own before copying it: the pod that
    holds the output layer (125 MiB, f16 32000 x 2048) needs that much more than the plan puts on it."""
    objects = export(sparse_or_tiny, tmp_path, node_memory=GiB, nodes_per_group=2, backend=backend)
    validate_all(objects)
    template = objects["leaderworkerset.yaml"]["spec"]["leaderWorkerTemplate"]
    sidecar = template["leaderTemplate"]["spec"]["initContainers"][0]
    (worker,) = template["workerTemplate"]["spec"]["containers"]
    plan = Plan.from_text(objects["configmap.yaml"]["data"]["plan.json"])
    assert plan.devices[1].has_output and not plan.devices[0].has_output
    output = math.ceil(32000 * 2048 * 2 / MiB)  # 125 MiB
    memory = {
        name: {k: int(v["memory"].removesuffix("Mi")) for k, v in container["resources"].items()}
        for name, container in (("leader", sidecar), ("worker", worker))
    }
    if backend == "cpu":
        # the limit: --node-memory (what the plan fills) + the largest tensor + the process's allowance
        assert memory["worker"]["limits"] == 1024 + output + 128
        assert 1024 + 128 < memory["leader"]["limits"] < memory["worker"]["limits"]  # a layer's tensors
    else:
        assert memory["worker"] == {"requests": 512 + output, "limits": 1536 + output}
        assert memory["leader"]["requests"] < memory["worker"]["requests"]


def test_a_group_of_one_pod_is_its_leader_only(tiny_model: Path, tmp_path: Path) -> None:
    objects = export(tiny_model, tmp_path, node_memory=GiB, nodes_per_group=1)
    validate_all(objects)
    template = objects["leaderworkerset.yaml"]["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 1 and "leaderTemplate" not in template  # no worker pod to describe
    pod = template["workerTemplate"]
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "leader"
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["rpc-server", "plan"]
    assert [c["name"] for c in pod["spec"]["containers"]] == ["llama-server"]


def test_the_checks_fail_on_a_broken_manifest(tiny_model: Path, tmp_path: Path) -> None:
    objects = export(tiny_model, tmp_path, node_memory=GiB, nodes_per_group=2)
    lws = objects["leaderworkerset.yaml"]
    typo = copy.deepcopy(lws)
    container = typo["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    container["comand"] = container.pop("command")
    with pytest.raises(jsonschema.ValidationError, match="comand"):
        validate_lws(typo)
    with pytest.raises(kubernetes_validate.ValidationError, match="comand"):
        validate_core(list(pod_templates(typo))[1])
    wrong = copy.deepcopy(lws)
    wrong["spec"]["leaderWorkerTemplate"]["size"] = "three"
    with pytest.raises(jsonschema.ValidationError, match="three"):
        validate_lws(wrong)
    policy = copy.deepcopy(lws)
    policy["spec"]["startupPolicy"] = "WorkersFirst"
    with pytest.raises(jsonschema.ValidationError, match="WorkersFirst"):
        validate_lws(policy)
    service = copy.deepcopy(objects["service.yaml"])
    service["spec"]["ports"][0]["port"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_core(service)


def test_the_command_writes_the_four_files(tiny_model: Path, tmp_path: Path) -> None:
    done = rpcfleet(
        "export", "lws", "-m", str(tiny_model), "--node-memory", "1GiB", "-o", "k8s", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "k8s").iterdir()) == [
        "configmap.yaml",
        "leaderworkerset.yaml",
        "networkpolicy.yaml",
        "service.yaml",
    ]
    assert "1 group(s) of 1 pod(s)" in done.stdout


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--node-memory", "8GiB", "--backend", "vulkan"], "backend vulkan has no known GPU resource name"),
        (["--node-memory", "300MiB"], "fits no group of up to 15 pods of 300.00 MiB"),
        (["--node-memory", "100MiB", "--nodes-per-group", "1"], "fits no group of 1 pod(s) of 100.00 MiB"),
        (["--node-memory", "1GiB", "--name", "Not_A_Label"], "--name 'Not_A_Label': not a DNS label"),
        (["--node-memory", "1GiB", "--chat-template", "nosuch"], "--chat-template nosuch"),
        (["--node-memory", "lots"], "--node-memory"),
        (["--node-memory", "1GiB", "--nodes-per-group", "16"], "--nodes-per-group"),
        (["--node-memory", "1GiB", "--gpu-resource", "nvidia.com/gpu"], "with --backend cpu: a CPU pod"),
        (
            ["--node-memory", "8GiB", "--backend", "cuda", "--gpu-resource", "not a name!"],
            "--gpu-resource 'not a name!' is not an extended resource name: its domain",
        ),
        (
            ["--node-memory", "8GiB", "--backend", "vulkan", "--gpu-resource", "gpu"],
            "--gpu-resource 'gpu' is not an extended resource name",
        ),
        (
            ["--node-memory", "8GiB", "--backend", "rocm", "--gpu-resource", "kubernetes.io/gpu"],
            "the kubernetes.io domain is Kubernetes' own",
        ),
        (
            ["--node-memory", "8GiB", "--backend", "cuda", "--gpu-resource", "nvidia.com/-gpu"],
            "its name (after the '/') must be",
        ),
        (
            ["--node-memory", "1GiB", "--http-from", "gateway"],
            "--http-from 'gateway' is not a label: not key",
        ),
        (
            ["--node-memory", "1GiB", "--http-from-namespace", "Bad_Prefix/x=y"],
            "--http-from-namespace 'Bad_Prefix/x=y' is not a label: its prefix",
        ),
        (["--node-memory", "1GiB", "--http-from", "app=-x"], "'app=-x' is not a label: its value"),
        (["--node-memory", "1GiB", "--api-key-secret", "Keys!"], "--api-key-secret 'Keys!' is not a Secret"),
        (["--node-memory", "1GiB", "--node-cpus", "0"], "--node-cpus: expected an integer >= 1, got 0"),
    ],
)
def test_bad_input_is_a_clear_error_with_exit_status_2(
    sparse_or_tiny: Path, tmp_path: Path, extra: list[str], says: str
) -> None:
    done = rpcfleet("export", "lws", "-m", str(sparse_or_tiny), "-o", "k8s", *extra, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "k8s").exists()


@pytest.fixture
def sparse_or_tiny(tiny_model_factory: Any) -> Path:
    """A small llama whose output layer alone is larger than 100 MiB (so that 300 MiB pods with the
    256 MiB margin hold no group): 32k vocabulary at n_embd 2048, f16."""
    path: Path = tiny_model_factory(n_vocab=32000, n_embd=2048, n_head=16, n_head_kv=16, n_layer=2)
    return path


def test_a_model_that_is_not_there_is_named(tmp_path: Path) -> None:
    done = rpcfleet("export", "lws", "-m", "nope.gguf", "--node-memory", "1GiB", "-o", "k8s", cwd=tmp_path)
    assert done.returncode == 2 and "model nope.gguf does not exist" in done.stderr


def test_a_valid_gpu_resource_is_taken(tiny_model: Path, tmp_path: Path) -> None:
    objects = export(
        tiny_model, tmp_path, node_memory=8 * GiB, backend="vulkan", gpu_resource="gpu.intel.com/i915"
    )
    validate_all(objects)
    leader = objects["leaderworkerset.yaml"]["spec"]["leaderWorkerTemplate"]["workerTemplate"]  # one pod
    assert leader["spec"]["initContainers"][0]["resources"]["limits"]["gpu.intel.com/i915"] == "1"


def test_the_files_read_as_a_reviewer_reads_them(tiny_model: Path, tmp_path: Path) -> None:
    """The ConfigMap's JSON files as blocks (as they will be in the pod), no YAML anchors or aliases
    (`&id001` for the probes' shared command), and no path of this machine: the plan names the model as
    the pods see it."""
    objects = export(tiny_model, tmp_path / "k8s", node_memory=GiB, nodes_per_group=2)
    texts = {path.name: path.read_text() for path in (tmp_path / "k8s").iterdir()}
    config = texts["configmap.yaml"]
    assert "  plan.json: |\n    {\n" in config and "  settings.json: |\n    {\n" in config, config[:400]
    assert "\\n" not in config  # no escaped one-line string
    for name, text in texts.items():
        assert "&id" not in text and "*id" not in text, name
    data = objects["configmap.yaml"]["data"]
    plan = Plan.from_text(data["plan.json"])
    assert plan.model_path == f"/models/{tiny_model.name}"
    assert str(tiny_model.parent) not in "".join(texts.values())
    assert objects["configmap.yaml"]["data"]["settings.json"].endswith("}\n")


@pytest.mark.parametrize(("backend", "memory"), [("cpu", GiB), ("cuda", 8 * GiB)])
def test_every_container_asks_for_cpus_and_the_rpc_server_runs_that_many_threads(
    tiny_model: Path, tmp_path: Path, backend: str, memory: int
) -> None:
    objects = export(
        tiny_model, tmp_path, node_memory=memory, nodes_per_group=2, backend=backend, node_cpus=6
    )
    validate_all(objects)
    template = objects["leaderworkerset.yaml"]["spec"]["leaderWorkerTemplate"]
    sidecar, init = template["leaderTemplate"]["spec"]["initContainers"]
    (engine,) = template["leaderTemplate"]["spec"]["containers"]
    (worker,) = template["workerTemplate"]["spec"]["containers"]
    for server in (sidecar, worker):
        assert server["resources"]["requests"]["cpu"] == server["resources"]["limits"]["cpu"] == "6"
        command = server["command"]
        assert command[command.index("--threads") + 1] == "6"  # no more threads than the limit pays for
    assert engine["resources"]["requests"]["cpu"] == "1" and engine["resources"]["limits"]["cpu"] == "6"
    assert init["resources"]["requests"]["cpu"] == "100m" and init["resources"]["limits"]["cpu"] == "1"
    default = export(tiny_model, tmp_path / "default", node_memory=memory, backend=backend)
    pod = default["leaderworkerset.yaml"]["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    assert pod["initContainers"][0]["resources"]["limits"]["cpu"] == "4"


def test_where_no_context_fits_the_hint_is_the_ubatch_which_export_takes(
    sparse_or_tiny: Path, tmp_path: Path
) -> None:
    """A pod of 490 MiB holds no context of this model at the default --ubatch 512 (the weights and the
    compute buffer alone are too large): a smaller --ctx cannot help, the hint names --ubatch, which
    export lws takes (at 32 the model fits); at 530 MiB a context of 2048 fits, and --ctx is the hint.
    (The pods run llama-server, whose compute buffer holds logits for one output per slot.)"""
    argv = ["export", "lws", "-m", str(sparse_or_tiny), "--nodes-per-group", "1", "--ctx", "1024"]
    done = rpcfleet(*argv, "--node-memory", "490MiB", "-o", "k8s", cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no context fits" in done.stderr and "a smaller --ubatch (now 512" in done.stderr, done.stderr
    assert "--ctx or --parallel" not in done.stderr and "Traceback" not in done.stderr
    done = rpcfleet(*argv, "--node-memory", "490MiB", "--ubatch", "32", "-o", "k8s", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    plan = yaml.safe_load((tmp_path / "k8s" / "configmap.yaml").read_text())["data"]["plan.json"]
    assert Plan.from_text(plan).options.n_ubatch == 32
    done = rpcfleet(*argv[:-1], "4096", "--node-memory", "530MiB", "-o", "more", cwd=tmp_path)
    assert done.returncode == 2 and "the largest context that fits: 2048" in done.stderr, done.stderr
    assert "a smaller --ctx or --parallel" in done.stderr and "--ubatch" not in done.stderr


def test_the_help_says_the_slots_export_uses(tmp_path: Path) -> None:
    done = rpcfleet("export", "lws", "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert "--parallel N, -np N llama-server's slots" in text and "(default: 4, as serve)" in text, text
    assert "default: 1" not in text
    assert "--ubatch" in text
