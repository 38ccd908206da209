"""Turn one step's logits into tokens: penalties, temperature, truncation, keyed sampling.

Each row of the ``[B, V]`` logits goes through, in this order (vLLM v1's order):

1. repetition penalty (Hugging Face: over prompt + output tokens), then frequency and
   presence penalties (OpenAI: over output tokens only), then suppression (-inf);
2. greedy rows (``temperature == 0``) stop here and take the argmax;
3. temperature, then min-p, then top-k, then top-p (on the top-k survivors,
   renormalised), then softmax: this is the distribution ``Sampler.probs`` returns.

Sampling is exact, not an approximation: with ``E_i ~ Exp(1)`` independent,
``argmax_i p_i / E_i`` is token ``j`` with probability ``p_j`` (the exponential race;
Gumbel-max in another guise), up to float32 rounding of ``p`` and of the uniform draws
behind ``E``. A row's noise comes from a generator keyed by (seed, token_index)
alone, so a request samples the same tokens whatever batch it shares and whichever row
it sits in. Generators are device-specific: CPU and CUDA streams differ for one key.

Logprobs are always those of the raw logits (before penalties and temperature).

Step 1 is ``penalties``, step 3 ``truncation``, the keyed noise and the race
``keyed_noise``; a row's inputs are a ``sampling_row.SamplingRow``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tessera.workers.api import SamplingParams, TokenLogprob
from tessera.workers.decoding.keyed_noise import keyed_uniform, race, random_generator
from tessera.workers.decoding.penalties import apply_penalties, has_penalties
from tessera.workers.decoding.sampling_row import SamplingRow, TokenSpan
from tessera.workers.decoding.truncation import rows_of, truncated_probs
from tessera.workers.quant.kernels import argmax_rows

__all__ = [
    "SampleResult",
    "Sampler",
    "SamplingRow",
    "TokenSpan",
    "argmax_only",
    "keyed_uniform",
    "random_generator",
]


class SampleResult(NamedTuple):  # a tuple: a step builds one per row (a third of the time)
    token_id: int
    logprob: TokenLogprob | None  # set when the row asks for logprobs or has n > 1


def _greedy_unchanged(params: SamplingParams) -> bool:
    """Greedy on the logits as they are: no logit bias or penalties (suppression aside)."""
    return params.greedy and not params.logit_bias and not has_penalties(params)


def _wants_logprob(params: SamplingParams) -> bool:
    """A sampled token carries its logprob: asked for, or n > 1 (cumulative_logprob)."""
    return params.logprobs is not None or params.num_samples > 1


def argmax_only(params: SamplingParams) -> bool:
    """Whether every token a request with ``params`` samples is the argmax of its logits
    row, with no logprob: greedy, and no logit bias, penalties, ``min_tokens``
    (suppression), ``logprobs`` or ``n > 1``. ``Sampler.sample`` answers that for such a
    row whatever else its ``SamplingRow`` holds, so the engine takes the argmax without
    building one."""
    return _greedy_unchanged(params) and params.min_tokens == 0 and not _wants_logprob(params)


def _is_plain_greedy(row: SamplingRow) -> bool:
    return _greedy_unchanged(row.params) and not row.suppressed_token_ids


@dataclass(frozen=True, slots=True)
class _Prepared:
    token_ids: torch.Tensor  # [B] long; final for greedy rows, a placeholder for others
    random_rows: list[int]  # rows that sample
    random_probs: torch.Tensor | None  # [len(random_rows), V] float32


class Sampler:
    """Stateless: everything a row needs is in its ``SamplingRow``."""

    def _prepare(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        argmax: torch.Tensor | None = None,
    ) -> _Prepared:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if argmax is not None and tuple(argmax.shape) != (len(rows),):
            raise ValueError(f"argmax {tuple(argmax.shape)} does not match {len(rows)} rows")
        work = [i for i, row in enumerate(rows) if not _is_plain_greedy(row)]
        if not work:
            # The hot path: the float32 cast cannot change an argmax, so it is skipped.
            return _Prepared(argmax_rows(logits) if argmax is None else argmax, [], None)
        if len(work) == len(rows):
            token_ids = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
        else:  # right for the plain greedy rows
            token_ids = argmax_rows(logits) if argmax is None else argmax.clone()
        x = logits[work].to(torch.float32)  # [W, V]; indexing copies, the caller's stays
        work_rows = [rows[i] for i in work]
        for j, row in enumerate(work_rows):  # OpenAI's logit_bias: added to the logits
            if row.params.logit_bias:
                ids, biases = zip(*row.params.logit_bias, strict=True)
                index = torch.tensor(ids, device=x.device)
                x[j].index_add_(0, index, torch.tensor(biases, dtype=x.dtype, device=x.device))
        apply_penalties(x, work_rows)
        greedy = [j for j, row in enumerate(work_rows) if row.params.greedy]
        if greedy:
            token_ids[[work[j] for j in greedy]] = argmax_rows(rows_of(x, greedy))
        rand = [j for j, row in enumerate(work_rows) if not row.params.greedy]
        if not rand:
            return _Prepared(token_ids, [], None)
        probs = truncated_probs(rows_of(x, rand), [work_rows[j].params for j in rand])
        return _Prepared(token_ids, [work[j] for j in rand], probs)

    def probs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The distribution each row samples from, ``[B, V]`` float32, rows summing to 1.

        Greedy rows get a one-hot at their (penalised, suppressed) argmax.
        """
        prepared = self._prepare(logits, rows)
        out = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        out.scatter_(1, prepared.token_ids.unsqueeze(1), 1.0)
        if prepared.random_probs is not None:
            out[prepared.random_rows] = prepared.random_probs
        return out

    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        argmax: torch.Tensor | None = None,
    ) -> list[SampleResult]:
        """One token per row of ``logits`` [B, V]; see the module docstring for the rules.
        ``argmax``: ``argmax_rows(logits)`` where the caller has it already (the LM head
        took it as it wrote the logits: ``kernels.taken_argmax``)."""
        prepared = self._prepare(logits, rows, argmax)
        token_ids = prepared.token_ids
        if prepared.random_probs is not None:
            chosen = race(prepared.random_probs, [rows[i] for i in prepared.random_rows])
            token_ids[prepared.random_rows] = chosen
        return self.with_logprobs(logits, rows, token_ids.tolist())

    def sample_from(self, probs: torch.Tensor, row: SamplingRow) -> int:
        """One token from the distribution ``probs`` [V] with ``row``'s keyed noise."""
        return int(race(probs.unsqueeze(0).clone(), [row])[0])

    def token_logprobs(
        self, logits: torch.Tensor, token_ids: Sequence[int], k: int
    ) -> list[TokenLogprob]:
        """Each row's logprob of ``token_ids[row]`` (the raw distribution) and the
        top ``k`` (prompt logprobs)."""
        if not len(token_ids):
            return []
        raw = torch.log_softmax(logits.to(torch.float32), dim=1)
        index = torch.tensor(list(token_ids), device=raw.device).unsqueeze(1)
        chosen = raw.gather(1, index).squeeze(1).tolist()
        top: list[tuple[tuple[int, float], ...]] = [()] * len(chosen)
        if k:
            values, ids = raw.topk(k, dim=1, sorted=True)
            top = [
                tuple(zip(i, v, strict=True))
                for i, v in zip(ids.tolist(), values.tolist(), strict=True)
            ]
        return [TokenLogprob(t, lp, tp) for t, lp, tp in zip(token_ids, chosen, top, strict=True)]

    def with_logprobs(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: Sequence[int]
    ) -> list[SampleResult]:
        """``token_ids`` (one per row of ``logits``) with their raw logprobs, for the
        rows that ask for logprobs or have n > 1 (for cumulative_logprob and best_of)."""
        ids = list(token_ids)
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        want = [i for i, row in enumerate(rows) if _wants_logprob(row.params)]
        if want:
            raw = torch.log_softmax(logits[want].to(torch.float32), dim=1)  # [L, V]
            index = torch.tensor([ids[i] for i in want], device=raw.device).unsqueeze(1)
            chosen = raw.gather(1, index).squeeze(1).tolist()
            n_top = max(rows[i].params.logprobs or 0 for i in want)
            top_vals, top_ids = raw.topk(n_top, dim=1, sorted=True)
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            for j, i in enumerate(want):
                n = rows[i].params.logprobs or 0
                top = tuple(zip(top_ids[j][:n], top_vals[j][:n], strict=True))
                logprobs[i] = TokenLogprob(ids[i], chosen[j], top)
        return [SampleResult(t, lp) for t, lp in zip(ids, logprobs, strict=True)]
