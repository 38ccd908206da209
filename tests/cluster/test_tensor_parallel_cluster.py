"""Tensor-parallel worker groups in a cluster: `tessera serve --tensor-parallel-size 2`
answering the `openai` client with transformers' tokens, its ready line and /metrics
showing the group's ranks; a rank killed mid-stream under 8 streams: every stream ends
with the text an undisturbed run gave, the group comes back, and its placement group is
removed with the cluster; prefill and decode groups shipping KV blocks between them."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import ray
import torch
import transformers

from tessera.scheduler.api import WorkerStatus
from tessera.workers.api import SamplingParams
from tests.cluster.conftest import running_cluster
from tests.cluster.serve_process import serve_process
from tests.cluster.test_serve_families import assert_same_tokens
from tests.helpers import (
    TransformersReference,
    assert_greedy_matches,
    read_through_a_fault,
    save_random_model,
    text_of,
    tokens_of,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

API_KEY = "tp-key-41c9"
MODEL = "tiny-qwen2"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, smollm2):
    """A tiny random Qwen2 (q/k/v biases, 4 heads, 2 KV heads) saved with the built-in
    tokenizer: (path, transformers' model)."""
    path = tmp_path_factory.mktemp("tp-qwen2")
    return path, save_random_model(path, smollm2.tokenizer, "Qwen2Config")


def _placement_groups() -> int:
    table = ray.util.placement_group_table().values()
    return sum(1 for group in table if group["state"] != "REMOVED")


def test_serve_with_two_ranks_answers_with_transformers_tokens(ray_session, tmp_path, qwen2):
    path, model = qwen2
    reference = TransformersReference(model)
    settings = (
        f"model: {path}\nserved_model_name: {MODEL}\nnum_kv_blocks: 64\n"
        "worker_num_cpus: 0.5\nreport_interval_s: 0.1\n"
    )
    before = _placement_groups()
    with serve_process(
        tmp_path, settings, API_KEY, "tp-serve-test", "--tensor-parallel-size", "2"
    ) as server:
        log = server.log.read_text()
        assert "1 worker group(s) of 2 ranks" in log
        assert "0.5 CPU(s) and torch threads per rank" in log
        client = server.client()
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        generator = torch.Generator().manual_seed(3)
        for n in (25, 7):
            prompt = torch.randint(3, 512, (n,), generator=generator).tolist()
            done = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0
            )
            expected = reference.greedy(tuple(prompt), MAX_TOKENS)
            assert_same_tokens(done.choices[0].logprobs.tokens, expected, tokenizer)
        metrics = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=30).text
        ranks = [line for line in metrics.splitlines() if line.startswith("tessera_worker_rank{")]
        assert len(ranks) == 2, metrics[-3000:]
        assert 'rank="0"' in ranks[0] and 'place="cpu@' in ranks[0]
        assert _placement_groups() == before + 1  # the worker group's
    assert _placement_groups() == before


async def test_a_killed_rank_fails_its_group_over_without_changing_the_text(ray_session, qwen2):
    path, _ = qwen2
    before = _placement_groups()
    async with running_cluster(
        model=str(path), tensor_parallel_size=2, worker_num_cpus=0.5, workers=1
    ) as cluster:
        requests = []
        for i in range(8):
            params = (
                SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
                if i < 4
                else SamplingParams(max_tokens=40, temperature=0.8, seed=100 + i, ignore_eos=True)
            )
            requests.append((f"tp-{i}", list(range(3 + i, 30 + i)), params))
        expected = {}
        for request_id, prompt, params in requests:  # undisturbed, one by one
            stream = await cluster.submit(request_id + "-calm", prompt, params)
            expected[request_id] = [delta async for delta in stream]
        stats = await cluster.stats()
        (worker,) = stats.workers
        assert len(worker.ranks) == 2
        handle = await cluster.scheduler.worker_handle.remote(worker.worker_id)
        (rank,) = await handle.tensor_parallel_ranks.remote()

        streams = [await cluster.submit(*request) for request in requests]
        received = await read_through_a_fault(streams, lambda: ray.kill(rank), 120, 240)
        for (request_id, _, _), deltas in zip(requests, received, strict=True):
            assert tokens_of(deltas) == tokens_of(expected[request_id]), request_id
            assert text_of(deltas) == text_of(expected[request_id]), request_id
            assert [d.finished for d in deltas].count(True) == 1
        stats = await cluster.stats()
        assert stats.failovers >= 8
        # the group is back, and nothing of the streams is left on it
        for _ in range(200):
            stats = await cluster.stats()
            (worker,) = stats.workers
            engine = worker.load.engine if worker.load else None
            if (
                worker.status is WorkerStatus.HEALTHY
                and worker.ongoing == 0
                and engine is not None
                and engine.free_blocks == engine.total_blocks
            ):
                break
            await asyncio.sleep(0.1)
        assert worker.status is WorkerStatus.HEALTHY and worker.restarts >= 1, stats.events
        assert worker.ongoing == 0 and engine.free_blocks == engine.total_blocks
        assert len(worker.ranks) == 2
        assert _placement_groups() == before + 1
    assert _placement_groups() == before


def pd_cluster(path, **sizes) -> dict:
    """One prefill and one decode worker (``sizes``: their groups'), half a CPU a rank."""
    fields = dict(worker_num_cpus=0.5, prefill_workers=1, decode_workers=1, block_size=16)
    return dict(model=str(path), **fields, **sizes)


async def greedy(cluster, request_id: str, prompt: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    stream = await cluster.submit(request_id, prompt, params)
    return tokens_of([delta async for delta in stream])


async def decode_report(cluster, done) -> tuple:
    """(the cluster's stats, the decode worker) once its transfer counters satisfy
    ``done`` (its reports come every 0.1 s), or after 10 s."""
    for _ in range(100):
        stats = await cluster.stats()
        (decode,) = [w for w in stats.workers if w.role == "decode"]
        if done(decode.load.transfers):
            break
        await asyncio.sleep(0.1)
    return stats, decode


async def test_prefill_and_decode_groups_ship_whole_blocks(ray_session, qwen2):
    """One prefill and one decode group of 2 ranks each: the prefill group gathers its
    ranks' heads into whole blocks, the decode group splits them over its ranks; the
    text is what a colocated group of 2 ranks writes, and no transfer fell back."""
    path, model = qwen2
    reference = TransformersReference(model)
    # 2-3 blocks of 16 each, no two alike
    prompts = [list(range(start, start + n)) for start, n in ((3, 40), (100, 57), (300, 33))]
    async with running_cluster(**pd_cluster(path, tensor_parallel_size=2)) as cluster:
        for i, prompt in enumerate(prompts):
            tokens = await greedy(cluster, f"pd-{i}", prompt)
            assert_greedy_matches(tokens, reference.greedy(tuple(prompt), MAX_TOKENS))
        stats, decode = await decode_report(cluster, lambda t: t.pulls == len(prompts))
        transfers = decode.load.transfers
        assert transfers.pulls == len(prompts) and transfers.fallbacks == {}
        assert transfers.blocks_received == sum((n - 1) // 16 for n in map(len, prompts))
        assert all(len(w.ranks) == 2 for w in stats.workers)


async def test_groups_of_other_sizes_recompute_instead_of_pulling(ray_session, qwen2):
    """Prefill groups of 2 ranks and unsplit decode workers: their K/V sum in other orders
    (their block hash keys differ), so the decode worker pulls nothing, counts a fallback
    by that reason and computes the prompt itself: transformers' tokens all the same."""
    path, model = qwen2
    reference = TransformersReference(model)
    prompt = list(range(40, 90))
    async with running_cluster(**pd_cluster(path, prefill_tensor_parallel_size=2)) as cluster:
        tokens = await greedy(cluster, "mixed-sizes", prompt)
        assert_greedy_matches(tokens, reference.greedy(tuple(prompt), MAX_TOKENS))
        stats, decode = await decode_report(cluster, lambda t: bool(t.fallbacks))
        (prefill,) = [w for w in stats.workers if w.role == "prefill"]
        assert len(prefill.ranks) == 2 and decode.ranks == ()
        assert decode.load.transfers.pulls == 0
        assert decode.load.transfers.fallbacks == {"hash_keys": 1}


async def test_groups_the_cluster_cannot_hold_are_refused_before_anything_starts(
    ray_session, qwen2
):
    from tessera.cluster.cluster_config import ConfigError

    path, _ = qwen2
    before = _placement_groups()
    cases = [
        (
            dict(tensor_parallel_size=4, worker_num_cpus=1),
            "tensor_parallel_size: 4 ranks of 1 CPU each need 4 CPUs on one node; it has 2",
        ),
        (
            dict(prefill_workers=1, decode_workers=1, prefill_tensor_parallel_size=3),
            "prefill_tensor_parallel_size: 3 ranks of 1 CPU each need 3 CPUs on one node; it has 2",
        ),
        (
            dict(tensor_parallel_size=2, enable_lora=True),
            "enable_lora: LoRA adapters are not served with tensor_parallel_size > 1 (got 2)",
        ),
    ]
    for fields, message in cases:
        with pytest.raises(ConfigError) as error:
            async with running_cluster(model=str(path), **fields):
                pass
        assert str(error.value) == message
    assert _placement_groups() == before
