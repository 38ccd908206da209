"""The worker's engine: validate requests, run batching steps, emit output deltas.

A step is three parts (``Engine.step``):

    schedule     hash the blocks the last step filled, propose drafts, choose this
                 step's tokens within the budget (``Batcher.schedule``)
    run          one forward over the batch; each sequence's rows of logits go to the
                 decoding feature that takes them (``run.BatchRunner``)
    postprocess  append the sampled tokens, apply the stop rules, free what finished,
                 build the deltas (``postprocess.Postprocessor``)

``Engine`` is synchronous; ``add_request`` and ``abort`` may be called from another
thread (the async wrapper's event loop). The batch, the pool and the block tables are
only touched under ``_step_lock``: ``step`` holds it throughout, ``add_request`` only
queues, and ``abort`` applies at once when no step is running (else the step that is
running applies it as soon as it ends, before the next one). No path frees a block
without holding that lock, so a block cannot be freed twice by racing callers.

Each request is a ``SequenceGroup``: one sequence, forked into ``n``/``best_of``
children once its prompt is computed (``decoding.forks``), or into beams.
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

import torch
from transformers import PreTrainedTokenizerBase

from tessera.workers.api import (
    InvalidRequestError,
    LoraRef,
    Request,
    RequestOutput,
    Resume,
    SamplingParams,
)
from tessera.workers.config import FAST, EngineConfig
from tessera.workers.decoding import structured
from tessera.workers.decoding.detokenizer import IncrementalDetokenizer, token_bytes
from tessera.workers.decoding.forks import Forks
from tessera.workers.decoding.outputs import aborted_outputs
from tessera.workers.decoding.rows import Rows
from tessera.workers.decoding.sampling import Sampler, argmax_only
from tessera.workers.decoding.speculative import DraftModel, Speculator, load_draft
from tessera.workers.decoding.stop import StopStringMatcher
from tessera.workers.engine import embedding
from tessera.workers.engine.batcher import Batcher, ScheduledBatch
from tessera.workers.engine.hashing import BlockHasher
from tessera.workers.engine.loras import LoraManager
from tessera.workers.engine.model_runner import ModelRunner
from tessera.workers.engine.postprocess import Postprocessor
from tessera.workers.engine.requests import LiveRequests
from tessera.workers.engine.run import BatchRunner
from tessera.workers.engine.sequence import PhaseClock, Sequence, SequenceGroup
from tessera.workers.engine.stats import EngineStats, StepCounters
from tessera.workers.engine.tensor_parallel import TensorParallelGroup
from tessera.workers.kv.handoff import BlockHandoff
from tessera.workers.kv.kv_cache import allocate_kv_cache, num_blocks_for_budget
from tessera.workers.kv.manager import KVCacheManager
from tessera.workers.model.loader import LoadedModel, load_model, load_tokenizer
from tessera.workers.model.lora import LoraSlots
from tessera.workers.validation import check_embedding_inputs, validate_request

__all__ = ["Engine", "EngineStats"]

logger = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        rank_resources: dict[str, float] | None = None,
    ) -> None:
        """``rank_resources``: with ``tensor_parallel_size > 1`` outside a worker's
        placement group, the Ray resources of each other rank (default one CPU)."""
        self.config = config
        shard = None
        if config.tensor_parallel_size > 1:
            config.check_tensor_parallel()
            if loaded is not None:
                raise ValueError("tensor_parallel_size: each rank loads its own part of the model")
            shard = TensorParallelGroup.spec(config)
        self.loaded = loaded or load_model(
            config.model,
            config.dtype,
            config.device,
            config.packed_weights,
            revision=config.revision,
            tokenizer=_tokenizer_override(config),
            shard=shard,
        )
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        # every layer's window (0: some layer attends to the whole context, so no block
        # is ever given back), and the blocks given back so far
        self.window = self.model_config.max_window
        self.released_blocks = 0
        device = torch.device(config.device)
        dtype = self.loaded.kv_dtype
        # (a rank's own heads: its model's config)
        num_blocks = config.num_kv_blocks or num_blocks_for_budget(
            self.loaded.model.config,
            config.block_size,
            dtype,
            device,
            config.kv_cache_memory,
            config.kv_cache_memory_fraction,
        )
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        kv_cache = allocate_kv_cache(
            self.loaded.model.config, num_blocks, config.block_size, dtype, device
        )
        self.group = None
        if shard is not None:
            self.group = TensorParallelGroup.start(
                config, shard, num_blocks, self.loaded.precision, rank_resources
            )
        graphs = config.cuda_graphs and device.type == "cuda"
        self.loras = None
        if config.enable_lora:
            # the fast mode's slots are bf16, as it rounds the GGUF matmuls' inputs
            dtype = torch.bfloat16 if self.loaded.precision == FAST else None
            slots = LoraSlots(self.loaded.model, config.max_loras, config.max_lora_rank, dtype)
            self.loras = LoraManager(slots)
        self.runner = ModelRunner(
            self.loaded.model,
            self.kv,
            kv_cache,
            static_decode="graphs" if graphs else "off",
            native_decode=config.native_decode,
            loras=self.loras,
            group=self.group,
        )
        self.batcher = Batcher(self.kv, config.max_num_batched_tokens, config.max_num_seqs)
        self.sampler = Sampler()
        self.rows = Rows(self.model_config.eos_token_ids)
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
            self.rows,
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
        if config.tensor_parallel_size > 1:  # its row-parallel sums add in another order
            self.hash_keys += (f"tensor_parallel_size={config.tensor_parallel_size}",)
        self.hasher = BlockHasher(
            self.kv,
            config.enable_prefix_caching,
            self.hash_keys,
            self.loaded.model.rope.context_key,
        )
        self.requests = LiveRequests(self.batcher, self.loras)
        self.groups = self.requests.groups  # by request id
        self.counters = StepCounters(self.speculator)
        self.post = Postprocessor(
            kv=self.kv,
            requests=self.requests,
            hasher=self.hasher,
            counters=self.counters,
            speculator=self.speculator,
            sampler=self.sampler,
            grammars=self.grammars,
            rows=self.rows,
            tokenizer=self.tokenizer,
            max_model_len=self.max_model_len,
        )
        self.batch_runner = BatchRunner(self.runner, self.post, self.speculator, self.forks)
        self._inbox: collections.deque[tuple[str, object]] = collections.deque()
        self._step_lock = threading.Lock()  # held while the batch or the pool changes
        self._ready: list[RequestOutput] = []  # produced outside step(), returned by the next
        # admitted requests whose LoRA adapter found every slot pinned, in arrival order
        self._lora_waiting: collections.deque[tuple[Request, object | None]] = collections.deque()
        # embedding jobs begun and not ended: their sequences hold blocks between steps
        self._embeddings: set[embedding.EmbeddingJob] = set()
        self._order = 0
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
        grammar: object | None = None,
        lora: LoraRef | None = None,
    ) -> Request:
        """Validate and queue a request; raises ``InvalidRequestError`` naming the field.

        ``resume`` continues a request another worker had started (failover): its
        tokens are recomputed here, not generated or sent again. ``grammar``: its
        structured output's matcher, built off the engine thread (``grammar_matcher``);
        without it the step that admits the request builds it. ``lora``: the adapter
        it runs with (read here unless ``prepare_lora`` read it already).
        """
        sampling = sampling or SamplingParams()
        token_ids = self.validate(prompt, sampling, resume)
        self.prepare_lora(lora)
        request = Request(
            request_id,
            token_ids,
            sampling,
            priority,
            time.monotonic(),
            cache_salt,
            resume,
            lora=lora,
        )
        return self._queue(request, grammar)

    def prepare_lora(self, lora: LoraRef | None) -> None:
        """Read and check a request's adapter (any thread: ``AsyncEngine`` calls it off
        its loop); ``InvalidRequestError`` on ``model`` if it cannot run here."""
        if lora is None:
            return
        if self.loras is None:
            raise InvalidRequestError(
                "model",
                f"{lora.name!r} is a LoRA adapter and this worker serves none (start it "
                f"with --enable-lora or --lora-modules)",
            )
        self.loras.prepare(lora)

    def submit(self, request: Request, grammar: object | None = None) -> Request:
        """Queue a request a front end built (``add_request``'s, whole), checked here
        against the model and the pool; its arrival is this engine's clock."""
        token_ids = self.validate(request.prompt_token_ids, request.sampling, request.resume)
        self.prepare_lora(request.lora)
        arrived = time.monotonic()
        return self._queue(
            dataclasses.replace(request, prompt_token_ids=token_ids, arrival_time=arrived),
            grammar,
        )

    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """Each input's pooled final hidden state (``embedding.EmbeddingJob``: the
        config's ``embedding_pooling`` and ``embedding_normalize``), float32
        ``[len(inputs), hidden]``, a forward at a time between steps;
        ``InvalidRequestError`` naming the input at fault."""
        job = self.start_embedding(inputs)
        try:
            while not job.finished:
                self.embedding_forward(job)
        finally:
            self.end_embedding(job)
        return job.result()

    def start_embedding(self, inputs: list[list[int]]) -> embedding.EmbeddingJob:
        """A job for ``embed``'s inputs, checked (``InvalidRequestError`` naming the input
        at fault); it holds no block yet. Run it with ``embedding_forward`` until
        ``finished``, then ``end_embedding`` it, whatever happened."""
        check_embedding_inputs(inputs, self.model_config.vocab_size, self.max_model_len)
        config = self.config
        return embedding.EmbeddingJob(
            self.kv,
            inputs,
            config.max_num_batched_tokens,
            config.embedding_pooling,
            config.embedding_normalize,
        )

    def embedding_forward(self, job: embedding.EmbeddingJob) -> None:
        """One forward of ``job`` (at most the token budget), between two steps."""
        with self._step_lock:
            self._embeddings.add(job)
            job.forward(self.runner)

    def end_embedding(self, job: embedding.EmbeddingJob) -> None:
        """Frees every block ``job`` holds."""
        with self._step_lock:
            job.close()
            self._embeddings.discard(job)

    def grammar_matcher(self, sampling: SamplingParams, resume: Resume | None) -> object | None:
        """The structured output's matcher for a request with ``sampling`` and
        ``resume`` (None without one), at the grammar's start or past the resumed tokens.
        Any thread may call it: a large grammar's matcher takes tens of milliseconds,
        which the step loop should not wait for (``AsyncEngine`` builds it beside it)."""
        if sampling.structured is None:
            return None
        replay = resume.token_ids if resume is not None else ()
        return self.grammars.matcher(sampling.structured, replay)

    def _queue(self, request: Request, grammar: object | None) -> Request:
        self.requests.reserve(request.request_id)
        self._inbox.append(("add", (request, grammar)))
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
        return self.counters.steps

    def has_work(self) -> bool:
        return bool(self._inbox or self._ready or self._lora_waiting) or self.batcher.has_work()

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Apply queued adds and aborts, then schedule -> run -> postprocess one batch;
        return the deltas it produced."""
        with self._step_lock:
            started = time.perf_counter()
            first = self.counters.steps == 0
            outputs, self._ready = self._ready, []
            outputs += self._drain_inbox()
            batch = self._schedule()
            if batch.items:
                outputs += self.batch_runner.run(batch)  # run, then postprocess
            outputs += self._drain_inbox()  # aborts that arrived during the batch
            if batch.items:
                ended = time.perf_counter()
                forward = self.runner.forward_time
                goes_on = bool(self.batcher.running)
                self.counters.step_ended(first, started, ended, forward, goes_on)
            return outputs

    def _schedule(self) -> ScheduledBatch:
        self.hasher.flush()  # before drafts join the tokens (hashes cover real tokens)
        if self.window:  # after the flush: a block released full is findable by its hash
            self._release_outside_window()
        speculating = bool(self.requests.speculating)
        if speculating:
            self.speculator.before_schedule(self.batcher.running, self.max_model_len)
        batch = self.batcher.schedule()
        self.speculator.after_schedule(batch, self.batcher.running, speculating)
        return batch

    def _release_outside_window(self) -> None:
        """Give back the blocks no query to come attends to: every layer has a window
        (``ModelConfig.max_window``), and a sequence's next query, at cache index
        ``num_computed_tokens``, attends to indices past ``num_computed_tokens - window``."""
        for group in self.batcher.running:
            for seq in group.seqs:
                index = seq.num_computed_tokens - self.window + 1
                self.released_blocks += self.kv.release_before(seq.seq_id, index)

    def _drain_inbox(self) -> list[RequestOutput]:
        outputs = []
        if self._lora_waiting:  # slots unpinned by the last step
            waiting, self._lora_waiting = self._lora_waiting, collections.deque()
            for request, grammar in waiting:
                outputs += self._admit(request, grammar)
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "add":
                outputs += self._admit(*payload)
            elif (group := self.groups.get(payload)) is not None:
                outputs += self.post.abort_group(group)
            else:
                outputs += self._abort_lora_waiting(payload)
        return outputs

    def _abort_lora_waiting(self, request_id: str) -> list[RequestOutput]:
        """Abort a request waiting for an adapter slot (none if it is not one)."""
        for entry in self._lora_waiting:
            if entry[0].request_id == request_id:
                self._lora_waiting.remove(entry)
                self.requests.release(request_id)
                return aborted_outputs(entry[0])
        return []

    def _admit(self, request: Request, grammar: object | None) -> list[RequestOutput]:
        """Start a queued request; the deltas of one that cannot start (none usually)."""
        if request.lora is not None:
            try:
                acquired = self.loras.acquire(request.request_id, request.lora)
            except InvalidRequestError as error:  # its files went or changed since submit
                logger.warning("request %s aborted: %s", request.request_id, error)
                self.requests.release(request.request_id)
                return aborted_outputs(request)
            if not acquired:
                self._lora_waiting.append((request, grammar))  # every slot is pinned
                return []
        sampling, resume = request.sampling, request.resume
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
        seq.grammar = grammar if grammar is not None else self.grammar_matcher(sampling, resume)
        if request.traced:  # its arrival on this engine's clock, as wall-clock time
            waited = time.monotonic() - request.arrival_time
            seq.clock = PhaseClock(time.time_ns() - round(waited * 1e9))
        seq.argmax_only = argmax_only(sampling) and sampling.parallel_tokens is None
        seq.plain = sampling.num_samples == 1 and sampling.parallel_tokens is None
        self.hasher.update(seq)
        self.speculator.start(seq)
        if seq.grammar is not None:
            seq.spec = None  # no speculation: drafts would not be checked against the grammar
        group = SequenceGroup(request, [seq], sampling.num_samples, self._order)
        if sampling.beam_width > 1:
            group.beam = self.forks.new_beam_search(sampling, self.rows.end_token_ids(sampling))
        self._order += 1
        self.requests.add(group)
        return []

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel group (nothing to do otherwise)."""
        if self.group is not None:
            self.group.close()

    # ------------------------------------------------------------ inspection
    def check_integrity(self) -> None:
        reserved = [r.blocks for r in self.handoff.reservations]  # incoming transfers
        self.kv.pool.check_integrity([*self.kv.held_tables(), *reserved])
        self.kv.check_block_ids()
        held = set(self.kv.tables)
        held -= {seq_id for job in self._embeddings for seq_id in job.held_seq_ids()}
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
            released_blocks=self.released_blocks,
            total_blocks=self.kv.pool.num_blocks,
            free_blocks=self.kv.num_free_blocks,
            kv_usage=self.kv.usage,
            prefix_cache=self.kv.prefix_cache_stats(),
            shared_blocks=sum(block.ref_count > 1 for block in self.kv.pool.blocks),
            loras=() if self.loras is None else tuple(self.loras.resident),
            **self.counters.snapshot,
        )


def _tokenizer_override(config: EngineConfig) -> PreTrainedTokenizerBase | None:
    """The tokenizer that ``--tokenizer`` or ``--chat-template`` makes, None without
    them (the model's own, as the loader finds it)."""
    if config.tokenizer is None and config.chat_template is None:
        return None
    return load_tokenizer(
        config.model,
        config.revision,
        tokenizer=config.tokenizer,
        chat_template=config.chat_template,
    )
