"""The worker's engine: validate requests, run batching steps, emit output deltas.

``Engine`` is synchronous; ``add_request`` and ``abort`` may be called from another
thread (the async wrapper's event loop). The batch, the pool and the block tables are
only touched under ``_step_lock``: ``step`` holds it throughout, ``add_request`` only
queues, and ``abort`` applies at once when no step is running (else the step that is
running applies it as soon as it ends, before the next one). No path frees a block
without holding that lock, so a block cannot be freed twice by racing callers.

Each request is a ``SequenceGroup``: one sequence, forked into ``n``/``best_of``
children once its prompt is computed (``workers.forks``), or into beams.

A step may add several tokens to one sequence: the drafts a speculating sequence
proposed (``workers.speculative``: verified, then rolled back to what was accepted),
or a set of parallel tokens (``workers.parallel_tokens``). Both are chunks of the same
forward pass as everything else (``model_runner.Chunk``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tessera.workers.api import (
    FinishReason,
    InvalidRequestError,
    ParallelSet,
    Phase,
    Request,
    RequestOutput,
    Resume,
    SamplingParams,
    TokenLogprob,
)
from tessera.workers.config import EngineConfig
from tessera.workers.decoding import structured
from tessera.workers.decoding.detokenizer import IncrementalDetokenizer, token_bytes
from tessera.workers.decoding.forks import Forks
from tessera.workers.decoding.outputs import aborted_outputs, beam_outputs, sequence_output
from tessera.workers.decoding.parallel_tokens import choose_set, mean_distribution_logits
from tessera.workers.decoding.sampling import (
    Sampler,
    SampleResult,
    SamplingRow,
    TokenSpan,
    argmax_only,
)
from tessera.workers.decoding.speculative import DraftModel, Speculator, load_draft
from tessera.workers.decoding.stop import StopStringMatcher
from tessera.workers.engine.batcher import Batcher, ScheduledBatch
from tessera.workers.engine.model_runner import Chunk, ModelRunner
from tessera.workers.engine.sequence import Sequence, SequenceGroup
from tessera.workers.kv.handoff import BlockHandoff
from tessera.workers.kv.kv_cache import allocate_kv_cache, num_blocks_for_budget
from tessera.workers.kv.manager import KVCacheManager
from tessera.workers.kv.prefix_cache import PrefixCacheStats, extend_block_hashes
from tessera.workers.model.loader import LoadedModel, load_model
from tessera.workers.quant.kernels import argmax_rows, taken_argmax
from tessera.workers.validation import validate_request

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineStats:
    steps: int
    running: int  # sequences
    waiting: int  # sequences
    phases: dict[str, int]
    preemptions: int
    total_blocks: int
    free_blocks: int
    kv_usage: float
    last_batch_size: int
    last_num_tokens: int
    mean_batch_size: float
    mean_tokens_per_step: float
    prompt_tokens: int
    generated_tokens: int
    prefix_cache: PrefixCacheStats
    peak_used_blocks: int  # most blocks in use at any step so far
    shared_blocks: int  # blocks held by more than one sequence right now
    #: seconds a ``step`` call that ran a batch took, moving average over the last ones
    recent_step_time: float
    #: seconds of those steps spent outside the model's forward (scheduling, building
    #: the batch, sampling, detokenizing, outputs): the host overhead, moving average
    recent_host_time: float = 0.0
    #: seconds in every ``step`` call that ran a batch so far, and of them outside the
    #: forward (``step_seconds`` less the forwards): over an interval,
    #: ``step_seconds`` / ``steps`` is the mean step time exactly
    step_seconds: float = 0.0
    host_seconds: float = 0.0
    #: of those steps, the ones of decodes only (one token a sequence, no prompt token),
    #: and their seconds: a decode step's mean, which a stream's time per token follows
    decode_steps: int = 0
    decode_seconds: float = 0.0
    spec_proposed: int = 0  # draft tokens proposed
    spec_accepted: int = 0  # of them accepted
    spec_steps: int = 0  # verification steps (one per speculating sequence and step)
    spec_tokens: int = 0  # tokens those steps produced

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0

    @property
    def spec_tokens_per_step(self) -> float:
        return self.spec_tokens / self.spec_steps if self.spec_steps else 0.0


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or load_model(
            config.model, config.dtype, config.device, config.packed_weights
        )
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        device = torch.device(config.device)
        dtype = self.loaded.kv_dtype
        num_blocks = config.num_kv_blocks or num_blocks_for_budget(
            self.model_config,
            config.block_size,
            dtype,
            device,
            config.kv_cache_memory,
            config.kv_cache_memory_fraction,
        )
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        kv_cache = allocate_kv_cache(
            self.model_config, num_blocks, config.block_size, dtype, device
        )
        graphs = config.cuda_graphs and device.type == "cuda"
        self.runner = ModelRunner(
            self.loaded.model,
            self.kv,
            kv_cache,
            static_decode="graphs" if graphs else "off",
            native_decode=config.native_decode,
        )
        self.batcher = Batcher(self.kv, config.max_num_batched_tokens, config.max_num_seqs)
        self.sampler = Sampler()
        self.grammars = structured.Grammars(
            self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids
        )
        # the detokenizer's byte table (~0.1 s, once per tokenizer): built here rather
        # than in the first request's step
        token_bytes(self.tokenizer, skip_special_tokens=True)
        draft = None
        if config.draft_model is not None:
            drafter = load_draft(config.draft_model, self.loaded, config.dtype, config.device)
            draft = DraftModel(
                drafter,
                num_blocks,
                config.block_size,
                drafter.kv_dtype,
                device,
                config.native_decode,
            )
        self.speculator = Speculator(
            self.sampler,
            self._sampling_row,
            config.default_speculative,
            config.speculative_min_tokens,
            draft,
        )
        self.forks = Forks(self.kv, self.tokenizer, config.enable_block_sharing)
        self.handoff = BlockHandoff(self)  # KV blocks in and out (disaggregation)
        # What changes a block's K/V besides its tokens (the request's salt is added).
        self.hash_keys: tuple[str, ...] = (self.loaded.model_id, self.loaded.precision)
        if self.loaded.kernels:
            self.hash_keys += (self.loaded.kernels,)
        self.groups: dict[str, SequenceGroup] = {}
        self._inbox: collections.deque[tuple[str, object]] = collections.deque()
        self._lock = threading.Lock()  # guards request-id bookkeeping across threads
        self._step_lock = threading.Lock()  # held while the batch or the pool changes
        self._ready: list[RequestOutput] = []  # produced outside step(), returned by the next
        self._known_ids: set[str] = set()
        self._order = 0
        self._steps = 0
        self._batch_size_sum = 0
        self._tokens_sum = 0
        self._last = (0, 0)
        self._prompt_tokens = 0
        self._generated_tokens = 0
        self._peak_used_blocks = 0
        self._step_time = 0.0
        self._host_time = 0.0
        self._step_seconds = 0.0  # totals of the steps that ran a batch (``step``)
        self._host_seconds = 0.0
        self._decode_steps = 0  # of them, decodes only
        self._decode_seconds = 0.0
        self._decode_only = False  # whether the last batch was decodes only
        self._counted = self._counts()  # as of the last whole step: what stats() reports
        #: Sequences whose last token filled a block, to hash at the next step's start
        #: (``_append_token``): nothing reads a sequence's hashes before then but
        #: ``_verify``, which hashes its own sequence first.
        self._unhashed: list[Sequence] = []
        #: Live requests whose sequence speculates: without any, a step skips looking for
        #: sequences to propose drafts for, or drafts to drop.
        self._speculating_ids: set[str] = set()
        logger.info(
            "engine ready: %d KV blocks of %d tokens, max_model_len %d, prefix caching %s",
            num_blocks,
            config.block_size,
            self.max_model_len,
            "on" if config.enable_prefix_caching else "off",
        )

    # ----------------------------------------------------------------- requests
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def validate(
        self,
        prompt: str | list[int] | tuple[int, ...],
        sampling: SamplingParams,
        resume: Resume | None = None,
    ) -> tuple[int, ...]:
        """Check a prompt against the model and pool; return its token ids."""
        self.speculator.check(sampling)
        if sampling.structured is not None:
            structured.check(sampling.structured)
            self.grammars.tokenizer  # noqa: B018 - built (and checked) here, not in the step
        return validate_request(
            prompt,
            sampling,
            resume=resume,
            tokenize=self.tokenize,
            model=self.model_config,
            config=self.config,
            max_model_len=self.max_model_len,
            num_blocks=self.kv.pool.num_blocks,
        )

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | tuple[int, ...],
        sampling: SamplingParams | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        resume: Resume | None = None,
    ) -> Request:
        """Validate and queue a request; raises ``InvalidRequestError`` naming the field.

        ``resume`` continues a request another worker had started (failover): its
        tokens are recomputed here, not generated or sent again.
        """
        sampling = sampling or SamplingParams()
        token_ids = self.validate(prompt, sampling, resume)
        request = Request(request_id, token_ids, sampling, priority, time.monotonic(), cache_salt)
        with self._lock:
            if request_id in self._known_ids:
                raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
            self._known_ids.add(request_id)
        self._inbox.append(("add", (request, resume)))
        return request

    def abort(self, request_id: str) -> None:
        """Abort a request and free its blocks: now if no step is running, else right
        after it. Its final deltas (``finish_reason`` abort) come from the next ``step``."""
        self._inbox.append(("abort", request_id))
        if self._step_lock.acquire(blocking=False):
            try:
                self._ready.extend(self._drain_inbox())
            finally:
                self._step_lock.release()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """No step runs while this is held (nor does an abort free blocks): for callers
        outside the step loop that read or change the pool, such as ``handoff``."""
        with self._step_lock:
            yield

    @property
    def num_steps(self) -> int:
        """Batches run so far (``stats().steps``, without building the stats)."""
        return self._steps

    def has_work(self) -> bool:
        return bool(self._inbox or self._ready) or self.batcher.has_work()

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Apply queued adds/aborts, run one batch, return the deltas it produced."""
        with self._step_lock:
            started = time.perf_counter()
            steps = self._steps
            outputs, self._ready = self._ready, []
            outputs += self._drain_inbox()
            outputs += self._run_batch()
            outputs += self._drain_inbox()  # aborts that arrived during the batch
            if self._steps > steps:  # a batch ran
                # every figure is of this whole call, so the host time is a part of it
                wall = time.perf_counter() - started
                host = wall - self.runner.forward_time
                self._step_time = wall if steps == 0 else 0.8 * self._step_time + 0.2 * wall
                self._host_time = host if steps == 0 else 0.8 * self._host_time + 0.2 * host
                self._step_seconds += wall
                self._host_seconds += host
                if self._decode_only:
                    self._decode_steps += 1
                    self._decode_seconds += wall
                self._counted = self._counts()
            return outputs

    def _run_batch(self) -> list[RequestOutput]:
        if self._unhashed:  # before drafts join the tokens (hashes cover real tokens)
            for seq in self._unhashed:
                self._update_hashes(seq)
            self._unhashed = []
        if self._speculating_ids:
            self.speculator.propose(self._speculating(), self.max_model_len)
        batch = self.batcher.schedule()
        for group in batch.preempted:
            for seq in group.seqs:
                self.speculator.free(seq)
        if self._speculating_ids:
            scheduled = {id(seq) for seq, _ in batch.items}
            for group in self.batcher.running:
                for seq in group.seqs:
                    if seq.num_draft and id(seq) not in scheduled:
                        seq.drop_drafts()  # not verified this step: propose afresh next time
        if not batch.items:
            return []
        self._peak_used_blocks = max(self._peak_used_blocks, self.kv.pool.num_used)
        prompt_tokens = self._prompt_tokens
        if batch.decodes_only:
            seqs = [seq for seq, _ in batch.items]
            for seq in seqs:  # (a loop: all() over a generator cost ~15 us more)
                if not seq.plain or seq.num_draft or seq.prompt_logprobs is not None:
                    break
            else:
                outputs = self._decode_step(seqs)
                self._count_batch(batch, prompt_tokens)
                return outputs
        chunks = [seq.chunk(n) for seq, n in batch.items]
        # every row a plain argmax (``Sequence.takes_argmax``; such a sequence is alone in
        # its group): the forward gives those, not the logits
        argmax_only = True
        for seq, _ in batch.items:
            if not seq.takes_argmax:
                argmax_only = False
                break
        logits = self.runner.execute(chunks, argmax_only)
        # the rows' argmax where the LM head took it as it wrote them (a Q8_0 head on the
        # native kernels, ``Q8Weight``); nothing below writes into these logits, and where
        # the sampler gets other rows the argmax follows them or is dropped. With
        # ``argmax_only`` the forward gave the argmax alone: one row a sampled sequence, in
        # order, which ``_sample`` appends as they are (its every target ``argmax_only``)
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
                self._prompt_tokens += n
            if seq.num_computed_tokens // bs > first_full:  # a block filled (a decode: 1 in bs)
                self._cache_computed(seq, first_full)
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
                seq_logits = self._prompt_logprobs(seq, chunk, seq_logits)
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
            outputs += self._verify(self.groups[seq.request.request_id], seq, seq_logits)
        targets: list[tuple[SequenceGroup, Sequence]] = []
        logit_rows: list[int] = []
        rows: dict[int, int] = {}  # id(seq) -> its row, once a group of several needs it
        taken: set[int] = set()  # (ids of) the groups of several sequences, each taken once
        # every group looked up first: a beam search may end (and leave self.groups) below
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
                outputs += self._beam_step(group, logits[[rows[id(s)] for s in group.seqs]])
                continue
            sampled_here = [s for s in group.seqs if id(s) in rows]
            if not group.forked and group.width > 1:
                children = self.forks.fork(group)
                rows.update({id(child): rows[id(group.seqs[0])] for child in children})
                sampled_here += children
                parent = group.seqs[0]
                for child in children:
                    if parent.grammar is not None:  # each fork follows the grammar alone
                        child.grammar = parent.grammar.deep_copy()
                    if parent.prompt_logprobs is not None:  # best_of may not send the parent
                        child.prompt_logprobs = list(parent.prompt_logprobs)
            targets += [(group, s) for s in sampled_here]
            logit_rows += [rows[id(s)] for s in sampled_here]
        if targets:
            if logit_rows != list(range(len(sampled))):
                logits = logits[logit_rows]
                argmax = None if argmax is None else argmax[logit_rows]
            outputs += self._sample(targets, logits, argmax)
        self._count_batch(batch, prompt_tokens)
        return outputs

    def _decode_step(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """``_run_batch``'s work for a batch of plain decodes (``Sequence.plain``, no
        drafts, no prompt logprobs pending; one token each, ``ScheduledBatch.decodes_only``),
        without the chunks, verifications and forks the general path looks for.

        What does not need the logits is done before the forward, while the sequences
        are still in the caches (after it, each first touch of an object is a miss: the
        forward streams the weights through them); a forward that raises leaves the
        sequences as they were. A filled block is offered to the prefix cache after the
        forward has written its K/V."""
        seq_ids: list[str] = []
        token_ids: list[int] = []
        starts: list[int] = []
        filled: list[Sequence] = []  # sequences whose decode fills a block
        targets: list[tuple[SequenceGroup, Sequence]] = []
        groups = self.groups
        bs = self.kv.block_size
        prompt_tokens = self._prompt_tokens
        argmax_only = True  # every token a plain argmax: the forward gives those, no logits
        for seq in seqs:
            if not seq.takes_argmax:
                argmax_only = False
            start = seq.num_computed_tokens
            seq_ids.append(seq.seq_id)
            token_ids.append(seq.token_ids[-1])
            starts.append(start)
            targets.append((groups[seq.request.request_id], seq))
            seq.num_computed_tokens = start + 1
            if (start + 1) % bs == 0:
                filled.append(seq)
            if len(seq.token_ids) == seq.num_prompt_tokens:  # the prompt's last token
                self._prompt_tokens += 1
        try:
            out = self.runner.execute_decodes(seq_ids, token_ids, starts, argmax_only)
        except BaseException:
            for seq, start in zip(seqs, starts, strict=True):
                seq.num_computed_tokens = start
            self._prompt_tokens = prompt_tokens
            raise
        for seq in filled:
            self._cache_computed(seq, seq.num_computed_tokens // bs - 1)
        if argmax_only:
            return self._append_argmax(targets, out.tolist())
        return self._sample(targets, out, taken_argmax(out))  # as in _run_batch

    def _append_argmax(
        self, targets: list[tuple[SequenceGroup, Sequence]], token_ids: list[int]
    ) -> list[RequestOutput]:
        """Append each target's token, its row's argmax (every target ``argmax_only``,
        unconstrained), and return the deltas."""
        outputs: list[RequestOutput] = []
        for (group, seq), token_id in zip(targets, token_ids, strict=True):
            self._append_token(group, seq, token_id, None)
            if seq.plain:  # it streams, and has this token to send
                outputs.append(sequence_output(seq))
            else:
                outputs += self._emit(group, seq)
        return outputs

    def _sample(
        self,
        targets: list[tuple[SequenceGroup, Sequence]],
        logits: torch.Tensor,
        argmax: torch.Tensor | None,
    ) -> list[RequestOutput]:
        """Sample each target's next token from its row of ``logits`` (``argmax``: the
        rows' argmax, where the forward took it), append it, and return the deltas."""
        outputs: list[RequestOutput] = []
        constrained = [i for i, (_, s) in enumerate(targets) if s.grammar is not None]
        if constrained:
            logits = logits.clone()  # masked here: the step's own logits stay as they are
            matchers = [targets[i][1].grammar for i in constrained]
            self.grammars.apply(logits, constrained, matchers)
            argmax = None
        if all(seq.argmax_only for _, seq in targets):  # what the sampler would answer
            token_ids = (argmax_rows(logits) if argmax is None else argmax).tolist()
            return self._append_argmax(targets, token_ids)
        sampling_rows = [self._sampling_row(s) for _, s in targets]
        results = self.sampler.sample(logits, sampling_rows, argmax)
        for i, ((group, seq), result) in enumerate(zip(targets, results, strict=True)):
            if seq.request.sampling.parallel_tokens is not None:
                self._append_set(group, seq, result, logits[i])
            else:
                self._append_token(group, seq, result.token_id, result.logprob)
            if seq.plain:
                outputs.append(sequence_output(seq))
            else:
                outputs += self._emit(group, seq)
        return outputs

    def _count_batch(self, batch: ScheduledBatch, prompt_tokens: int) -> None:
        """Count a batch that ran; ``prompt_tokens``: ``self._prompt_tokens`` before it."""
        self._decode_only = (
            batch.num_tokens == len(batch.items) and self._prompt_tokens == prompt_tokens
        )
        self._steps += 1
        self._batch_size_sum += len(batch.items)
        self._tokens_sum += batch.num_tokens
        self._last = (len(batch.items), batch.num_tokens)

    def _prompt_logprobs(
        self, seq: Sequence, chunk: Chunk, rows: torch.Tensor
    ) -> torch.Tensor | None:
        """Record the logprobs of the prompt tokens this chunk's rows predict; return
        the row that samples the first output token (the chunk's last, once it ends the
        prompt), or None."""
        # entry i is token i's; recomputed after a preemption, the chunk overwrites
        del seq.prompt_logprobs[chunk.start + 1 :]
        samples = chunk.end == seq.num_tokens
        prompt_rows = rows[:-1] if samples else rows
        first = chunk.start + 1
        targets = seq.token_ids[first : first + len(prompt_rows)]
        k = seq.request.sampling.prompt_logprobs or 0
        seq.prompt_logprobs += self.sampler.token_logprobs(prompt_rows, targets, k)
        return rows[-1:] if samples else None

    def _speculating(self) -> list[Sequence]:
        """Running sequences that speculate and are decoding (their last token is the
        only one to compute)."""
        return [
            seq
            for group in self.batcher.running
            for seq in group.seqs
            if seq.spec is not None
            and seq.num_output_tokens > 0
            and seq.num_computed_tokens == seq.num_tokens - 1
        ]

    def _verify(
        self, group: SequenceGroup, seq: Sequence, logits: torch.Tensor
    ) -> list[RequestOutput]:
        """Accept what the target agrees with, roll the rest back, append the tokens."""
        results = self.speculator.verify(seq, logits)
        real = seq.num_real_tokens
        seq.drop_drafts()
        computed = real + len(results) - 1  # the last real token and the accepted drafts
        seq.num_computed_tokens = computed
        self.kv.truncate(seq.seq_id, computed)
        self.speculator.rollback(seq, computed)
        for result in results:
            self._append_token(group, seq, result.token_id, result.logprob)
            if seq.finished:
                break
        else:
            self._update_hashes(seq)  # the accepted drafts' blocks (no drafts left)
            self._cache_computed(seq, real // self.kv.block_size)
        return self._emit(group, seq)

    def _append_set(
        self, group: SequenceGroup, seq: Sequence, result: SampleResult, logits: torch.Tensor
    ) -> None:
        """Parallel tokens: the sampled token and every other one at or above the
        threshold, all at the next logical position."""
        params = seq.request.sampling
        row = self._sampling_row(seq)
        if params.greedy:  # the set is chosen by probability: softmax at temperature 1
            row = dataclasses.replace(row, params=dataclasses.replace(params, temperature=1.0))
        probs = self.sampler.probs(logits[None], [row])[0]
        room = min(params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        members = choose_set(
            result.token_id, probs, params.parallel_tokens, self._end_token_ids(params), room
        )
        position = (seq.positions[-1] if seq.positions else seq.num_tokens - 1) + 1
        if len(members) > 1:
            if seq.positions is None:
                seq.positions = list(range(seq.num_tokens))
            seq.parallel_sets.append((seq.num_tokens, len(members)))
        seq.pending_sets.append(
            ParallelSet(
                position=position,
                token_ids=tuple(members),
                tokens=tuple(self.tokenizer.decode([t]) for t in members),
                probs=tuple(probs[members].tolist()),
            )
        )
        rows = [self._sampling_row(seq)] * len(members)
        logprobs = self.sampler.with_logprobs(logits.expand(len(members), -1), rows, members)
        for token_id, member in zip(members, logprobs, strict=True):
            if seq.positions is not None:
                seq.positions.append(position)
            self._append_token(group, seq, token_id, member.logprob)
            if seq.finished:
                break

    def check_integrity(self) -> None:
        reserved = [r.blocks for r in self.handoff.reservations]  # incoming transfers
        self.kv.pool.check_integrity([*self.kv.tables.values(), *reserved])
        self.kv.check_block_ids()
        held = set(self.kv.tables)
        running = {seq.seq_id for group in self.batcher.running for seq in group.seqs}
        waiting = {seq.seq_id for group in self.batcher.waiting for seq in group.seqs}
        assert not running & waiting, "a sequence is both running and waiting"
        assert held <= running, f"blocks held by sequences that are not running: {held - running}"
        self.speculator.check_integrity(running)
        for group in self.batcher.running + self.batcher.waiting:
            for seq in group.seqs:
                assert not seq.num_draft, f"{seq.seq_id} kept draft tokens past a step"
                table = self.kv.tables.get(seq.seq_id, [])
                need = -(-seq.num_computed_tokens // self.kv.block_size)
                assert len(table) <= max(need, -(-seq.num_tokens // self.kv.block_size)), (
                    f"{seq.seq_id} holds {len(table)} blocks for {seq.num_tokens} tokens"
                )

    def _drain_inbox(self) -> list[RequestOutput]:
        outputs = []
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "add":
                self._admit(*payload)
            elif (group := self.groups.get(payload)) is not None:
                outputs += self._abort_group(group)
        return outputs

    def _admit(self, request: Request, resume: Resume | None) -> None:
        sampling = request.sampling
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        seq = Sequence(
            request=request,
            seed=seed,
            token_ids=list(request.prompt_token_ids),
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, sampling.skip_special_tokens
            ),
            stop_matcher=StopStringMatcher(sampling.stop),
        )
        if resume is not None:  # replay: the text these tokens made was sent already
            for token_id in resume.token_ids:
                seq.token_ids.append(token_id)
                seq.stop_matcher.feed(seq.detokenizer.push(token_id))
            seq.cumulative_logprob = resume.cumulative_logprob
        if sampling.prompt_logprobs is not None and resume is None:
            seq.prompt_logprobs = [None]  # the first token has none
        if sampling.structured is not None:
            replay = resume.token_ids if resume is not None else ()
            seq.grammar = self.grammars.matcher(sampling.structured, replay)
        seq.argmax_only = argmax_only(sampling) and sampling.parallel_tokens is None
        seq.plain = sampling.num_samples == 1 and sampling.parallel_tokens is None
        self._update_hashes(seq)
        self.speculator.start(seq)
        if seq.grammar is not None:
            seq.spec = None  # no speculation: drafts would not be checked against the grammar
        if seq.spec is not None:
            self._speculating_ids.add(request.request_id)
        group = SequenceGroup(request, [seq], sampling.num_samples, self._order)
        if sampling.beam_width > 1:
            group.beam = self.forks.new_beam_search(sampling, self._end_token_ids(sampling))
        self._order += 1
        self.groups[request.request_id] = group
        self.batcher.add(group)

    def _update_hashes(self, seq: Sequence) -> None:
        """Hash the sequence's new full blocks. Blocks from its first parallel set on
        are not hashed: their K/V depend on positions and masks, not tokens alone."""
        if not self.config.enable_prefix_caching:
            return
        end = seq.parallel_sets[0][0] if seq.parallel_sets else len(seq.token_ids)
        if end // self.kv.block_size <= len(seq.block_hashes):
            return  # no block has filled (most tokens fill none)
        keys = (*self.hash_keys, seq.request.cache_salt or "")
        if seq.request.sampling.prompt_logprobs is not None:
            # Every prompt position's logits are needed, and a cached block holds only
            # K/V: such a prompt runs whole, so it neither matches nor is matched (its
            # blocks hash under its own request id).
            keys = (*keys, seq.request.request_id)
        token_ids = seq.token_ids if end == len(seq.token_ids) else seq.token_ids[:end]
        extend_block_hashes(seq.block_hashes, token_ids, self.kv.block_size, keys)

    def _cache_computed(self, seq: Sequence, first_full: int) -> None:
        """Offer the prefix cache ``seq``'s full blocks from block ``first_full`` up to the
        end of its computed tokens (each under its hash: ``block_hashes`` covers real
        tokens only, so never a block holding drafts)."""
        last_full = min(seq.num_computed_tokens // self.kv.block_size, len(seq.block_hashes))
        self.kv.cache_blocks(seq.seq_id, seq.block_hashes, first_full, last_full)

    def _end_token_ids(self, params: SamplingParams) -> tuple[int, ...]:
        eos = () if params.ignore_eos else self.model_config.eos_token_ids
        return tuple(dict.fromkeys(eos + tuple(params.stop_token_ids)))

    def _sampling_row(self, seq: Sequence, length: int | None = None) -> SamplingRow:
        """The row that samples the token after the first ``length`` tokens (default:
        all of them) of ``seq``."""
        request = seq.request
        params = request.sampling
        length = len(seq.token_ids) if length is None else length
        num_output = length - seq.num_prompt_tokens
        suppressed: tuple[int, ...] = ()
        if num_output < params.min_tokens:
            suppressed = self._end_token_ids(params)
        return SamplingRow(  # positional, in field order: built per row and step
            params,
            seq.seed,
            num_output,  # token_index
            request.prompt_token_ids,
            TokenSpan(seq.token_ids, seq.num_prompt_tokens, length),  # output_token_ids
            suppressed,
        )

    def _append_token(
        self, group: SequenceGroup, seq: Sequence, token_id: int, logprob: TokenLogprob | None
    ) -> None:
        params = seq.request.sampling
        token_ids = seq.token_ids
        token_ids.append(token_id)
        grammar = seq.grammar
        eos = token_id in self.model_config.eos_token_ids
        if grammar is not None and not eos and not grammar.consume_token(token_id):
            logger.error("grammar refused token %d: %s", token_id, grammar.get_error())  # a bug
        if len(token_ids) % self.kv.block_size == 0:  # a block filled: hash it next step
            # (hashed here, in a 64-sequence step, ~4 blocks cost ~70 us: SHA-256's code
            # and each sequence's tokens out of the caches after the forward)
            self._unhashed.append(seq)
        seq.phase = Phase.DECODE
        self._generated_tokens += 1
        seq.pending_token_ids.append(token_id)
        if logprob is not None:
            seq.cumulative_logprob += logprob.logprob
            if params.logprobs is not None:
                seq.pending_logprobs.append(logprob)
        if (eos and not params.ignore_eos) or token_id in params.stop_token_ids:
            self._finish(group, seq, FinishReason.STOP, token_id)
            return
        text, matched = seq.stop_matcher.feed(seq.detokenizer.push(token_id))
        seq.pending_text += text
        if matched is not None:
            self._finish(group, seq, FinishReason.STOP, matched)
        elif (
            len(token_ids) - seq.num_prompt_tokens >= params.max_tokens
            or len(token_ids) >= self.max_model_len
        ):
            self._finish(group, seq, FinishReason.LENGTH)

    def _finish(
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
            self._end_group(group)

    def _end_group(self, group: SequenceGroup) -> None:
        self.batcher.remove(group)
        del self.groups[group.request_id]
        self._speculating_ids.discard(group.request_id)
        with self._lock:
            self._known_ids.discard(group.request_id)

    def _abort_group(self, group: SequenceGroup) -> list[RequestOutput]:
        """Finish every live sequence with ``abort`` and free the group's blocks."""
        live = group.seqs
        for seq in live:
            seq.finish_reason = FinishReason.ABORT
            seq.phase = Phase.FINISHED
            self.speculator.free(seq)
        self.batcher.remove(group)  # frees the live sequences' blocks
        group.seqs = []
        self._end_group(group)
        if not group.streams:
            return aborted_outputs(group.request)
        # One final delta per output that has not had one: the live sequences', and
        # empty ones for children an unforked request never got to create.
        outputs = [sequence_output(seq) for seq in live]
        done = {seq.index for seq in group.finished_seqs + live}
        missing = [i for i in range(group.request.sampling.n) if i not in done]
        return outputs + aborted_outputs(group.request, missing)

    def _emit(self, group: SequenceGroup, seq: Sequence) -> list[RequestOutput]:
        if group.streams:
            if seq.pending_text or seq.pending_token_ids or seq.finished:
                return [sequence_output(seq)]
            return []
        if group.seqs:
            return []  # best_of: the n best are sent whole when the last one finishes
        ranked = sorted(group.finished_seqs, key=lambda s: -s.cumulative_logprob)
        n = group.request.sampling.n
        return [sequence_output(s, index) for index, s in enumerate(ranked[:n])]

    def _beam_step(self, group: SequenceGroup, logits: torch.Tensor) -> list[RequestOutput]:
        """Score every beam's next token; re-point the beams, or end the search."""
        params = group.request.sampling
        end_ids = self._end_token_ids(params)
        self._generated_tokens += len(group.seqs)
        if not self.forks.beam_step(group, logits, end_ids):
            for seq in group.seqs:
                self._update_hashes(seq)
            return []
        self.batcher.remove(group)
        group.seqs = []
        self._end_group(group)
        return beam_outputs(group.request, group.beam.best(params.n), end_ids, self.tokenizer)

    # -------------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        """The engine's state now, and its counters as of its last whole step.

        Another thread may call this while ``step`` runs (the worker's reports): its
        counters (steps, tokens, seconds) are the snapshot ``step`` took when it last
        ended, so one report never counts a step's tokens without the step."""
        # list() copies under the GIL: stats may be read while another thread runs step().
        seqs = [seq for group in list(self.groups.values()) for seq in list(group.seqs)]
        phases = collections.Counter(seq.phase.value for seq in seqs)
        return EngineStats(
            running=sum(len(group.seqs) for group in list(self.batcher.running)),
            waiting=sum(len(group.seqs) for group in list(self.batcher.waiting)),
            phases=dict(phases),
            preemptions=self.batcher.num_preemptions,
            total_blocks=self.kv.pool.num_blocks,
            free_blocks=self.kv.num_free_blocks,
            kv_usage=self.kv.usage,
            prefix_cache=self.kv.prefix_cache_stats(),
            shared_blocks=sum(block.ref_count > 1 for block in self.kv.pool.blocks),
            **self._counted,
        )

    def _counts(self) -> dict[str, Any]:
        """``EngineStats``' step counters, live: only ``step`` reads them, between steps."""
        steps = max(self._steps, 1)
        return {
            "steps": self._steps,
            "last_batch_size": self._last[0],
            "last_num_tokens": self._last[1],
            "mean_batch_size": self._batch_size_sum / steps,
            "mean_tokens_per_step": self._tokens_sum / steps,
            "prompt_tokens": self._prompt_tokens,
            "generated_tokens": self._generated_tokens,
            "peak_used_blocks": self._peak_used_blocks,
            "recent_step_time": self._step_time,
            "recent_host_time": self._host_time,
            "step_seconds": self._step_seconds,
            "host_seconds": self._host_seconds,
            "decode_steps": self._decode_steps,
            "decode_seconds": self._decode_seconds,
            "spec_proposed": self.speculator.proposed,
            "spec_accepted": self.speculator.accepted,
            "spec_steps": self.speculator.steps,
            "spec_tokens": self.speculator.tokens,
        }
