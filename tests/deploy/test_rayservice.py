"""The RayService wires the app the way KubeRay and Kubernetes need: ports named as KubeRay
looks them up, probes that neither block the app's deployment nor kill a cold start, Ray's
token auth from a Secret, a dashboard that stays inside the cluster, Prometheus annotations."""

from __future__ import annotations

from typing import Any

import yaml

from tests.deploy.helm import documents, only, template


def cluster_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return only(docs, "RayService")["spec"]["rayClusterConfig"]


def ray_containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Group name ("head" for the head) -> its Ray container."""
    spec = cluster_spec(docs)
    containers = {"head": spec["headGroupSpec"]["template"]["spec"]["containers"][0]}
    for group in spec["workerGroupSpecs"]:
        containers[group["groupName"]] = group["template"]["spec"]["containers"][0]
    return containers


def test_service_and_container_ports_are_named_serve_and_serve_grpc(render):
    """KubeRay (>= 1.6) builds the serve Service from container ports named serve and
    serve-*; their numbers are Serve's HTTP and gRPC proxy ports."""
    rayservice = only(render, "RayService")
    config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    http, grpc = config["http_options"]["port"], config["grpc_options"]["port"]
    expected = {"serve": http, "serve-grpc": grpc}
    assert expected == {"serve": 8000, "serve-grpc": 9000}
    service = rayservice["spec"]["serveService"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == expected
    assert service["metadata"]["name"] == "tessera-serve-svc"
    for container in ray_containers(render).values():
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports.items() >= expected.items()


def test_grpc_off_drops_its_port_options_and_probe():
    """``tessera.grpc_port: null`` (as ServeConfig: gRPC off) leaves no gRPC anywhere."""
    docs = documents(template(sets=("tessera.grpc_port=null",)))
    rayservice = only(docs, "RayService")
    assert "grpc_options" not in yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    assert [p["name"] for p in rayservice["spec"]["serveService"]["spec"]["ports"]] == ["serve"]
    head = ray_containers(docs)["head"]
    assert "livenessProbe" not in head
    assert "serve-grpc" not in {p["name"] for p in head["ports"]}


def test_probes_leave_the_head_ready_to_deploy_and_check_the_app(render):
    """KubeRay deploys the Serve app only once the head pod is ready, so the head keeps
    KubeRay's Ray-level readiness; its liveness is the app's gRPC health, late and lenient
    enough for a cold start. Worker pods are ready while the app's /health answers there."""
    containers = ray_containers(render)
    head = containers.pop("head")
    assert "readinessProbe" not in head
    assert head["livenessProbe"] == {
        "grpc": {"port": 9000},
        "initialDelaySeconds": 900,
        "periodSeconds": 30,
        "timeoutSeconds": 10,
        "failureThreshold": 10,
    }
    assert containers
    for worker in containers.values():
        assert worker["readinessProbe"]["httpGet"] == {"path": "/health", "port": "serve"}
        assert "livenessProbe" not in worker  # KubeRay's Ray-level one


def test_ray_token_auth_comes_from_a_secret_and_the_dashboard_stays_inside(render):
    spec = cluster_spec(render)
    assert spec["authOptions"] == {"mode": "token", "secretName": "tessera-ray-auth"}
    head = spec["headGroupSpec"]
    assert head["enableIngress"] is False
    assert "serviceType" not in head  # KubeRay's default: a cluster-internal Service
    assert "dashboard-host" not in head["rayStartParams"]
    service = only(render, "RayService")["spec"]["serveService"]
    assert service["spec"]["type"] == "ClusterIP"
    assert {p["port"] for p in service["spec"]["ports"]}.isdisjoint({8265, 6379, 10001})


def test_head_pod_carries_prometheus_scrape_annotations(default_render):
    head = cluster_spec(default_render)["headGroupSpec"]["template"]["metadata"]
    assert head["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8000",
        "prometheus.io/path": "/metrics",
    }


def test_model_from_a_host_path_is_mounted_read_only_on_every_ray_pod():
    model = ("model.source=hostPath", "model.hostPath.path=/data/models")
    docs = documents(template(sets=(*model, "tessera.model=/models/SmolLM2-1.7B-Instruct")))
    spec = cluster_spec(docs)
    pods = [spec["headGroupSpec"]["template"]["spec"]] + [
        group["template"]["spec"] for group in spec["workerGroupSpecs"]
    ]
    for pod in pods:
        model = {"name": "model", "hostPath": {"path": "/data/models", "type": "Directory"}}
        assert model in pod["volumes"]
        mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model"]
        assert mounts == [{"name": "model", "mountPath": "/models", "readOnly": True}]


def test_gpu_groups_ask_kubernetes_for_their_gpus(gpu_render):
    spec = cluster_spec(gpu_render)
    for group in spec["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert pod["containers"][0]["image"] == "registry.example.com/tessera:0.1.0-gpu"
        assert pod["tolerations"] == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
    assert spec["autoscalerOptions"]["idleTimeoutSeconds"] == 300


def test_tensor_parallel_groups_get_a_pod_with_a_gpu_per_rank(gpu_tp_render):
    """The tensor-parallel example: its app runs worker groups of 2 ranks, and the pod
    that hosts a group offers both ranks' GPUs on one node."""
    rayservice = only(gpu_tp_render, "RayService")
    app = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]
    assert app["args"]["tensor_parallel_size"] == 2
    (group,) = cluster_spec(gpu_tp_render)["workerGroupSpecs"]
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
