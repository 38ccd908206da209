"""The per-step hook of a ``parallel_tokens`` request: the set a step appends
(``decoding.parallel_tokens`` holds the mechanism: which tokens, and their masks)."""

from __future__ import annotations

import dataclasses

import torch

from tessera.workers.api import ParallelSet
from tessera.workers.decoding.hooks import StepContext
from tessera.workers.decoding.parallel_tokens import choose_set
from tessera.workers.decoding.sampling import SampleResult
from tessera.workers.engine.sequence import Sequence, SequenceGroup


def append_set(
    post: StepContext,
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
