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
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tessera.workers.api import SamplingParams, TokenLogprob
from tessera.workers.quant.kernels import argmax_rows

_MASK64 = (1 << 64) - 1
# splitmix64 constants (Steele, Lea and Flood, "Fast splittable pseudorandom number
# generators", 2014): a bijective 64-bit mix whose outputs pass BigCrush.
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX_MUL_1 = 0xBF58476D1CE4E5B9
_MIX_MUL_2 = 0x94D049BB133111EB
# Top-p looks for its cut among this many best tokens first, widening by the growth factor
# up to the whole vocabulary: on CPU a top-4096 of [64, 49152] costs a fifth of a full
# sort, and real next-token distributions reach top_p = 0.9 within a few hundred tokens.
_TOP_P_FIRST_CANDIDATES = 256
_TOP_P_CANDIDATE_GROWTH = 16


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN_GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX_MUL_1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX_MUL_2) & _MASK64
    return x ^ (x >> 31)


def random_generator(
    seed: int, token_index: int, *, device: torch.device | str = "cpu"
) -> torch.Generator:
    """A generator keyed by (seed, token_index) only, on ``device``.

    Each mixing step is a bijection, so for one seed distinct token indices get
    distinct 64-bit keys. torch's CPU generator (mt19937) keeps only the low 32 bits of
    its seed, so on CPU two keys collide with probability 2**-32 (they would share noise).
    """
    key = _splitmix64(_splitmix64(seed) ^ token_index)
    generator = torch.Generator(device=device)
    generator.manual_seed(key)
    return generator


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


class SampleResult(NamedTuple):  # a tuple: a step builds one per row (a third of the time)
    token_id: int
    logprob: TokenLogprob | None  # set when the row asks for logprobs or has n > 1


def _penalties(params: SamplingParams) -> tuple[float, float, float]:
    return (params.repetition_penalty, params.presence_penalty, params.frequency_penalty)


def _has_penalties(params: SamplingParams) -> bool:
    # neutral values: repetition 1, presence and frequency 0 (checked per row and step)
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def _greedy_unchanged(params: SamplingParams) -> bool:
    """Greedy on the logits as they are: no logit bias or penalties (suppression aside)."""
    return params.greedy and not params.logit_bias and not _has_penalties(params)


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


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """Per-row values as a float32 ``[R, 1]`` tensor on ``like``'s device, to broadcast."""
    return torch.tensor(values, dtype=torch.float32, device=like.device).unsqueeze(1)


def _flat_ids(
    rows: Sequence[int], seqs: Sequence[Sequence[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """Flat indices into a ``[*, vocab]`` tensor of each (rows[j], token id in seqs[j]).

    One tensor build per sequence rather than a Python step per token.
    """
    lists = [list(seq) for seq in seqs]  # each read once (a TokenSpan reads its list)
    ids = torch.cat([torch.as_tensor(ids, dtype=torch.long) for ids in lists])
    starts = torch.tensor(rows, dtype=torch.long) * vocab
    offsets = torch.repeat_interleave(starts, torch.tensor([len(ids) for ids in lists]))
    return (offsets + ids).to(device)


def _apply_penalties(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Penalties, then suppression, in place on contiguous float32 ``x`` [len(rows), V].

    Only the entries of tokens a sequence holds are touched, so the cost grows with
    sequence length, not with batch size times vocabulary.
    """
    device, vocab, flat = x.device, x.shape[1], x.view(-1)
    pen = [j for j, row in enumerate(rows) if _has_penalties(row.params)]
    if pen:
        outputs = _flat_ids(pen, [rows[j].output_token_ids for j in pen], vocab, device)
        prompts = _flat_ids(pen, [rows[j].prompt_token_ids for j in pen], vocab, device)
        table = [_penalties(row.params) for row in rows]
        per_row = torch.tensor(table, dtype=torch.float32, device=device)  # [W, 3]
        rep, presence, frequency = per_row.unbind(dim=1)
        seen = torch.unique(torch.cat([prompts, outputs]))  # repetition: prompt + output
        values, penalty = flat[seen], rep[seen // vocab]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
        generated, counts = torch.unique(outputs, return_counts=True)  # OpenAI: output only
        row = generated // vocab
        flat[generated] -= frequency[row] * counts + presence[row]
    suppressed = [row.suppressed_token_ids for row in rows]
    if any(suppressed):
        flat[_flat_ids(range(len(rows)), suppressed, vocab, device)] = -math.inf


def _best_mask(x: torch.Tensor, kth: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Bool [T, V]: the ``count`` [T, 1] best logits of each row of ``x`` [T, V].

    ``kth`` [T, 1] is the count-th best value. Ties at it go to the lowest ids, the order
    a stable sort and argmax use, so keeping one token is exactly greedy.
    """
    above = x > kth
    tied = x == kth
    room = count - above.sum(dim=1, keepdim=True)
    return above | (tied & (tied.cumsum(dim=1) <= room))


def _top_k(x: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    count = _column(top_k, x).long()  # [T, 1]
    best = x.topk(max(top_k), dim=1).values  # [T, max k], descending
    return x.masked_fill(~_best_mask(x, best.gather(1, count - 1), count), -math.inf)


def _top_p(x: torch.Tensor, probs: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """``probs`` [T, V] cut to the fewest best tokens whose mass reaches top_p, renormalised.

    The best token always survives. Rather than sort the vocabulary, look for the cut
    among a few best tokens and widen the search only for rows whose candidates hold less
    than top_p of the mass. Ranks come from the logits ``x`` so that ties break as above.
    """
    vocab = x.shape[1]
    threshold = _column(top_p, x)  # [T, 1]
    kth = torch.empty_like(threshold)
    count = torch.empty_like(threshold, dtype=torch.long)
    todo = torch.arange(len(x), device=x.device)  # rows whose cut is not found yet
    n = _TOP_P_FIRST_CANDIDATES
    while len(todo):
        n = min(n, vocab)
        best, ids = x[todo].topk(n, dim=1)  # [t, n], descending
        p = probs[todo].gather(1, ids)  # tied logits have equal p: their order is moot
        mass_before = p.cumsum(dim=1) - p  # of strictly better-ranked tokens
        reached = (mass_before[:, -1] + p[:, -1] >= threshold[todo, 0]) | (n == vocab)
        found = (mass_before < threshold[todo]).sum(dim=1, keepdim=True)[reached]  # >= 1
        count[todo[reached]] = found
        kth[todo[reached]] = best[reached].gather(1, found - 1)
        todo = todo[~reached]
        n *= _TOP_P_CANDIDATE_GROWTH
    kept = probs.masked_fill(~_best_mask(x, kth, count), 0.0)
    return kept / kept.sum(dim=1, keepdim=True)


def _rows_of(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x[rows]``, but ``x`` itself (no copy) when ``rows`` is every row in order."""
    return x if len(rows) == len(x) else x[rows]


def _truncated_probs(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p on float32 logits ``x`` [R, V]; returns probs.

    Consumes ``x``: it is the sampler's own copy and is divided in place.
    """
    vocab = x.shape[1]
    if any(p.temperature != 1.0 for p in params):
        x.div_(_column([p.temperature for p in params], x))
    if any(p.min_p > 0.0 for p in params):
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p): no softmax needed, and
        # log(0) = -inf turns min-p off for rows that did not ask for it.
        log_min_p = torch.log(_column([p.min_p for p in params], x))
        x.masked_fill_(x < x.amax(dim=1, keepdim=True) + log_min_p, -math.inf)
    rows = [j for j, p in enumerate(params) if 0 < p.top_k < vocab]
    if rows:
        x[rows] = _top_k(_rows_of(x, rows), [params[j].top_k for j in rows])
    # One softmax; top-p reuses it. (torch's exp and logsumexp slow down ~10x on -inf
    # inputs on CPU; its softmax kernel does not.)
    probs = x.softmax(dim=1)
    rows = [j for j, p in enumerate(params) if p.top_p < 1.0]
    if rows:  # after top-k, so its mass is that of the renormalised top-k survivors
        cut = [params[j].top_p for j in rows]
        probs[rows] = _top_p(_rows_of(x, rows), _rows_of(probs, rows), cut)
    return probs


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
        _apply_penalties(x, work_rows)
        greedy = [j for j, row in enumerate(work_rows) if row.params.greedy]
        if greedy:
            token_ids[[work[j] for j in greedy]] = argmax_rows(_rows_of(x, greedy))
        rand = [j for j, row in enumerate(work_rows) if not row.params.greedy]
        if not rand:
            return _Prepared(token_ids, [], None)
        probs = _truncated_probs(_rows_of(x, rand), [work_rows[j].params for j in rand])
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
            chosen = _race(prepared.random_probs, [rows[i] for i in prepared.random_rows])
            token_ids[prepared.random_rows] = chosen
        return self.with_logprobs(logits, rows, token_ids.tolist())

    def sample_from(self, probs: torch.Tensor, row: SamplingRow) -> int:
        """One token from the distribution ``probs`` [V] with ``row``'s keyed noise."""
        return int(_race(probs.unsqueeze(0).clone(), [row])[0])

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


def _race(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The exponential race over ``probs`` [R, V] (consumed), one keyed stream per row:
    ``argmax p / E`` with ``E ~ Exp(1)``; returns [R] token ids."""
    noise = torch.empty_like(probs)
    for j, row in enumerate(rows):
        gen = random_generator(row.seed, row.token_index, device=probs.device)
        noise[j].uniform_(generator=gen)
    # E = -log(U) with U in [0, 1) is Exp(1) and never 0, so p / E is never 0/0
    # (a NaN argmax would pick); torch's own exponential_ is 4x slower on CPU.
    noise.log_().neg_()
    return argmax_rows(probs.div_(noise))


def keyed_uniform(seed: int, token_index: int) -> float:
    """One uniform draw in [0, 1) keyed by (seed, token_index), like the sampler's noise."""
    gen = random_generator(seed, token_index)
    return float(torch.rand((), generator=gen))
