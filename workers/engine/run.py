"""A step's second part: run the scheduled batch's forward, and hand each sequence's
rows of logits to the decoding feature that takes them.

One forward per step. Most sequences take one row and sample from it
(``Postprocessor.sample``); the others are routed to their feature's hook: a pending
prompt's logprobs (``decoding.logprobs``), drafts to verify (``decoding.speculative``),
a parallel set's merged distribution (``decoding.parallel_tokens``), the first sample
of a request that forks (``decoding.forks``) and beam search (``Forks.step_beams``).

A batch of plain decodes (``Sequence.plain``, one token each, nothing pending) takes
``run_decodes``: the same forward through ``ModelRunner.execute_decodes``, without the
chunks, and with what does not need the logits done before the forward, while the
sequences are still in the caches (``benchmarks/step_overhead.py`` measures the host
time per step this saves at 16-64 sequences).
"""

from __future__ import annotations

import torch

from tessera.workers.api import RequestOutput
from tessera.workers.decoding.forks import Forks
from tessera.workers.decoding.logprobs import record_prompt_logprobs
from tessera.workers.decoding.parallel_tokens import mean_distribution_logits
from tessera.workers.decoding.speculative import Speculator
from tessera.workers.engine.batcher import ScheduledBatch
from tessera.workers.engine.model_runner import ModelRunner
from tessera.workers.engine.postprocess import Postprocessor, Targets
from tessera.workers.engine.sequence import Sequence
from tessera.workers.quant.kernels import taken_argmax


class BatchRunner:
    def __init__(
        self, runner: ModelRunner, post: Postprocessor, speculator: Speculator, forks: Forks
    ) -> None:
        self.runner = runner
        self.post = post
        self.speculator = speculator
        self.forks = forks
        self.groups = post.requests.groups
        self.kv = post.kv
        self.counters = post.counters

    def run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Run ``batch`` (not empty), append what it sampled, return the deltas."""
        self.counters.peak_used_blocks = max(self.counters.peak_used_blocks, self.kv.pool.num_used)
        prompt_tokens = self.counters.prompt_tokens
        if batch.decodes_only and all_plain(batch):
            outputs = self.run_decodes([seq for seq, _ in batch.items])
        else:
            outputs = self.run_chunks(batch)
        self.counters.count_batch(batch, prompt_tokens)
        return outputs

    def run_chunks(self, batch: ScheduledBatch) -> list[RequestOutput]:
        chunks = [seq.chunk(n) for seq, n in batch.items]
        # every row a plain argmax (``Sequence.takes_argmax``; such a sequence is alone in
        # its group): the forward gives those, not the logits
        argmax_only = all_take_argmax(batch)
        logits = self.runner.execute(chunks, argmax_only)
        # the rows' argmax where the LM head took it as it wrote them (a Q8_0 head on the
        # native kernels, ``Q8Weight``); nothing below writes into these logits, and where
        # the sampler gets other rows the argmax follows them or is dropped. With
        # ``argmax_only`` the forward gave the argmax alone: one row a sampled sequence, in
        # order, which ``sample`` appends as they are (its every target ``argmax_only``)
        argmax = logits if argmax_only else taken_argmax(logits)
        bs = self.kv.block_size
        outputs: list[RequestOutput] = []
        sampled: list[Sequence] = []
        # each sampled sequence's next-token logits: a row of ``logits`` (the common
        # case, no tensor op per sequence), or a row computed from its rows
        next_logits: list[int | torch.Tensor] = []
        verifying: list[tuple[Sequence, torch.Tensor]] = []
        offset = 0
        for (seq, n), chunk in zip(batch.items, chunks, strict=True):
            first_full = seq.num_computed_tokens // bs
            seq.num_computed_tokens += n
            if len(seq.token_ids) == seq.num_prompt_tokens:  # no output yet
                self.counters.prompt_tokens += n
            if seq.num_computed_tokens // bs > first_full:  # a block filled (a decode: 1 in bs)
                self.post.hasher.cache_computed(seq, first_full)
            count = len(chunk.logits_rows)
            if not count:
                continue
            offset += count
            prompt_logprobs = seq.prompt_logprobs is not None and seq.wants_prompt_logprobs(
                chunk.start
            )
            if count == 1 and not seq.num_draft and not prompt_logprobs:
                sampled.append(seq)
                next_logits.append(offset - 1)
                continue
            seq_logits = logits[offset - count : offset]
            if prompt_logprobs:
                seq_logits = record_prompt_logprobs(self.post.sampler, seq, chunk, seq_logits)
                if seq_logits is None:
                    continue  # a prompt chunk that samples nothing yet
            if seq.num_draft:
                verifying.append((seq, seq_logits))
            else:
                sampled.append(seq)
                # after a parallel set: the mean of its members' distributions
                merged = seq_logits[0] if count == 1 else mean_distribution_logits(seq_logits)
                next_logits.append(merged)
        # (argmax_only: every row is a sampled sequence's, in order)
        assert not argmax_only or (not verifying and len(sampled) == offset)
        if verifying or len(sampled) != offset:  # else every row of logits, in order
            if all(isinstance(row, int) for row in next_logits):
                index = torch.tensor(next_logits, dtype=torch.long, device=logits.device)
                logits = logits.index_select(0, index)
                argmax = None if argmax is None else argmax.index_select(0, index)
            else:
                logits = torch.stack([logits[r] if isinstance(r, int) else r for r in next_logits])
                argmax = None
        for seq, seq_logits in verifying:
            group = self.groups[seq.request.request_id]
            outputs += self.speculator.verify_step(self.post, group, seq, seq_logits)
        outputs += self._sample_rows(sampled, logits, argmax)
        return outputs

    def _sample_rows(
        self, sampled: list[Sequence], logits: torch.Tensor, argmax: torch.Tensor | None
    ) -> list[RequestOutput]:
        """Sample row ``i`` of ``logits`` for ``sampled[i]``: a group of several
        sequences takes all its rows at once (a beam step, or its first sample forks)."""
        outputs: list[RequestOutput] = []
        targets: Targets = []
        logit_rows: list[int] = []
        rows: dict[int, int] = {}  # id(seq) -> its row, once a group of several needs it
        taken: set[int] = set()  # (ids of) the groups of several sequences, each taken once
        # every group looked up first: a beam search may end (and leave the groups) below
        groups = [self.groups[seq.request.request_id] for seq in sampled]
        for row, (seq, group) in enumerate(zip(sampled, groups, strict=True)):
            if len(group.seqs) == 1 and group.width == 1 and group.beam is None:
                targets.append((group, seq))  # most groups: one sequence, no forks or beams
                logit_rows.append(row)
                continue
            if id(group) in taken:
                continue
            taken.add(id(group))
            if not rows:
                rows = {id(s): i for i, s in enumerate(sampled)}
            if group.beam is not None:
                beam_rows = logits[[rows[id(s)] for s in group.seqs]]
                outputs += self.forks.step_beams(self.post, group, beam_rows)
                continue
            sampled_here = [s for s in group.seqs if id(s) in rows]
            if not group.forked and group.width > 1:
                children = self.forks.fork(group)
                rows.update({id(child): rows[id(group.seqs[0])] for child in children})
                sampled_here += children
            targets += [(group, s) for s in sampled_here]
            logit_rows += [rows[id(s)] for s in sampled_here]
        if targets:
            if logit_rows != list(range(len(sampled))):
                logits = logits[logit_rows]
                argmax = None if argmax is None else argmax[logit_rows]
            outputs += self.post.sample(targets, logits, argmax)
        return outputs

    def run_decodes(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """A batch of plain decodes. A forward that raises leaves the sequences as they
        were. A filled block is offered to the prefix cache after the forward has
        written its K/V."""
        seq_ids: list[str] = []
        token_ids: list[int] = []
        starts: list[int] = []
        filled: list[Sequence] = []  # sequences whose decode fills a block
        targets: Targets = []
        groups = self.groups
        counters = self.counters
        bs = self.kv.block_size
        prompt_tokens = counters.prompt_tokens
        # rows that need their logits; the others a plain argmax, which the forward gives
        logits_for: list[int] = []
        for row, seq in enumerate(seqs):
            if not seq.takes_argmax:
                logits_for.append(row)
            start = seq.num_computed_tokens
            seq_ids.append(seq.seq_id)
            token_ids.append(seq.token_ids[-1])
            starts.append(start)
            targets.append((groups[seq.request.request_id], seq))
            seq.num_computed_tokens = start + 1
            if (start + 1) % bs == 0:
                filled.append(seq)
            if len(seq.token_ids) == seq.num_prompt_tokens:  # the prompt's last token
                counters.prompt_tokens += 1
        # Some rows take the argmax, others (a grammar's) their logits: the forward gives
        # both (plain sequences are each their group's only one, sampled alone)
        split = 0 < len(logits_for) < len(seqs)
        argmax_only = not logits_for or split
        try:
            out = self.runner.execute_decodes(
                seq_ids, token_ids, starts, argmax_only, logits_for if split else ()
            )
        except BaseException:
            for seq, start in zip(seqs, starts, strict=True):
                seq.num_computed_tokens = start
            counters.prompt_tokens = prompt_tokens
            raise
        for seq in filled:
            self.post.hasher.cache_computed(seq, seq.num_computed_tokens // bs - 1)
        if split:
            argmax, logits = out
            full = set(logits_for)
            plain = [target for row, target in enumerate(targets) if row not in full]
            outputs = self.post.append_argmax(plain, argmax.tolist())
            sampled = [targets[row] for row in logits_for]
            return outputs + self.post.sample(sampled, logits, taken_argmax(logits))
        if argmax_only:
            return self.post.append_argmax(targets, out.tolist())
        return self.post.sample(targets, out, taken_argmax(out))


def all_plain(batch: ScheduledBatch) -> bool:
    """Every sequence plain, without drafts or pending prompt logprobs."""
    for seq, _ in batch.items:  # (a loop: all() over a generator costs ~15 us more)
        if not seq.plain or seq.num_draft or seq.prompt_logprobs is not None:
            return False
    return True


def all_take_argmax(batch: ScheduledBatch) -> bool:
    for seq, _ in batch.items:  # noqa: SIM110 - as in all_plain
        if not seq.takes_argmax:
            return False
    return True
