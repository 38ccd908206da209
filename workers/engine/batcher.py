"""Iteration-level continuous batching: what each step computes.

The batcher schedules ``SequenceGroup``s (a request and its forks or beams), each
step within a budget of ``max_num_batched_tokens`` and ``max_num_seqs`` sequences.
Running groups go first, in (priority, arrival) order, each asking for all the tokens
its sequences have not computed (1 per decode, a chunk for a prefill); then waiting
groups are admitted with what is left, after taking the longest run of their prompt
that the prefix cache holds. A group with several sequences advances in lockstep: when
the budget cannot take every sequence to its end, none of them reaches it (their last
tokens wait for a step that fits them all), so a beam step always sees every beam.

When the pool has no block for a running group, the lowest-priority, newest running
group is preempted by recompute: its blocks are freed and it waits again with its
tokens kept, to be recomputed later (its output does not change).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from tessera.workers.api import Phase
from tessera.workers.engine.sequence import Sequence, SequenceGroup
from tessera.workers.kv.manager import KVCacheManager, Write


@dataclass(slots=True)
class ScheduledBatch:
    """This step's work: (sequence, number of new tokens), decodes first."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    #: every item is a decode of one token: the last of its sequence's tokens, at cache
    #: index ``num_computed_tokens``, its block already in the table and not shared
    decodes_only: bool = False
    #: items of sequences with output already whose step reaches their end (phase
    #: ``DECODE``): each gets its next token from this step, its inter-token latency
    num_decodes: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


def _key(group: SequenceGroup) -> tuple[int, int]:
    return group.sort_key


class Batcher:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: list[SequenceGroup] = []  # sorted by sort_key
        self.running: list[SequenceGroup] = []  # sorted by sort_key
        self.num_preemptions = 0

    def add(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            seq.phase = Phase.WAITING
        bisect.insort(self.waiting, group, key=_key)

    def remove(self, group: SequenceGroup) -> None:
        """Drop a finished or aborted group and free its sequences' blocks."""
        for queue in (self.running, self.waiting):
            if group in queue:
                queue.remove(group)
        for seq in group.seqs:
            self.kv.free(seq.seq_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(group.seqs) for group in self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        index = 0
        planned = False  # whether some item did not take the decode path below
        while index < len(self.running) and budget > 0:
            group = self.running[index]
            if len(group.seqs) == 1:  # most groups: a decode needs no plan (nor a block)
                seq = group.seqs[0]
                start = seq.num_computed_tokens
                if start == len(seq.token_ids) - 1 and self.kv.append_slot(seq.seq_id, start):
                    batch.items.append((seq, 1))
                    # its phase, as the loop at the end sets the others'
                    has_output = len(seq.token_ids) > seq.num_prompt_tokens
                    seq.phase = Phase.DECODE if has_output else Phase.PREFILL
                    batch.num_decodes += has_output
                    budget -= 1
                    index += 1
                    continue
            planned = True
            writes = self._plan(group, budget)
            if writes is None:
                index += 1  # its lockstep step does not fit what is left of the budget
                continue
            while self.kv.blocks_for(writes) > self.kv.num_free_blocks:
                victim = self.running[-1]  # lowest priority, newest; never one scheduled
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is group:
                    break
            else:
                budget -= self._apply(group, writes, batch)
                index += 1
        # Admitting new work right after preempting would only thrash.
        width = sum(group.width for group in self.running) if self.waiting else 0
        while not batch.preempted and self.waiting and budget > 0:
            group = self.waiting[0]
            if width + group.width > self.max_num_seqs:
                break
            writes = self._plan(group, budget)
            if writes is None or self.kv.blocks_for(writes) > self.kv.num_free_blocks:
                break
            self.waiting.pop(0)
            clock = group.seqs[0].clock
            if clock is not None and clock.scheduled_ns is None:  # traced: its queue ends
                clock.scheduled_ns = time.time_ns()
            bisect.insort(self.running, group, key=_key)
            width += group.width
            budget -= self._apply(group, writes, batch)
            planned = True
        if not planned:  # decodes only (the steady state): phases set, one token each
            batch.decodes_only = True
            return batch
        batch.num_decodes = 0  # counted again with every item's phase
        for seq, n in batch.items:
            num_tokens = len(seq.token_ids)
            reaches_end = seq.num_computed_tokens + n == num_tokens
            decoding = reaches_end and num_tokens > seq.num_prompt_tokens  # has output
            seq.phase = Phase.DECODE if decoding else Phase.PREFILL
            batch.num_decodes += decoding
        # Single-token sequences first: the attention backend batches them as decodes.
        batch.items.sort(key=lambda item: item[1] != 1)
        return batch

    def _plan(self, group: SequenceGroup, budget: int) -> list[Write] | None:
        """This step's writes for ``group`` within ``budget`` tokens, or None.

        A sequence with no blocks yet starts with the longest cached run of its tokens.
        In a group recomputing after preemption, the others wait while the first one
        computes their common prompt, then take its blocks from the cache (so the
        group never needs more blocks than with its prompt shared)."""
        bs = self.kv.block_size
        writes = []
        reaches_end = True
        lead_busy = False
        for i, seq in enumerate(group.seqs):
            fresh = seq.num_computed_tokens == 0 and seq.seq_id not in self.kv.tables
            hits = self.kv.find_cached(seq.block_hashes, seq.num_tokens) if fresh else ()
            start = seq.num_computed_tokens + len(hits) * bs
            n = 0 if fresh and lead_busy else min(seq.num_tokens - start, budget)
            if n:
                n = seq.fit(start, start + n) - start  # whole draft runs and parallel sets
            if i == 0:
                lead_busy = start < seq.num_tokens - 1
            budget -= n
            reaches_end &= start + n == seq.num_tokens
            writes.append(Write(seq.seq_id, start, start + n, hits, seq.num_tokens if fresh else 0))
        if len(group.seqs) > 1 and not reaches_end:
            # lockstep: nobody reaches the end unless everybody does
            last = {seq.seq_id: seq.num_tokens - 1 for seq in group.seqs}
            writes = [
                Write(w.seq_id, w.start, min(w.end, last[w.seq_id]), w.hits, w.query_tokens)
                for w in writes
            ]
        writes = [w for w in writes if w.end > w.start]
        return writes or None

    def _apply(self, group: SequenceGroup, writes: list[Write], batch: ScheduledBatch) -> int:
        self.kv.write(writes)
        if len(group.seqs) == 1:  # (most groups) its one write
            (seq,), (w,) = group.seqs, writes
            seq.num_computed_tokens = w.start  # a prefix hit skips ahead
            batch.items.append((seq, w.end - w.start))
            return w.end - w.start
        by_id = {seq.seq_id: seq for seq in group.seqs}
        for w in writes:
            seq = by_id[w.seq_id]
            seq.num_computed_tokens = w.start  # a prefix hit skips ahead
            batch.items.append((seq, w.end - w.start))
        return sum(w.end - w.start for w in writes)

    def _preempt(self, group: SequenceGroup) -> None:
        self.running.remove(group)
        for seq in group.seqs:
            self.kv.free(seq.seq_id)
            seq.drop_drafts()
            seq.num_computed_tokens = 0
            seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(group)
