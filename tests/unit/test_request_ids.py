"""Requests cannot reach into others': a gRPC request runs under an id scoped to its
caller's credential (``grpc_access.scoped_id``), so ``Abort`` reaches only the caller's
own; the scheduler refuses a new request under the id of one that runs, so one front
end's request never moves another's place."""

from __future__ import annotations

import asyncio

import pytest

from tessera.cluster.config import ClusterConfig
from tessera.cluster.grpc_access import MAX_REQUEST_ID_CHARS, check_request_id, scoped_id
from tessera.cluster.launch import scheduler_config
from tessera.cluster.openai_errors import APIError, api_error
from tessera.scheduler.actor import Scheduler
from tessera.scheduler.api import Placement, Refusal, RequestIdInUseError
from tessera.scheduler.registry import WorkerRecord
from tessera.workers.process.protocol import WorkerInfo


def test_ids_are_scoped_to_the_callers_credential():
    alice, bob = b"Bearer alice", b"Bearer bob"
    assert scoped_id(alice, "req-1") == scoped_id(alice, "req-1")  # Abort finds it
    assert scoped_id(alice, "req-1") != scoped_id(bob, "req-1")  # no collision, no reach
    assert scoped_id(b"", "req-1") != scoped_id(alice, "req-1")
    assert scoped_id(alice, "req-1") != scoped_id(alice, "req-2")
    scoped = scoped_id(alice, "chatcmpl-" + "0" * 32)  # an HTTP request's id: out of reach
    assert scoped.startswith("grpc-") and len(scoped) == 37 and "#" not in scoped


def test_request_ids_are_bounded():
    check_request_id("x" * MAX_REQUEST_ID_CHARS)
    check_request_id("", allow_empty=True)
    with pytest.raises(APIError, match="^request_id: must not be empty"):
        check_request_id("")
    with pytest.raises(APIError, match="^request_id: is 257 characters, over the limit of 256"):
        check_request_id("x" * (MAX_REQUEST_ID_CHARS + 1))


def _scheduler() -> Scheduler:
    config = ClusterConfig.create(workers=1, max_ongoing_requests=1, max_queued_requests=4)
    scheduler = Scheduler(scheduler_config(config, "cpu", 0, 1))
    scheduler.registry.add(WorkerRecord("mixed-0", "mixed", handle=None))
    scheduler.register(
        WorkerInfo(
            worker_id="mixed-0",
            role="mixed",
            incarnation="first",
            hash_keys=("model", "float32"),
            block_size=4,
            total_blocks=64,
            max_num_seqs=8,
            max_model_len=512,
            vocab_size=100,
            node_id="node",
            pid=1,
        )
    )
    return scheduler


def test_a_new_request_under_a_running_ones_id_is_refused():
    async def run() -> None:
        scheduler = _scheduler()
        first = await scheduler.place("r1", [])
        assert isinstance(first, Placement)
        again = await scheduler.place("r1", [])  # another front end, the same id
        assert isinstance(again, Refusal) and again.error is RequestIdInUseError
        error = api_error(again.error(again.message))
        assert (error.status, error.message) == (
            400,
            "request_id: another running request has this id",
        )
        assert scheduler.registry.placed_on("r1") is not None  # the first keeps its place
        moved = await scheduler.place("r1", [], failover=True)  # a failover moves it
        assert isinstance(moved, Placement)
        # waiting in the queue counts too (the worker's one place is taken)
        waiting = asyncio.ensure_future(scheduler.place("r2", [], timeout_s=5))
        await asyncio.sleep(0)
        assert scheduler.queue.holds("r2")
        assert isinstance(await scheduler.place("r2", []), Refusal)
        scheduler.release("r2")  # its caller left
        assert isinstance(await waiting, Refusal)

    asyncio.run(run())
