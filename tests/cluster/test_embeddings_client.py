"""The cluster client's embeddings call, the one layer under test: the scheduler and
the worker are stand-in Ray actors (the real ones are tested through the openai client
in test_serve.py). A worker whose KV pool running requests hold has no room for an input
now: the front end answers a retriable 429, not a 500 or "a part of the cluster failed",
and the place is released."""

from __future__ import annotations

import pytest
import ray

from tessera.cluster.client import ClusterClient
from tessera.cluster.openai_errors import api_error
from tessera.scheduler.api import OverloadedError, Placement
from tessera.workers.api import EmbeddingCapacityError

FULL = "the KV pool has 0 free blocks, too few for an input of 9 tokens"


@ray.remote
class BusyWorker:
    def embed(self, inputs):
        raise EmbeddingCapacityError(FULL)


@ray.remote
class OneWorkerScheduler:
    def __init__(self, worker) -> None:
        self.worker = worker
        self.released: list[str] = []

    def place(self, request_id, *args):
        return Placement(request_id, "w0", "first", self.worker, 0)

    def release(self, request_id) -> None:
        self.released.append(request_id)

    def releases(self) -> list[str]:
        return self.released


async def test_a_pool_held_by_running_requests_is_a_retriable_429(ray_session):
    scheduler = OneWorkerScheduler.remote(BusyWorker.remote())
    client = ClusterClient(scheduler, tokenizer=None)
    with pytest.raises(OverloadedError) as refused:
        await client.embed("embd-1", [[1] * 9])
    message = f"the worker's KV pool is held by running requests: {FULL}"
    assert str(refused.value) == message
    error = api_error(refused.value)
    assert (error.status, error.message, error.headers["Retry-After"]) == (429, message, "1")
    assert await scheduler.releases.remote() == ["embd-1"]
