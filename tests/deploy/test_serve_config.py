"""What Ray and Tessera make of the rendered RayService: Serve accepts its ``serveConfigV2``,
the application and gRPC services it names import, ``ServeConfig`` accepts its ``args``, and
Ray's autoscaler reads each worker group's resources as the workers will ask for them."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import yaml

from tests.deploy.helm import only


def serve_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(only(docs, "RayService")["spec"]["serveConfigV2"])


def resolve(dotted: str) -> Any:
    """``module.attr`` or ``module:attr`` -> the object, imported."""
    module, _, name = dotted.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_serve_config_passes_ray_serve_schema(render):
    """Ray's own schema of a Serve deploy config (what the dashboard checks) takes it."""
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(serve_config(render))
    (app,) = config.applications
    assert (app.name, app.route_prefix) == ("tessera", "/")
    assert config.http_options.host == "0.0.0.0"


def test_the_application_and_grpc_servicers_import(default_render):
    """Serve imports these paths in the pods: each resolves to a callable here."""
    config = serve_config(default_render)
    (app,) = config["applications"]
    assert callable(resolve(app["import_path"]))
    for path in config["grpc_options"]["grpc_servicer_functions"]:
        assert callable(resolve(path)), path


def test_grpc_servicers_are_the_ones_tessera_serve_registers(default_render):
    from tessera.cluster.grpc_api import SERVICER_FUNCTIONS

    functions = serve_config(default_render)["grpc_options"]["grpc_servicer_functions"]
    assert functions == list(SERVICER_FUNCTIONS)


def test_args_are_a_valid_serve_config_with_the_key_from_the_secret(render, monkeypatch):
    """``args`` pass ``ServeConfig.create`` as the app is built: the API key is not in the
    RayService but in $TESSERA_API_KEY, which the head's container gets from the Secret (the
    app is built where KubeRay deploys it, and its replicas get the key with their
    deployment); no worker pod holds it."""
    from tessera.cluster.config import ServeConfig

    (app,) = serve_config(render)["applications"]
    assert "api_key" not in app["args"]
    monkeypatch.setenv("TESSERA_API_KEY", "from-the-secret")
    config = ServeConfig.create(**app["args"])
    key = config.api_key
    assert getattr(key, "get_secret_value", lambda: key)() == "from-the-secret"
    assert config.role_resources is True

    spec = only(render, "RayService")["spec"]["rayClusterConfig"]
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    from_secret = {"secretKeyRef": {"name": "tessera-api-key", "key": "api-key"}}
    assert {"name": "TESSERA_API_KEY", "valueFrom": from_secret} in head["env"]
    for group in spec["workerGroupSpecs"]:
        (worker,) = group["template"]["spec"]["containers"]
        assert "TESSERA_API_KEY" not in {env["name"] for env in worker.get("env", [])}
        assert "tessera-api-key" not in str(group)


def test_gpu_example_starts_two_prefill_and_four_decode_workers_with_mtls(gpu_render):
    from tessera.cluster.config import ServeConfig

    (app,) = serve_config(gpu_render)["applications"]
    config = ServeConfig.create(**app["args"])
    assert (config.workers, config.prefill_workers, config.decode_workers) == (0, 2, 4)
    assert (config.kv_transfer_tls_cert, config.kv_transfer_tls_key, config.kv_transfer_tls_ca) == (
        "/etc/tessera/kv-tls/tls.crt",
        "/etc/tessera/kv-tls/tls.key",
        "/etc/tessera/kv-tls/ca.crt",
    )
    # one certificate for every worker: checked by its name, not the pod IP dialled
    assert config.kv_transfer_tls_server_name == "tessera-kv"
    spec = only(gpu_render, "RayService")["spec"]["rayClusterConfig"]
    assert spec["enableInTreeAutoscaling"] is True
    groups = {group["groupName"]: group for group in spec["workerGroupSpecs"]}
    assert [(name, group["replicas"]) for name, group in groups.items()] == [
        ("prefill", 2),
        ("decode", 4),
    ]
    for group in groups.values():
        pod = group["template"]["spec"]
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "kv-tls"]
        assert mount == {"name": "kv-tls", "mountPath": "/etc/tessera/kv-tls", "readOnly": True}
        assert {"name": "kv-tls", "secret": {"secretName": "tessera-kv-tls"}} in pod["volumes"]


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ("default", {"mixed": {"CPU": 2, "tessera-mixed": 1}}),
        (
            "gpu",
            {
                "prefill": {"CPU": 8, "GPU": 1, "tessera-prefill": 1},
                "decode": {"CPU": 8, "GPU": 1, "tessera-decode": 1},
            },
        ),
    ],
)
def test_ray_autoscaler_sees_each_group_offer_its_role(values, expected, request):
    """Ray's KubeRay autoscaler derives node types from the RayCluster spec this way: a
    group of role R offers ``tessera-R`` (what Tessera's R workers ask for with
    role_resources) and its GPUs; the head offers no CPU and no role, so no worker lands there."""
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )

    render = request.getfixturevalue(f"{values}_render")
    rayservice = only(render, "RayService")
    cluster = {
        "metadata": {"name": rayservice["metadata"]["name"], "namespace": "default"},
        "spec": rayservice["spec"]["rayClusterConfig"],
    }
    node_types = _derive_autoscaling_config_from_ray_cr(cluster)["available_node_types"]
    offered = {
        name: {k: v for k, v in node["resources"].items() if k != "memory"}
        for name, node in node_types.items()
    }
    assert offered == {"headgroup": {"CPU": 0}, **expected}
