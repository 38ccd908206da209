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

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from tessera.workers.api import ParallelSet, ParallelTokensParams
from tessera.workers.attention.paged import causal_mask

if TYPE_CHECKING:
    from tessera.workers.decoding.sampling import SampleResult
    from tessera.workers.engine.postprocess import Postprocessor
    from tessera.workers.engine.sequence import Sequence, SequenceGroup


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


def append_set(
    post: Postprocessor,
    group: SequenceGroup,
    seq: Sequence,
    result: SampleResult,
    logits: torch.Tensor,
) -> None:
    """A step's hook for a ``parallel_tokens`` sequence: append the sampled token and
    every other one at or above the threshold, all at the next logical position."""
    params = seq.request.sampling
    row = post.rows(seq)
    if params.greedy:  # the set is chosen by probability: softmax at temperature 1
        row = dataclasses.replace(row, params=dataclasses.replace(params, temperature=1.0))
    probs = post.sampler.probs(logits[None], [row])[0]
    room = min(params.max_tokens - seq.num_output_tokens, post.max_model_len - seq.num_tokens)
    members = choose_set(
        result.token_id, probs, params.parallel_tokens, post.rows.end_token_ids(params), room
    )
    position = (seq.positions[-1] if seq.positions else seq.num_tokens - 1) + 1
    if len(members) > 1:
        if seq.positions is None:
            seq.positions = list(range(seq.num_tokens))
        seq.parallel_sets.append((seq.num_tokens, len(members)))
    seq.pending_sets.append(
        ParallelSet(
            position=position,
            token_ids=tuple(members),
            tokens=tuple(post.tokenizer.decode([t]) for t in members),
            probs=tuple(probs[members].tolist()),
        )
    )
    rows = [post.rows(seq)] * len(members)
    logprobs = post.sampler.with_logprobs(logits.expand(len(members), -1), rows, members)
    for token_id, member in zip(members, logprobs, strict=True):
        if seq.positions is not None:
            seq.positions.append(position)
        post.append_token(group, seq, token_id, member.logprob)
        if seq.finished:
            break
