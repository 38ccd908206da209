"""One real local Ray cluster (``num_cpus=2``) for the whole test session, and helpers
to start Tessera clusters on it and stop exactly what they started."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

ray = pytest.importorskip("ray")

NAMESPACE = "tessera-tests"


@pytest.fixture(scope="session")
def ray_session():
    """The session's Ray cluster; ``ray.shutdown`` stops the local cluster it started."""
    ray.init(
        num_cpus=2,
        namespace=NAMESPACE,
        include_dashboard=False,
        object_store_memory=150 * 2**20,
        log_to_driver=False,
    )
    yield
    ray.shutdown()


def cluster_config(**fields):
    """A test cluster: float32, a small KV pool, quick reports, one CPU per worker."""
    from cluster.config import ClusterConfig

    fields.setdefault("num_kv_blocks", 256)
    fields.setdefault("report_interval_s", 0.1)
    fields.setdefault("namespace", NAMESPACE)
    fields.setdefault("device", "cpu")
    return ClusterConfig.create(**fields)


@contextlib.asynccontextmanager
async def running_cluster(**fields):
    """Start a Tessera cluster on the session's Ray; shut it down afterwards."""
    from cluster.launch import Cluster

    cluster = await Cluster.start(cluster_config(**fields))
    try:
        yield cluster
    finally:
        await cluster.shutdown()


@contextlib.contextmanager
def running_cluster_sync(**fields):
    """``running_cluster`` for fixtures shared by several tests: start and stop run in
    their own event loops (Ray handles work from any loop)."""
    from cluster.launch import Cluster

    cluster = asyncio.run(Cluster.start(cluster_config(**fields)))
    try:
        yield cluster
    finally:
        asyncio.run(cluster.shutdown())
