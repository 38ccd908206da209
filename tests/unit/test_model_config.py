"""A model's configuration as ``ModelConfig.from_hf`` reads it: each family's switches
from its ``config.json``, and every field that changes the computation either read or
refused with its name, the limit and what was given."""

from __future__ import annotations

import pytest

from tessera.workers.model.config import ModelConfig

BASE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def config(**fields) -> ModelConfig:
    return ModelConfig.from_hf({**BASE, **fields})


def test_gemma2_switches():
    c = config(
        model_type="gemma2",
        head_dim=32,
        sliding_window=16,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
    )
    assert c.sandwich_norms and c.tie_word_embeddings and not c.qk_norm
    assert c.embedding_scale == 64**0.5 and c.scale == 24**-0.5
    assert (c.attn_softcap, c.final_softcap) == (50.0, 30.0)
    assert c.layer_windows == (16, 0, 16, 0) and c.max_window == 0  # local, global, ...


def test_gemma3_pattern_and_local_rope():
    c = config(
        model_type="gemma3_text",
        num_hidden_layers=7,
        head_dim=32,
        sliding_window=8,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    )
    assert c.layer_windows == (8, 8, 8, 8, 8, 0, 8) and c.qk_norm
    assert c.local_rope_theta == 10000.0 and c.rope_theta == 1e6
    assert c.rope_scaling == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}


def test_phi3_partial_rotary_longrope_and_window():
    c = config(
        model_type="phi3",
        sliding_window=2047,
        original_max_position_embeddings=4096,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "longrope",
            "partial_rotary_factor": 0.5,
            "short_factor": [1.0] * 4,
            "long_factor": [2.0] * 4,
        },
    )
    assert c.rotary_dims == 8 and c.layer_windows == (2047,) * 4 and c.max_window == 2047
    assert c.rope_scaling["original_max_position_embeddings"] == 4096


def test_dynamic_rope_serves_factor_times_the_context():
    c = config(max_position_embeddings=2048, rope_scaling={"type": "dynamic", "factor": 2.0})
    assert c.max_position_embeddings == 4096
    assert c.rope_scaling["original_max_position_embeddings"] == 2048


def test_qwen2_windows_only_past_max_window_layers():
    assert config(model_type="qwen2", sliding_window=32).layer_windows == ()
    c = config(model_type="qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=2)
    assert c.layer_windows == (0, 0, 32, 32)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"model_type": "gpt2"},
            "architecture: 'gpt2' is not supported (supported: llama, mistral, qwen2, qwen3, "
            "gemma2, gemma3_text, phi3",
        ),
        (
            {"hidden_act": "relu"},
            "hidden_activation: 'relu' is not supported (silu, gelu_pytorch_tanh)",
        ),
        (
            {
                "model_type": "mistral",
                "sliding_window": 8,
                "layer_types": ["chunked_attention"] * 4,
            },
            "layer_types: 'chunked_attention' is not supported (full_attention, sliding_attention)",
        ),
        (
            {"model_type": "mistral", "sliding_window": 8, "layer_types": ["sliding_attention"]},
            "layer_types: 1 entries for 4 layers",
        ),
        (
            {"model_type": "mistral", "sliding_window": -4},
            "sliding_window: must be a positive integer, got -4",
        ),
        (
            {"partial_rotary_factor": 0.5},
            "partial_rotary_factor: 0.5 is not supported for llama (RoPE over whole heads)",
        ),
        (
            {"rope_scaling": {"type": "dynamic", "factor": 0.5}},
            "rope_scaling.factor: must be a number >= 1, got 0.5",
        ),
        (
            {"rope_scaling": {"type": "mrope"}},
            "rope_scaling: type 'mrope' is not supported",
        ),
        (
            {
                "model_type": "phi3",
                "rope_parameters": {
                    "rope_type": "longrope",
                    "short_factor": [1.0] * 3,
                    "long_factor": [2.0] * 8,
                    "original_max_position_embeddings": 16,
                },
            },
            "rope_scaling.short_factor: needs 8 factors, got 3",
        ),
        (
            {"model_type": "gemma2", "attn_logit_softcapping": -1.0},
            "attn_softcap: must be a positive number, got -1.0",
        ),
        (
            {"model_type": "gemma3_text", "use_bidirectional_attention": True},
            "use_bidirectional_attention: only causal attention is supported",
        ),
        (
            {
                "model_type": "gemma3_text",
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "yarn", "factor": 2.0},
                    "full_attention": {"rope_type": "default"},
                },
            },
            "rope_parameters.sliding_attention: type 'yarn' is not supported for the local "
            "layers (default)",
        ),
        ({"num_key_value_heads": 3}, "num_heads (4) must be a multiple of num_kv_heads (3)"),
    ],
)
def test_fields_it_does_not_implement_are_refused(fields, message):
    with pytest.raises(ValueError) as refused:
        config(**fields)
    assert str(refused.value).startswith(message)
