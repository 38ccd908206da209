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
its own (``x @ W``: the faster layout for skinny batches). The router and the shared
expert are ``Linear`` layers, whose class the decoder passes in (it lives in
``llama.py``, which imports this file).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tessera.workers.model.config import ModelConfig
from tessera.workers.model.hf_weights import copy_checked

#: Builds a projection ``[T, in] -> [T, out]`` with ``load_weight``: ``llama.Linear``.
LinearFactory = Callable[[int, int, bool], nn.Module]


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, linear: LinearFactory) -> None:
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ValueError("SparseMoE: the config has no mixture of experts")
        hidden, size = config.hidden_size, moe.expert_intermediate_size
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.expert_size = size
        self.gelu = config.hidden_activation == "gelu_pytorch_tanh"
        self.gate = linear(hidden, moe.num_experts, False)  # the router
        # [E, hidden, 2 * size] (each expert's gate then up columns) and [E, size, hidden]
        self.gate_up = nn.Parameter(torch.empty(moe.num_experts, hidden, 2 * size), False)
        self.down = nn.Parameter(torch.empty(moe.num_experts, size, hidden), False)
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
                h = self._act(rows[start:end] @ self.gate_up[expert], self.expert_size)
                torch.mm(h, self.down[expert], out=outputs[start:end])
                start = end
        outputs.mul_(weights.reshape(-1, 1).index_select(0, order))
        return torch.zeros_like(x).index_add_(0, tokens, outputs)

    def _act(self, gate_up: torch.Tensor, size: int) -> torch.Tensor:
        gate, up = gate_up.split(size, dim=-1)
        return (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up

    def load_experts(
        self,
        gate: torch.Tensor,  # [E, size, hidden]: Hugging Face's [out, in] per expert
        up: torch.Tensor,
        down: torch.Tensor,  # [E, hidden, size]
        name: str,
    ) -> None:
        """Set the experts from their stacked ``[out, in]`` matrices."""
        gate_up = torch.cat((gate, up), dim=1).transpose(1, 2)
        copy_checked(self.gate_up, gate_up, name + ".gate_up")
        copy_checked(self.down, down.transpose(1, 2), name + ".down")
