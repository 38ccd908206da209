"""Iteration-level continuous batching: what each step computes.

Every step has a budget of ``max_num_batched_tokens`` and at most ``max_num_seqs``
running sequences. Running sequences go first, in (priority, arrival) order, each
asking for all the tokens it has not computed yet (1 for a decode, a chunk for a
prefill); then waiting sequences are admitted with what is left. When the pool has
no block for a running sequence, the lowest-priority, newest running sequence is
preempted by recompute: its blocks are freed and it waits again with its tokens
kept, to be recomputed later (its output does not change).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from workers.api import Phase
from workers.kv.manager import KVCacheManager
from workers.sequence import Sequence


@dataclass(slots=True)
class ScheduledBatch:
    """This step's work: (sequence, number of new tokens), decodes first."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Batcher:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.phase = Phase.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        self.kv.free(seq.seq_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate(seq.seq_id, seq.num_computed_tokens + n):
                victim = self.running[-1]  # lowest priority, newest; never one scheduled already
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.items.append((seq, n))
                budget -= n
                index += 1
        # Admitting new work right after preempting would only thrash.
        while (
            not batch.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.kv.allocate(seq.seq_id, seq.num_computed_tokens + n):
                break
            self.waiting.pop(0)
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            batch.items.append((seq, n))
            budget -= n
        for seq, n in batch.items:
            reaches_end = seq.num_computed_tokens + n == seq.num_tokens
            seq.phase = Phase.DECODE if reaches_end and seq.num_output_tokens else Phase.PREFILL
        # Single-token sequences first: the attention backend batches them as decodes.
        batch.items.sort(key=lambda item: item[1] != 1)
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)
