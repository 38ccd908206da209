"""Forking a group's sequences: n > 1 / best_of children (with their grammar and prompt
logprobs), and beam search steps.

Both fork by block tables, not by copying K/V: a child (or a beam that continues
another) takes a reference to each of its parent's blocks, and the first write into a
shared, partly filled block copies that one block (``KVCacheManager.write``). When a
beam is dropped, the blocks only it held go back to the pool at once.

With block sharing off (``EngineConfig.enable_block_sharing=False``, a baseline for
benchmarks) each fork gets private copies of its parent's blocks instead, or, when the
pool is short, no blocks at all and recomputes its tokens.
"""

from __future__ import annotations

import time

import torch

from tessera.workers.api import Phase, RequestOutput, SamplingParams, fork_seed
from tessera.workers.decoding.beam import BeamSearch
from tessera.workers.decoding.detokenizer import IncrementalDetokenizer
from tessera.workers.decoding.hooks import StepContext
from tessera.workers.decoding.outputs import beam_outputs
from tessera.workers.decoding.stop import StopStringMatcher
from tessera.workers.engine.sequence import Sequence, SequenceGroup
from tessera.workers.kv.manager import KVCacheManager


class Forks:
    def __init__(self, kv: KVCacheManager, tokenizer, share: bool) -> None:
        self.kv = kv
        self.tokenizer = tokenizer
        self.share = share

    def fork(self, group: SequenceGroup) -> list[Sequence]:
        """Fork the group's computed prompt into ``width - 1`` more children; child
        ``i`` samples with seed ``seed + i``."""
        (parent,) = group.seqs
        params = parent.request.sampling
        children = []
        for index in range(1, group.width):
            child = Sequence(
                request=parent.request,
                seed=fork_seed(parent.seed, index),
                token_ids=list(parent.token_ids),
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, parent.request.prompt_token_ids, params.skip_special_tokens
                ),
                stop_matcher=StopStringMatcher(params.stop),
                index=index,
                num_computed_tokens=parent.num_computed_tokens,
                phase=parent.phase,
                block_hashes=list(parent.block_hashes),
                clock=parent.clock,
            )
            if not self.kv.fork(parent.seq_id, child.seq_id, share=self.share):
                child.num_computed_tokens = 0  # no room for a private copy: recompute
            if parent.grammar is not None:  # each fork follows the grammar alone
                child.grammar = parent.grammar.deep_copy()
            if parent.prompt_logprobs is not None:  # best_of may not send the parent
                child.prompt_logprobs = list(parent.prompt_logprobs)
            children.append(child)
        group.seqs += children
        group.forked = True
        return children

    def new_beam_search(self, params: SamplingParams, end_token_ids: tuple[int, ...]) -> BeamSearch:
        return BeamSearch(
            params.beam_width,
            params.length_penalty,
            params.early_stopping,
            params.max_tokens,
            end_token_ids,
        )

    def step_beams(
        self, post: StepContext, group: SequenceGroup, logits: torch.Tensor
    ) -> list[RequestOutput]:
        """A step's hook for a beam search: score every beam's next token from its
        row of ``logits``; re-point the beams, or end the search with its best outputs."""
        params = group.request.sampling
        end_ids = post.rows.end_token_ids(params)
        post.counters.generated_tokens += len(group.seqs)
        clock = group.seqs[0].clock  # a traced request's: this step's tokens may be its first
        if clock is not None and clock.first_token_ns is None:
            clock.first_token_ns = time.time_ns()
        if not self.beam_step(group, logits, end_ids):
            for seq in group.seqs:
                post.hasher.update(seq)
            return []
        post.end_search(group)
        best = group.beam.best(params.n)
        times = clock.ended() if clock is not None else None
        return beam_outputs(group.request, best, end_ids, self.tokenizer, times)

    def beam_step(
        self, group: SequenceGroup, logits: torch.Tensor, end_token_ids: tuple[int, ...]
    ) -> bool:
        """One beam-search step from the beams' logits (``[beams, V]``). Returns True
        when the search is over; else ``group.seqs`` are the next step's beams."""
        params = group.request.sampling
        beams = group.seqs
        # The search's bookkeeping is a few [width, V] tensors: it runs on the CPU.
        log_probs = torch.log_softmax(logits.to(torch.float32), dim=-1).cpu()
        if beams[0].num_output_tokens < params.min_tokens and end_token_ids:
            log_probs[:, list(end_token_ids)] = -float("inf")
        choices = group.beam.step(log_probs, [tuple(b.output_token_ids) for b in beams])
        if group.beam.done:
            return True
        successors = []
        for index, (p, token) in enumerate(choices):
            parent = beams[p]
            successors.append(
                Sequence(
                    request=parent.request,
                    seed=parent.seed,
                    token_ids=parent.token_ids + [token],
                    detokenizer=None,
                    stop_matcher=None,
                    index=index,
                    num_computed_tokens=parent.num_computed_tokens,
                    phase=Phase.DECODE,
                    num_preemptions=parent.num_preemptions,
                    block_hashes=list(parent.block_hashes),
                    clock=parent.clock,
                )
            )
        missing = self.kv.reassign(
            [s.seq_id for s in successors],
            [beams[p].seq_id for p, _ in choices],
            [b.seq_id for b in beams],
            share=self.share,
        )
        for seq in successors:
            if seq.seq_id in missing:
                seq.num_computed_tokens = 0  # no room for a private copy: recompute
        group.seqs = successors
        return False
