"""The chart lints and renders for the supported configurations, refuses bad values with a
message naming the value, keeps its settings schema in step with ``ServeConfig``, and
``k8s/`` is exactly a fresh render."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest

from tests.deploy.chart_schema import SCHEMA, engine_properties, values_schema
from tests.deploy.helm import (
    CHART,
    GPU_EXAMPLE,
    GPU_TP_EXAMPLE,
    K8S_MANIFEST,
    RELEASE,
    HelmError,
    documents,
    k8s_manifest,
    only,
    run_helm,
    template,
)

#: ServeConfig fields the chart sets itself, so its values refuse them under ``tessera``.
CHART_OWNED = {
    "api_key",  # from the Secret in apiKey, never in the RayService in clear
    "api_key_file",  # likewise: the chart hands the key over from its Secret
    "host",  # Serve's proxy listens on 0.0.0.0 in a pod
    "address",  # the app runs inside the Ray cluster
    "role_resources",  # worker groups offer tessera-<role>; always on
    "kv_transfer_host",  # 0.0.0.0 in a pod; a worker advertises its node's IP
    "kv_transfer_tls_cert",  # the kvTransferTLS Secret's files
    "kv_transfer_tls_key",
    "kv_transfer_tls_ca",
    "kv_transfer_tls_server_name",  # kvTransferTLS.serverName, the shared certificate's name
}
SCHEMA_ERROR = (
    "Error: values don't meet the specifications of the schema(s) in the following chart(s):\n"
    "tessera:\n"
)
TEMPLATE_ERROR = "Error: execution error at (tessera/templates/rayservice.yaml:1:4): "


@pytest.mark.parametrize(
    "values",
    [[], [GPU_EXAMPLE], [GPU_TP_EXAMPLE]],
    ids=["default", "gpu-disagg", "gpu-tensor-parallel"],
)
def test_lint_strict_passes(values: list[Path]):
    """``helm lint --strict`` finds nothing to warn about (an INFO line is not a warning)."""
    args = [arg for path in values for arg in ("-f", path)]
    out = run_helm("lint", "--strict", CHART, *args)
    assert "1 chart(s) linted, 0 chart(s) failed" in out
    assert "[WARNING]" not in out and "[ERROR]" not in out


def test_default_and_gpu_renders_hold_the_rayservice_and_the_test_pod(render):
    """A render is the NetworkPolicy, the Grafana dashboard's ConfigMap, the RayService
    and the ``helm test`` pod; the ServiceMonitor is opt-in."""
    assert [(doc["apiVersion"], doc["kind"]) for doc in render] == [
        ("networking.k8s.io/v1", "NetworkPolicy"),
        ("v1", "ConfigMap"),
        ("ray.io/v1", "RayService"),
        ("v1", "Pod"),
    ]


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        # wrong types
        (
            "workerGroups.mixed.replicas=two",
            "- at '/workerGroups/mixed/replicas': got string, want integer",
        ),
        ("tessera.max_num_seqs=lots", "- at '/tessera/max_num_seqs': got string, want integer"),
        ("autoscaling.enabled=maybe", "- at '/autoscaling/enabled': got string, want boolean"),
        # unknown roles and settings
        (
            "workerGroups.gpu.replicas=1",
            "- at '/workerGroups': additional properties 'gpu' not allowed",
        ),
        ("tessera.max_worker=4", "- at '/tessera': additional properties 'max_worker' not allowed"),
        ("tessera.api_key=secret", "- at '/tessera': additional properties 'api_key' not allowed"),
        # negative counts
        (
            "workerGroups.decode.replicas=-1",
            "- at '/workerGroups/decode/replicas': minimum: got -1, want 0",
        ),
        (
            "workerGroups.prefill.maxReplicas=-2",
            "- at '/workerGroups/prefill/maxReplicas': minimum: got -2, want 0",
        ),
        # a model volume without its source
        (
            "model.source=pvc",
            "- at '/model': 'allOf' failed\n"
            "  - at '/model/pvc/claimName': minLength: got 0, want 1",
        ),
    ],
)
def test_schema_refuses_bad_values(assignment: str, message: str):
    """values.schema.json stops ``helm template`` and ``helm lint`` alike, naming the value."""
    with pytest.raises(HelmError) as template_error:
        template(sets=(assignment,))
    assert str(template_error.value) == SCHEMA_ERROR + message
    with pytest.raises(HelmError) as lint_error:
        run_helm("lint", "--strict", CHART, "--set", assignment)
    assert message in lint_error.value.output


@pytest.mark.parametrize(
    ("assignments", "message"),
    [
        (
            ("workerGroups.mixed.minReplicas=3",),
            "workerGroups.mixed: minReplicas (3) is above maxReplicas (1)",
        ),
        (
            ("workerGroups.mixed.maxReplicas=4", "workerGroups.mixed.replicas=5"),
            "workerGroups.mixed: replicas (5) must be between minReplicas (1) and maxReplicas (4)",
        ),
        (
            ("tessera.workers=3",),
            "tessera.workers: 3 mixed workers do not fit workerGroups.mixed "
            "(maxReplicas 1 x workersPerPod 1 = 1)",
        ),
        (
            ("tessera.prefill_workers=2",),
            "tessera.prefill_workers: 2 prefill workers need workerGroups.prefill, "
            "which is disabled",
        ),
        (
            ("workerGroups.mixed.gpus=1",),
            "tessera.device: worker groups have GPUs, so device must be cuda, got auto "
            "(auto picks the CPU while no GPU pod has started yet)",
        ),
        (
            (
                "workerGroups.mixed.gpus=1",
                "workerGroups.mixed.workersPerPod=2",
                "tessera.device=cuda",
            ),
            "workerGroups.mixed: workersPerPod (2) is above gpus (1); each worker takes one GPU",
        ),
        (
            (
                "workerGroups.mixed.gpus=1",
                "tessera.tensor_parallel_size=2",
                "tessera.device=cuda",
            ),
            "workerGroups.mixed: workersPerPod (1) x tensor_parallel_size (2) is above gpus "
            "(1); each rank of a worker group takes one GPU on the same node",
        ),
        (("workerGroups.mixed.enabled=false",), "workerGroups: no worker group is enabled"),
        (
            ("model.source=pvc", "model.pvc.claimName=models"),
            "tessera.model: give the model's path under /models (model.source is pvc)",
        ),
    ],
)
def test_template_refuses_values_that_contradict_each_other(
    assignments: tuple[str, ...], message: str
):
    """Relations between values (min > max, workers that no group can host) are beyond JSON
    Schema; the chart's template stops the render with the same kind of message."""
    with pytest.raises(HelmError) as error:
        template(sets=assignments)
    assert str(error.value).splitlines()[0] == TEMPLATE_ERROR + message


def test_settings_schema_lists_exactly_the_serve_config_fields_users_set():
    """``tessera`` in values.schema.json is ServeConfig less what the chart owns, with the
    same choices for the enumerated fields: a new setting fails here until the chart takes it."""
    from tessera.cluster.config import ServeConfig

    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["tessera"]
    settings, listed = set(ServeConfig.model_fields) - CHART_OWNED, set(schema["properties"])
    assert settings - listed == set(), "ServeConfig settings that the chart's schema lacks"
    assert listed - settings == set(), "settings in the chart's schema that ServeConfig lacks"
    for name, field in ServeConfig.model_fields.items():
        if typing.get_origin(field.annotation) is typing.Literal:
            assert schema["properties"][name]["enum"] == list(typing.get_args(field.annotation))


def test_engine_settings_schema_is_generated_from_their_declaration():
    """Each engine setting's property (type, bounds, description, default) is what
    ``EngineConfig``'s declaration makes of it: ``python -m tests.deploy.helm`` rewrites them."""
    schema = json.loads(SCHEMA.read_text())["properties"]["tessera"]["properties"]
    for name, expected in engine_properties().items():
        assert schema.get(name) == expected, name
    assert SCHEMA.read_text() == values_schema()


@pytest.mark.parametrize("values", [[], [GPU_EXAMPLE]], ids=["default", "gpu-disagg"])
def test_notes_tell_where_the_http_and_grpc_apis_are(values: list[Path]):
    """NOTES.txt, as ``helm install`` prints it (a client-side dry run, no cluster)."""
    args = [arg for path in values for arg in ("-f", path)]
    out = run_helm("install", RELEASE, CHART, "-n", "llm", "--dry-run=client", *args)
    notes = out.split("NOTES:\n", 1)[1]
    assert "HTTP (OpenAI API): http://tessera-serve-svc.llm.svc:8000/v1" in notes
    assert "gRPC (tessera.v1.Generation, grpc.health.v1): tessera-serve-svc.llm.svc:9000" in notes
    assert "kubectl port-forward -n llm svc/tessera-serve-svc 8000:8000 9000:9000" in notes


def test_service_monitor_selects_the_serve_service():
    """With metrics.serviceMonitor.enabled, the ServiceMonitor's selector matches the serve
    Service's labels and scrapes its `serve` port."""
    docs = documents(template(sets=("metrics.serviceMonitor.enabled=true",)))
    monitor = only(docs, "ServiceMonitor")
    labels = only(docs, "RayService")["spec"]["serveService"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    endpoint = {"port": "serve", "path": "/metrics", "interval": "30s"}
    # /metrics needs the API key: sent from its Secret as a bearer token
    bearer = {"type": "Bearer", "credentials": {"name": "tessera-api-key", "key": "api-key"}}
    assert monitor["spec"]["endpoints"] == [{**endpoint, "authorization": bearer}]
    docs = documents(
        template(sets=("metrics.serviceMonitor.enabled=true", "tessera.metrics_open=true"))
    )
    assert only(docs, "ServiceMonitor")["spec"]["endpoints"] == [endpoint]


def test_serve_grpc_message_cap_is_the_request_cap():
    """Serve's gRPC proxy takes no message larger than ``max_request_bytes`` (given as a
    size, as the settings take it), on every Ray container."""
    for size, expected in (("4MiB", "4194304"), ("512KiB", "524288"), ("2MB", "2000000")):
        docs = documents(template(sets=(f"tessera.max_request_bytes={size}",)))
        spec = only(docs, "RayService")["spec"]["rayClusterConfig"]
        pods = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        for pod in pods:
            for container in pod["template"]["spec"]["containers"]:
                if container["name"] == "autoscaler":
                    continue
                env = {e["name"]: e.get("value") for e in container.get("env", [])}
                assert env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] == expected, container["name"]


def test_k8s_manifests_equal_a_fresh_render():
    """k8s/ is the chart rendered with its defaults; regenerate it with
    ``python -m tests.deploy.helm`` after a chart change."""
    assert K8S_MANIFEST.read_text() == k8s_manifest(), (
        "k8s/tessera.yaml is stale: run `.venv/bin/python -m tests.deploy.helm`"
    )
