"""Embeddings: a prompt-only forward over the paged KV cache, pooled, no sampling.

Each input is a temporary sequence: its blocks are allocated, its tokens run through
``ModelRunner.execute(..., hidden_only=True)`` in chunks of at most the engine's token
budget (several inputs' chunks share a forward), and its blocks are freed as soon as
its last chunk has run. Only the rows pooled ask for a hidden state: the last token's
(``last``), or every token's (``mean``). The LM head never runs for them.

::

    input 0: [t0 t1 t2 t3 t4]  last -> row of t4        mean -> mean of t0..t4 rows
    input 1: [u0 u1]           last -> row of u1        mean -> mean of u0..u1 rows

An ``EmbeddingJob`` runs one forward at a time (``forward``), each between two of the
engine's steps under its step lock (``Engine.embedding_forward``): a request of many
long inputs holds generation back by one forward of at most the token budget at a
time, as a prompt chunk does, never for the whole request. Between forwards its
sequences hold their blocks (``Engine.check_integrity`` counts them as the job's);
``close`` frees every one, whether the job finished, failed or its caller went away.
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


class EmbeddingJob:
    """The pooled final hidden states of ``inputs``, a forward at a time. ``budget``:
    most tokens in one forward; ``pooling``: ``last`` or ``mean``; ``normalize``: L2.
    Invariant: ``live`` are the inputs with blocks, started and not finished; inputs
    start in order; ``close`` leaves none holding a block."""

    def __init__(
        self,
        kv: KVCacheManager,
        inputs: Seq[Seq[int]],
        budget: int,
        pooling: str,
        normalize: bool,
    ) -> None:
        if pooling not in ("last", "mean"):
            raise ValueError(f"pooling: 'last' or 'mean', got {pooling!r}")
        self.kv, self.inputs, self.budget = kv, inputs, budget
        self.pooling, self.normalize = pooling, normalize
        tag = uuid.uuid4().hex
        self.seq_ids = [f"{SEQ_PREFIX}{tag}:{i}" for i in range(len(inputs))]
        self.done = [0] * len(inputs)  # tokens computed of each input
        self.rows: list[list[torch.Tensor]] = [[] for _ in inputs]  # pooled rows so far
        self.live: list[int] = []
        self.following = 0  # the next input to start

    @property
    def finished(self) -> bool:
        return self.following == len(self.inputs) and not self.live

    def forward(self, runner: ModelRunner) -> None:
        """Starts inputs while the pool holds them (at least one runs at a time), then
        runs one forward of at most ``budget`` of the live inputs' tokens."""
        inputs, kv = self.inputs, self.kv
        while (
            self.following < len(inputs)
            and sum(len(inputs[i]) - self.done[i] for i in self.live) < self.budget
        ):
            index = self.following
            if not kv.allocate(self.seq_ids[index], len(inputs[index])):
                size = len(inputs[index])
                if blocks_needed(size, kv.block_size) > kv.pool.num_blocks:
                    raise InvalidRequestError(
                        f"input[{index}]",
                        f"{size} tokens, more than the KV pool's "
                        f"{kv.pool.num_blocks * kv.block_size}",
                    )
                if not self.live:
                    raise EmbeddingCapacityError(
                        f"the KV pool has {kv.num_free_blocks} free blocks, too few "
                        f"for an input of {size} tokens"
                    )
                break
            self.live.append(index)
            self.following += 1
        chunks: list[Chunk] = []
        taken: list[tuple[int, int]] = []  # (input, tokens) of each chunk
        left = self.budget
        for i in self.live:
            if not left:
                break
            tokens = inputs[i]
            n = min(left, len(tokens) - self.done[i])
            start = self.done[i]
            # (``last``: a chunk not the input's last asks for its last row too, and
            # drops it: no forward runs without a row wanted)
            wanted = range(n) if self.pooling == "mean" else (n - 1,)
            chunks.append(
                Chunk(
                    self.seq_ids[i],
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
            if self.pooling == "mean" or self.done[i] + n == len(inputs[i]):
                self.rows[i].append(hidden[offset : offset + count])
            offset += count
            self.done[i] += n
            if self.done[i] == len(inputs[i]):
                kv.free(self.seq_ids[i])
                self.live.remove(i)

    def held_seq_ids(self) -> list[str]:
        """The sequences that hold blocks between forwards."""
        return [self.seq_ids[i] for i in self.live]

    def close(self) -> None:
        """Frees every block the job holds (idempotent)."""
        for seq_id in self.seq_ids:
            self.kv.free(seq_id)
        self.live.clear()

    def result(self) -> torch.Tensor:
        """float32 ``[len(inputs), hidden]``: each input's pooled rows, L2-normalised
        with ``normalize``; only once ``finished``."""
        assert self.finished, "EmbeddingJob.result before its last forward"
        rows = self.rows
        if self.pooling == "mean":
            pooled = torch.stack([torch.cat(r).mean(0) for r in rows])
        else:
            pooled = torch.stack([r[0][0] for r in rows])
        if self.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2.0, dim=-1)
        return pooled
