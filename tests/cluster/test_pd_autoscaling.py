"""Prefill/decode pools autoscale on real Ray, by their own load signals: the decode
pool grows by one under sustained load (requests queue for a decode worker) and drains
back to its floor when idle; an idle prefill worker is drained and stopped while the
decode workers keep pulling from the other, and none of them ever falls back to a local
prefill (a draining prefill worker is no request's source, and stops only once nothing
may still pull from it). Outputs equal the in-process engine's."""

from __future__ import annotations

import asyncio
import time

import pytest

from tessera.scheduler.api import WorkerStatus
from tessera.workers.api import SamplingParams
from tests.cluster.conftest import running_cluster
from tests.helpers import run_engine, tokens_of

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

BLOCK = 16
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SYSTEM = (
    "You are a careful assistant for a shipping company. Answer questions about parcels, "
    "delivery windows, customs forms and returns in two short sentences. "
)


def roles(stats) -> dict[str, int]:
    counts = {"prefill": 0, "decode": 0}
    for worker in stats.workers:
        counts[worker.role] += 1
    return counts


async def test_decode_pool_grows_under_load_and_both_pools_drain_back(ray_session, make_engine):
    async with running_cluster(
        prefill_workers=2,
        decode_workers=1,
        min_prefill_workers=1,
        min_decode_workers=1,
        max_decode_workers=2,
        block_size=BLOCK,
        max_num_seqs=4,
        max_ongoing_requests=2,
        upscale_delay_s=0.5,
        downscale_delay_s=2.0,
        worker_num_cpus=0.5,  # up to four workers on the session's two CPUs
    ) as cluster:
        requests: list[tuple[str, str]] = []
        outputs: dict[str, list[int]] = {}
        transfers = {}  # worker id -> its last reported KV transfers (stopped ones too)

        async def poll():
            stats = await cluster.stats()
            transfers.update({w.worker_id: w.load.transfers for w in stats.workers if w.load})
            return stats

        async def one(i: int) -> None:
            request_id, prompt = f"load-{i}", SYSTEM + f"Parcel {i} is late. Why?"
            requests.append((request_id, prompt))
            stream = await cluster.submit(request_id, prompt, PARAMS)
            outputs[request_id] = tokens_of([d async for d in stream])

        # Sustained load (six in flight, two per decode worker at most): requests queue
        # for a decode worker until a second one serves.
        tasks: set[asyncio.Task] = set()
        deadline = time.monotonic() + 90
        scaled, i = False, 0
        while not scaled and time.monotonic() < deadline:
            while len(tasks) < 6:
                task = asyncio.create_task(one(i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
            stats = await poll()
            decode = [
                w for w in stats.workers if w.role == "decode" and w.status is WorkerStatus.HEALTHY
            ]
            scaled = len(decode) == 2 and all(w.placed for w in decode)
            await asyncio.sleep(0.1)
        assert scaled, f"the decode pool did not scale up: {stats}"
        await asyncio.gather(*tasks)

        # Idle: each pool is drained back to its floor, its extra workers stopped.
        for _ in range(300):
            stats = await poll()
            if roles(stats) == {"prefill": 1, "decode": 1}:
                break
            await asyncio.sleep(0.1)
        assert roles(stats) == {"prefill": 1, "decode": 1}, stats
        events = "\n".join(stats.events)
        assert "scaled decode up to 2 workers" in events, events
        assert "stopped drained worker decode-" in events, events
        assert "stopped drained worker prefill-" in events, events
        assert not any(t.fallbacks for t in transfers.values()), transfers
        assert sum(t.pulls for t in transfers.values()) > 0

        stream = await cluster.submit("after", SYSTEM + "Thanks!", PARAMS)
        outputs["after"] = tokens_of([d async for d in stream])
        requests.append(("after", SYSTEM + "Thanks!"))

    engine = make_engine(block_size=BLOCK)
    for request_id, prompt in requests:
        engine.add_request(request_id, prompt, PARAMS)
    expected = {rid: tokens_of(deltas) for rid, deltas in run_engine(engine).items()}
    assert outputs == expected
