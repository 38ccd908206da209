"""The engine on CUDA: same greedy tokens as transformers (float32). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tessera.workers.api import SamplingParams
from tessera.workers.config import EngineConfig
from tests.helpers import (
    assert_greedy_matches,
    multi_row_requests,
    run_engine,
    run_multi_row,
    tokens_of,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_greedy_on_cuda_matches_transformers(smollm2_path, hf_reference):
    from tessera.workers.engine.engine import Engine
    from tessera.workers.model.loader import load_model

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


def test_packed_weights_on_cuda_give_the_dense_weights_outputs(smollm2_path, hf_reference):
    """A float32 model on CUDA keeps the file's Q4_1 / Q8_0 matrices packed (the
    default), multiplying with them in the fused kernel (``triton_mm``): its weights
    take under a third of the dense model's GPU memory, its greedy tokens are
    transformers', and it gives the dense model's tokens and prompt logprobs (the same
    weights; float32 sums in another order)."""
    import gc

    from tessera.workers.engine.engine import Engine
    from tessera.workers.model.loader import load_model

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=1)
    prompt = "The history of the Roman empire is long. " * 4
    results, resident = [], []
    for packed in (True, False):
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loaded = load_model(smollm2_path, "float32", "cuda", packed_weights=packed)
        resident.append(torch.cuda.memory_allocated() - before)
        qkv = loaded.model.layers[0].qkv_proj.packed
        assert (qkv is not None and qkv.device.type == "cuda") == packed
        engine = Engine(EngineConfig(device="cuda", num_kv_blocks=64), loaded=loaded)
        engine.add_request("p", prompt, params)
        deltas = run_engine(engine)["p"]
        logprobs = [e.logprob for e in deltas[0].prompt_logprobs[1:]]
        results.append((tokens_of(deltas), logprobs))
        ids = tuple(loaded.tokenizer(prompt).input_ids)
        del engine, loaded
    assert resident[0] < resident[1] / 3, f"packed {resident[0]} B vs dense {resident[1]} B"
    assert_greedy_matches(results[0][0], hf_reference.greedy(ids, 24))
    assert results[0][0] == results[1][0]
    assert results[0][1] == pytest.approx(results[1][1], abs=1e-3)


def test_block_sharing_on_cuda_matches_the_cpu_engine(smollm2_path, make_engine):
    """n > 1 (copy-on-write on the GPU pool), prefix hits and beam search on CUDA give
    what the CPU engine gives."""
    from tessera.workers.engine.engine import Engine
    from tessera.workers.model.loader import load_model

    loaded = load_model(smollm2_path, "float32", "cuda")
    cuda = Engine(EngineConfig(device="cuda", num_kv_blocks=64), loaded=loaded)
    cpu = make_engine(num_kv_blocks=64)
    prompt = "Here is a short story about a lighthouse keeper and the sea. " * 3
    requests = {
        "beam": SamplingParams(beam_width=4, n=2, max_tokens=12),
        "greedy-n": SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True),
        "again": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),  # prefix hit
    }
    results = []
    for engine in (cuda, cpu):
        out = {}
        for rid, params in requests.items():
            engine.add_request(rid, prompt, params)
            deltas = run_engine(engine)[rid]
            out[rid] = sorted((d.index, tuple(d.token_ids)) for d in deltas if d.token_ids)
        results.append(out)
        assert engine.stats().prefix_cache.hits > 0
    assert results[0]["beam"] == results[1]["beam"]
    assert results[0]["again"] == results[1]["again"]


def test_several_tokens_per_step_on_cuda_match_the_cpu_engine(smollm2_path, make_engine):
    """Speculative decoding (prompt lookup, a self-speculative draft) and parallel tokens
    on CUDA give the CPU engine's greedy tokens and sets."""
    from tessera.workers.engine.engine import Engine
    from tessera.workers.model.loader import load_model

    loaded = load_model(smollm2_path, "float32", "cuda")
    # 8 of SmolLM2's 30 layers; fewer where a cut-down copy of it has fewer
    draft = f"target:{min(8, loaded.config.num_layers // 2)}"
    config = EngineConfig(device="cuda", num_kv_blocks=64, draft_model=draft)
    cuda = Engine(config, loaded=loaded)
    cpu = make_engine(num_kv_blocks=64, draft_model=draft)
    requests = multi_row_requests(forks=False)
    results = [run_multi_row(engine, requests) for engine in (cuda, cpu)]
    assert results[0] == results[1]


def test_cuda_graphs_replay_what_eager_steps_compute(smollm2_path):
    """Decode steps replayed from CUDA graphs (the default) give the eager steps'
    tokens, for a batch that changes size as requests finish (several buckets)."""
    from tessera.workers.engine.engine import Engine
    from tessera.workers.model.loader import load_model

    loaded = load_model(smollm2_path, "float32", "cuda")
    prompts = [f"Item {i}: a short note about the number {i * 7}." for i in range(11)]
    results = []
    for graphs in (True, False):
        engine = Engine(
            EngineConfig(device="cuda", num_kv_blocks=128, cuda_graphs=graphs), loaded=loaded
        )
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=8 + 3 * i, temperature=0, ignore_eos=True)
            engine.add_request(f"r{i}", prompt, params)
        outputs = run_engine(engine)
        results.append({rid: tokens_of(deltas) for rid, deltas in outputs.items()})
        steps = engine.runner.decode_graphs.steps if graphs else {}
        if graphs:
            assert len(steps) >= 3 and all(s.graph is not None for s in steps.values())
        else:
            assert engine.runner.decode_graphs is None
    assert results[0] == results[1]


def test_structured_outputs_and_prompt_logprobs_on_cuda_match_the_cpu_engine(
    smollm2_path, make_engine
):
    """A grammar's mask (computed on the CPU, applied to CUDA logits) and prompt
    logprobs give on CUDA what they give on the CPU."""
    import json

    from tessera.workers.api import StructuredParams
    from tessera.workers.engine.engine import Engine
    from tessera.workers.model.loader import load_model

    loaded = load_model(smollm2_path, "float32", "cuda")
    cuda = Engine(EngineConfig(device="cuda", num_kv_blocks=64), loaded=loaded)
    cpu = make_engine(num_kv_blocks=64)
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["city", "n"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        max_tokens=40,
        temperature=0,
        structured=StructuredParams("json", json.dumps(schema)),
        prompt_logprobs=1,
    )
    results = []
    for engine in (cuda, cpu):
        engine.add_request("s", "A city as JSON:", params)
        deltas = run_engine(engine)["s"]
        logprobs = [e.logprob for e in deltas[0].prompt_logprobs[1:]]
        results.append((tokens_of(deltas), logprobs))
    assert results[0][0] == results[1][0]
    json.loads(cuda.tokenizer.decode(results[0][0], skip_special_tokens=True))
    assert results[0][1] == pytest.approx(results[1][1], abs=1e-3)
