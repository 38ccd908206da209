"""One row of a step's logits as the sampler sees it: the request's parameters, the key of
its noise, and the tokens its penalties count."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tessera.workers.api import SamplingParams


class TokenSpan(Sequence[int]):
    """``tokens[start:stop]`` of a list, without copying it: the engine's
    ``SamplingRow.output_token_ids`` (a slice per row and step was O(output) each; only
    the rows with penalties read it). The list may grow past ``stop`` meanwhile."""

    __slots__ = ("_tokens", "_start", "_stop")

    def __init__(self, tokens: list[int], start: int, stop: int) -> None:
        self._tokens, self._start, self._stop = tokens, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, index: int | slice) -> int | list[int]:  # as a list's
        if isinstance(index, slice):
            return self._tokens[self._start : self._stop][index]
        size = self._stop - self._start
        if not -size <= index < size:
            raise IndexError(f"token index {index} out of range for {size} tokens")
        return self._tokens[self._start + index % size]

    def __iter__(self) -> Iterator[int]:
        return iter(self._tokens[self._start : self._stop])


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one row of the logits (one token to sample)."""

    params: SamplingParams
    seed: int  # the request's seed, or one the engine drew for it
    token_index: int  # among the sequence's output tokens; 0 = first generated
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated before this one
    suppressed_token_ids: tuple[int, ...] = ()  # e.g. EOS and stop ids below min_tokens
