"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE), computed as
transformers computes it.

A router scores every expert per token (float32 softmax over its logits), keeps the
``top_k`` most probable (``torch.topk``, ties as transformers breaks them), renormalises
their probabilities to sum to 1 where the family does (``norm_topk_prob``), and sums
those experts' SwiGLU outputs weighted by them, in expert order. Qwen2-MoE adds a shared
expert that every token takes, scaled by ``sigmoid(shared_expert_gate(x))``.

A step's tokens are grouped by expert, so that each expert multiplies all the rows routed
to it at once (one gate/up and one down matmul per expert that has rows), never a loop
over tokens::

    (token, expert) pairs sorted by expert:
    | e0: t3 t7 | e2: t0 t3 t5 | e5: t0 t5 t7 |   <- rows gathered in this order
      2 rows      3 rows         3 rows           one matmul pair each
    weighted outputs added back into their tokens' rows (index_add)

Expert weights are dense stacks, each expert's matrix ``[in, out]`` as ``Linear`` stores
its own (``x @ W``: the faster layout for skinny batches); or, in a float32 model given
GGUF-quantised experts, each expert's matrices packed as the file stores them
(``PackedWeight``: its gate rows then up rows fused into one, and its down), multiplied
by ``quant_matmul`` (exact float32: only the order of the sums differs from the
dequantised weights' matmul; in the int8 mode, ``int8``, K-quant experts multiply inputs
quantised to int8 per 256 as the mode's projections do) and never expanded. The router
and the shared expert are ``Linear`` layers, whose class the decoder passes in (it lives
in ``llama.py``, which imports this file).

The native decode stack (``native_stack.py``, ``csrc/decode_experts.h``) runs the same
layers in one call for steps without masked chunks, through the same kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tessera.workers.model.config import ModelConfig
from tessera.workers.model.hf_weights import Weight, copy_checked, dequantized
from tessera.workers.quant import PackedWeight, quant_matmul

#: Builds a projection ``[T, in] -> [T, out]`` with ``load_weight``: ``llama.Linear``.
LinearFactory = Callable[[int, int, bool], nn.Module]
#: A projection's experts as a checkpoint holds them: stacked ``[E, out, in]``, or one
#: ``[out, in]`` matrix per expert (dense, or packed as a GGUF file stores it).
Experts = torch.Tensor | Sequence[Weight]


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, linear: LinearFactory) -> None:
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ValueError("SparseMoE: the config has no mixture of experts")
        hidden, size = config.hidden_size, moe.expert_intermediate_size
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.hidden_size, self.expert_size = hidden, size
        self.gelu = config.hidden_activation == "gelu_pytorch_tanh"
        self.gate = linear(hidden, moe.num_experts, False)  # the router
        # [E, hidden, 2 * size] (each expert's gate then up columns) and [E, size, hidden]
        self.gate_up = nn.Parameter(torch.empty(moe.num_experts, hidden, 2 * size), False)
        self.down = nn.Parameter(torch.empty(moe.num_experts, size, hidden), False)
        # Packed instead (then the stacks above are empty): per expert, its gate/up row
        # groups (one, gate rows then up rows, where both have one type) and its down,
        # Hugging Face's [out, in] as the file stores them
        self.packed_gate_up: tuple[tuple[PackedWeight, ...], ...] = ()
        self.packed_down: tuple[PackedWeight, ...] = ()
        self.int8 = False  # packed K-quant experts times int8 inputs (the int8 mode)
        shared = moe.shared_expert_intermediate_size
        self.shared_size = shared
        self.shared_gate_up = linear(hidden, 2 * shared, False) if shared else None
        self.shared_down = linear(shared, hidden, False) if shared else None
        self.shared_expert_gate = linear(hidden, 1, False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        weights, experts = self.route(x)
        out = self.experts(x, experts, weights)
        if self.shared_gate_up is not None:
            shared = self.shared_down(self._act(self.shared_gate_up(x), self.shared_size))
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts ``[T, top_k]`` (int64) and their weights (``x``'s dtype),
        most probable first."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def experts(
        self,
        x: torch.Tensor,  # [T, hidden]
        experts: torch.Tensor,  # [T, top_k]
        weights: torch.Tensor,  # [T, top_k]
    ) -> torch.Tensor:
        """The weighted sum of each token's experts' outputs, ``[T, hidden]``."""
        flat = experts.reshape(-1)  # [T * top_k], pair p is token p // top_k
        order = torch.argsort(flat, stable=True)
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x.index_select(0, tokens)  # [T * top_k, hidden], grouped by expert
        outputs = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                end = start + count
                h = self._act(self._gate_up(rows[start:end], expert), self.expert_size)
                if self.packed_down:
                    down = self.packed_down[expert]
                    outputs[start:end] = quant_matmul(h, down, int8=self.int8)
                else:
                    torch.mm(h, self.down[expert], out=outputs[start:end])
                start = end
        outputs.mul_(weights.reshape(-1, 1).index_select(0, order))
        return torch.zeros_like(x).index_add_(0, tokens, outputs)

    def _gate_up(self, rows: torch.Tensor, expert: int) -> torch.Tensor:
        """``rows`` ``[n, hidden]`` through ``expert``'s gate and up: ``[n, 2 * size]``."""
        if not self.packed_gate_up:
            return rows @ self.gate_up[expert]
        parts = self.packed_gate_up[expert]
        if len(parts) == 1:
            return quant_matmul(rows, parts[0], int8=self.int8)
        return torch.cat([quant_matmul(rows, part, int8=self.int8) for part in parts], dim=-1)

    def _act(self, gate_up: torch.Tensor, size: int) -> torch.Tensor:
        gate, up = gate_up.split(size, dim=-1)
        return (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up

    def load_experts(
        self, gate: Experts, up: Experts, down: Experts, name: str, int8: bool = False
    ) -> None:
        """Set the experts from their ``[out, in]`` matrices (gate and up ``[size, hidden]``,
        down ``[hidden, size]``), stacked or one per expert. A float32 model keeps a
        projection whose every expert is packed (``PackedWeight``) as it is, gate and up
        together; anything else is expanded into the dense stacks. ``int8``: the packed
        K-quant experts multiply int8-quantised inputs (the int8 mode; the loader asks
        only where the kernel is built), where there are any."""
        hidden, size = self.hidden_size, self.expert_size
        packs = self.gate_up.dtype == torch.float32
        if packs and _packed(gate, self.num_experts) and _packed(up, self.num_experts):
            for part in (*gate, *up):
                _check_shape(part, (size, hidden), name + ".gate_up")
            self.packed_gate_up = tuple(_fused(g, u) for g, u in zip(gate, up, strict=True))
            self.gate_up = nn.Parameter(torch.empty(0), requires_grad=False)
        else:
            gate_up = torch.cat((_stacked(gate), _stacked(up)), dim=1).transpose(1, 2)
            copy_checked(self.gate_up, gate_up, name + ".gate_up")
        if packs and _packed(down, self.num_experts):
            for part in down:
                _check_shape(part, (hidden, size), name + ".down")
            self.packed_down = tuple(down)
            self.down = nn.Parameter(torch.empty(0), requires_grad=False)
        else:
            copy_checked(self.down, _stacked(down).transpose(1, 2), name + ".down")
        packed = [*(p for parts in self.packed_gate_up for p in parts), *self.packed_down]
        self.int8 = int8 and any(weight.qtype.is_k for weight in packed)


def _packed(experts: Experts, count: int) -> bool:
    """Whether ``experts`` are ``count`` packed matrices, one per expert."""
    return (
        not isinstance(experts, torch.Tensor)
        and len(experts) == count
        and all(isinstance(e, PackedWeight) for e in experts)
    )


def _stacked(experts: Experts) -> torch.Tensor:
    """``experts`` as a dense ``[E, out, in]`` stack (packed ones dequantised)."""
    if isinstance(experts, torch.Tensor):
        return experts
    return torch.stack([dequantized(e) for e in experts])


def _fused(gate: PackedWeight, up: PackedWeight) -> tuple[PackedWeight, ...]:
    """An expert's gate then up rows: one matrix where both have one type, else two."""
    if gate.qtype is up.qtype:
        return (PackedWeight.cat([gate, up]),)
    return gate, up


def _check_shape(weight: PackedWeight, shape: tuple[int, int], name: str) -> None:
    if weight.shape != shape:
        raise ValueError(f"tensor {name!r}: an expert's shape {weight.shape}, expected {shape}")
