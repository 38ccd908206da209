"""A checkpoint's tensors, named as in Hugging Face's Llama, copied into a ``LlamaModel``.

Hugging Face stores every projection as ``[out, in]`` and q/k/v, gate/up as separate
tensors; the model fuses q/k/v and gate/up into one matmul each and keeps dense weights
transposed (``Linear``). GGUF-quantised matrices (``PackedWeight``) arrive as the file
stores them and stay packed where ``Linear`` and the embedding can use them so.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.workers.quant import PackedWeight
from tessera.workers.quant.int4 import Q8Weight

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
    model: nn.Module, state: dict[str, Weight], bf16_matmuls: bool = False
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
            reduced = bf16_matmuls or model.norm.weight.dtype == torch.bfloat16
            exact = not reduced
            if model.lm_head is None and Q8Weight.supports(embedding, exact):
                model.head_q8 = Q8Weight.from_packed(embedding, exact)
        else:
            copy_checked(model.embed_tokens.weight, embedding, "embed_tokens")
        norm = dequantized(take("model.norm.weight"))
        copy_checked(model.norm.weight, norm, "model.norm.weight")
        if model.lm_head is not None:
            model.lm_head.load_weight([take("lm_head.weight")], "lm_head.weight", bf16_matmuls)
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
            layer.qkv_proj.load_weight(qkv, attn + "qkv", bf16_matmuls)
            if layer.qkv_proj.bias is not None:
                copy_checked(
                    layer.qkv_proj.bias,
                    torch.cat([dequantized(take(attn + f"{n}_proj.bias")) for n in "qkv"]),
                    attn + "qkv.bias",
                )
            layer.o_proj.load_weight([take(attn + "o_proj.weight")], attn + "o_proj", bf16_matmuls)
            if layer.o_proj.bias is not None:
                copy_checked(
                    layer.o_proj.bias,
                    dequantized(take(attn + "o_proj.bias")),
                    attn + "o_proj.bias",
                )
            mlp = p + "mlp."
            fused = mlp + "gate_up_proj.weight"  # Phi-3: gate and up as one matrix
            gate_up = (
                [take(fused)]
                if fused in state
                else [take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]
            )
            layer.gate_up_proj.load_weight(gate_up, mlp, bf16_matmuls)
            layer.down_proj.load_weight(
                [take(mlp + "down_proj.weight")], mlp + "down_proj", bf16_matmuls
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
