"""One sequence's state inside the engine.

Scheduling is in tokens: ``num_computed_tokens`` chases ``num_tokens``. A prefill,
a chunk of one, a decode step and a recompute after preemption all compute
``token_ids[num_computed_tokens : num_computed_tokens + n]``; when that reaches
``num_tokens`` the last row's logits pick the next token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.api import FinishReason, Phase, Request, TokenLogprob
from workers.detokenizer import IncrementalDetokenizer
from workers.stop import StopStringMatcher


@dataclass(slots=True)
class Sequence:
    request: Request
    seed: int  # the request's seed, or one the engine drew for it
    order: int  # admission counter: ties in priority go to the older request
    token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    num_computed_tokens: int = 0
    phase: Phase = Phase.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    # What the next output delta carries; cleared when the delta is emitted.
    pending_text: str = ""
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def seq_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower runs first and is preempted last."""
        return (self.request.priority, self.order)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
