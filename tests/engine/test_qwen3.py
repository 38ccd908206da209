"""Qwen3 (an RMSNorm over each q and k head before RoPE, a head size other than
hidden / heads): a tiny random model saved as a Hugging Face directory, run by the engine
in float32 and compared token for token with transformers' greedy decoding of the same
weights, batched with chunked prefill, with a prefix-cache hit, preempted for lack of
blocks, and as n = 2 forks."""

from __future__ import annotations

import pytest
import torch
import transformers

from tessera.workers.api import SamplingParams
from tessera.workers.config import EngineConfig
from tessera.workers.engine.engine import Engine
from tests.helpers import TransformersReference, assert_greedy_matches, run_engine, tokens_of

VOCAB = 512
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, smollm2):
    """The directory and transformers' model; weights scaled up so that the logits are
    peaked (a random model's are nearly flat, and near-ties would hide mistakes)."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(1.0, 0.5)
            elif "norm" not in name:
                param.mul_(4.0)
    path = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(path)
    smollm2.tokenizer.save_pretrained(path)
    return path, TransformersReference(model)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **kwargs)


def test_qwen3_engine_paths_match_transformers(qwen3):
    path, reference = qwen3
    generator = torch.Generator().manual_seed(1)
    shared = torch.randint(3, VOCAB, (20,), generator=generator).tolist()
    prompts = {
        "long": torch.randint(3, VOCAB, (37,), generator=generator).tolist(),
        "short": torch.randint(3, VOCAB, (5,), generator=generator).tolist(),
        "prefix-a": shared + [7, 8, 9],
        "prefix-b": shared + [10, 11],
    }
    # a 16-token step budget chunks the long prompt; 24 blocks of 4 tokens are too few
    # for all four at full length, so the youngest is preempted and recomputed
    engine = Engine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            block_size=4,
            num_kv_blocks=48,
            max_num_batched_tokens=16,
        )
    )
    assert engine.loaded.config.qk_norm and engine.runner.model.native_layers() is None
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, greedy())
    engine.add_request("forked", prompts["short"], greedy(n=2))
    outputs = run_engine(engine)
    assert engine.stats().preemptions > 0
    assert engine.stats().prefix_cache.hits > 0
    for request_id, prompt in prompts.items():
        assert_greedy_matches(
            tokens_of(outputs[request_id]), reference.greedy(tuple(prompt), MAX_TOKENS)
        )
    for index in (0, 1):
        forked = [d for d in outputs["forked"] if d.index == index]
        assert_greedy_matches(
            tokens_of(forked), reference.greedy(tuple(prompts["short"]), MAX_TOKENS)
        )
