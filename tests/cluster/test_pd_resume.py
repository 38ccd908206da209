"""Failover in a disaggregated cluster on real Ray (1 prefill + 2 decode workers, KV
blocks over real gRPC): a request whose decode worker dies mid-stream resumes on the
other decode worker, which pulls the prompt's blocks from the prefill worker that holds
them (a pull, counted as resumed, no fallback) instead of prefilling the prompt again,
recomputes only the tokens already sent, and the stream's text equals the in-process
engine's."""

from __future__ import annotations

import asyncio

import pytest
import ray

from tessera.scheduler.api import WorkerStatus
from tessera.workers.api import SamplingParams
from tessera.workers.process.kv_transfer import usable_blocks
from tests.cluster.conftest import running_cluster_sync
from tests.helpers import run_engine, text_of, tokens_of

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

BLOCK = 16
SYSTEM = (
    "You are a careful assistant for a shipping company. Answer questions about parcels, "
    "delivery windows, customs forms and returns in two short sentences, and never invent "
    "tracking numbers. Be polite, brief and exact. "
)


@pytest.fixture(scope="module")
def cluster(ray_session):
    # three workers on the session's two CPUs: half a CPU (and one torch thread) each
    with running_cluster_sync(
        prefill_workers=1,
        decode_workers=2,
        block_size=BLOCK,
        max_num_seqs=8,
        worker_num_cpus=0.5,
    ) as cluster:
        yield cluster


async def decode_loads(cluster) -> dict:
    stats = await cluster.stats()
    return {w.worker_id: w.load for w in stats.workers if w.role == "decode"}


async def test_a_resumed_request_pulls_its_prompt_from_the_prefill_worker(cluster, make_engine):
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    prompt = "Resumed after a failover. " + SYSTEM * 3 + "Where is my parcel?"
    engine = make_engine(block_size=BLOCK)
    engine.add_request("resume", prompt, params)
    expected = run_engine(engine)["resume"]
    prompt_blocks = usable_blocks(len(engine.tokenize(prompt)), BLOCK)

    for _ in range(100):  # every worker has reported (the prefill worker its address)
        stats = await cluster.stats()
        if all(w.status is WorkerStatus.HEALTHY and w.load for w in stats.workers):
            break
        await asyncio.sleep(0.1)
    before = await decode_loads(cluster)
    stream = await cluster.submit("resume", prompt, params)
    (victim,) = [w.worker_id for w in (await cluster.stats()).workers if w.ongoing]
    (survivor,) = set(before) - {victim}
    handle = await cluster.scheduler.worker_handle.remote(victim)

    received = []
    async for delta in stream:
        received.append(delta)
        if len(tokens_of(received)) >= 3:
            break
    assert not received[-1].finished, "the kill must come mid-stream"
    ray.kill(handle, no_restart=False)  # Ray restarts it; the stream fails over
    received += [delta async for delta in stream]

    assert tokens_of(received) == tokens_of(expected)
    assert text_of(received) == text_of(expected)
    assert [d.finished for d in received].count(True) == 1
    for _ in range(50):  # the survivor's report after the resumed request
        after = (await decode_loads(cluster))[survivor]
        if after.transfers.resumed_pulls > before[survivor].transfers.resumed_pulls:
            break
        await asyncio.sleep(0.1)
    moved, was = after.transfers, before[survivor].transfers
    assert (moved.pulls, moved.resumed_pulls) == (was.pulls + 1, was.resumed_pulls + 1)
    assert moved.blocks_received - was.blocks_received == prompt_blocks > 0
    assert moved.fallbacks == was.fallbacks  # pulled, not prefilled here
    assert (await cluster.stats()).failovers >= 1
