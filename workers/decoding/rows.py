"""The sampling row of a sequence (what samples its next token) and the token ids
that end it."""

from __future__ import annotations

from tessera.workers.api import SamplingParams
from tessera.workers.decoding.sampling import SamplingRow, TokenSpan
from tessera.workers.engine.sequence import Sequence


class Rows:
    def __init__(self, eos_token_ids: tuple[int, ...]) -> None:
        self.eos_token_ids = eos_token_ids

    def end_token_ids(self, params: SamplingParams) -> tuple[int, ...]:
        """The tokens that end a sequence sampled with ``params``: EOS (unless ignored)
        and the request's stop token ids."""
        eos = () if params.ignore_eos else self.eos_token_ids
        return tuple(dict.fromkeys(eos + tuple(params.stop_token_ids)))

    def __call__(self, seq: Sequence, length: int | None = None) -> SamplingRow:
        """The row that samples the token after the first ``length`` tokens (default:
        all of them) of ``seq``; end tokens are suppressed before ``min_tokens``."""
        request = seq.request
        params = request.sampling
        length = len(seq.token_ids) if length is None else length
        num_output = length - seq.num_prompt_tokens
        suppressed: tuple[int, ...] = ()
        if num_output < params.min_tokens:
            suppressed = self.end_token_ids(params)
        return SamplingRow(  # positional, in field order: built per row and step
            params,
            seq.seed,
            num_output,  # token_index
            request.prompt_token_ids,
            TokenSpan(seq.token_ids, seq.num_prompt_tokens, length),  # output_token_ids
            suppressed,
        )
