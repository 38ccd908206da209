"""The chart runs locked down: every pod and container (Ray's, the autoscaler's sidecar, the
``helm test`` pod) non-root, without privilege escalation or capabilities, under
RuntimeDefault seccomp, on a read-only root filesystem with emptyDirs where Ray and Tessera
write; a NetworkPolicy admits the serve ports from anywhere and everything else only from
the release's own pods (and the dashboard from KubeRay's operator)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.helm import documents, only, template
from tests.deploy.test_rayservice import cluster_spec

POD_CONTEXT = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 100,
    "fsGroup": 100,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_CONTEXT = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
CACHE = "/home/ray/.cache"
RELEASE_PODS = {"app.kubernetes.io/instance": "tessera", "app.kubernetes.io/part-of": "tessera"}


def pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every pod spec of a render by name: the head, each worker group, the test pod."""
    spec = cluster_spec(docs)
    pods = {"head": spec["headGroupSpec"]["template"]["spec"]}
    pods |= {g["groupName"]: g["template"]["spec"] for g in spec["workerGroupSpecs"]}
    pods["helm-test"] = only(docs, "Pod")["spec"]
    return pods


def test_every_pod_and_container_is_locked_down(render):
    pods = pod_specs(render)
    assert len(pods) >= 3
    for name, pod in pods.items():
        assert pod["securityContext"] == POD_CONTEXT, name
        for container in pod["containers"]:
            assert container["securityContext"] == CONTAINER_CONTEXT, (name, container["name"])
        assert "initContainers" not in pod and not pod.get("hostNetwork")


def test_the_autoscalers_sidecar_is_locked_down_too(gpu_render):
    options = cluster_spec(gpu_render)["autoscalerOptions"]
    assert options["securityContext"] == CONTAINER_CONTEXT


def test_ray_pods_write_only_to_their_emptydirs(render):
    """/tmp (Ray's /tmp/ray, compilers' scratch) and the cache (XDG_CACHE_HOME: Tessera's
    kernels and tokenizers, Hugging Face's hub; Triton's cache) are emptyDirs; the rest of
    the filesystem is read-only."""
    pods = pod_specs(render)
    del pods["helm-test"]  # writes nothing
    for name, pod in pods.items():
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["tmp"] == {"name": "tmp", "emptyDir": {}}, name
        assert volumes["cache"] == {"name": "cache", "emptyDir": {}}, name
        (container,) = pod["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/tmp"] == "tmp" and mounts[CACHE] == "cache"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["XDG_CACHE_HOME"] == CACHE
        assert env["TRITON_CACHE_DIR"] == f"{CACHE}/triton"
        writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
        assert writable == {"/tmp", CACHE}, name


def test_the_network_policy_admits_the_serve_ports_from_anywhere_and_the_rest_from_the_release(
    render,
):
    policy = only(render, "NetworkPolicy")
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": RELEASE_PODS}
    assert spec["policyTypes"] == ["Ingress"]
    serve, own, operator = spec["ingress"]
    # the serve ports: no "from", so any source
    assert serve == {
        "ports": [{"protocol": "TCP", "port": 8000}, {"protocol": "TCP", "port": 9000}]
    }
    # every other port (GCS 6379, dashboard 8265, client 10001, Ray's own, KV transfer):
    # the release's own pods only
    assert own == {"from": [{"podSelector": {"matchLabels": RELEASE_PODS}}]}
    # the dashboard from KubeRay's operator, which deploys the app through it
    assert operator["ports"] == [{"protocol": "TCP", "port": 8265}]
    assert operator["from"] == [
        {
            "namespaceSelector": {},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
        }
    ]
    # every Ray pod is one the policy selects
    spec = cluster_spec(render)
    templates = [spec["headGroupSpec"]["template"]] + [
        g["template"] for g in spec["workerGroupSpecs"]
    ]
    for pod in templates:
        assert RELEASE_PODS.items() <= pod["metadata"]["labels"].items()


@pytest.mark.parametrize(
    ("sets", "ports"),
    [(("tessera.grpc_port=null",), [8000]), (("tessera.port=8080",), [8080, 9000])],
)
def test_the_network_policy_follows_the_serve_ports(sets, ports):
    (serve, *_) = only(documents(template(sets=sets)), "NetworkPolicy")["spec"]["ingress"]
    assert serve == {"ports": [{"protocol": "TCP", "port": port} for port in ports]}


def test_the_network_policy_can_be_left_out():
    docs = documents(template(sets=("networkPolicy.enabled=false",)))
    assert "NetworkPolicy" not in {doc["kind"] for doc in docs}
