"""The cluster on real Ray: outputs, placement, abort and failover over two workers.

One two-worker cluster serves the module (starting one takes ~20 s on two cores).
Each test sets the placement policy it needs. The failover test kills workers; it
waits for them to come back, so the tests stay independent of their order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest
import ray

from tessera.cluster.client import ClusterClient
from tessera.scheduler.api import WorkerStatus
from tessera.workers.api import (
    FinishReason,
    Request,
    RequestOutput,
    SamplingParams,
    StructuredParams,
)
from tessera.workers.process.channel import END, read_frame
from tests.cluster.conftest import freed_within, running_cluster_sync
from tests.helpers import (
    ABSTRACT_SOCKETS,
    LINUX_ONLY,
    engine_outputs,
    read_through_a_fault,
    text_of,
    tokens_of,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
SYSTEM = (
    "You are a careful assistant for a shipping company. Answer questions about "
    "parcels, delivery windows, customs forms and returns in two short sentences, "
    "and never invent tracking numbers. "
)


@pytest.fixture(scope="module")
def cluster(ray_session):
    with running_cluster_sync(workers=2, max_num_seqs=16, max_ongoing_requests=16) as cluster:
        yield cluster


async def collect(cluster, request_id, prompt, params):
    return [d async for d in await cluster.submit(request_id, prompt, params)]


async def channel_deltas(receive, requests, batches=None) -> dict[str, list]:
    """Each request's deltas from a channel's batches (``await receive()``, and then
    its value awaited too where it is a Ray ref) until every request has ended."""
    deltas: dict[str, list] = {request_id: [] for request_id, _, _ in requests}
    ended = set()
    while len(ended) < len(requests):
        batch = await receive()
        batch = await batch if isinstance(batch, ray.ObjectRef) else batch
        if batches is not None:
            batches.append(batch)
        for request_id, item in batch:
            assert request_id not in ended
            if item is END:
                ended.add(request_id)
            else:
                deltas[request_id].append(item)
    return deltas


def assert_as_the_engine(make_engine, requests, deltas) -> None:
    expected = engine_outputs(make_engine(), requests)
    for request_id, _, _ in requests:
        assert tokens_of(deltas[request_id]) == tokens_of(expected[request_id]), request_id
        assert text_of(deltas[request_id]) == text_of(expected[request_id]), request_id


async def placed(cluster) -> dict[str, int]:
    return {w.worker_id: w.placed for w in (await cluster.stats()).workers}


async def settle(cluster) -> None:
    """Wait until no request is placed and every worker has reported since."""
    for _ in range(100):
        stats = await cluster.stats()
        if not any(w.ongoing for w in stats.workers) and all(
            w.status is WorkerStatus.HEALTHY for w in stats.workers
        ):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # > report_interval_s: the prefix index is up to date


async def test_outputs_equal_the_single_engine(cluster, make_engine):
    await cluster.scheduler.set_placement.remote("least_loaded")
    before = await placed(cluster)
    topics = ["the sea", "mountains", "a robot", "bread", "the moon", "rain", "chess", "tea"]
    requests = [
        (f"eq-{i}", f"Write one sentence about {topics[i % 8]} ({i}).", GREEDY) for i in range(16)
    ]
    outputs = await asyncio.gather(*(collect(cluster, *r) for r in requests))
    expected = engine_outputs(make_engine(), requests)
    for (request_id, _, _), deltas in zip(requests, outputs, strict=True):
        assert tokens_of(deltas) == tokens_of(expected[request_id]), request_id
        assert text_of(deltas) == text_of(expected[request_id]), request_id
        assert deltas[-1].finish_reason is FinishReason.LENGTH
        assert all(d.request_id == request_id for d in deltas)
    after = await placed(cluster)
    assert all(after[w] > before[w] for w in after), "both workers must have served requests"
    assert sum(after.values()) - sum(before.values()) == 16


async def test_prefix_affinity_follows_the_prefix_and_round_robin_spreads(cluster):
    await settle(cluster)
    await cluster.scheduler.set_placement.remote("prefix_affinity")
    prefix = SYSTEM * 2  # ~90 tokens: several full blocks
    start = await placed(cluster)
    await collect(cluster, "aff-first", prefix + "Where is my parcel?", GREEDY)
    first = await placed(cluster)
    (holder,) = [w for w in first if first[w] > start[w]]
    await settle(cluster)  # the holder has reported the prefix's blocks
    hits_before = (await cluster.stats()).worker(holder).load.engine.prefix_cache.hits

    questions = [f"Question {i}: can I return a parcel after {i + 2} days?" for i in range(6)]
    await asyncio.gather(
        *(collect(cluster, f"aff-{i}", prefix + q, GREEDY) for i, q in enumerate(questions))
    )
    after = await placed(cluster)
    assert after[holder] - first[holder] == 6
    assert all(after[w] == first[w] for w in after if w != holder)
    await settle(cluster)
    stats = await cluster.stats()
    prefix_blocks = len(cluster.client.tokenizer(prefix).input_ids) // 16
    assert (
        stats.worker(holder).load.engine.prefix_cache.hits - hits_before >= 6 * prefix_blocks * 16
    )

    await cluster.scheduler.set_placement.remote("round_robin")
    await asyncio.gather(
        *(collect(cluster, f"rr-{i}", prefix + q, GREEDY) for i, q in enumerate(questions))
    )
    spread = await placed(cluster)
    assert sorted(spread[w] - after[w] for w in spread) == [3, 3]


async def _worker_of(cluster) -> str:
    """The worker holding the one request in flight."""
    for _ in range(100):
        busy = [w for w in (await cluster.stats()).workers if w.ongoing]
        if busy:
            return busy[0].worker_id
        await asyncio.sleep(0.02)
    raise AssertionError("no worker holds the request")


async def test_a_cancelled_stream_is_aborted_and_its_blocks_freed(cluster):
    await settle(cluster)
    long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    stream = await cluster.submit("leaver", "Tell me a very long story about a lighthouse.", long)
    worker_id = await _worker_of(cluster)
    worker = await cluster.scheduler.worker_handle.remote(worker_id)
    got = 0
    async for delta in stream:
        got += len(delta.token_ids)
        if got >= 3:
            break
    await stream.aclose()  # the caller goes away
    assert await freed_within(worker, "leaver", 1.0) <= 1.0
    await worker.check_integrity.remote()

    # Closed straight after submit, never read: aborted, and its place freed too.
    stream = await cluster.submit("unread", "Tell me a long story about a ship.", long)
    await stream.aclose()
    stats = await _wait_for(cluster, lambda s: not any(w.ongoing for w in s.workers), "release")
    for state in stats.workers:
        handle = await cluster.scheduler.worker_handle.remote(state.worker_id)
        await freed_within(handle, "unread", 5.0)

    stream = await cluster.submit("stopped", "Tell me another long story.", long)
    worker_id = await _worker_of(cluster)
    worker = await cluster.scheduler.worker_handle.remote(worker_id)
    first = await anext(stream)
    assert await cluster.abort("stopped")
    rest = [d async for d in stream]
    assert rest[-1].finish_reason is FinishReason.ABORT
    assert len(tokens_of([first, *rest])) < 300
    assert await freed_within(worker, "stopped", 1.0) <= 1.0


async def test_a_channel_carries_each_step_of_its_requests_as_one_batch(cluster, make_engine):
    await settle(cluster)
    worker_id = (await cluster.stats()).workers[0].worker_id
    worker = await cluster.scheduler.worker_handle.remote(worker_id)
    tokenize = cluster.client.tokenizer
    requests = [
        (f"ch-{i}", tokenize(f"Write one sentence about {topic}.").input_ids, GREEDY)
        for i, topic in enumerate(["owls", "glass", "snow"])
    ]
    with pytest.raises(ray.exceptions.RayTaskError, match="channel 'nowhere' is not open"):
        await worker.start.remote("nowhere", Request(*requests[0]))

    channel = worker.deltas.remote("test-channel")
    assert await (await anext(channel)) == []  # open
    for request_id, prompt, params in requests:
        accepted = await worker.start.remote("test-channel", Request(request_id, prompt, params))
        assert accepted.request_id == request_id
    batches = []
    deltas = await channel_deltas(lambda: anext(channel), requests, batches)
    # a step of three running requests travels as one item, not one per token
    assert max(len({request_id for request_id, _ in batch}) for batch in batches) == 3
    assert len(batches) < sum(map(len, deltas.values()))
    assert_as_the_engine(make_engine, requests, deltas)

    # Closing a channel aborts what it still carries: the blocks go back at once.
    long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    await worker.start.remote("test-channel", Request("ch-long", requests[0][1], long))
    await (await anext(channel))
    ray.cancel(channel)
    assert await freed_within(worker, "ch-long", 2.0) <= 2.0
    with pytest.raises(ray.exceptions.RayTaskError, match="channel 'test-channel' is not open"):
        await worker.start.remote("test-channel", Request(*requests[0]))

    # A caller that stops touching its channel is gone (Ray would stream on to a dead
    # caller): the channel ends and aborts its requests.
    channel = worker.deltas.remote("untouched", 1.0)
    assert await (await anext(channel)) == []
    assert await worker.touch.remote("untouched")
    await worker.start.remote("untouched", Request("ch-orphan", requests[0][1], long))
    assert await freed_within(worker, "ch-orphan", 5.0) >= 0.5
    assert not await worker.touch.remote("untouched")
    with pytest.raises(StopAsyncIteration):
        while True:
            await (await anext(channel))
    await worker.check_integrity.remote()


@LINUX_ONLY
async def test_a_channel_from_the_workers_node_runs_over_its_socket(cluster, make_engine):
    await settle(cluster)
    worker_id = (await cluster.stats()).workers[0].worker_id
    worker = await cluster.scheduler.worker_handle.remote(worker_id)
    address = await worker.channel_socket.remote()
    assert address.node_id == ray.get_runtime_context().get_node_id()
    assert address.pid == (await worker.info.remote()).pid
    assert address.token not in repr(address)
    assert await worker.channel_socket.remote() == address  # one socket per worker
    tokenize = cluster.client.tokenizer
    requests = [
        (f"sock-{i}", tokenize(f"Write one sentence about {topic}.").input_ids, GREEDY)
        for i, topic in enumerate(["kites", "bread", "rivers"])
    ]

    # The cluster's client reads its channels to this node's workers from their sockets.
    await collect(cluster, "sock-client", requests[0][1], GREEDY)
    channels = list(cluster.client._channels.values())
    assert channels and all(c.socket is not None and c.stream is None for c in channels)

    async def open_channel(channel_id: str, token: str = address.token, keepalive_s: float = 30.0):
        reader, writer = await asyncio.open_unix_connection(address.path)
        hello = {"channel": channel_id, "keepalive_s": keepalive_s, "token": token}
        writer.write(json.dumps(hello).encode() + b"\n")
        return reader, writer

    reader, writer = await open_channel("sock-channel")
    assert await read_frame(reader) == []  # open
    for request_id, prompt, params in requests:
        await worker.start.remote("sock-channel", Request(request_id, prompt, params))
    deltas = await channel_deltas(lambda: read_frame(reader), requests)
    assert_as_the_engine(make_engine, requests, deltas)

    # Closing the socket closes the channel, which aborts what it carries.
    long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    await worker.start.remote("sock-channel", Request("sock-long", requests[0][1], long))
    await read_frame(reader)
    writer.close()
    assert await freed_within(worker, "sock-long", 2.0) <= 2.0
    with pytest.raises(ray.exceptions.RayTaskError, match="channel 'sock-channel' is not open"):
        await worker.start.remote("sock-channel", Request(*requests[0]))

    # A caller without the worker's token gets no channel: the worker hangs up.
    reader, writer = await open_channel("sock-stranger", token="0" * 32)
    with pytest.raises(asyncio.IncompleteReadError):
        await read_frame(reader)
    writer.close()
    with pytest.raises(ray.exceptions.RayTaskError, match="channel 'sock-stranger' is not open"):
        await worker.start.remote("sock-stranger", Request(*requests[0]))

    # A caller that neither reads its socket nor touches its channel is gone after its
    # keepalive: the worker aborts its requests (long before this one would end) and
    # hangs up.
    opened = time.monotonic()
    reader, writer = await open_channel("sock-silent", keepalive_s=2.0)
    assert await read_frame(reader) == []
    longer = SamplingParams(max_tokens=2500, temperature=0, ignore_eos=True)
    await worker.start.remote("sock-silent", Request("sock-silent-long", requests[0][1], longer))
    await freed_within(worker, "sock-silent-long", 8.0)
    assert time.monotonic() - opened >= 2.0
    assert not await worker.touch.remote("sock-silent")
    sent = []

    async def read_to_the_end():
        while True:  # what was sent before the hang-up, then its end
            sent.extend(await read_frame(reader))

    with pytest.raises(asyncio.IncompleteReadError):
        await asyncio.wait_for(read_to_the_end(), 10)
    assert sent and all(isinstance(item, RequestOutput) and not item.finished for _, item in sent)
    writer.close()
    await worker.check_integrity.remote()


@contextlib.asynccontextmanager
async def client_reading(cluster, channel_sockets: bool):
    """The cluster's requests go through a new client of this test's event loop, which
    reads its channels from the workers' sockets, or from Ray streams."""
    own = cluster.client
    cluster.client = ClusterClient(cluster.scheduler, own.tokenizer, channel_sockets)
    try:
        yield
    finally:
        await cluster.client.close()
        cluster.client = own


async def _wait_for(cluster, predicate, what: str, seconds: float = 90.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        stats = await cluster.stats()
        if predicate(stats):
            return stats
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}: {await cluster.stats()}")


@pytest.mark.parametrize(
    "channel_sockets",
    [pytest.param(True, id="socket", marks=LINUX_ONLY), pytest.param(False, id="ray-stream")],
)
async def test_killed_worker_fails_over_without_changing_the_text(
    cluster, make_engine, channel_sockets
):
    async with client_reading(cluster, channel_sockets):
        await settle(cluster)
        await cluster.scheduler.set_placement.remote("prefix_affinity")
        # A prefix no worker holds yet: the first request picks a worker, the rest follow it.
        prefix = f"Failover drill {channel_sockets}. " + SYSTEM * 2
        # Two under a grammar (6, 7): a resumed output replays its tokens into a new matcher.
        listing = {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 10},
                    "minItems": 6,
                    "maxItems": 6,
                }
            },
            "required": ["items"],
            "additionalProperties": False,
        }
        grammar = StructuredParams("json", json.dumps(listing))
        requests = []
        for i in range(8):
            if i < 4:
                params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
            elif i < 6:
                # EOS ignored: fo-5's seeded sample ends in EOS after 5 tokens, and a stream
                # that ends before the slowest has its 3rd token made the kill come too late
                params = SamplingParams(
                    max_tokens=40, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True
                )
            else:
                params = SamplingParams(
                    max_tokens=80, temperature=0.8, seed=100 + i, structured=grammar
                )
            requests.append((f"fo-{i}", prefix + f"Customer {i} asks about returns.", params))
        expected = engine_outputs(make_engine(), requests)

        streams = [await cluster.submit(*r) for r in requests]
        stats = await cluster.stats()
        (victim,) = [w.worker_id for w in stats.workers if w.ongoing]
        assert stats.worker(victim).ongoing == 8, "all 8 must stream from one worker"
        (channel,) = cluster.client._channels.values()
        assert (channel.socket is not None, channel.stream is not None) == (
            channel_sockets,
            not channel_sockets,
        )
        handle = await cluster.scheduler.worker_handle.remote(victim)

        # Ray restarts it (max_restarts)
        received = await read_through_a_fault(
            streams, lambda: ray.kill(handle, no_restart=False), 60, 120
        )

        for (request_id, _, _), deltas in zip(requests, received, strict=True):
            assert tokens_of(deltas) == tokens_of(expected[request_id]), request_id
            assert text_of(deltas) == text_of(expected[request_id]), request_id
            assert deltas[-1].finish_reason is expected[request_id][-1].finish_reason
            assert [d.finished for d in deltas].count(True) == 1
        stats = await _wait_for(
            cluster,
            lambda s: (
                s.worker(victim).status is WorkerStatus.HEALTHY
                and s.worker(victim).restarts
                and s.worker(victim).load.incarnation == s.worker(victim).incarnation
            ),  # it reported
            "the killed worker to come back",
        )
        assert stats.failovers >= 8

        # It takes new work: round robin gives each worker one of two requests.
        await settle(cluster)
        await cluster.scheduler.set_placement.remote("round_robin")
        before = await placed(cluster)
        await asyncio.gather(*(collect(cluster, f"back-{i}", "Hello", GREEDY) for i in range(2)))
        after = await placed(cluster)
        events = (await cluster.stats()).events
        assert after[victim] - before[victim] == 1, events

        # Shut down, it takes no socket channel: its socket is closed, and no new one opens.
        handle = await cluster.scheduler.worker_handle.remote(victim)
        address = await handle.channel_socket.remote()
        await handle.shutdown.remote()
        assert await handle.channel_socket.remote() is None
        if ABSTRACT_SOCKETS:
            assert address is not None
            with pytest.raises(ConnectionRefusedError):
                await asyncio.open_unix_connection(address.path)

        # Killed for good (no restart): the scheduler starts a replacement under the same id.
        incarnation = stats.worker(victim).incarnation
        ray.kill(handle)
        await _wait_for(
            cluster,
            lambda s: any(
                w.worker_id == victim
                and w.status is WorkerStatus.HEALTHY
                and w.incarnation != incarnation
                for w in s.workers
            ),
            "a replacement worker",
        )
        deltas = await collect(cluster, "after-replace", "Hello", GREEDY)
        assert len(tokens_of(deltas)) == 16
