"""The fast mode's quality contract per family: each family's Q4_0 GGUF (a tiny random
model with peaked logits, written as llama.cpp's converter writes it) read in the fast
mode and in the exact mode, teacher-forced over random token sequences; the fast mode's
next-token distributions must stay within SmolLM2's contract of the exact mode's (mean
KL, perplexity, agreement where the exact mode's choice is clear), and ``auto`` picks the
fast mode for exactly the families in ``FAST_MODE_FAMILIES``."""

from __future__ import annotations

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType

from benchmarks.fast_mode_families import MAX_MEAN_KL, MAX_PERPLEXITY_CHANGE, MIN_AGREEMENT, measure
from tessera.workers.model.config import FAST_MODE_FAMILIES
from tessera.workers.model.loader import fast_mode_available
from tests.engine import test_gguf_types as gguf_tests

pytestmark = pytest.mark.slow

SHAPE = dict(
    vocab_size=gguf_tests.VOCAB,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=gguf_tests.KV_HEADS,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
#: (config class, its fields past SHAPE, GGUF architecture, head size, extra metadata)
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}, "llama", None, None),
    "qwen2": (transformers.Qwen2Config, {}, "qwen2", None, None),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 64}, "qwen3", 64, None),
    "gemma2": (
        transformers.Gemma2Config,
        {"head_dim": 64, "sliding_window": 32, "query_pre_attn_scalar": 64},
        "gemma2",
        64,
        lambda w: (
            w.add_sliding_window(32),
            w.add_final_logit_softcapping(30.0),
            w.add_attn_logit_softcapping(50.0),
        ),
    ),  # fmt: skip
    # not in FAST_MODE_FAMILIES: auto is exact for it
    "gemma3": (
        transformers.Gemma3TextConfig,
        {"head_dim": 64, "sliding_window": 32, "query_pre_attn_scalar": 64},
        "gemma3",
        64,
        lambda w: w.add_sliding_window(32),
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def q4_file(request, tmp_path_factory, tokenizer_fields):
    if not fast_mode_available():
        pytest.skip("the fast mode needs the AVX512_BF16 kernel; auto is float32 here")
    config_cls, extra, arch, head_dim, metadata = FAMILIES[request.param]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**{**SHAPE, **extra}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.5 if arch.startswith("gemma") else 1.0, 0.2)
            else:
                param.mul_(3.0)
    path = tmp_path_factory.mktemp(request.param) / f"{request.param}-q4_0.gguf"
    gguf_tests._write_gguf(
        path, model, GGMLQuantizationType.Q4_0, tokenizer_fields, metadata, arch, head_dim
    )
    return request.param, path


tokenizer_fields = gguf_tests.tokenizer_fields


def test_fast_mode_meets_its_contract_per_family(q4_file):
    family, path = q4_file
    row = measure(path, sequences=4, length=96, decisive_gap=0.05)
    assert row["fast_precision"] == ("fast" if row["family"] in FAST_MODE_FAMILIES else "float32")
    assert row["mean_kl"] <= MAX_MEAN_KL, row
    assert abs(row["perplexity_ratio"] - 1) <= MAX_PERPLEXITY_CHANGE, row
    assert row["decisive_agreement"] >= MIN_AGREEMENT, row
