"""What an engine reports: ``EngineStats``, and the step counters behind it."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tessera.workers.api import INTER_TOKEN_LATENCY_BUCKETS
from tessera.workers.kv.prefix_cache import PrefixCacheStats

if TYPE_CHECKING:
    from tessera.workers.decoding.speculative import Speculator
    from tessera.workers.engine.batcher import ScheduledBatch


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
    loras: tuple[str, ...] = ()  # the digests of the LoRA adapters in its slots
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
    #: blocks given back because every layer's sliding window had passed them, ever
    released_blocks: int = 0
    #: inter-token latency, as vLLM measures it (once per sequence and step that gave
    #: it a token after its first): sequences per bucket of
    #: ``INTER_TOKEN_LATENCY_BUCKETS`` (not cumulative; one more for above the last
    #: bound), and the sum of their seconds
    itl_counts: tuple[int, ...] = ()
    itl_seconds: float = 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0

    @property
    def spec_tokens_per_step(self) -> float:
        return self.spec_tokens / self.spec_steps if self.spec_steps else 0.0


class StepCounters:
    """The counters of the steps an engine ran. Only the step thread writes them;
    ``snapshot`` is what they were when the last whole step ended, which is what
    ``Engine.stats`` reports to other threads (never a step's tokens without the step)."""

    def __init__(self, speculator: Speculator) -> None:
        self.speculator = speculator
        self.steps = 0
        self.batch_size_sum = 0
        self.tokens_sum = 0
        self.last = (0, 0)  # the last batch's sequences and tokens
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.peak_used_blocks = 0
        self.step_time = 0.0  # moving averages of the steps that ran a batch
        self.host_time = 0.0
        self.step_seconds = 0.0  # totals of those steps
        self.host_seconds = 0.0
        self.decode_steps = 0  # of them, decodes only
        self.decode_seconds = 0.0
        self.decode_only = False  # whether the last batch was decodes only
        self.decodes = 0  # the last batch's sequences that got a token after their first
        self.last_end: float | None = None  # when the last step that ran a batch ended
        self.itl_counts = [0] * (len(INTER_TOKEN_LATENCY_BUCKETS) + 1)
        self.itl_seconds = 0.0
        self.snapshot = self.counts()

    def count_batch(self, batch: ScheduledBatch, prompt_tokens: int) -> None:
        """Count a batch that ran; ``prompt_tokens``: ``self.prompt_tokens`` before it."""
        self.decode_only = (
            batch.num_tokens == len(batch.items) and self.prompt_tokens == prompt_tokens
        )
        self.steps += 1
        self.batch_size_sum += len(batch.items)
        self.tokens_sum += batch.num_tokens
        self.last = (len(batch.items), batch.num_tokens)
        self.decodes = batch.num_decodes

    def step_ended(
        self, first: bool, started: float, ended: float, forward: float, goes_on: bool
    ) -> None:
        """Time a ``step`` call that ran a batch (``first``: the engine's first such;
        ``started`` and ``ended``: ``time.perf_counter`` around it; ``goes_on``: it left
        sequences running, so the next step follows at once); every figure is of the
        whole call, so the host time is a part of it."""
        wall = ended - started
        host = wall - forward
        if self.decodes:
            # A decoding sequence had its previous token from the engine's previous step
            # (nearly always): its latency runs from that step's end to this one's, once
            # per sequence and step as vLLM counts (a step of speculated tokens is one
            # interval). After an idle engine the previous token came from elsewhere (a
            # prefill worker, a failed worker): this step alone. Per step, not per token.
            latency = ended - (started if self.last_end is None else self.last_end)
            bucket = bisect.bisect_left(INTER_TOKEN_LATENCY_BUCKETS, latency)
            self.itl_counts[bucket] += self.decodes
            self.itl_seconds += latency * self.decodes
        self.last_end = ended if goes_on else None
        self.step_time = wall if first else 0.8 * self.step_time + 0.2 * wall
        self.host_time = host if first else 0.8 * self.host_time + 0.2 * host
        self.step_seconds += wall
        self.host_seconds += host
        if self.decode_only:
            self.decode_steps += 1
            self.decode_seconds += wall
        self.snapshot = self.counts()

    def counts(self) -> dict[str, Any]:
        """``EngineStats``' step counters, live."""
        steps = max(self.steps, 1)
        speculator = self.speculator
        return {
            "steps": self.steps,
            "last_batch_size": self.last[0],
            "last_num_tokens": self.last[1],
            "mean_batch_size": self.batch_size_sum / steps,
            "mean_tokens_per_step": self.tokens_sum / steps,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "peak_used_blocks": self.peak_used_blocks,
            "recent_step_time": self.step_time,
            "recent_host_time": self.host_time,
            "step_seconds": self.step_seconds,
            "host_seconds": self.host_seconds,
            "decode_steps": self.decode_steps,
            "decode_seconds": self.decode_seconds,
            "spec_proposed": speculator.proposed,
            "spec_accepted": speculator.accepted,
            "spec_steps": speculator.steps,
            "spec_tokens": speculator.tokens,
            "itl_counts": tuple(self.itl_counts),
            "itl_seconds": self.itl_seconds,
        }
