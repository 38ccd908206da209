"""A step's third part: each sampled token appended to its sequence, the stop rules
applied, finished sequences' blocks freed, and the deltas built.

Every decoding feature that appends tokens (sampling, speculative verification,
parallel sets, beams) goes through ``append_token``, so a token is counted, checked
against the grammar, the end tokens, the stop strings and the length once, in one place.
"""

from __future__ import annotations

import logging
import time

import torch

from tessera.workers.api import FinishReason, Phase, RequestOutput, TokenLogprob
from tessera.workers.decoding import parallel_sets
from tessera.workers.decoding.outputs import aborted_outputs, sequence_output
from tessera.workers.decoding.rows import Rows
from tessera.workers.decoding.sampling import Sampler
from tessera.workers.decoding.speculative import Speculator
from tessera.workers.decoding.structured import Grammars
from tessera.workers.engine.hashing import BlockHasher
from tessera.workers.engine.requests import LiveRequests
from tessera.workers.engine.sequence import Sequence, SequenceGroup
from tessera.workers.engine.stats import StepCounters
from tessera.workers.kv.manager import KVCacheManager
from tessera.workers.quant.kernels import argmax_rows

logger = logging.getLogger(__name__)

#: (group, sequence) pairs, one per row of logits to sample from
Targets = list[tuple[SequenceGroup, Sequence]]


class Postprocessor:
    def __init__(
        self,
        *,
        kv: KVCacheManager,
        requests: LiveRequests,
        hasher: BlockHasher,
        counters: StepCounters,
        speculator: Speculator,
        sampler: Sampler,
        grammars: Grammars,
        rows: Rows,
        tokenizer,
        max_model_len: int,
    ) -> None:
        self.kv = kv
        self.requests = requests
        self.hasher = hasher
        self.counters = counters
        self.speculator = speculator
        self.sampler = sampler
        self.grammars = grammars
        self.rows = rows
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = rows.eos_token_ids

    # ------------------------------------------------------------------ tokens
    def sample(
        self, targets: Targets, logits: torch.Tensor, argmax: torch.Tensor | None
    ) -> list[RequestOutput]:
        """Sample each target's next token from its row of ``logits`` (``argmax``: the
        rows' argmax, where the forward took it), append it, and return the deltas."""
        constrained = [i for i, (_, s) in enumerate(targets) if s.grammar is not None]
        if constrained:
            logits = logits.clone()  # masked here: the step's own logits stay as they are
            matchers = [targets[i][1].grammar for i in constrained]
            self.grammars.apply(logits, constrained, matchers)
            argmax = None
        if all(seq.argmax_only for _, seq in targets):  # what the sampler would answer
            token_ids = (argmax_rows(logits) if argmax is None else argmax).tolist()
            return self.append_argmax(targets, token_ids)
        outputs: list[RequestOutput] = []
        sampling_rows = [self.rows(s) for _, s in targets]
        results = self.sampler.sample(logits, sampling_rows, argmax)
        for i, ((group, seq), result) in enumerate(zip(targets, results, strict=True)):
            if seq.request.sampling.parallel_tokens is not None:
                parallel_sets.append_set(self, group, seq, result, logits[i])
            else:
                self.append_token(group, seq, result.token_id, result.logprob)
            if seq.plain:
                outputs.append(sequence_output(seq))
            else:
                outputs += self.emit(group, seq)
        return outputs

    def append_argmax(self, targets: Targets, token_ids: list[int]) -> list[RequestOutput]:
        """Append each target's token, its row's argmax (every target ``argmax_only``,
        unconstrained), and return the deltas."""
        outputs: list[RequestOutput] = []
        for (group, seq), token_id in zip(targets, token_ids, strict=True):
            self.append_token(group, seq, token_id, None)
            if seq.plain:  # it streams, and has this token to send
                outputs.append(sequence_output(seq))
            else:
                outputs += self.emit(group, seq)
        return outputs

    def append_token(
        self, group: SequenceGroup, seq: Sequence, token_id: int, logprob: TokenLogprob | None
    ) -> None:
        """Append one token and apply the stop rules: an end token, a stop string, the
        request's ``max_tokens`` or the model's context."""
        params = seq.request.sampling
        token_ids = seq.token_ids
        token_ids.append(token_id)
        grammar = seq.grammar
        eos = token_id in self.eos_token_ids
        if grammar is not None and not eos and not grammar.consume_token(token_id):
            logger.error("grammar refused token %d: %s", token_id, grammar.get_error())  # a bug
        if len(token_ids) % self.kv.block_size == 0:  # a block filled: hash it next step
            self.hasher.filled(seq)
        if seq.phase is not Phase.DECODE:  # its first token (the batcher marks decodes)
            seq.phase = Phase.DECODE
            if seq.clock is not None and seq.clock.first_token_ns is None:  # traced
                seq.clock.first_token_ns = time.time_ns()
        self.counters.generated_tokens += 1
        seq.pending_token_ids.append(token_id)
        if logprob is not None:
            seq.cumulative_logprob += logprob.logprob
            if params.logprobs is not None:
                seq.pending_logprobs.append(logprob)
        if (eos and not params.ignore_eos) or token_id in params.stop_token_ids:
            self.finish(group, seq, FinishReason.STOP, token_id)
            return
        text, matched = seq.stop_matcher.feed(seq.detokenizer.push(token_id))
        seq.pending_text += text
        if matched is not None:
            self.finish(group, seq, FinishReason.STOP, matched)
        elif (
            len(token_ids) - seq.num_prompt_tokens >= params.max_tokens
            or len(token_ids) >= self.max_model_len
        ):
            self.finish(group, seq, FinishReason.LENGTH)

    # --------------------------------------------------------------- endings
    def finish(
        self,
        group: SequenceGroup,
        seq: Sequence,
        reason: FinishReason,
        stop_reason: str | int | None = None,
    ) -> None:
        """End one sampled sequence: its blocks go back at once; the group ends with
        its last sequence."""
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.phase = Phase.FINISHED
        if not isinstance(stop_reason, str):  # a stop string drops the held-back text
            seq.pending_text += seq.stop_matcher.feed(seq.detokenizer.flush())[0]
            seq.pending_text += seq.stop_matcher.flush()
        group.seqs.remove(seq)
        group.finished_seqs.append(seq)
        self.kv.free(seq.seq_id)
        self.speculator.free(seq)
        if not group.seqs:
            self.requests.end(group)

    def end_search(self, group: SequenceGroup) -> None:
        """End a group whose live sequences are all dropped (a finished beam search)."""
        self.requests.end(group)  # frees the live sequences' blocks
        group.seqs = []

    def abort_group(self, group: SequenceGroup) -> list[RequestOutput]:
        """Finish every live sequence with ``abort`` and free the group's blocks."""
        live = group.seqs
        for seq in live:
            seq.finish_reason = FinishReason.ABORT
            seq.phase = Phase.FINISHED
            self.speculator.free(seq)
        self.end_search(group)
        if not group.streams:
            return aborted_outputs(group.request)
        # One final delta per output that has not had one: the live sequences', and
        # empty ones for children an unforked request never got to create.
        outputs = [sequence_output(seq) for seq in live]
        done = {seq.index for seq in group.finished_seqs + live}
        missing = [i for i in range(group.request.sampling.n) if i not in done]
        return outputs + aborted_outputs(group.request, missing)

    # ---------------------------------------------------------------- deltas
    def emit(self, group: SequenceGroup, seq: Sequence) -> list[RequestOutput]:
        """``seq``'s delta where its group streams; else, once the group's last
        sequence ends, its ``n`` best outputs whole (``best_of``)."""
        if group.streams:
            if seq.pending_text or seq.pending_token_ids or seq.finished:
                return [sequence_output(seq)]
            return []
        if group.seqs:
            return []  # best_of: the n best are sent whole when the last one finishes
        ranked = sorted(group.finished_seqs, key=lambda s: -s.cumulative_logprob)
        n = group.request.sampling.n
        return [sequence_output(s, index) for index, s in enumerate(ranked[:n])]
