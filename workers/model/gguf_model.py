"""A model's configuration and tensors from a GGUF file, as llama.cpp's converter
(``convert_hf_to_gguf.py``) writes each family.

The file's metadata becomes a Hugging Face-style config dict (``ModelConfig.from_hf``
reads both), its tensors take their Hugging Face names (``hf_weights`` loads both).
Every key that changes the computation is either implemented or refused with its name:
an unknown tensor, RoPE scaling type or architecture is an error, never skipped.

Per family, what the converter writes differently:

- ``llama``: q and k rows interleaved into llama.cpp's rotary layout (undone here);
  Llama 3's RoPE scaling as a ``rope_freqs`` tensor of per-frequency divisors.
- ``gemma2``/``gemma3``: norms stored as 1 + w (the 1 already added), four norms a
  layer (``post_attention_norm``, ``ffn_norm`` before the MLP, ``post_ffw_norm``), soft-caps
  and the window as keys; the window pattern and the query scale are llama.cpp's per
  family (every other layer local in Gemma 2, five of six in Gemma 3; the scale
  ``(hidden / heads) ** -0.5`` for the 27B shapes, ``head_dim ** -0.5`` otherwise).
- ``phi3``: q/k/v as one ``attn_qkv`` tensor, gate/up as one ``ffn_up``; LongRoPE's
  factors as ``rope_factors_short``/``rope_factors_long`` tensors, the rotary
  dimensions as ``rope.dimension_count``.
- mixtures of experts (Mixtral under ``llama`` with an ``expert_count``, ``qwen2moe``,
  ``qwen3moe``): the router ``ffn_gate_inp``, each projection's experts stacked
  (``ffn_gate_exps`` ``[E, I, H]``; read packed, one ``PackedWeight`` per expert under
  transformers' per-expert name ``mlp.experts.{e}.gate_proj.weight``), Qwen2-MoE's
  shared expert (``*_shexp``); whether the top-k weights are renormalised is llama.cpp's
  per family unless ``expert_weights_norm`` says; a layer without a router is dense.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from tessera.workers.model.config import ModelConfig
from tessera.workers.model.hf_weights import Weight
from tessera.workers.quant import PackedWeight

logger = logging.getLogger(__name__)

#: GGUF ``general.architecture`` -> the family's Hugging Face ``model_type``.
ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
}

# GGUF tensor names -> Hugging Face names (per layer: "blk.{i}.<name>").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "self_attn.qkv_proj",  # the converter's --fuse-qkv: q, k, v rows stacked
    "attn_q_norm": "self_attn.q_norm",  # Qwen3, Gemma 3
    "attn_k_norm": "self_attn.k_norm",
}
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
#: A mixture of experts' layer tensors (each projection's experts stacked ``[E, out, in]``).
_EXPERT_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # Qwen2-MoE's shared expert
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_MOE_LAYER_NAMES = {**_LAYER_NAMES, **_EXPERT_NAMES}
#: Each family's layer names where they differ from Llama's.
_FAMILY_LAYER_NAMES = {
    "gemma2": _GEMMA_LAYER_NAMES,
    "gemma3": _GEMMA_LAYER_NAMES,
    "phi3": {
        **{k: v for k, v in _LAYER_NAMES.items() if k not in ("attn_q", "attn_k", "attn_v")},
        "attn_qkv": "self_attn.qkv_proj",
        "ffn_up": "mlp.gate_up_proj",  # gate and up, stacked
    },
    "mixtral": _MOE_LAYER_NAMES,  # (a llama file with experts)
    "qwen2moe": _MOE_LAYER_NAMES,
    "qwen3moe": _MOE_LAYER_NAMES,
}
#: llama.cpp's router keys, each with the values the router implements and what they
#: mean: softmax scores (gguf's ``ExpertGatingFuncType.SOFTMAX``), weights unscaled.
_ROUTER_KEYS = {
    "expert_gating_func": ((1,), "1, softmax"),
    "expert_weights_scale": ((0.0, 1.0), "1 or 0, unscaled"),
}
#: Whether llama.cpp renormalises a family's top-k weights (where the file has no
#: ``expert_weights_norm``).
_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
#: GGUF RoPE scaling types implemented (``{arch}.rope.scaling.type``); any other would
#: give wrong positions, so it is refused rather than ignored.
ROPE_SCALING = ("none", "linear", "yarn", "longrope")
#: YaRN keys as the converter writes them -> transformers' ``rope_scaling`` names.
_YARN_KEYS = {
    "rope.scaling.factor": "factor",
    "rope.scaling.original_context_length": "original_max_position_embeddings",
    "rope.scaling.yarn_beta_fast": "beta_fast",
    "rope.scaling.yarn_beta_slow": "beta_slow",
    "rope.scaling.yarn_attn_factor": "attention_factor",
}
#: YaRN keys that llama.cpp reads and transformers' YaRN has no counterpart for (other
#: than their neutral value): refused unless neutral.
_YARN_NEUTRAL = {"rope.scaling.yarn_ext_factor": 1.0, "rope.scaling.yarn_log_multiplier": 0.0}
#: Per-frequency RoPE divisors (Llama 3's scaling, as llama.cpp's converter writes it).
ROPE_FREQS = "rope_freqs.weight"
#: LongRoPE's factors (Phi-3).
ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")
#: llama.cpp's Gemma query scale: ``(hidden / heads) ** -0.5`` for the 27B models (these
#: layer counts), ``head_dim ** -0.5`` for the others.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def hf_name(name: str, arch: str = "llama") -> tuple[str, str | None]:
    """A GGUF tensor's Hugging Face name and its layer part (``attn_q`` ...), or a
    ``ValueError`` naming a tensor the model has no place for (a tensor that changes the
    computation is never skipped)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name], None
    names = _FAMILY_LAYER_NAMES.get(arch, _LAYER_NAMES)
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
        _, layer, base, kind = parts
        return f"model.layers.{layer}.{names[base]}.{kind}", base
    raise ValueError(
        f"model: GGUF tensor {name!r} is not supported: this loader reads the token "
        f"embedding, the output norm and head, and per layer {', '.join(names)}"
    )


def read_gguf(path: Path, packed: bool = False) -> tuple[ModelConfig, dict[str, Weight]]:
    """Read config and tensors: dequantised (every type ``gguf`` can dequantise), or,
    with ``packed``, Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K matrices kept as the file stores them
    (a mixture's stacked experts ``[E, out, in]`` as E matrices, ``_expert_names``).
    One log line names the types that were expanded to float32 and what that costs."""
    from gguf import GGMLQuantizationType, dequantize

    from tessera.workers.model.gguf_file import GGUFFile

    reader = GGUFFile(path)
    arch = reader.fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"model: GGUF architecture {arch!r} is not supported ({', '.join(ARCHITECTURES)})"
        )
    by_name = {t.name: t for t in reader.tensors}
    hf = _hf_config(reader.fields, arch, by_name, dequantize)
    config = ModelConfig.from_hf(hf)
    family = "mixtral" if hf["model_type"] == "mixtral" else arch  # its tensor names
    extra = (ROPE_FREQS, *ROPE_FACTORS)  # read into the config above
    tensors = [t for t in reader.tensors if t.name not in extra]
    for tensor in tensors:  # every tensor has a place and a type gguf reads before any is read
        hf_name(tensor.name, family)
        _check_readable(tensor)
    state: dict[str, Weight] = {}
    expanded: Counter[str] = Counter()  # bytes in the file of each type expanded
    expanded_bytes = 0
    for tensor in tqdm(tensors, desc=f"reading {path.name}", unit="tensor", leave=False):
        keep = packed and len(tensor.shape) in (2, 3) and PackedWeight.supports(tensor.tensor_type)
        name, base = hf_name(tensor.name, family)
        if keep and len(tensor.shape) == 3:  # a mixture's experts, stored expert after expert
            in_features, out, count = (int(s) for s in tensor.shape)
            for expert, expert_name in enumerate(_expert_names(name, count)):
                # data is uint8 [E, out, row bytes]: each expert's rows copied out once
                state[expert_name] = PackedWeight.from_raw(
                    tensor.data[expert], tensor.tensor_type, (out, in_features)
                )
            reader.release(tensor)
            continue
        # llama.cpp's converter interleaves the rotary halves of q and k; undo it.
        rows = _rotary_rows(config, base) if arch == "llama" else None
        if keep:
            weight = PackedWeight.from_gguf(tensor)
            if rows is not None:  # a permutation of output rows: done on the packed rows
                weight = weight.select_rows(torch.from_numpy(rows))
            state[name] = weight
            reader.release(tensor)  # copied out: the file's bytes are held once
            continue
        weights = dequantize(tensor.data, tensor.tensor_type)
        if tensor.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            expanded[GGMLQuantizationType(tensor.tensor_type).name] += tensor.data.nbytes
            expanded_bytes += weights.size * 4
        if rows is not None:
            weights = weights[rows]
        # np.array copies: F32 tensors come back as read-only memory maps of the file.
        state[name] = torch.from_numpy(np.array(weights, dtype=np.float32))
        reader.release(tensor)
    if expanded:
        logger.info(
            "%s: %s expanded to float32 (%.0f MiB in the file, %.0f MiB in memory)",
            path.name,
            ", ".join(sorted(expanded)),
            sum(expanded.values()) / 2**20,
            expanded_bytes / 2**20,
        )
    return config, state


def _expert_names(name: str, count: int) -> list[str]:
    """A stacked expert tensor's name (``...mlp.experts.gate_proj.weight``) as each of its
    ``count`` experts' (``...mlp.experts.{e}.gate_proj.weight``: transformers' matrix per
    expert, a layout ``hf_weights`` loads)."""
    layer, projection = name.split(".experts.")
    return [f"{layer}.experts.{expert}.{projection}" for expert in range(count)]


def _check_readable(tensor: Any) -> None:
    """Refuse a tensor whose type ``gguf`` cannot dequantise, naming it and the type."""
    from gguf import GGMLQuantizationType, dequantize
    from gguf.constants import GGML_QUANT_SIZES

    kind = GGMLQuantizationType(tensor.tensor_type)
    if kind.name in _READABLE:
        return
    block, size = GGML_QUANT_SIZES[kind]
    try:  # one block of zeros: the type's dequantisation exists or it does not
        dequantize(np.zeros((1, size), dtype=np.uint8), kind)
    except NotImplementedError:
        raise ValueError(
            f"model: GGUF tensor {tensor.name!r} has type {kind.name}, which gguf cannot "
            "dequantise (this loader reads the types it can)"
        ) from None
    _READABLE.add(kind.name)


#: GGUF types found readable so far (the float types always are).
_READABLE = {"F32", "F16", "BF16"}


def _hf_config(
    fields: dict[str, Any], arch: str, tensors: dict[str, Any], dequantize: Any
) -> dict[str, Any]:
    """The file's metadata as a Hugging Face config dict of its family."""

    def field(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    num_heads = field("attention.head_count")
    hidden = field("embedding_length")
    num_layers = field("block_count")
    # (Qwen3's and Gemma's heads are not hidden / heads wide: the key length says how wide)
    head_dim = field("attention.key_length") or hidden // num_heads
    value_dim = field("attention.value_length", head_dim)
    if value_dim != head_dim:  # the attention's values are as wide as its keys
        raise ValueError(
            f"model: GGUF {arch}.attention.value_length {value_dim} differs from the keys' "
            f"{head_dim} (values as wide as keys only)"
        )
    rope_dims = field("rope.dimension_count") or head_dim
    hf: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "vocab_size": field("vocab_size") or len(fields["tokenizer.ggml.tokens"]),
        "hidden_size": hidden,
        "intermediate_size": field("feed_forward_length"),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": field("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "max_position_embeddings": field("context_length"),
        "rms_norm_eps": field("attention.layer_norm_rms_epsilon"),
        "rope_theta": field("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensors,
        # a Llama with biases (Qwen2's q/k/v biases come with its architecture)
        "attention_bias": arch == "llama" and _has_qkv_bias(tensors),
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
    }
    if field("expert_count"):
        hf.update(_moe_fields(fields, arch, tensors))
    if rope_dims != head_dim:
        if arch != "phi3":
            raise ValueError(
                f"model: GGUF {arch}.rope.dimension_count {rope_dims} differs from the heads' "
                f"{head_dim} dimensions (partial rotary is implemented for phi3 only)"
            )
        hf["partial_rotary_factor"] = rope_dims / head_dim
    window = field("attention.sliding_window") or None
    pattern = field("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per layer: True where the layer is local
        hf["layer_types"] = [
            "sliding_attention" if local else "full_attention" for local in pattern
        ]
    elif pattern is not None and not arch.startswith("gemma"):
        raise ValueError(
            f"model: GGUF {arch}.attention.sliding_window_pattern {pattern!r} is not supported "
            "(a list of each layer's kind, or Gemma's period)"
        )
    if arch.startswith("gemma"):
        hf["sliding_window"] = window
        hf["attn_logit_softcapping"] = field("attn_logit_softcapping")
        hf["final_logit_softcapping"] = field("final_logit_softcapping")
        hf["hidden_activation"] = "gelu_pytorch_tanh"
        wide = num_layers == _GEMMA_27B_LAYERS[arch]
        hf["query_pre_attn_scalar"] = hidden // num_heads if wide else head_dim
        if pattern is not None and "layer_types" not in hf:
            hf["sliding_window_pattern"] = pattern
    elif arch == "phi3":
        hf["sliding_window"] = window
    elif window is not None:  # Llama's files: every layer (Mistral); Qwen's: listed layers
        if arch != "llama" and "layer_types" not in hf:
            raise ValueError(
                f"model: GGUF {arch}.attention.sliding_window {window} is not supported "
                f"without {arch}.attention.sliding_window_pattern (its windows cover some "
                "layers only)"
            )
        hf.update(sliding_window=window, use_sliding_window=True)
        if hf["model_type"] == "llama":
            hf["model_type"] = "mistral"
    scaling_type = field("rope.scaling.type")
    if scaling_type is not None and scaling_type not in ROPE_SCALING:
        raise ValueError(
            f"model: GGUF {arch}.rope.scaling.type {scaling_type!r} is not supported "
            f"({', '.join(ROPE_SCALING)})"
        )
    scaling = None
    if scaling_type == "yarn":
        scaling = {"rope_type": "yarn"}
        for key, name in _YARN_KEYS.items():
            if (value := field(key)) is not None:
                scaling[name] = value
        for key, neutral in _YARN_NEUTRAL.items():
            if field(key, neutral) not in (neutral, -1.0):  # -1: llama.cpp's "derive it"
                raise ValueError(
                    f"model: GGUF {arch}.{key} {field(key)!r} is not supported ({neutral})"
                )
    if scaling_type == "linear":
        scaling = {"rope_type": "linear", "factor": field("rope.scaling.factor")}

    def factors(name: str) -> tuple[float, ...]:
        tensor = tensors[name]
        return tuple(dequantize(tensor.data, tensor.tensor_type).reshape(-1).tolist())

    given = [name for name in (ROPE_FREQS, *ROPE_FACTORS) if name in tensors]
    if given and scaling is not None:
        raise ValueError(
            f"model: GGUF {arch}.rope.scaling.type {scaling_type!r} and a {given[0]!r} "
            "tensor: one RoPE scaling at a time"
        )
    if ROPE_FREQS in tensors:
        scaling = {"rope_type": "freq_factors", "factors": factors(ROPE_FREQS)}
    elif scaling_type == "longrope" or any(name in tensors for name in ROPE_FACTORS):
        missing = [name for name in ROPE_FACTORS if name not in tensors]
        if missing:
            raise ValueError(f"model: GGUF LongRoPE scaling without a {missing[0]!r} tensor")
        scaling = {
            "rope_type": "longrope",
            "short_factor": factors(ROPE_FACTORS[0]),
            "long_factor": factors(ROPE_FACTORS[1]),
            "attention_factor": field("rope.scaling.attn_factor"),
        }
        hf["original_max_position_embeddings"] = field("rope.scaling.original_context_length")
    if arch == "gemma3":  # the global layers' RoPE (scaled), the local layers' own base
        hf["rope_parameters"] = {
            "full_attention": {"rope_theta": hf["rope_theta"], **(scaling or {})},
            "sliding_attention": {"rope_theta": field("rope.freq_base_swa", 10000.0)},
        }
    elif scaling is not None:
        hf["rope_scaling"] = scaling
    return hf


def _moe_fields(fields: dict[str, Any], arch: str, tensors: dict[str, Any]) -> dict[str, Any]:
    """A mixture of experts' config fields from llama.cpp's keys; its layers without a
    router (``ffn_gate_inp``) are dense."""

    def field(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    for key, (implemented, meaning) in _ROUTER_KEYS.items():
        if field(key) not in (None, *implemented):
            raise ValueError(
                f"model: GGUF {arch}.{key} {field(key)!r} is not supported ({meaning})"
            )
    num_layers = field("block_count")
    moe = {
        "model_type": "mixtral" if arch == "llama" else ARCHITECTURES[arch],
        "num_local_experts": field("expert_count"),
        "num_experts_per_tok": field("expert_used_count"),
        "moe_intermediate_size": field("expert_feed_forward_length")
        or field("feed_forward_length"),
        "norm_topk_prob": bool(field("expert_weights_norm", _NORM_TOPK.get(arch, True))),
        "mlp_only_layers": [
            i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors
        ],
    }
    if any(name.endswith(".ffn_gate_shexp.weight") for name in tensors):
        shared = field("expert_shared_feed_forward_length") or field("feed_forward_length")
        moe["shared_expert_intermediate_size"] = shared
    if arch == "qwen2moe":
        moe["qkv_bias"] = _has_qkv_bias(tensors)
    return moe


def _has_qkv_bias(tensors: dict[str, Any]) -> bool:
    """Whether the first layer's q/k/v have biases (separate, or fused by --fuse-qkv)."""
    return "blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors


def _rotary_rows(config: ModelConfig, base: str | None) -> Any:
    """The row order that undoes the converter's q/k interleaving of a Llama tensor
    (``attn_q``, ``attn_k``, or ``attn_qkv``: q's rows, then k's, then v's), or None."""
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    q = _unpermute_rotary(np.arange(q_rows), config.num_heads)
    k = _unpermute_rotary(np.arange(kv_rows), config.num_kv_heads)
    if base == "attn_q":
        return q
    if base == "attn_k":
        return k
    if base == "attn_qkv":
        return np.concatenate([q, q_rows + k, np.arange(q_rows + kv_rows, q_rows + 2 * kv_rows)])
    return None


def _unpermute_rotary(weights: Any, num_heads: int) -> Any:
    half = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)
