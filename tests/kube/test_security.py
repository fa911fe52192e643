"""`rpcfleet export lws`'s pods locked down (issue 43, F8): every pod template passes the Pod Security
"restricted" profile (tests/plugins/pod_security.py applies its documented controls; no cluster admits them
here) and the checker refuses a template that lacks any one of them; NetworkPolicies let only each
group's leader reach its rpc-servers and only the pods named for it reach llama-server; llama-server's
key comes from a Secret mounted in its own container only."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.plugins.kube import ROOT, export, pod_templates, rpcfleet, validate_all
from tests.plugins.pod_security import restricted_violations

GiB = 1 << 30
NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
GROUP_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"

EXPORTS: dict[str, dict[str, Any]] = {
    "cpu, groups of 3, 2 replicas": {"node_memory": GiB, "nodes_per_group": 3, "replicas": 2},
    "cpu, a group of 1": {"node_memory": GiB, "nodes_per_group": 1},
    "cuda, groups of 2, a key": {
        "node_memory": 8 * GiB,
        "backend": "cuda",
        "nodes_per_group": 2,
        "api_key_secret": "llm-keys",
    },
}


def _templates(objects: dict[str, Any]) -> list[dict[str, Any]]:
    return [wrapped["template"] for wrapped in pod_templates(objects["leaderworkerset.yaml"])]


def _containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    spec = template["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


@pytest.mark.parametrize("case", EXPORTS)
def test_every_pod_passes_the_restricted_pod_security_profile(
    tiny_model: Path, tmp_path: Path, case: str
) -> None:
    objects = export(tiny_model, tmp_path, **EXPORTS[case])
    validate_all(objects)
    templates = _templates(objects)
    assert templates
    # the image's user (deploy/Containerfile), so that the kubelet checks runAsNonRoot against a number
    assert "\nUSER 65532:65532\n" in (ROOT / "deploy" / "Containerfile").read_text()
    for template in templates:
        assert restricted_violations(template) == []
        spec = template["spec"]
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["runAsUser"] == 65532
        assert {"name": "tmp", "emptyDir": {}} in spec["volumes"]
        for container in _containers(template):
            # beyond the profile: the image's files are read-only; what the programs write goes to /tmp
            # and the `run` volume (tests/kube/test_pods.py runs them so)
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, container["name"]
            assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def _first_init(template: dict[str, Any]) -> dict[str, Any]:
    context: dict[str, Any] = template["spec"]["initContainers"][0]["securityContext"]
    return context


def _init_step(template: dict[str, Any]) -> dict[str, Any]:
    context: dict[str, Any] = template["spec"]["initContainers"][1]["securityContext"]
    return context


def _engine(template: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = template["spec"]["containers"][0]
    return container


def _pod(template: dict[str, Any]) -> dict[str, Any]:
    context: dict[str, Any] = template["spec"]["securityContext"]
    return context


# Each control of the profile, broken in the leader's template: (how, what the checker must say).
BROKEN: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "runAsNonRoot missing": (lambda t: _pod(t).pop("runAsNonRoot"), "runAsNonRoot must be true"),
    "runAsNonRoot false in a container": (
        lambda t: _engine(t)["securityContext"].update(runAsNonRoot=False),
        "llama-server].securityContext.runAsNonRoot is false",
    ),
    "runAsUser 0": (lambda t: _pod(t).update(runAsUser=0), "runAsUser is 0"),
    "seccompProfile missing": (
        lambda t: _pod(t).pop("seccompProfile"),
        "seccompProfile.type must be RuntimeDefault",
    ),
    "seccomp Unconfined in a container": (
        lambda t: _first_init(t).update(seccompProfile={"type": "Unconfined"}),
        "rpc-server].securityContext.seccompProfile.type 'Unconfined'",
    ),
    "allowPrivilegeEscalation missing": (
        lambda t: _init_step(t).pop("allowPrivilegeEscalation"),
        "plan].securityContext.allowPrivilegeEscalation must be false",
    ),
    "capabilities not dropped": (
        lambda t: _engine(t)["securityContext"].pop("capabilities"),
        "capabilities.drop must hold ALL",
    ),
    "a default capability added": (
        lambda t: _first_init(t)["capabilities"].update(add=["CHOWN"]),
        "capabilities.add: only NET_BIND_SERVICE",
    ),
    "SYS_ADMIN added": (
        lambda t: _first_init(t)["capabilities"].update(add=["SYS_ADMIN"]),
        "capabilities.add: SYS_ADMIN",
    ),
    "privileged": (lambda t: _init_step(t).update(privileged=True), "privileged must be false"),
    "hostNetwork": (lambda t: t["spec"].update(hostNetwork=True), "spec.hostNetwork must be false"),
    "hostPath volume": (
        lambda t: t["spec"]["volumes"].append({"name": "root", "hostPath": {"path": "/"}}),
        "spec.volumes[root]: hostPath",
    ),
    "hostPort": (lambda t: _engine(t)["ports"][0].update(hostPort=8080), "no hostPort"),
    "an unsafe sysctl": (
        lambda t: _pod(t).update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
        "kernel.msgmax is not a safe sysctl",
    ),
    "procMount Unmasked": (lambda t: _init_step(t).update(procMount="Unmasked"), "procMount must be Default"),
    "an SELinux user": (
        lambda t: _pod(t).update(seLinuxOptions={"user": "system_u"}),
        "seLinuxOptions: only a container type",
    ),
}


@pytest.mark.parametrize("control", BROKEN)
def test_the_checker_refuses_a_template_that_breaks_each_control(
    tiny_model: Path, tmp_path: Path, control: str
) -> None:
    objects = export(tiny_model, tmp_path, node_memory=GiB, nodes_per_group=2)
    leader = _templates(objects)[0]
    assert leader["metadata"]["labels"]["app.kubernetes.io/component"] == "leader"
    assert restricted_violations(leader) == []
    broken = copy.deepcopy(leader)
    change, says = BROKEN[control]
    change(broken)
    wrong = restricted_violations(broken)
    assert any(says in line for line in wrong), wrong


def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the manifests use labels only
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def admitted(
    policies: Sequence[dict[str, Any]], pod: Mapping[str, str], peer: Mapping[str, str], port: int
) -> bool:
    """Whether a pod of labels `peer` may open `port` of the pod of labels `pod`, both in the policies'
    namespace, as NetworkPolicy's ingress rules say: a pod no policy selects takes anything; a selected
    one only what a rule of a policy selecting it allows (rules add up)."""
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], pod)]
    if not selecting:
        return True
    for policy in selecting:
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:
            ports = {p["port"] for p in rule["ports"]}
            peers = [p for p in rule["from"] if "namespaceSelector" not in p]
            if port in ports and any(_selects(p["podSelector"], peer) for p in peers):
                return True
    return False


def _pod_labels(template: dict[str, Any], name: str, group: int, index: int) -> dict[str, str]:
    """A pod's labels as the LWS controller and its pod webhook set them, beside the template's."""
    labels = {NAME_LABEL: name, GROUP_LABEL: str(group), WORKER_LABEL: str(index)}
    return {**template["metadata"]["labels"], **labels}


def test_only_each_groups_leader_reaches_its_rpc_servers_and_only_named_pods_the_api(
    tiny_model: Path, tmp_path: Path
) -> None:
    objects = export(tiny_model, tmp_path, node_memory=GiB, nodes_per_group=3, replicas=2, name="m")
    validate_all(objects)
    policies = objects["networkpolicy.yaml"]
    assert [p["metadata"]["name"] for p in policies] == ["m", "m-group-0", "m-group-1"]
    leader_t, worker_t = _templates(objects)

    def pod(group: int, index: int) -> dict[str, str]:
        return _pod_labels(leader_t if index == 0 else worker_t, "m", group, index)

    rpc, http = 50052, 8080
    client, stranger = {"rpcfleet/client": "m", "app": "gateway"}, {"app": "gateway"}
    assert admitted(policies, pod(0, 1), pod(0, 0), rpc)  # the group's leader: its workers
    assert admitted(policies, pod(1, 2), pod(1, 0), rpc)
    assert not admitted(policies, pod(0, 1), pod(1, 0), rpc)  # another group's leader
    assert not admitted(policies, pod(0, 1), pod(0, 2), rpc)  # a worker of the same group
    assert not admitted(policies, pod(0, 0), stranger, rpc)  # any other pod, the leader's server too
    assert not admitted(policies, pod(0, 1), client, rpc)
    assert admitted(policies, pod(0, 0), client, http)  # the API: the pods named for it
    assert admitted(policies, pod(1, 0), client, http)
    assert not admitted(policies, pod(0, 0), stranger, http)
    assert not admitted(policies, pod(0, 0), pod(0, 1), http)
    # a group beyond the export's (after `kubectl scale`) is closed, not open: its leader fails its wait
    assert not admitted(policies, pod(2, 1), pod(2, 0), rpc)
    # and nothing else of the pods is open: a port no rule names
    assert not admitted(policies, pod(0, 0), client, 9090)


def test_a_group_of_one_pod_takes_only_the_api(tiny_model: Path, tmp_path: Path) -> None:
    objects = export(tiny_model, tmp_path, node_memory=GiB, nodes_per_group=1, name="solo")
    (policy,) = objects["networkpolicy.yaml"]  # its server is reached on loopback, which no policy governs
    (leader_t,) = _templates(objects)
    leader = _pod_labels(leader_t, "solo", 0, 0)
    assert admitted([policy], leader, {"rpcfleet/client": "solo"}, 8080)
    assert not admitted([policy], leader, {"rpcfleet/client": "solo"}, 50052)


def test_the_api_callers_are_chosen_by_labels_and_namespaces(tiny_model: Path, tmp_path: Path) -> None:
    argv = ["export", "lws", "-m", str(tiny_model), "--node-memory", "1GiB", "-o", "k8s", "--name", "m"]
    done = rpcfleet(
        *argv,
        "--http-from",
        "app.kubernetes.io/name=gateway,tier=edge",
        "--http-from-namespace",
        "kubernetes.io/metadata.name=ingress",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    import yaml

    (policy,) = list(yaml.safe_load_all((tmp_path / "k8s" / "networkpolicy.yaml").read_text()))
    assert policy["spec"]["ingress"][0]["from"] == [
        {
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "gateway", "tier": "edge"}},
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}},
        }
    ]
    done = rpcfleet(*argv, "-o", "all", "--http-from", "", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (policy,) = list(yaml.safe_load_all((tmp_path / "all" / "networkpolicy.yaml").read_text()))
    assert policy["spec"]["ingress"][0]["from"] == [{"podSelector": {"matchLabels": {}}}]  # every pod


def test_the_api_key_comes_from_a_secret_mounted_in_llama_servers_container_only(
    tiny_model: Path, tmp_path: Path
) -> None:
    objects = export(tiny_model, tmp_path, node_memory=GiB, nodes_per_group=2, api_key_secret="llm-keys")
    validate_all(objects)
    leader = _templates(objects)[0]
    volumes = {v["name"]: v for v in leader["spec"]["volumes"]}
    secret = volumes["api-key"]["secret"]
    assert secret["secretName"] == "llm-keys" and secret["items"] == [{"key": "api-key", "path": "api-key"}]
    engine = _engine(leader)
    assert engine["command"][-2:] == ["--api-key-file", "/var/run/secrets/rpcfleet/api-key"]
    mount = {"name": "api-key", "mountPath": "/var/run/secrets/rpcfleet", "readOnly": True}
    assert mount in engine["volumeMounts"]
    others = [c for t in _templates(objects) for c in _containers(t) if c is not engine]
    assert others and not any(m["name"] == "api-key" for c in others for m in c["volumeMounts"])
    # without it, no key and no Secret; the probes' /health needs none either way
    plain = export(tiny_model, tmp_path / "plain", node_memory=GiB, nodes_per_group=2)
    assert "api-key" not in str(plain["leaderworkerset.yaml"])
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
