"""The rendered resources are what a Kubernetes API server would accept in strict field
validation: core resources (the ``helm test`` pod, the NetworkPolicy, the dashboard's
ConfigMap, and the pod templates and Service that the RayService embeds) against
Kubernetes' own schemas (kubernetes-validate), and the RayService against KubeRay
v1.7.0's CRD with unknown fields refused."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.helm import REPO, only

#: KubeRay's CRDs sit in the shared folder beside the repository (CI has it; a lone clone
#: may not), never copied into the project.
RAYSERVICE_CRD = REPO.parent / "shared" / "kuberay-crds" / "v1.7.0" / "ray.io_rayservices.yaml"
#: The chart's floor (Chart.yaml kubeVersion) and the newest schemas kubernetes-validate has.
KUBERNETES_VERSIONS = ["1.27.0", kubernetes_validate.utils.latest_version()]


def core_resources(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The render's core resources, and those inside the RayService made whole: each pod
    template as the Pod KubeRay makes of it, the serve Service as KubeRay creates it."""
    spec = only(docs, "RayService")["spec"]
    cluster = spec["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]} | {
        group["groupName"]: group["template"] for group in cluster["workerGroupSpecs"]
    }
    pods = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"tessera-{name}", **template["metadata"]},
            "spec": template["spec"],
        }
        for name, template in templates.items()
    ]
    service = {"apiVersion": "v1", "kind": "Service", **spec["serveService"]}
    plain = [doc for doc in docs if doc["apiVersion"] in ("v1", "networking.k8s.io/v1")]
    return plain + pods + [service]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_core_resources_pass_kubernetes_validate_strict(render, version):
    """Pods, the Service, the NetworkPolicy and the dashboard's ConfigMap are valid
    Kubernetes objects, unknown fields refused."""
    resources = core_resources(render)
    assert {doc["kind"] for doc in resources} == {"Pod", "Service", "NetworkPolicy", "ConfigMap"}
    for resource in resources:
        try:
            kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            name = resource["metadata"]["name"]
            pytest.fail(f"{resource['kind']} {name}: {error.message} at {list(error.path)}")


@pytest.fixture(scope="module")
def crd_validator() -> jsonschema.Draft7Validator:
    """A strict validator of KubeRay v1.7.0's RayService. Outside CI the CRD may be absent
    (skip, saying where it was looked for); CI has it, so there its absence fails."""
    if not RAYSERVICE_CRD.exists():
        reason = f"KubeRay's RayService CRD is not at {RAYSERVICE_CRD}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return jsonschema.Draft7Validator(rayservice_schema(RAYSERVICE_CRD))


def rayservice_schema(crd: Path) -> dict[str, Any]:
    """The CRD's v1 schema with every object closed (``additionalProperties: false`` where
    it lists its properties): the API server's strict field validation."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    definition = yaml.load(crd.read_text(), Loader=loader)
    (v1,) = [v for v in definition["spec"]["versions"] if v["name"] == "v1"]
    return _closed(v1["schema"]["openAPIV3Schema"])


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    schema = dict(schema)
    if "properties" in schema:
        schema["properties"] = {name: _closed(sub) for name, sub in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
    if isinstance(schema.get("additionalProperties"), dict):
        schema["additionalProperties"] = _closed(schema["additionalProperties"])
    if "items" in schema:
        schema["items"] = _closed(schema["items"])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema:
            schema[key] = [_closed(sub) for sub in schema[key]]
    if schema.get("nullable"):
        schema["type"] = [schema["type"], "null"]
    return schema


def test_rayservice_passes_kuberay_crd_strictly(render, crd_validator):
    """Every field is one KubeRay v1.7.0 knows, of the type it expects (pod templates, the
    serve Service and the autoscaler options included)."""
    errors = [
        f"{'.'.join(map(str, error.absolute_path))}: {error.message}"
        for error in crd_validator.iter_errors(only(render, "RayService"))
    ]
    assert errors == []


def test_strict_crd_check_refuses_an_unknown_field(default_render, crd_validator):
    """The check is strict: a field KubeRay does not know fails, however deep."""
    misspelt = copy.deepcopy(only(default_render, "RayService"))
    misspelt["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    (error,) = crd_validator.iter_errors(misspelt)
    assert "'rayStartParam' was unexpected" in error.message
