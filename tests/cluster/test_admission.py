"""Global admission, autoscaling and start-up validation on real Ray."""

from __future__ import annotations

import asyncio
import time

import pytest

from tessera.cluster.config import ClusterConfig, ConfigError
from tessera.cluster.launch import Cluster
from tessera.scheduler.api import OverloadedError, WorkerStatus
from tessera.workers.api import FinishReason, InvalidRequestError, Request, SamplingParams
from tests.cluster.conftest import freed_within, running_cluster
from tests.helpers import tokens_of

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

LONG = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


async def _consume(stream):
    return [d async for d in stream]


async def _submit_or_refusal(cluster, request_id, params=LONG, **options):
    start = time.monotonic()
    try:
        stream = await cluster.submit(request_id, f"Count to ten, {request_id}.", params, **options)
    except OverloadedError as error:
        return error, time.monotonic() - start
    return stream, time.monotonic() - start


async def test_overload_is_refused_at_once_and_the_rest_complete(ray_session):
    async with running_cluster(workers=1, max_ongoing_requests=4, max_queued_requests=4) as cluster:
        results = await asyncio.gather(*(_submit_or_refusal(cluster, f"o-{i}") for i in range(12)))
        refused = [(r, t) for r, t in results if isinstance(r, OverloadedError)]
        streams = [r for r, _ in results if not isinstance(r, OverloadedError)]
        assert len(refused) == 4 and len(streams) == 8
        for error, seconds in refused:
            assert "max_queued_requests=4" in str(error) and error.retriable
            assert seconds < 5.0  # refused at once, not after waiting for a worker
        outputs = await asyncio.gather(*(_consume(s) for s in streams))
        for deltas in outputs:
            assert len(tokens_of(deltas)) == 32
            assert deltas[-1].finish_reason is FinishReason.LENGTH
        assert (await cluster.stats()).refused == 4

        # A queued request whose deadline passes is refused too, and leaves the queue.
        busy = await asyncio.gather(*(_submit_or_refusal(cluster, f"b-{i}") for i in range(4)))
        late, seconds = await _submit_or_refusal(cluster, "late", timeout_s=0.3)
        assert isinstance(late, OverloadedError) and "within its deadline" in str(late)
        assert 0.3 <= seconds < 5.0
        for stream, _ in busy:
            assert len(tokens_of([d async for d in stream])) == 32
        assert (await cluster.stats()).queued == 0

        # A bad request raises from submit, naming its field; the cluster goes on.
        with pytest.raises(InvalidRequestError, match="prompt: token id 999999 is out of"):
            await cluster.submit("bad", [1, 999999], LONG)
        with pytest.raises(InvalidRequestError, match="request_id: must not contain '#'"):
            await cluster.submit("bad#1", "hi", LONG)
        with pytest.raises(InvalidRequestError, match="timeout_s: must be a number > 0"):
            await cluster.submit("bad", "hi", LONG, timeout_s=0)
        with pytest.raises(InvalidRequestError, match="prompt: must be text or a list"):
            await cluster.submit("bad", None, LONG)
        with pytest.raises(InvalidRequestError, match="sampling: must be a SamplingParams"):
            await cluster.submit("bad", "hi", {"max_tokens": 3})
        stream = await cluster.submit("fine", "Hello", LONG)
        assert len(tokens_of([d async for d in stream])) == 32
        # A whole engine Request works too.
        ids = tuple(cluster.client.tokenizer("Hello").input_ids)
        stream = await cluster.submit(Request("whole", ids, LONG))
        assert len(tokens_of([d async for d in stream])) == 32

        # Closing the client aborts what still runs (4000 tokens would take minutes),
        # frees its blocks, releases its place, and leaves no task of it behind: one
        # that called into Ray after ``ray.shutdown`` would end the process.
        endless = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
        await cluster.submit("unread", "Hello", endless)
        worker = cluster.client.placement("unread").worker
        await cluster.client.close()
        assert cluster.client.placement("unread") is None
        assert asyncio.all_tasks() == {asyncio.current_task()}
        await freed_within(worker, "unread", 10.0)
        assert all(w.ongoing == 0 for w in (await cluster.stats()).workers)


async def test_pool_scales_up_under_load_and_drains_back(ray_session):
    async with running_cluster(
        workers=1,
        min_workers=1,
        max_workers=2,
        max_num_seqs=4,
        max_ongoing_requests=2,
        upscale_delay_s=0.5,
        downscale_delay_s=2.0,
    ) as cluster:
        failures: list[BaseException] = []
        done = 0

        async def one(i):
            nonlocal done
            try:
                stream = await cluster.submit(f"load-{i}", f"Story number {i}:", LONG)
                deltas = [d async for d in stream]
                assert len(tokens_of(deltas)) == 32
                done += 1
            except BaseException as error:  # noqa: BLE001 - collected and asserted below
                failures.append(error)

        # Sustained load: keep six requests in flight until the second worker serves.
        tasks: set[asyncio.Task] = set()
        deadline = time.monotonic() + 120
        scaled = False
        i = 0
        while not scaled and time.monotonic() < deadline:
            while len(tasks) < 6:
                task = asyncio.create_task(one(i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
            stats = await cluster.stats()
            healthy = [w for w in stats.workers if w.status is WorkerStatus.HEALTHY]
            scaled = len(healthy) == 2 and all(w.placed for w in healthy)
            await asyncio.sleep(0.1)
        assert scaled, f"the pool did not scale up: {stats}"
        await asyncio.gather(*tasks)
        assert not failures and done == i

        # Idle: the extra worker is drained and stopped, leaving min_workers.
        for _ in range(200):
            stats = await cluster.stats()
            if len(stats.workers) == 1:
                break
            await asyncio.sleep(0.1)
        assert len(stats.workers) == 1, stats
        assert any("scaled mixed up to 2" in e for e in stats.events)
        assert any("stopped drained worker" in e for e in stats.events)
        stream = await cluster.submit("after", "Hello", LONG)
        assert len(tokens_of([d async for d in stream])) == 32


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"workers": 0}, "workers: the cluster needs at least one worker, got 0"),
        ({"block_size": 0}, "block_size: Input should be greater than or equal to 1, got 0"),
        ({"kv_cache_memory": 10**15}, "kv_cache_memory: 1000000000000000 bytes per worker"),
        ({"model": "/no/such/model.gguf"}, "model: path '/no/such/model.gguf' does not exist"),
        ({"placement": "random"}, "placement: must be one of"),
    ],
)
async def test_invalid_config_fails_at_start_naming_the_field(fields, message):
    with pytest.raises(ConfigError) as info:
        await Cluster.start(ClusterConfig.create(**fields))
    assert str(info.value).startswith(message)
