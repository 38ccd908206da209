"""The model's layers as the native decode stack (``csrc/decode_layers.cpp``).

``DecodeLayers`` runs every layer of a step without masked chunks in one native call
(decode rows, then whole causal chunks), reading the same tensors as the torch layers:
each ``Linear`` is handed over as it stores its weight (dense, packed GGUF, torch's int4,
or the tiled Q4 layout), nothing is copied. The model's classes are typed here as
modules: ``llama`` imports this file.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from tessera.workers.quant.blocks import PackedWeight
from tessera.workers.quant.int4 import Int4Weight, Q4Weight
from tessera.workers.quant.kernels import native_kernels

#: ``Linear`` kinds of the native decode stack (``csrc/decode_stack.h``).
NATIVE_DENSE, NATIVE_GGUF, NATIVE_INT4, NATIVE_Q4, NATIVE_Q4_EXACT, NATIVE_K_QUANT = range(6)
NATIVE_K_QUANT_INT8 = 7  # (6 is a projection of parts, make_parts)
#: Model dtypes the native decode stack has kernels for.
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def native_linear(linear: nn.Module, kernels: ModuleType) -> Any:
    """``linear``, a ``llama.Linear``, as the native extension's ``Linear`` (sharing its
    tensors)."""
    weight, packed, int4, bias = linear.weight, linear.packed, linear.int4, linear.bias
    if linear.packed_parts:  # row groups of different types, one product each
        parts = [_packed(part, None, linear.int8, kernels) for part in linear.packed_parts]
        return kernels.make_parts(parts, bias)
    if packed is not None:
        return _packed(packed, bias, linear.int8, kernels)
    if isinstance(int4, Q4Weight):
        kind = NATIVE_Q4_EXACT if int4.exact else NATIVE_Q4
        return kernels.make_linear(
            kind, weight, None, None, int4.m, int(int4.qtype), int4.nibbles, int4.d,
            linear.int4_rows, bias,
        )  # fmt: skip
    if isinstance(int4, Int4Weight):
        return kernels.make_linear(
            NATIVE_INT4, weight, None, None, None, 0, int4.packed, int4.scales_and_zeros,
            linear.int4_rows, bias,
        )  # fmt: skip
    return kernels.make_linear(NATIVE_DENSE, weight, None, None, None, 0, None, None, 0, bias)


def _packed(
    packed: PackedWeight, bias: torch.Tensor | None, int8: bool, kernels: ModuleType
) -> Any:
    if packed.qtype.is_k:  # the file's super-blocks, for kquant_mm (or kquant_q8_mm)
        kind, scales = NATIVE_K_QUANT_INT8 if int8 else NATIVE_K_QUANT, None
    else:
        kind, scales = NATIVE_GGUF, packed.scales
    return kernels.make_linear(
        kind, None, packed.qs, scales, packed.mins, int(packed.qtype), None, None, 0, bias
    )


def _dense(weight: torch.Tensor, kernels: ModuleType) -> Any:
    """A dense ``[in, out]`` matrix as the native extension's ``Linear``."""
    return kernels.make_linear(NATIVE_DENSE, weight, None, None, None, 0, None, None, 0, None)


def native_experts(moe: nn.Module, kernels: ModuleType) -> tuple[list[Any], list[Any]]:
    """A ``moe.SparseMoE``'s experts' gate/up and down projections as the native
    extension's ``Linear`` s, one each per expert (packed as the file stores them, with
    int8 inputs where ``moe.int8``, or views of the dense stacks), multiplied by the
    kernels ``moe.py`` multiplies them by."""
    if moe.packed_gate_up:
        gate_up = []
        for parts in moe.packed_gate_up:
            linears = [_packed(part, None, moe.int8, kernels) for part in parts]
            gate_up.append(linears[0] if len(linears) == 1 else kernels.make_parts(linears, None))
    else:
        gate_up = [_dense(weight, kernels) for weight in moe.gate_up]
    if moe.packed_down:
        down = [_packed(weight, None, moe.int8, kernels) for weight in moe.packed_down]
    else:
        down = [_dense(weight, kernels) for weight in moe.down]
    return gate_up, down


def build_native_layers(model: nn.Module) -> Any | None:
    """Every layer of ``model``, a ``LlamaModel`` with its weights loaded, as one
    ``DecodeLayers``; None where that cannot run: not on the CPU, no native extension, a
    dtype it has no kernels for, or a family whose layers it does not have (Gemma's norms,
    GELU gates and soft-caps, windows that differ between layers, LoRA slots on a
    mixture of experts' layers)."""
    weight = model.norm.weight
    kernels = native_kernels() if weight.device.type == "cpu" else None
    config = model.config
    unsupported = (
        config.sandwich_norms
        or config.hidden_activation != "silu"
        or config.attn_softcap is not None
        or len(set(config.layer_windows)) > 1
        or any(
            layer.moe is not None and getattr(layer.qkv_proj, "lora_a", None) is not None
            for layer in model.layers
        )
    )
    if kernels is None or weight.dtype not in NATIVE_DTYPES or unsupported:
        return None
    stack = kernels.DecodeLayers(
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.intermediate_size,
        config.rms_norm_eps,
        config.scale,
        config.window(0),  # every layer's, or 0
        config.rotary_dims,
    )
    for layer in model.layers:
        attention = (
            layer.input_layernorm.weight,
            native_linear(layer.qkv_proj, kernels),
            native_linear(layer.o_proj, kernels),
            layer.post_attention_layernorm.weight,
        )
        qk_norms = (layer.q_norm.weight, layer.k_norm.weight) if layer.qk_norm else (None, None)
        moe = layer.moe
        if moe is None:
            gate_up, down = (
                native_linear(x, kernels) for x in (layer.gate_up_proj, layer.down_proj)
            )
            stack.add_layer(*attention, gate_up, down, *qk_norms)
            continue
        shared = []
        if moe.shared_gate_up is not None:
            shared = [
                native_linear(linear, kernels)
                for linear in (moe.shared_gate_up, moe.shared_down, moe.shared_expert_gate)
            ]
        stack.add_moe_layer(
            *attention,
            native_linear(moe.gate, kernels),
            *native_experts(moe, kernels),
            moe.top_k,
            moe.norm_topk_prob,
            moe.expert_size,
            shared,
            moe.shared_size,
            *qk_norms,
        )
    for index, layer in enumerate(model.layers):  # LoRA slots (``lora.LoraSlots``)
        linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        if getattr(layer.qkv_proj, "lora_a", None) is not None:
            slots = [
                t
                for lin in linears
                for t in (lin.lora_a, lin.lora_b, lin.lora_ranks, lin.lora_cols)
            ]
            stack.set_lora(index, slots)
    return stack
