"""Parallel tokens (TEMPO): several tokens at one logical position, in one sequence.

A step of a ``parallel_tokens`` request appends a *set*: the token the sampler picks,
then every other token whose probability reaches the threshold, most likely first, up
to ``max_width``. All of them take the same RoPE position ``p``; their K/V go into the
sequence's own blocks at consecutive cache indices, as any tokens do, so nothing is
replicated or merged. The next step computes the set in one forward pass, each member
seeing the context and, by ``mode``, itself only (``isolated``) or every member
(``visible``); tokens from position ``p + 1`` on see all of them. The distribution after
the set is the mean of the members' next-token distributions.

Positions are explicit per token (``Sequence.positions``), independent of the cache
index: this is the mechanism speculative decoding also uses (``model_runner.Chunk``).
"""

from __future__ import annotations

import math

import torch

from tessera.workers.api import ParallelTokensParams
from tessera.workers.attention.paged import causal_mask


def parallel_mask(
    sets: list[tuple[int, int]], start: int, end: int, mode: str
) -> torch.Tensor | None:
    """Bool ``[end - start, end]`` attention mask of cache indices ``start..end-1``
    over ``0..end-1``, or None when no set of two or more tokens lies among them
    (plain causal). ``sets`` are (first index, width); a set is never split by a step."""
    inside = [(first, width) for first, width in sets if start <= first < end]
    if not inside:
        return None
    mask = causal_mask(end - start, end, torch.device("cpu"))
    for first, width in inside:
        rows = slice(first - start, first - start + width)
        if mode == "visible":
            mask[rows, first : first + width] = True
        else:
            mask[rows, first : first + width] = False
            index = torch.arange(width)
            mask[first - start + index, first + index] = True
    return mask


def mean_distribution_logits(logits: torch.Tensor) -> torch.Tensor:
    """``[w, V]`` logits of a set's members -> ``[V]`` logits of their mean
    distribution: log(mean_i softmax(logits_i))."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return torch.logsumexp(log_probs, dim=0) - math.log(logits.shape[0])


def choose_set(
    chosen: int,
    probs: torch.Tensor,
    params: ParallelTokensParams,
    excluded: tuple[int, ...],
    room: int,
) -> list[int]:
    """The set's token ids: ``chosen`` (the sampled token) first, then the tokens of
    ``probs`` [V] at or above the threshold, most likely first, skipping ``excluded``
    (end-of-sequence and stop ids), at most ``min(max_width, room)`` in all."""
    width = min(params.max_width, room)
    if width <= 1:
        return [chosen]
    top = probs.topk(min(probs.shape[0], width + len(excluded) + 1))
    members = [chosen]
    for p, token_id in zip(top.values.tolist(), top.indices.tolist(), strict=True):
        if p < params.threshold or len(members) == width:
            break
        if token_id != chosen and token_id not in excluded:
            members.append(token_id)
    return members
