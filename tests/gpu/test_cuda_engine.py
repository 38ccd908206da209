"""The engine on CUDA: same greedy tokens as transformers (float32). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_greedy_matches, run_engine, tokens_of
from workers.api import SamplingParams
from workers.config import EngineConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_greedy_on_cuda_matches_transformers(smollm2_path, hf_reference):
    from workers.engine import Engine
    from workers.model.loader import load_model

    loaded = load_model(smollm2_path, "float32", "cuda")
    engine = Engine(EngineConfig(device="cuda", num_kv_blocks=64), loaded=loaded)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, " * 20]
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    ids = [tuple(loaded.tokenizer(p).input_ids) for p in prompts]
    for i, prompt in enumerate(ids):
        engine.add_request(f"r{i}", list(prompt), greedy)
    outputs = run_engine(engine)
    for i, prompt in enumerate(ids):
        assert_greedy_matches(tokens_of(outputs[f"r{i}"]), hf_reference.greedy(prompt, 32))
