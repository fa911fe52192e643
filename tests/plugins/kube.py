"""What the `export lws` tests share: the offline checks of its manifests (Kubernetes' own schemas with
kubernetes-validate, strict; the vendored LeaderWorkerSet CRD's with jsonschema), the export itself, and
the command run as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from orchestrator.kube.export import ExportRequest, export_lws
from orchestrator.workflows.options import plan_options

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "deploy" / "schemas" / "lws" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
CRD_SHA256 = "c5dcad8ed943e495490241f00b9a1b45d51203b6d484020db3636d5bf553568e"  # v0.10.0
KUBERNETES = "1.33"  # native sidecars (restartPolicy in an init container) are on by default since 1.29
GiB = 1 << 30


def _strict(node: Any) -> Any:
    """The CRD's schema with `additionalProperties: false` on every object that lists its properties and
    does not keep unknown fields, as the API server's strict field validation treats them."""
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@cache
def lws_schema() -> dict[str, Any]:
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema: dict[str, Any] = _strict(version["schema"]["openAPIV3Schema"])
    return schema


def validate_lws(obj: dict[str, Any]) -> None:
    jsonschema.Draft7Validator(lws_schema()).validate(obj)


def validate_core(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def pod_templates(lws: dict[str, Any]) -> Iterator[dict[str, Any]]:
    template = lws["spec"]["leaderWorkerTemplate"]
    for key in ("leaderTemplate", "workerTemplate"):
        if key not in template:  # a group of one pod: its leader's is the workerTemplate
            continue
        yield {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": key.lower()},
            "template": template[key],
        }


def validate_all(objects: dict[str, Any]) -> None:
    assert "'0Mi'" not in str(objects)  # every memory request and limit is something
    for name, found in objects.items():
        for obj in found if isinstance(found, list) else [found]:
            if obj["kind"] == "LeaderWorkerSet":
                validate_lws(obj)
                for template in pod_templates(obj):
                    validate_core(template)
            else:
                validate_core(obj)
            assert name == f"{obj['kind'].lower()}.yaml"


def export(model: Path, out: Path, **kw: Any) -> dict[str, Any]:
    """Each file's object, or its objects (a list) for networkpolicy.yaml."""
    options = plan_options(
        {"ctx": kw.pop("ctx", 1024), "parallel": kw.pop("parallel", 2), "ubatch": kw.pop("ubatch", None)}
    )
    request = ExportRequest(model=model, options=options, out=out, image="rpcfleet:test", **kw)
    result = export_lws(request)
    objects: dict[str, Any] = {}
    for path in result.files:
        found = list(yaml.safe_load_all(path.read_text()))
        objects[path.name] = found if path.name == "networkpolicy.yaml" else found[0]
    return objects


def rpcfleet(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's package, from any folder
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
