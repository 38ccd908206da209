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
    # Sliding windows far shorter than the 30 positions: each query sees its last 8 (5)
    "mistral-sliding-window": (
        transformers.MistralConfig,
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=8),
    ),
    "qwen2-sliding-window-upper-layers": (
        transformers.Qwen2Config,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=3,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
        ),
    ),
    # 1 + w norms, sqrt(hidden) embedding scale, GELU(tanh), four norms a layer,
    # attention and logit soft-caps, query_pre_attn_scalar, local/global layers
    "gemma2": (
        transformers.Gemma2Config,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=3,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
    ),
    # q/k norms, local layers with their own RoPE base, global layers scaled (linear 4)
    "gemma3-text": (
        transformers.Gemma3TextConfig,
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            num_hidden_layers=4,
            sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 1
            + ["sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            },
        ),
    ),
    # a prompt past LongRoPE's original context: every position takes the long factors
    # (transformers' forward sees the prompt's whole length), chunked or not
    "phi3-longrope-past-original": (
        transformers.Phi3Config,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            pad_token_id=0,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5],
                "long_factor": [2.0, 3.0, 5.0, 7.0, 9.0, 11.0, 13.0, 15.0],
            },
            original_max_position_embeddings=16,
        ),
    ),
    # dynamic NTK: a 30-token prompt past the 16-token context the base was set for
    "llama-dynamic": (
        transformers.LlamaConfig,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=16,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
        ),
    ),
    # fused q/k/v and gate/up, partial rotary (12 of 16 dimensions), LongRoPE inside
    # its original context (past it: ``test_longrope_past_the_original_context``), a
    # sliding window
    "phi3-longrope-partial": (
        transformers.Phi3Config,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=10,
            pad_token_id=0,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.5, 2.0, 2.5, 3.0, 3.5],
                "long_factor": [2.0, 3.0, 5.0, 7.0, 9.0, 11.0],
            },
            original_max_position_embeddings=64,
        ),
    ),
    # Mixtures of experts: top-2 of 4 renormalised (Mixtral); a shared expert, top-2 of
    # 6 renormalised, the middle layer dense (mlp_only_layers) with its own width
    # (Qwen2-MoE); top-3 of 8 not renormalised, q/k norms (Qwen3-MoE)
    "mixtral-moe": (
        transformers.MixtralConfig,
        dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4),
    ),
    "qwen2-moe-shared-expert-dense-layer": (
        transformers.Qwen2MoeConfig,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=3,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=True,
        ),
    ),
    "qwen3-moe-unnormalised-top-k": (
        transformers.Qwen3MoeConfig,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=False,
        ),
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny_model_dir(request, tmp_path_factory, smollm2):
    config_cls, extra = CASES[request.param]
    torch.manual_seed(0)
    config = config_cls(**{**COMMON, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, param in model.named_parameters():
        if "bias" in name:  # random biases, so the test notices if one is dropped
            torch.nn.init.normal_(param, std=0.5)
        if "norm" in name:  # likewise every norm's weights (Gemma's 1 + w included)
            torch.nn.init.normal_(param, mean=0.5, std=0.5)
        if name.endswith("mlp.gate.weight"):  # MoE routers: clear choices, no near-ties
            torch.nn.init.normal_(param, std=1.0)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    smollm2.tokenizer.save_pretrained(path)
    return path, model.eval()


def _run_ours(path, prompt: list[int], prompt_len: int | None = None) -> dict[int, torch.Tensor]:
    """Logits at the rows we compute: end of a prefill, end of a chunk, each decode; the
    request's prompt is ``prompt``'s first ``prompt_len`` tokens (default all), the rest
    computed as if generated."""
    loaded = load_model(path, "float32")
    kv = KVCacheManager(num_blocks=16, block_size=4)
    cache = allocate_kv_cache(loaded.config, 16, 4, torch.float32, torch.device("cpu"))
    runner = ModelRunner(loaded.model, kv, cache)
    seq = Sequence(
        request=Request("s", tuple(prompt[:prompt_len])),
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


def test_longrope_past_the_original_context(tmp_path, smollm2):
    """Positions past a LongRoPE model's original context take the long factors, those
    inside it the short ones: as transformers computes a sequence whose prompt fits the
    original context and whose decoding runs past it (its cached keys keep the short
    factors, each new token's forward the long ones)."""
    _, extra = CASES["phi3-longrope-partial"]
    torch.manual_seed(0)
    config = transformers.Phi3Config(**{**COMMON, **extra, "original_max_position_embeddings": 16})
    hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for name, param in hf_model.named_parameters():
        if "norm" in name:
            torch.nn.init.normal_(param, mean=0.5, std=0.5)
    hf_model.save_pretrained(tmp_path)
    smollm2.tokenizer.save_pretrained(tmp_path)
    prompt = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = {}
    with torch.no_grad():  # a 13-token prefill, then one token at a time, cached
        out = hf_model(torch.tensor([prompt[:13]]), use_cache=True)
        expected[12] = out.logits[0, -1]
        for i in range(13, 30):
            out = hf_model(torch.tensor([[prompt[i]]]), cache=out.cache, use_cache=True)
            expected[i] = out.logits[0, -1]
    ours = _run_ours(tmp_path, prompt, prompt_len=13)
    assert sorted(ours) == [12, 18, *range(19, 30)]
    for row in ours:
        torch.testing.assert_close(
            ours[row], expected[row], atol=1e-4, rtol=1e-4, msg=lambda m, row=row: f"row {row}: {m}"
        )
