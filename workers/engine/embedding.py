"""Embeddings: a prompt-only forward over the paged KV cache, pooled, no sampling.

Each input is a temporary sequence: its blocks are allocated, its tokens run through
``ModelRunner.execute(..., hidden_only=True)`` in chunks of at most the engine's token
budget (several inputs' chunks share a forward), and its blocks are freed as soon as
its last chunk has run. Only the rows pooled ask for a hidden state: the last token's
(``last``), or every token's (``mean``). The LM head never runs for them.

::

    input 0: [t0 t1 t2 t3 t4]  last -> row of t4        mean -> mean of t0..t4 rows
    input 1: [u0 u1]           last -> row of u1        mean -> mean of u0..u1 rows

The caller holds the engine's step lock (``Engine.embed``): no step runs meanwhile,
so the forwards never mix with generation steps and the decode path is unchanged.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence as Seq

import torch

from tessera.workers.api import EmbeddingCapacityError, InvalidRequestError
from tessera.workers.engine.flat_batch import Chunk
from tessera.workers.engine.model_runner import ModelRunner
from tessera.workers.kv.manager import KVCacheManager, blocks_needed

#: Seq ids of embedding inputs start with this (request ids are uuids or client ids
#: without a colon-prefixed kind, so they never collide).
SEQ_PREFIX = "embedding:"


def embed(
    runner: ModelRunner,
    kv: KVCacheManager,
    inputs: Seq[Seq[int]],
    budget: int,
    pooling: str,
    normalize: bool,
) -> torch.Tensor:
    """float32 ``[len(inputs), hidden]``: each input's final-normed hidden states pooled
    (``last`` or ``mean``), L2-normalised with ``normalize``. ``budget``: most tokens in
    one forward. Every block allocated here is freed before it returns (or raises)."""
    if pooling not in ("last", "mean"):
        raise ValueError(f"pooling: 'last' or 'mean', got {pooling!r}")
    tag = uuid.uuid4().hex
    seq_ids = [f"{SEQ_PREFIX}{tag}:{i}" for i in range(len(inputs))]
    done = [0] * len(inputs)  # tokens computed of each input
    rows: list[list[torch.Tensor]] = [[] for _ in inputs]  # each input's pooled rows so far
    live: list[int] = []  # inputs with blocks, not finished
    following = 0  # the next input to start
    try:
        while following < len(inputs) or live:
            # start inputs while the pool holds them (at least one runs at a time)
            while following < len(inputs) and sum(len(inputs[i]) - done[i] for i in live) < budget:
                if not kv.allocate(seq_ids[following], len(inputs[following])):
                    size = len(inputs[following])
                    if blocks_needed(size, kv.block_size) > kv.pool.num_blocks:
                        raise InvalidRequestError(
                            f"input[{following}]",
                            f"{size} tokens, more than the KV pool's "
                            f"{kv.pool.num_blocks * kv.block_size}",
                        )
                    if not live:
                        raise EmbeddingCapacityError(
                            f"the KV pool has {kv.num_free_blocks} free blocks, too few "
                            f"for an input of {len(inputs[following])} tokens"
                        )
                    break
                live.append(following)
                following += 1
            chunks: list[Chunk] = []
            taken: list[tuple[int, int]] = []  # (input, tokens) of each chunk
            left = budget
            for i in live:
                if not left:
                    break
                tokens = inputs[i]
                n = min(left, len(tokens) - done[i])
                start = done[i]
                # (``last``: a chunk not the input's last asks for its last row too, and
                # drops it: no forward runs without a row wanted)
                wanted = range(n) if pooling == "mean" else (n - 1,)
                chunks.append(
                    Chunk(
                        seq_ids[i],
                        tokens[start : start + n],
                        start,
                        logits_rows=tuple(wanted),
                        prompt_len=len(tokens),
                    )
                )
                taken.append((i, n))
                left -= n
            hidden = runner.execute(chunks, hidden_only=True)  # [rows wanted, hidden]
            offset = 0
            for (i, n), chunk in zip(taken, chunks, strict=True):
                count = len(chunk.logits_rows)
                if pooling == "mean" or done[i] + n == len(inputs[i]):
                    rows[i].append(hidden[offset : offset + count])
                offset += count
                done[i] += n
                if done[i] == len(inputs[i]):
                    kv.free(seq_ids[i])
                    live.remove(i)
    finally:
        for seq_id in seq_ids:
            kv.free(seq_id)
    pooled = torch.stack([torch.cat(r).mean(0) if pooling == "mean" else r[0][0] for r in rows])
    if normalize:
        pooled = torch.nn.functional.normalize(pooled, p=2.0, dim=-1)
    return pooled
