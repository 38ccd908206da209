"""The cluster on a GPU machine: ``device=auto`` gives each worker a GPU from Ray, and
outputs match transformers (float32, greedy). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tessera.workers.api import SamplingParams
from tests.helpers import assert_greedy_matches, tokens_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.cluster,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


async def test_auto_device_takes_a_gpu_per_worker(ray_session, smollm2, hf_reference):
    import ray

    from tessera.cluster.config import ClusterConfig
    from tessera.cluster.launch import Cluster
    from tests.helpers import RAY_NAMESPACE

    gpus = ray.cluster_resources().get("GPU", 0)
    assert gpus >= 1, "Ray must see the GPU"
    config = ClusterConfig.create(workers=1, num_kv_blocks=128, namespace=RAY_NAMESPACE)
    cluster = await Cluster.start(config)
    try:
        assert ray.available_resources().get("GPU", 0) == gpus - 1  # the worker holds one
        prompt = "The capital of France is"
        greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        deltas = [d async for d in await cluster.submit("g", prompt, greedy)]
        ids = tuple(smollm2.tokenizer(prompt).input_ids)
        assert_greedy_matches(tokens_of(deltas), hf_reference.greedy(ids, 24))
    finally:
        await cluster.shutdown()
