"""Tensor parallelism: one model's weights split over ``size`` ranks, as Megatron-LM
splits them, so that each rank holds and reads about ``1 / size`` of every layer.

Per decoder layer, rank ``r`` holds:

- its attention heads' rows of q/k/v (column-parallel: heads ``[r H/N, (r+1) H/N)``),
  and its KV heads': the KV heads split as the query heads where ``N`` divides them;
  with fewer KV heads than ranks each rank holds the one KV head its query heads read
  (replicated over the ``N / H_kv`` ranks of a group);
- the matching input columns of ``o_proj`` (row-parallel), whose partial outputs one
  all-reduce sums;
- its slice of the MLP's intermediate size: rows of gate/up, columns of down, and one
  all-reduce; an MoE layer splits every expert (and a shared expert) the same way, with
  the router replicated;
- the norms, whole (every rank holds the full residual stream after each all-reduce).

The embedding and the LM head are vocab-parallel: rank ``r`` holds rows
``[r V', (r+1) V')`` of ``V' = ceil(V / N)`` (the last rank's padded). A token's
embedding comes from the one rank holding its row, the others adding zeros (an exact
sum); each rank's logits of its rows are gathered into the whole ``[S, V]`` on every
rank, so the argmax (ties included) and sampling read exactly the logits an unsplit head
gives from the same hidden state.

Packed GGUF matrices are split along their rows, and along their columns only on whole
blocks (``PackedWeight.select_columns``); a split that would cut a block is refused with
the tensor's name and sizes. Biases of column-parallel projections are split with their
rows; a row-parallel projection's bias is added once, by rank 0.

Row-parallel sums change the order of float32 additions, so ``size > 1`` meets the
exactness contract's near-tie clause, not bit equality; ``size == 1`` changes nothing.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tessera.workers.model.config import ModelConfig
from tessera.workers.model.shared_collectives import SharedCollectives
from tessera.workers.quant import PackedWeight

#: A checkpoint tensor: dense, or a GGUF-quantised matrix kept packed.
Weight = torch.Tensor | PackedWeight

SETTING = "tensor_parallel_size"


def check_shardable(config: ModelConfig, size: int) -> None:
    """Raise ``ValueError`` naming ``tensor_parallel_size`` and the model's numbers where
    ``size`` ranks cannot split ``config`` (heads, KV heads, MLP and expert widths)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{SETTING}: must be a positive integer, got {size!r}")
    if size == 1:
        return
    heads, kv_heads = config.num_heads, config.num_kv_heads
    if heads % size:
        raise ValueError(f"{SETTING}: {size} does not divide the model's {heads} attention heads")
    if kv_heads % size and size % kv_heads:
        raise ValueError(
            f"{SETTING}: {size} neither divides the model's {kv_heads} KV heads nor is a "
            f"multiple of them"
        )
    widths = [("intermediate_size", config.intermediate_size)]
    if config.moe is not None:
        widths.append(("moe_intermediate_size", config.moe.expert_intermediate_size))
        if config.moe.shared_expert_intermediate_size:
            widths.append(
                ("shared_expert_intermediate_size", config.moe.shared_expert_intermediate_size)
            )
    for name, width in widths:
        if width % size:
            raise ValueError(f"{SETTING}: {size} does not divide the model's {name} {width}")


def shard_config(config: ModelConfig, rank: int, size: int) -> ModelConfig:
    """The model one rank runs: its heads, widths and vocab rows (see the module
    docstring); everything else as ``config``."""
    check_shardable(config, size)
    if size == 1:
        return config
    moe = config.moe
    if moe is not None:
        moe = dataclasses.replace(
            moe,
            expert_intermediate_size=moe.expert_intermediate_size // size,
            shared_expert_intermediate_size=moe.shared_expert_intermediate_size // size,
        )
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // size,
        num_kv_heads=max(1, config.num_kv_heads // size),
        intermediate_size=config.intermediate_size // size,
        vocab_size=math.ceil(config.vocab_size / size),
        moe=moe,
    )


@dataclass(slots=True)
class Shard:
    """One rank's place in a tensor-parallel group, and its collectives.

    ``group`` is a ``torch.distributed`` backend (gloo on the CPU, NCCL on CUDA) made
    for this group alone (no default process group), set before the first forward;
    every rank calls each collective in the same order, which the forward pass
    guarantees (the same layers, the same step inputs). A collective waits at most
    ``timeout_s`` for the other ranks."""

    #: its memory is the group's, never the model's (``hugepages`` leaves it alone)
    holds_weights: ClassVar[bool] = False

    rank: int
    size: int
    group: Any = None
    vocab_size: int = 0  # the whole model's (the loader sets it)
    hidden_size: int = 0  # the model's (the loader sets it)
    timeout_s: float = 120.0
    #: what the collectives cost so far (benchmarks read them): seconds waited in them
    #: (including for the slowest rank), bytes this rank sent into them, their count
    collective_s: float = 0.0
    collective_bytes: int = 0
    collectives: int = 0
    #: the ranks' shared-memory collectives where all are on one node (CPU groups);
    #: calls whose tensors do not fit its slots go through ``group``
    shared: SharedCollectives | None = None

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and head each rank holds (the last one's padded)."""
        return math.ceil(self.vocab_size / self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks, in place (every rank gets the same values)."""
        import torch.distributed as dist

        started = time.perf_counter()
        if self.shared is not None and x.is_contiguous() and self.shared.fits(x):
            self.shared.all_reduce(x, self.timeout_s)
        else:
            options = dist.AllreduceOptions()
            options.timeout = datetime.timedelta(seconds=self.timeout_s)
            self.group.allreduce([x], options).wait()
        self._count(started, x)
        return x

    def _count(self, started: float, x: torch.Tensor) -> None:
        self.collective_s += time.perf_counter() - started
        self.collective_bytes += x.numel() * x.element_size()
        self.collectives += 1

    def embed(
        self, ids: torch.Tensor, lookup: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The float32 embeddings ``[T, hidden]`` of ``ids``, from the rank holding each
        row (``lookup`` reads this rank's rows by local index)."""
        first = self.rank * self.vocab_rows
        local = ids - first
        mine = (local >= 0) & (local < self.vocab_rows)
        hidden = lookup(local.clamp(0, self.vocab_rows - 1)).float()
        hidden.mul_(mine.unsqueeze(-1))
        return self.all_reduce(hidden)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's ``[S, vocab_rows]`` logits and the others' as ``[S, vocab]``."""
        logits = logits.contiguous()
        started = time.perf_counter()
        if self.shared is not None and self.shared.fits(logits):
            whole = self.shared.all_gather(logits, self.timeout_s)
        else:
            from torch._C._distributed_c10d import AllgatherOptions  # (not re-exported)

            options = AllgatherOptions()
            options.timeout = datetime.timedelta(seconds=self.timeout_s)
            parts = [torch.empty_like(logits) for _ in range(self.size)]
            self.group.allgather([parts], [logits], options).wait()
            whole = torch.cat(parts, dim=-1)
        self._count(started, logits)
        return whole[:, : self.vocab_size]


def shard_state(
    state: dict[str, Weight], config: ModelConfig, rank: int, size: int
) -> dict[str, Weight]:
    """Rank ``rank``'s tensors of a Hugging Face-named checkpoint ``state`` (consumed),
    for ``shard_config(config, rank, size)``'s model."""
    check_shardable(config, size)
    if size == 1:
        return state
    d = config.head_dim
    heads = config.num_heads // size
    q_rows = _range(rank * heads * d, heads * d)
    kv_heads, kv_first = _kv_heads(config, rank, size)
    k_rows = _range(kv_first * d, kv_heads * d)
    vocab_rows = math.ceil(config.vocab_size / size)
    vocab = [min(i, config.vocab_size - 1) for i in _range(rank * vocab_rows, vocab_rows)]
    q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
    qkv_rows = q_rows + [q_size + i for i in k_rows] + [q_size + kv_size + i for i in k_rows]
    o_cols = (rank * heads * d, (rank + 1) * heads * d)

    def mlp(width: int) -> tuple[list[int], list[int], tuple[int, int]]:
        part = width // size
        rows = _range(rank * part, part)
        return rows, rows + [width + i for i in rows], (rank * part, (rank + 1) * part)

    dense_rows, dense_fused, dense_cols = mlp(config.intermediate_size)
    expert_rows = expert_fused = expert_cols = shared_rows = shared_cols = None
    if config.moe is not None:
        expert_rows, expert_fused, expert_cols = mlp(config.moe.expert_intermediate_size)
        if config.moe.shared_expert_intermediate_size:
            shared_rows, _, shared_cols = mlp(config.moe.shared_expert_intermediate_size)
    out: dict[str, Weight] = {}
    for name in list(state):
        value = state.pop(name)
        part = name.rsplit(".", 2)
        leaf = part[-2] if len(part) >= 2 else name  # the module: q_proj, w2, ...
        kind = part[-1]  # weight, bias, or a fused stack's own name
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = _rows(value, vocab, name)
        elif ".self_attn." in name and leaf in ("q_proj", "k_proj", "v_proj", "qkv_proj"):
            rows = {"q_proj": q_rows, "k_proj": k_rows, "v_proj": k_rows, "qkv_proj": qkv_rows}
            out[name] = _rows(value, rows[leaf], name)
        elif ".self_attn." in name and leaf == "o_proj":
            out[name] = _columns(value, *o_cols, name) if kind == "weight" else _once(value, rank)
        elif ".shared_expert." in name:
            assert shared_rows is not None and shared_cols is not None
            if leaf in ("gate_proj", "up_proj"):
                out[name] = _rows(value, shared_rows, name)
            else:
                out[name] = _columns(value, *shared_cols, name)
        elif ".experts." in name:
            assert expert_rows is not None and expert_fused is not None and expert_cols
            out[name] = _expert(name, value, leaf, kind, expert_rows, expert_fused, expert_cols)
        elif ".mlp." in name and leaf in ("gate_proj", "up_proj"):
            out[name] = _rows(value, dense_rows, name)
        elif ".mlp." in name and leaf == "gate_up_proj":
            out[name] = _rows(value, dense_fused, name)
        elif ".mlp." in name and leaf == "down_proj":
            if kind == "weight":
                out[name] = _columns(value, *dense_cols, name)
            else:
                out[name] = _once(value, rank)
        else:  # norms, the router, a shared expert's gate: whole on every rank
            out[name] = value
    return out


def _expert(
    name: str,
    value: Weight,
    leaf: str,
    kind: str,
    rows: list[int],
    fused: list[int],
    cols: tuple[int, int],
) -> Weight:
    """One tensor of an MoE layer's experts, split (the layouts of ``hf_weights``)."""
    if kind == "gate_up_proj":  # transformers' fused stack [E, 2I, H]
        return _dense(value, name)[:, fused].contiguous()
    if kind == "down_proj":  # [E, H, I]
        return _dense(value, name)[:, :, cols[0] : cols[1]].contiguous()
    if leaf in ("gate_proj", "up_proj", "w1", "w3"):
        if isinstance(value, torch.Tensor) and value.dim() == 3:  # a stack [E, I, H]
            return value[:, rows].contiguous()
        return _rows(value, rows, name)
    if isinstance(value, torch.Tensor) and value.dim() == 3:  # down's stack [E, H, I]
        return value[:, :, cols[0] : cols[1]].contiguous()
    return _columns(value, *cols, name)


def kv_head_range(config: ModelConfig, rank: int, size: int) -> tuple[int, int]:
    """(the first of the KV heads rank ``rank`` holds, how many): a KV block of the whole
    model is the ranks' blocks side by side, replicated heads once."""
    count, first = _kv_heads(config, rank, size)
    return first, count


def _kv_heads(config: ModelConfig, rank: int, size: int) -> tuple[int, int]:
    """(KV heads this rank holds, the first one's index)."""
    kv = config.num_kv_heads
    if kv >= size:
        return kv // size, rank * (kv // size)
    return 1, rank * kv // size


def _range(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def _dense(value: Weight, name: str) -> torch.Tensor:
    if isinstance(value, PackedWeight):
        raise ValueError(f"tensor {name!r}: a packed stack cannot be split here")
    return value


def _rows(value: Weight, rows: Sequence[int], name: str) -> Weight:
    """Rows ``rows`` of an ``[out, in]`` matrix or ``[out]`` bias (packed: row by row)."""
    if isinstance(value, PackedWeight):
        return value.select_rows(list(rows))
    if value.shape[0] <= max(rows):
        raise ValueError(f"tensor {name!r}: {value.shape[0]} rows, needs {max(rows) + 1}")
    return value.index_select(0, torch.as_tensor(rows)).contiguous()


def _columns(value: Weight, start: int, stop: int, name: str) -> Weight:
    """Input columns ``start:stop`` of an ``[out, in]`` matrix (packed: whole blocks)."""
    if isinstance(value, PackedWeight):
        size = value.qtype.block_size
        if start % size or stop % size:
            ranks = value.in_features // (stop - start)
            raise ValueError(
                f"{SETTING}: tensor {name!r} ({value.qtype.name}, {list(value.shape)}) "
                f"cannot be split over {ranks} ranks: its {value.in_features} columns give "
                f"{stop - start} each, not a multiple of the {value.qtype.name} block of {size}"
            )
        return value.select_columns(start, stop)
    return value[:, start:stop].contiguous()


def _once(bias: Weight, rank: int) -> Weight:
    """A row-parallel projection's bias: rank 0's to add, zeros elsewhere."""
    if isinstance(bias, PackedWeight):
        bias = bias.dequantize()
    return bias if rank == 0 else torch.zeros_like(bias)
