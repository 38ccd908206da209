"""Sequences and the groups the batcher schedules.

Scheduling is in tokens: ``num_computed_tokens`` chases ``num_tokens``. A prefill,
a chunk of one, a prefix-cache hit, a decode step and a recompute after preemption all
compute ``token_ids[num_computed_tokens : num_computed_tokens + n]``; when that reaches
``num_tokens`` the last row's logits pick the next token.

A request is one ``SequenceGroup``. It starts as one sequence; ``n > 1`` (or
``best_of``) forks it into children once its prompt is computed, and beam search
forks it into beams. A group's live sequences are scheduled, preempted and aborted
together, so a beam step always sees every beam's logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tessera.workers.api import (
    EngineTimes,
    FinishReason,
    ParallelSet,
    Phase,
    Request,
    SpeculativeParams,
    SpeculativeStats,
    TokenLogprob,
)
from tessera.workers.decoding.detokenizer import IncrementalDetokenizer
from tessera.workers.decoding.parallel_tokens import parallel_mask
from tessera.workers.decoding.stop import StopStringMatcher
from tessera.workers.engine.model_runner import Chunk

if TYPE_CHECKING:
    from tessera.workers.decoding.beam import BeamSearch


@dataclass(slots=True)
class SpecState:
    """One sequence's speculation: its settings, draft-model progress and counters
    (``workers.speculative`` drives it; it lives here because ``Sequence`` holds it)."""

    params: SpeculativeParams
    num_tokens: int  # drafts to propose next step (adaptive)
    draft_computed: int = 0  # tokens of token_ids whose K/V the draft model holds
    draft_probs: torch.Tensor | None = None  # [num_draft, V] q; None: point-mass drafts
    rate: float = 1.0  # moving average of the per-token acceptance rate
    proposed: int = 0
    accepted: int = 0
    steps: int = 0
    tokens: int = 0

    def drop_drafts(self, keep: int) -> None:
        if self.draft_probs is not None:
            self.draft_probs = self.draft_probs[:keep]

    def stats(self) -> SpeculativeStats:
        return SpeculativeStats(self.proposed, self.accepted, self.steps, self.tokens)


@dataclass(slots=True)
class PhaseClock:
    """A traced request's way through this engine (``time.time_ns``), shared by its
    sequences (forks and beams too): queued, first scheduled, first token. Only traced
    requests have one, so an untraced token pays one None check for it."""

    arrived_ns: int
    scheduled_ns: int | None = None  # admitted to a step for the first time
    first_token_ns: int | None = None  # its first output token was appended

    def times(self, seq: Sequence) -> EngineTimes | None:
        """What ``seq``'s finished delta carries (None for the others)."""
        return None if seq.finish_reason is None else self.ended()

    def ended(self) -> EngineTimes:
        """The phases of an output that ends now."""
        return EngineTimes(self.arrived_ns, self.scheduled_ns, self.first_token_ns, time.time_ns())


@dataclass(slots=True, eq=False)  # identity: a sequence is itself, not its contents
class Sequence:
    request: Request
    seed: int  # this sequence's sampling seed: the request's (or a drawn one) + its index
    token_ids: list[int]
    detokenizer: IncrementalDetokenizer | None
    stop_matcher: StopStringMatcher | None
    index: int = 0  # child or beam index within its group
    num_computed_tokens: int = 0
    phase: Phase = Phase.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    cumulative_logprob: float = 0.0
    # Content hashes of the full blocks of token_ids (empty when prefix caching is off).
    block_hashes: list[bytes] = field(default_factory=list)
    # What the next output delta carries; cleared when the delta is emitted.
    pending_text: str = ""
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    pending_sets: list[ParallelSet] = field(default_factory=list)
    # Speculative decoding: the last ``num_draft`` of token_ids are unverified drafts.
    spec: SpecState | None = None
    num_draft: int = 0
    # Parallel tokens: each token's logical position (None: its index), and the
    # (first index, width) of every set of two or more tokens, in order.
    positions: list[int] | None = None
    parallel_sets: list[tuple[int, int]] = field(default_factory=list)
    # prompt_logprobs: what the prefill has computed so far (None for the first token),
    # sent with the first delta; None when the request did not ask.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Structured outputs: this sequence's llguidance matcher (tokens it has consumed:
    # the output so far), or None.
    grammar: Any = None
    # len(request.prompt_token_ids), read several times per sequence and step
    num_prompt_tokens: int = field(init=False)
    # The request id for index 0, ``request_id#index`` for forks (the KV manager's key).
    seq_id: str = field(init=False)
    # Its tokens are its logits rows' argmax (``sampling.argmax_only``, and no parallel
    # tokens): the engine samples it without a SamplingRow. Set at admission.
    argmax_only: bool = False
    # The request is one sequence that streams, without forks, beams or parallel tokens
    # (``num_samples == 1``, no ``parallel_tokens``): its decodes take the engine's lean
    # path (``BatchRunner.run_decodes``) when it has no drafts or prompt logprobs pending.
    plain: bool = False
    # A traced request's phase times (``Request.traced``); None for the others.
    clock: PhaseClock | None = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.request.prompt_token_ids)
        rid = self.request.request_id
        self.seq_id = rid if self.index == 0 else f"{rid}#{self.index}"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def takes_argmax(self) -> bool:
        """This step's row of it (one at most) needs only its argmax, not its logits:
        ``argmax_only``, and no grammar to mask them, drafts to verify or prompt logprobs
        to record. A step whose every sequence takes the argmax asks the forward for it
        alone (``ModelRunner.execute(..., argmax_only=True)``)."""
        return (
            self.argmax_only
            and self.grammar is None
            and not self.num_draft
            and self.prompt_logprobs is None
        )

    def wants_prompt_logprobs(self, start: int) -> bool:
        """A chunk from ``start`` is (part of) the prompt whose logprobs the request
        asked for, and not yet sent."""
        return self.prompt_logprobs is not None and start < self.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_real_tokens(self) -> int:
        """Tokens without the unverified drafts."""
        return len(self.token_ids) - self.num_draft

    def drop_drafts(self, keep: int = 0) -> None:
        """Keep only the first ``keep`` draft tokens (none by default)."""
        if self.num_draft > keep:
            del self.token_ids[len(self.token_ids) - self.num_draft + keep :]
            self.num_draft = keep
            if self.spec is not None:
                self.spec.drop_drafts(keep)

    def fit(self, start: int, end: int) -> int:
        """Where a step computing from ``start`` with room up to ``end`` must stop:
        drafts that do not fit are dropped (a verification step checks them all at
        once), and a parallel set is never split (its tokens see each other)."""
        if end < self.num_tokens and self.num_draft:
            self.drop_drafts(max(0, self.num_draft - (self.num_tokens - end)))
            end = min(end, self.num_tokens)
        for first, width in reversed(self.parallel_sets):
            if first < end < first + width:
                return max(first, start)
            if first + width <= end:
                break
        return end

    def chunk(self, n: int) -> Chunk:
        """The next ``n`` tokens to compute, and the rows whose logits decide what
        follows: the last token's, every draft's and the one before them (speculative),
        or every member's of a final parallel set."""
        start = self.num_computed_tokens
        end = start + n
        rows: range | tuple[int, ...] = ()
        if self.prompt_logprobs is not None and self.wants_prompt_logprobs(start):
            rows = range(n)  # every row: each predicts the next token
        elif end == len(self.token_ids):
            last = 1
            if self.num_draft:
                last = self.num_draft + 1
            elif self.parallel_sets and sum(self.parallel_sets[-1]) == end:
                last = self.parallel_sets[-1][1]
            rows = range(n - last, n)
        mode = self.request.sampling.parallel_tokens
        return Chunk(
            self.seq_id,
            self.token_ids[start:end],
            start,
            positions=None if self.positions is None else self.positions[start:end],
            mask=parallel_mask(self.parallel_sets, start, end, mode.mode) if mode else None,
            logits_rows=rows,
            prompt_len=len(self.request.prompt_token_ids),
        )


@dataclass(slots=True, eq=False)  # identity, so groups can key dicts and sets
class SequenceGroup:
    """One request's live sequences, scheduled as a unit.

    ``width`` is how many sequences the group can grow to (``best_of``, ``n`` or the
    beam width); admission reserves that many of ``max_num_seqs``.
    """

    request: Request
    seqs: list[Sequence]  # live (not finished), in index order
    width: int
    order: int  # admission counter: ties in priority go to the older request
    beam: BeamSearch | None = None
    forked: bool = False  # n > 1: the children exist
    finished_seqs: list[Sequence] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def streams(self) -> bool:
        """Whether outputs go out as deltas; beam search and ``best_of > n`` send each
        output whole when the group ends."""
        params = self.request.sampling
        return params.beam_width == 1 and (params.best_of is None or params.best_of == params.n)

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower runs first and is preempted last."""
        return (self.request.priority, self.order)
