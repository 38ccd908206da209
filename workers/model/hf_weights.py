"""A checkpoint's tensors, named as in Hugging Face's Llama, copied into a ``LlamaModel``.

Hugging Face stores every projection as ``[out, in]`` and q/k/v, gate/up as separate
tensors; the model fuses q/k/v and gate/up into one matmul each and keeps dense weights
transposed (``Linear``). GGUF-quantised matrices (``PackedWeight``) arrive as the file
stores them and stay packed where ``Linear`` and the embedding can use them so.

A mixture of experts' experts come in one of three layouts: one matrix per expert
(``mlp.experts.{e}.gate_proj``, Mixtral's ``block_sparse_moe.experts.{e}.w1`` (gate),
``w3`` (up), ``w2`` (down): what ``save_pretrained`` and the Hub's checkpoints hold),
transformers' fused stacks (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
``mlp.experts.down_proj`` ``[E, H, I]``), or a stack per projection
(``mlp.experts.gate_proj.weight`` ``[E, I, H]``: a GGUF file's ``ffn_gate_exps``, read
dequantised). Packed GGUF experts arrive one matrix per expert and stay packed where
``SparseMoE.load_experts`` keeps them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tessera.workers.config import FAST, INT8
from tessera.workers.quant import PackedWeight
from tessera.workers.quant.int4 import Q8Weight
from tessera.workers.quant.kernels import kquant_int8_available

#: A checkpoint tensor: dense, or a GGUF-quantised matrix kept as the file stores it.
Weight = torch.Tensor | PackedWeight


def dequantized(value: Weight) -> torch.Tensor:
    """``value`` as a dense tensor (a packed one dequantised)."""
    return value.dequantize() if isinstance(value, PackedWeight) else value


def copy_checked(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """Copy ``value`` into ``param``, refusing a shape that differs (``name`` says which)."""
    if param.shape != value.shape:
        raise ValueError(
            f"tensor {name!r}: shape {tuple(value.shape)}, expected {tuple(param.shape)}"
        )
    param.copy_(value)


def load_hf_state_dict(
    model: nn.Module, state: dict[str, Weight], rounding: str | None = None
) -> None:
    """Copy ``state`` (consumed) into ``model``, a ``LlamaModel`` (typed as a module: the
    model's file imports this one); see ``LlamaModel.load_hf_state_dict``."""

    def take(name: str) -> Weight:
        try:
            return state.pop(name)
        except KeyError:
            raise ValueError(f"checkpoint is missing tensor {name!r}") from None

    with torch.no_grad():
        embedding = take("model.embed_tokens.weight")
        if isinstance(embedding, PackedWeight):
            if embedding.shape != tuple(model.embed_tokens.weight.shape):
                raise ValueError(
                    f"tensor 'embed_tokens': shape {embedding.shape}, expected "
                    f"{tuple(model.embed_tokens.weight.shape)}"
                )
            model.packed_embedding = embedding
            model.embed_tokens.weight = nn.Parameter(torch.empty(0), requires_grad=False)
            reduced = rounding == FAST or model.norm.weight.dtype == torch.bfloat16
            exact = not reduced
            if model.lm_head is None and Q8Weight.supports(embedding, exact):
                model.head_q8 = Q8Weight.from_packed(embedding, exact)
            # a tied K-quant head, in the int8 mode: int8 inputs, as its projections
            model.head_int8 = (
                model.lm_head is None
                and rounding == INT8
                and embedding.qtype.is_k
                and kquant_int8_available()
            )
        else:
            copy_checked(model.embed_tokens.weight, embedding, "embed_tokens")
        norm = dequantized(take("model.norm.weight"))
        copy_checked(model.norm.weight, norm, "model.norm.weight")
        if model.lm_head is not None:
            model.lm_head.load_weight([take("lm_head.weight")], "lm_head.weight", rounding)
        else:
            state.pop("lm_head.weight", None)
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            for norm_name in layer.norms():
                weight = dequantized(take(p + norm_name + ".weight"))
                copy_checked(getattr(layer, norm_name).weight, weight, p + norm_name)
            attn = p + "self_attn."
            if layer.qk_norm:  # Qwen3: RMSNorm of each q and k head
                for norm_name in ("q_norm", "k_norm"):
                    weight = dequantized(take(attn + norm_name + ".weight"))
                    copy_checked(getattr(layer, norm_name).weight, weight, attn + norm_name)
            fused = attn + "qkv_proj.weight"  # Phi-3 stores q/k/v as one matrix
            qkv = (
                [take(fused)]
                if fused in state
                else [take(attn + f"{n}_proj.weight") for n in "qkv"]
            )
            layer.qkv_proj.load_weight(qkv, attn + "qkv", rounding)
            if layer.qkv_proj.bias is not None:
                fused_bias = attn + "qkv_proj.bias"  # a GGUF file's fused q/k/v biases
                bias = (
                    dequantized(take(fused_bias))
                    if fused_bias in state
                    else torch.cat([dequantized(take(attn + f"{n}_proj.bias")) for n in "qkv"])
                )
                copy_checked(layer.qkv_proj.bias, bias, attn + "qkv.bias")
            layer.o_proj.load_weight([take(attn + "o_proj.weight")], attn + "o_proj", rounding)
            if layer.o_proj.bias is not None:
                copy_checked(
                    layer.o_proj.bias,
                    dequantized(take(attn + "o_proj.bias")),
                    attn + "o_proj.bias",
                )
            mlp = p + "mlp."
            if layer.moe is not None:
                _load_moe(layer.moe, take, state, p, rounding)
                continue
            fused = mlp + "gate_up_proj.weight"  # Phi-3: gate and up as one matrix
            gate_up = (
                [take(fused)]
                if fused in state
                else [take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]
            )
            layer.gate_up_proj.load_weight(gate_up, mlp, rounding)
            layer.down_proj.load_weight(
                [take(mlp + "down_proj.weight")], mlp + "down_proj", rounding
            )
            if layer.gate_up_proj.bias is not None:
                copy_checked(
                    layer.gate_up_proj.bias,
                    torch.cat(
                        [
                            dequantized(take(mlp + "gate_proj.bias")),
                            dequantized(take(mlp + "up_proj.bias")),
                        ]
                    ),
                    mlp,
                )
                copy_checked(layer.down_proj.bias, dequantized(take(mlp + "down_proj.bias")), mlp)
    leftover = [k for k in state if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise ValueError(f"checkpoint has tensors the model does not use: {leftover[:5]}")


def _load_moe(
    moe: nn.Module,
    take: Callable[[str], Weight],
    state: dict[str, Weight],
    prefix: str,  # "model.layers.{i}."
    rounding: str | None,
) -> None:
    """A layer's router, experts (in any layout of the module docstring) and shared
    expert into ``moe``, a ``moe.SparseMoE``."""
    mlp = prefix + "mlp."
    mixtral = prefix + "block_sparse_moe."  # the Hub's Mixtral names
    block = mixtral if mixtral + "gate.weight" in state else mlp
    moe.gate.load_weight([take(block + "gate.weight")], block + "gate", rounding)
    experts = block + "experts."
    if experts + "gate_up_proj" in state:  # transformers' fused stacks
        gate, up = dequantized(take(experts + "gate_up_proj")).chunk(2, dim=1)
        down = dequantized(take(experts + "down_proj"))
    elif experts + "gate_proj.weight" in state:  # a stack per projection
        gate, up, down = (
            dequantized(take(experts + f"{n}_proj.weight")) for n in ("gate", "up", "down")
        )
    else:  # a matrix per expert (a GGUF file's packed experts too: ``read_gguf``)
        names = ("w1", "w3", "w2") if block == mixtral else ("gate_proj", "up_proj", "down_proj")
        gate, up, down = (
            [take(f"{experts}{e}.{n}.weight") for e in range(moe.num_experts)] for n in names
        )
    int8 = rounding == INT8 and kquant_int8_available()
    moe.load_experts(gate, up, down, experts[:-1], int8)
    if moe.shared_gate_up is not None:
        shared = mlp + "shared_expert."
        gate_up = [take(shared + "gate_proj.weight"), take(shared + "up_proj.weight")]
        moe.shared_gate_up.load_weight(gate_up, shared + "gate_up", rounding)
        down = [take(shared + "down_proj.weight")]
        moe.shared_down.load_weight(down, shared + "down_proj", rounding)
        # [1, hidden] (a GGUF file may store it as a vector)
        gate = [dequantized(take(mlp + "shared_expert_gate.weight")).reshape(1, -1)]
        moe.shared_expert_gate.load_weight(gate, mlp + "shared_expert_gate", rounding)
