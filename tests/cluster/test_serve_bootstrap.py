"""The Serve app starts the cluster itself when deployed on a Ray cluster that has none
(``serve run tessera.cluster.serve_app:app_builder`` or KubeRay's ``serveConfigV2``): its first
replica creates the scheduler, detached, which starts the workers."""

from __future__ import annotations

import socket

import httpx
import pytest
import ray
from ray import serve

from tessera.cluster.serve_app import app_builder

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NAMESPACE = "serve-bootstrap-test"


def test_app_builder_bootstraps_the_scheduler_and_workers(ray_session):
    with pytest.raises(ValueError):  # nothing running yet
        ray.get_actor("tessera-scheduler", namespace=NAMESPACE)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = {  # as serveConfigV2 or `serve run ... key=value` pass them: strings
        "namespace": NAMESPACE,
        "num_kv_blocks": "128",
        "device": "cpu",
        "report_interval_s": "0.1",
        "worker_num_cpus": "1",
    }
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(app_builder(args), name="bootstrap", route_prefix="/")
        scheduler = ray.get_actor("tessera-scheduler", namespace=NAMESPACE)
        url = f"http://127.0.0.1:{port}"
        health = httpx.get(f"{url}/health")
        assert health.json().get("healthy_workers") == 1, (health.status_code, health.text)
        done = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert done.status_code == 200, done.text
        assert done.json()["usage"]["completion_tokens"] == 4
        serve.shutdown()
        # Detached: the scheduler and its worker outlive the app's replicas.
        stats = ray.get(scheduler.stats.remote())
        assert [w.status.value for w in stats.workers] == ["healthy"]
    finally:
        serve.shutdown()
        try:
            scheduler = ray.get_actor("tessera-scheduler", namespace=NAMESPACE)
        except ValueError:
            pass
        else:
            ray.get(scheduler.shutdown.remote())
            ray.kill(scheduler, no_restart=True)
