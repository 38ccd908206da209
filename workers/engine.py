"""The worker's engine: validate requests, run batching steps, emit output deltas.

``Engine`` is synchronous; ``add_request`` and ``abort`` may be called from another
thread (the async wrapper's event loop). The batch, the pool and the block tables are
only touched under ``_step_lock``: ``step`` holds it throughout, ``add_request`` only
queues, and ``abort`` applies at once when no step is running (else the step that is
running applies it as soon as it ends, before the next one).
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from dataclasses import dataclass

import torch

from workers.api import (
    FinishReason,
    InvalidRequestError,
    Phase,
    Request,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from workers.batcher import Batcher
from workers.config import EngineConfig
from workers.detokenizer import IncrementalDetokenizer
from workers.kv.kv_cache import allocate_kv_cache, num_blocks_for_budget
from workers.kv.manager import KVCacheManager, blocks_needed
from workers.model.loader import DTYPES, LoadedModel, load_model
from workers.model_runner import ModelRunner
from workers.sampling import Sampler, SamplingRow
from workers.sequence import Sequence
from workers.stop import StopStringMatcher

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineStats:
    steps: int
    running: int
    waiting: int
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


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or load_model(config.model, config.dtype, config.device)
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        device = torch.device(config.device)
        dtype = DTYPES[config.dtype]
        num_blocks = config.num_kv_blocks or num_blocks_for_budget(
            self.model_config,
            config.block_size,
            dtype,
            device,
            config.kv_cache_memory,
            config.kv_cache_memory_fraction,
        )
        self.kv = KVCacheManager(num_blocks, config.block_size)
        kv_cache = allocate_kv_cache(
            self.model_config, num_blocks, config.block_size, dtype, device
        )
        self.runner = ModelRunner(self.loaded.model, self.kv, kv_cache)
        self.batcher = Batcher(self.kv, config.max_num_batched_tokens, config.max_num_seqs)
        self.sampler = Sampler()
        self.sequences: dict[str, Sequence] = {}
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
        logger.info(
            "engine ready: %d KV blocks of %d tokens, max_model_len %d",
            num_blocks,
            config.block_size,
            self.max_model_len,
        )

    # ----------------------------------------------------------------- requests
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def validate(
        self, prompt: str | list[int] | tuple[int, ...], sampling: SamplingParams
    ) -> tuple[int, ...]:
        """Check a prompt against the model and pool; return its token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            token_ids = tuple(self.tokenize(prompt))
        else:
            token_ids = tuple(prompt)
            vocab = self.model_config.vocab_size
            for token_id in token_ids:
                if isinstance(token_id, bool) or not isinstance(token_id, int):
                    raise InvalidRequestError(
                        "prompt", f"token ids must be integers, got {token_id!r}"
                    )
                if not 0 <= token_id < vocab:
                    raise InvalidRequestError(
                        "prompt", f"token id {token_id} is out of the vocabulary [0, {vocab})"
                    )
        if not token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        for token_id in sampling.stop_token_ids:
            if token_id >= self.model_config.vocab_size:
                raise InvalidRequestError(
                    "stop_token_ids",
                    f"token id {token_id} is out of the vocabulary "
                    f"[0, {self.model_config.vocab_size})",
                )
        total = len(token_ids) + sampling.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(token_ids)} tokens) + max_tokens ({sampling.max_tokens}) = "
                f"{total} exceeds the model's context length of {self.max_model_len} tokens",
            )
        need = blocks_needed(total, self.kv.block_size)
        if need > self.kv.pool.num_blocks:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt + max_tokens = {total} tokens needs {need} KV blocks, but the "
                f"KV pool has only {self.kv.pool.num_blocks}",
            )
        return token_ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | tuple[int, ...],
        sampling: SamplingParams | None = None,
        priority: int = 0,
    ) -> Request:
        """Validate and queue a request; raises ``InvalidRequestError`` naming the field."""
        sampling = sampling or SamplingParams()
        token_ids = self.validate(prompt, sampling)
        request = Request(request_id, token_ids, sampling, priority, time.monotonic())
        with self._lock:
            if request_id in self._known_ids:
                raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
            self._known_ids.add(request_id)
        self._inbox.append(("add", request))
        return request

    def abort(self, request_id: str) -> None:
        """Abort a request and free its blocks: now if no step is running, else right
        after it. Its final delta (``finish_reason`` abort) comes from the next ``step``."""
        self._inbox.append(("abort", request_id))
        if self._step_lock.acquire(blocking=False):
            try:
                self._ready.extend(self._drain_inbox())
            finally:
                self._step_lock.release()

    def has_work(self) -> bool:
        return bool(self._inbox or self._ready) or self.batcher.has_work()

    # --------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Apply queued adds/aborts, run one batch, return the deltas it produced."""
        with self._step_lock:
            outputs, self._ready = self._ready, []
            outputs += self._drain_inbox()
            outputs += self._run_batch()
            outputs += self._drain_inbox()  # aborts that arrived during the batch
            return outputs

    def _run_batch(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        batch = self.batcher.schedule()
        if not batch.items:
            return outputs
        logits, sampled = self.runner.execute(batch.items)
        for seq, n in batch.items:
            seq.num_computed_tokens += n
            if seq.num_output_tokens == 0:
                self._prompt_tokens += n
        rows = [self._sampling_row(seq) for seq in sampled]
        results = self.sampler.sample(logits, rows) if sampled else []
        for seq, result in zip(sampled, results, strict=True):
            self._append_token(seq, result.token_id, result.logprob)
            output = self._emit(seq)
            if output is not None:
                outputs.append(output)
        self._steps += 1
        self._batch_size_sum += len(batch.items)
        self._tokens_sum += batch.num_tokens
        self._last = (len(batch.items), batch.num_tokens)
        return outputs

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        held = set(self.kv.tables)
        running = {seq.seq_id for seq in self.batcher.running}
        waiting = {seq.seq_id for seq in self.batcher.waiting}
        assert not running & waiting, "a sequence is both running and waiting"
        assert held <= running, f"blocks held by sequences that are not running: {held - running}"

    def _drain_inbox(self) -> list[RequestOutput]:
        outputs = []
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "add":
                self._admit(payload)
            elif (seq := self.sequences.get(payload)) is not None:
                self._finish(seq, FinishReason.ABORT)
                outputs.append(self._emit(seq))
        return outputs

    def _admit(self, request: Request) -> None:
        sampling = request.sampling
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        seq = Sequence(
            request=request,
            seed=seed,
            order=self._order,
            token_ids=list(request.prompt_token_ids),
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, sampling.skip_special_tokens
            ),
            stop_matcher=StopStringMatcher(sampling.stop),
        )
        self._order += 1
        self.sequences[request.request_id] = seq
        self.batcher.add(seq)

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        params = seq.request.sampling
        suppressed: tuple[int, ...] = ()
        if seq.num_output_tokens < params.min_tokens:
            suppressed = tuple(params.stop_token_ids) + (
                () if params.ignore_eos else self.model_config.eos_token_ids
            )
        return SamplingRow(
            params=params,
            seed=seq.seed,
            token_index=seq.num_output_tokens,
            prompt_token_ids=seq.request.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            suppressed_token_ids=suppressed,
        )

    def _append_token(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> None:
        params = seq.request.sampling
        seq.token_ids.append(token_id)
        seq.phase = Phase.DECODE
        self._generated_tokens += 1
        seq.pending_token_ids.append(token_id)
        if logprob is not None:
            seq.pending_logprobs.append(logprob)
        if not params.ignore_eos and token_id in self.model_config.eos_token_ids:
            self._finish(seq, FinishReason.STOP, token_id)
            return
        if token_id in params.stop_token_ids:
            self._finish(seq, FinishReason.STOP, token_id)
            return
        text, matched = seq.stop_matcher.feed(seq.detokenizer.push(token_id))
        seq.pending_text += text
        if matched is not None:
            self._finish(seq, FinishReason.STOP, matched)
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, FinishReason.LENGTH)

    def _finish(
        self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None = None
    ) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.phase = Phase.FINISHED
        if not isinstance(stop_reason, str):  # a stop string drops the held-back text
            seq.pending_text += seq.stop_matcher.feed(seq.detokenizer.flush())[0]
            seq.pending_text += seq.stop_matcher.flush()
        self.batcher.remove(seq)

    def _emit(self, seq: Sequence) -> RequestOutput | None:
        if not (seq.pending_text or seq.pending_token_ids or seq.finished):
            return None
        params = seq.request.sampling
        output = RequestOutput(
            request_id=seq.seq_id,
            text=seq.pending_text,
            token_ids=tuple(seq.pending_token_ids),
            logprobs=tuple(seq.pending_logprobs) if params.logprobs is not None else None,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            stop_reason=seq.stop_reason,
        )
        seq.pending_text = ""
        seq.pending_token_ids = []
        seq.pending_logprobs = []
        if seq.finished:
            del self.sequences[seq.seq_id]
            with self._lock:
                self._known_ids.discard(seq.seq_id)
        return output

    # -------------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        # list() copies under the GIL: stats may be read while another thread runs step().
        phases = collections.Counter(seq.phase.value for seq in list(self.sequences.values()))
        steps = max(self._steps, 1)
        return EngineStats(
            steps=self._steps,
            running=len(self.batcher.running),
            waiting=len(self.batcher.waiting),
            phases=dict(phases),
            preemptions=self.batcher.num_preemptions,
            total_blocks=self.kv.pool.num_blocks,
            free_blocks=self.kv.num_free_blocks,
            kv_usage=self.kv.usage,
            last_batch_size=self._last[0],
            last_num_tokens=self._last[1],
            mean_batch_size=self._batch_size_sum / steps,
            mean_tokens_per_step=self._tokens_sum / steps,
            prompt_tokens=self._prompt_tokens,
            generated_tokens=self._generated_tokens,
        )
