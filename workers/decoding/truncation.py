"""Temperature, min-p, top-k and top-p on a step's logits rows, then the softmax: the
distribution a sampled row draws from.

Top-k and top-p keep the best tokens by logit, ties going to the lowest ids (the order a
stable sort and argmax use), so keeping one token is exactly greedy. Top-p works on the
top-k survivors, renormalised.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tessera.workers.api import SamplingParams

# Top-p looks for its cut among this many best tokens first, widening by the growth factor
# up to the whole vocabulary: on CPU a top-4096 of [64, 49152] costs a fifth of a full
# sort, and real next-token distributions reach top_p = 0.9 within a few hundred tokens.
_TOP_P_FIRST_CANDIDATES = 256
_TOP_P_CANDIDATE_GROWTH = 16


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """Per-row values as a float32 ``[R, 1]`` tensor on ``like``'s device, to broadcast."""
    return torch.tensor(values, dtype=torch.float32, device=like.device).unsqueeze(1)


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
        found = (mass_before < threshold[todo]).sum(dim=1, keepdim=True)[reached]
        found.clamp_(min=1)  # the best token: a top_p below float32's least (5e-324) is 0
        count[todo[reached]] = found
        kth[todo[reached]] = best[reached].gather(1, found - 1)
        todo = todo[~reached]
        n *= _TOP_P_CANDIDATE_GROWTH
    kept = probs.masked_fill(~_best_mask(x, kth, count), 0.0)
    return kept / kept.sum(dim=1, keepdim=True)


def rows_of(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x[rows]``, but ``x`` itself (no copy) when ``rows`` is every row in order."""
    return x if len(rows) == len(x) else x[rows]


def truncated_probs(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
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
        x[rows] = _top_k(rows_of(x, rows), [params[j].top_k for j in rows])
    # One softmax; top-p reuses it. (torch's exp and logsumexp slow down ~10x on -inf
    # inputs on CPU; its softmax kernel does not.)
    probs = x.softmax(dim=1)
    rows = [j for j, p in enumerate(params) if p.top_p < 1.0]
    if rows:  # after top-k, so its mass is that of the renormalised top-k survivors
        cut = [params[j].top_p for j in rows]
        probs[rows] = _top_p(rows_of(x, rows), rows_of(probs, rows), cut)
    return probs
