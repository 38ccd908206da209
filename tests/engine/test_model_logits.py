"""Our decoder's logits equal transformers' on tiny random Llama-family models.

Each model is saved as a Hugging Face directory (config.json + safetensors + tokenizer)
and loaded through our loader; the prompt runs as a prefill, a chunk after cached
tokens, then single-token decodes through the paged KV cache. Tolerance: float32,
atol = rtol = 1e-4 (observed differences are ~1e-6; these are summation-order effects).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tessera.workers.api import Request
from tessera.workers.engine.model_runner import ModelRunner
from tessera.workers.engine.sequence import Sequence
from tessera.workers.kv.kv_cache import allocate_kv_cache
from tessera.workers.kv.manager import KVCacheManager
from tessera.workers.model.loader import load_model
from tests.helpers import prefill_logits

VOCAB = 512
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)

CASES = {
    "llama-gqa-untied-llama3-rope": (
        transformers.LlamaConfig,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "llama-mha-tied-linear-rope": (
        transformers.LlamaConfig,
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        ),
    ),
    "mistral-gqa": (
        transformers.MistralConfig,
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            head_dim=16,
            sliding_window=None,
        ),
    ),
    "qwen2-bias-gqa-tied": (
        transformers.Qwen2Config,
        dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    ),
    # Qwen2.5's long-context configuration: YaRN from an 8-token original context, so
    # the test's 30 positions reach far past it (frequencies interpolated, extrapolated
    # and ramped between; cos and sin scaled by the attention factor)
    "qwen2-yarn": (
        transformers.Qwen2Config,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        ),
    ),
    # q/k RMSNorm per head, a head_dim that is not hidden / heads, no biases
    "qwen3-qknorm-gqa-tied": (
        transformers.Qwen3Config,
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny_model_dir(request, tmp_path_factory, smollm2):
    config_cls, extra = CASES[request.param]
    torch.manual_seed(0)
    config = config_cls(**COMMON, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, param in model.named_parameters():
        if "bias" in name:  # random biases, so the test notices if one is dropped
            torch.nn.init.normal_(param, std=0.5)
        if "q_norm" in name or "k_norm" in name:  # likewise the q/k norms' weights
            torch.nn.init.normal_(param, mean=1.0, std=0.5)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    smollm2.tokenizer.save_pretrained(path)
    return path, model.eval()


def _run_ours(path, prompt: list[int]) -> dict[int, torch.Tensor]:
    """Logits at the rows we compute: end of a prefill, end of a chunk, each decode."""
    loaded = load_model(path, "float32")
    kv = KVCacheManager(num_blocks=16, block_size=4)
    cache = allocate_kv_cache(loaded.config, 16, 4, torch.float32, torch.device("cpu"))
    runner = ModelRunner(loaded.model, kv, cache)
    seq = Sequence(
        request=Request("s", tuple(prompt)),
        seed=0,
        token_ids=[],
        detokenizer=None,
        stop_matcher=None,
    )
    logits = {}
    # 13-token prefill, a 6-token chunk after it, then one token at a time.
    steps = [13, 6] + [1] * (len(prompt) - 19)
    for n in steps:
        seq.token_ids = prompt[: seq.num_computed_tokens + n]
        assert kv.allocate("s", seq.num_tokens)
        out = runner.execute([seq.chunk(n)])
        seq.num_computed_tokens += n
        logits[seq.num_tokens - 1] = out[0]
        kv.check_integrity()
    return logits


def test_logits_match_transformers(tiny_model_dir):
    path, hf_model = tiny_model_dir
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (30,), generator=generator).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    ours = _run_ours(path, prompt)
    assert sorted(ours) == [12, 18, *range(19, 30)]
    for row, logits in ours.items():
        torch.testing.assert_close(
            logits, expected[row], atol=1e-4, rtol=1e-4, msg=lambda m, row=row: f"row {row}: {m}"
        )


def test_smollm2_logits_match_transformers(smollm2, hf_reference):
    """The GGUF path (dequantisation, q/k un-permutation) on the real model."""
    prompt = smollm2.tokenizer("The quick brown fox jumps over the lazy dog. " * 3).input_ids
    with torch.no_grad():
        expected = hf_reference.model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(smollm2, prompt), expected[-1], atol=1e-3, rtol=1e-4)
