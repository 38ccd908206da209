"""Mixture-of-experts GGUF files as llama.cpp's converter writes them: Mixtral under
``llama`` (q/k permuted, ``expert_count`` set), ``qwen2moe`` with its shared expert and a
dense layer, ``qwen3moe``. Each is written with gguf's writer from a tiny transformers
model's weights under llama.cpp's names (experts stacked per projection, ``[E, I, H]``),
read by our loader, and its logits compared with transformers running that model
(float32, atol = rtol = 1e-4). Q8_0 experts load dequantised; expert layouts and router
keys the loader does not implement are refused, naming the tensor or key."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter, quants

from tessera.workers.model.loader import load_model
from tests.engine.test_gguf_types import VOCAB, _permute_rotary, tokenizer_fields  # noqa: F401
from tests.helpers import prefill_logits

HIDDEN, HEADS, KV_HEADS = 64, 4, 2
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
# (config class, its fields, the GGUF architecture); the top-k renormalisation each
# family has in llama.cpp (Mixtral and Qwen3-MoE renormalise, Qwen2-MoE not)
FAMILIES = {
    "mixtral": (
        transformers.MixtralConfig,
        dict(num_local_experts=4, num_experts_per_tok=2),
        "llama",
    ),
    "qwen2moe-shared-expert-dense-layer": (
        transformers.Qwen2MoeConfig,
        dict(
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),
        "qwen2moe",
    ),
    "qwen3moe": (
        transformers.Qwen3MoeConfig,
        dict(
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            head_dim=32,
            norm_topk_prob=True,
        ),
        "qwen3moe",
    ),
}
#: transformers' (in-memory) layer tensor names -> llama.cpp's.
_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _tiny(name: str) -> transformers.PreTrainedModel:
    """The family's tiny model, its logits peaked and its routing clear (as in
    ``test_model_families.py``)."""
    config_cls, extra, _ = FAMILIES[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config_cls(**{**COMMON, **extra}), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.normal_(0.5, 0.5)
            elif param_name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 1.0)
            else:
                param.mul_(4.0)
    return model


def _gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """The model's tensors as llama.cpp's converter writes them."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        data = tensor.float().numpy().copy()
        if name in _GLOBAL:
            tensors[_GLOBAL[name]] = data
            continue
        _, _, layer, *rest = name.split(".")
        if rest[-1] == "gate_up_proj":  # [E, 2I, H]: the converter splits gate and up
            gate, up = np.split(data, 2, axis=1)
            tensors[f"blk.{layer}.ffn_gate_exps.weight"] = gate
            tensors[f"blk.{layer}.ffn_up_exps.weight"] = up
            continue
        if rest[-2:] == ["experts", "down_proj"]:  # a parameter, not a module's weight
            rest.append("weight")
        base, kind = ".".join(rest[:-1]), rest[-1]
        if arch == "llama" and base in ("self_attn.q_proj", "self_attn.k_proj"):
            data = _permute_rotary(data, HEADS if base == "self_attn.q_proj" else KV_HEADS)
        tensors[f"blk.{layer}.{_NAMES[base]}.{kind}"] = data
    return tensors


def _write(
    path,
    model,
    arch: str,
    tokenizer: dict[str, list],
    experts_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    extra: Callable[[GGUFWriter], None] | None = None,
) -> None:
    config = model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    head_dim = getattr(config, "head_dim", None) or HIDDEN // HEADS
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokenizer["tokens"])
    writer.add_token_types(tokenizer["token_type"])
    writer.add_token_merges(tokenizer["merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_expert_count(getattr(config, "num_local_experts", None) or config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch != "llama":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", 0):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    for name, data in _gguf_tensors(model, arch).items():
        if data.ndim == 3 and experts_type != GGMLQuantizationType.F32:
            packed = quants.quantize(data, experts_type)
            writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=experts_type)
        else:
            writer.add_tensor(name, data)
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


PROMPT = torch.randint(3, VOCAB, (23,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_gguf_matches_transformers(family, tmp_path, tokenizer_fields):  # noqa: F811
    model = _tiny(family)
    arch = FAMILIES[family][2]
    path = tmp_path / f"{family}.gguf"
    _write(path, model, arch, tokenizer_fields)
    loaded = load_model(path, "float32")
    assert loaded.config.architecture == model.config.model_type
    assert loaded.config.moe is not None
    with torch.no_grad():
        expected = model(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(prefill_logits(loaded, PROMPT), expected, atol=1e-4, rtol=1e-4)


def test_q8_0_experts_load_dequantised(tmp_path, tokenizer_fields):  # noqa: F811
    """Q8_0 expert stacks are expanded at load: the model computes what transformers
    computes with the dequantised experts."""
    model = _tiny("qwen3moe")
    path = tmp_path / "q8.gguf"
    _write(path, model, "qwen3moe", tokenizer_fields, GGMLQuantizationType.Q8_0)
    reference = copy.deepcopy(model)
    q8 = GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if ".experts." in name:  # the round trip through the file's Q8_0 blocks
                data = param.numpy()
                param.copy_(torch.from_numpy(quants.dequantize(quants.quantize(data, q8), q8)))
        expected = reference(torch.tensor([PROMPT])).logits[0, -1]
        unquantised = model(torch.tensor([PROMPT])).logits[0, -1]
    ours = prefill_logits(load_model(path, "float32"), PROMPT)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ours, unquantised, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("arch", "extra", "message"),
    [
        (
            "qwen3moe",
            lambda w: w.add_tensor(
                "blk.0.ffn_gate_up_exps.weight", np.ones((6, 64, HIDDEN), np.float32)
            ),
            "model: GGUF tensor 'blk.0.ffn_gate_up_exps.weight' is not supported",
        ),
        (
            "llama",  # llama.cpp's first Mixtral files: a matrix per expert
            lambda w: w.add_tensor("blk.0.ffn_gate.0.weight", np.ones((96, HIDDEN), np.float32)),
            "model: GGUF tensor 'blk.0.ffn_gate.0.weight' is not supported",
        ),
        (
            "qwen3moe",
            lambda w: w.add_uint32("qwen3moe.expert_gating_func", 2),
            "model: GGUF qwen3moe.expert_gating_func 2 is not supported (1, softmax)",
        ),
        (
            "qwen3moe",
            lambda w: w.add_float32("qwen3moe.expert_weights_scale", 2.5),
            "model: GGUF qwen3moe.expert_weights_scale 2.5 is not supported (1 or 0, unscaled)",
        ),
    ],
    ids=["fused-gate-up-experts", "per-expert-matrices", "sigmoid-router", "scaled-weights"],
)
def test_moe_gguf_layouts_it_does_not_implement_are_refused(
    arch,
    extra,
    message,
    tmp_path,
    tokenizer_fields,  # noqa: F811
):
    family = {"llama": "mixtral", "qwen3moe": "qwen3moe"}[arch]
    path = tmp_path / "unsupported.gguf"
    _write(path, _tiny(family), arch, tokenizer_fields, extra=extra)
    with pytest.raises(ValueError) as refused:
        load_model(path, "float32")
    assert str(refused.value).startswith(message)
