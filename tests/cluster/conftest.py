"""Helpers to start Tessera clusters on the session's Ray (``ray_session`` in
``tests/conftest.py``) and stop exactly what they started."""

from __future__ import annotations

import asyncio
import contextlib
import time

from tests.helpers import RAY_NAMESPACE


def cluster_config(**fields):
    """A test cluster: float32, a small KV pool, quick reports, one CPU per worker."""
    from tessera.cluster.config import ClusterConfig

    fields.setdefault("dtype", "float32")  # the exact mode (the entry points pick auto)
    fields.setdefault("stream_interval", 1)  # a delta per step, as the tests count them
    fields.setdefault("num_kv_blocks", 256)
    fields.setdefault("report_interval_s", 0.1)
    fields.setdefault("namespace", RAY_NAMESPACE)
    fields.setdefault("device", "cpu")
    fields.setdefault("worker_num_cpus", 1)  # the session's Ray has 2 CPUs for all clusters
    return ClusterConfig.create(**fields)


@contextlib.asynccontextmanager
async def running_cluster(**fields):
    """Start a Tessera cluster on the session's Ray; shut it down afterwards."""
    from tessera.cluster.launch import Cluster

    cluster = await Cluster.start(cluster_config(**fields))
    try:
        yield cluster
    finally:
        await cluster.shutdown()


@contextlib.contextmanager
def running_cluster_sync(**fields):
    """``running_cluster`` for fixtures shared by several tests: start and stop run in
    their own event loops (Ray handles work from any loop)."""
    from tessera.cluster.launch import Cluster

    cluster = asyncio.run(Cluster.start(cluster_config(**fields)))
    try:
        yield cluster
    finally:
        asyncio.run(cluster.shutdown())


async def freed_within(worker, request_id: str, seconds: float) -> float:
    """Seconds until the request is gone from ``worker`` (a ``WorkerActor`` handle) and
    its pool is all free (cached blocks count as free)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        stats = await worker.engine_stats.remote()
        gone = not await worker.has_request.remote(request_id)
        if gone and stats.free_blocks == stats.total_blocks:
            return time.monotonic() - start
        await asyncio.sleep(0.02)
    raise AssertionError(f"{request_id} still on its worker after {seconds} s")
