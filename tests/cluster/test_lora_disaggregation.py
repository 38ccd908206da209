"""Multi-LoRA on a disaggregated cluster: the prefill worker runs a request's prompt
with its adapter (the KV-transfer request carries it) and the decode worker goes on
with it; greedy tokens equal `transformers` + `peft` token for token."""

from __future__ import annotations

import asyncio

import pytest

from tessera.workers.api import LoraRef, SamplingParams
from tests.cluster.conftest import running_cluster_sync
from tests.helpers import TransformersReference, assert_greedy_matches, random_adapters, tokens_of

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    return random_adapters(tiny_llama[1], tmp_path_factory.mktemp("loras"))


async def _run(cluster, lora: LoraRef | None, prompt: list[int]) -> list[int]:
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    stream = await cluster.submit(
        f"r-{lora and lora.name}-{len(prompt)}", prompt, greedy, lora=lora
    )
    return tokens_of([delta async for delta in stream])


def test_a_disaggregated_adapter_request_prefills_with_its_adapter(
    ray_session, tiny_llama, adapters
):
    """The prefill worker runs the prompt with the adapter (the KV-transfer request
    carries it), the decode worker goes on with it: token for token peft's."""
    prompt = [5, 17, 99, 3, 42, 7, 11, 300, 21, 4, 8, 8, 77, 12, 9, 250, 31, 60, 2]
    modules = [f"first={adapters['first'][0]}", f"second={adapters['second'][0]}"]
    with running_cluster_sync(
        model=str(tiny_llama[0]),
        prefill_workers=1,
        decode_workers=1,
        block_size=4,
        num_kv_blocks=128,
        lora_modules=modules,
    ) as cluster:

        async def run_all():
            refs = [await cluster.client.lora(name) for name in ("first", "second")]
            before = await _decode_pulls(cluster)
            got = await asyncio.gather(*(_run(cluster, r, prompt) for r in [*refs, None]))
            return refs, got, await _decode_pulls(cluster) - before

        refs, got, pulls = asyncio.run(run_all())
    assert [r.name for r in refs] == ["first", "second"]
    assert pulls == 3  # each request's blocks came from the prefill worker
    for name, tokens in zip(("first", "second", None), got, strict=True):
        model = tiny_llama[1] if name is None else adapters[name][1]
        assert_greedy_matches(
            tokens, TransformersReference(model).greedy(tuple(prompt), MAX_TOKENS)
        )


async def _decode_pulls(cluster) -> int:
    await asyncio.sleep(0.5)  # a report after what ran
    stats = await cluster.stats()
    (decode,) = [w for w in stats.workers if w.role == "decode"]
    return decode.load.transfers.pulls
