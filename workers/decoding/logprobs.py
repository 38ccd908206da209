"""Prompt logprobs: the logprob of each prompt token given the ones before it (and the
top ``k`` there), from the rows of the chunks that compute the prompt.

Such a prompt asks the forward for a row per position (``Sequence.wants_prompt_logprobs``)
and runs whole: its blocks hash under its own request id, so it never takes cached K/V
whose logits nobody computed (``engine.hashing``). Sampled-token logprobs come from the
sampler (``Sampler.sample``).
"""

from __future__ import annotations

import torch

from tessera.workers.decoding.sampling import Sampler
from tessera.workers.engine.model_runner import Chunk
from tessera.workers.engine.sequence import Sequence


def record_prompt_logprobs(
    sampler: Sampler, seq: Sequence, chunk: Chunk, rows: torch.Tensor
) -> torch.Tensor | None:
    """A step's hook for a sequence whose prompt logprobs are pending: record the
    logprobs of the prompt tokens this chunk's ``rows`` predict; return the row that
    samples the first output token (the chunk's last, once it ends the prompt), or None."""
    # entry i is token i's; recomputed after a preemption, the chunk overwrites
    del seq.prompt_logprobs[chunk.start + 1 :]
    samples = chunk.end == seq.num_tokens
    prompt_rows = rows[:-1] if samples else rows
    first = chunk.start + 1
    targets = seq.token_ids[first : first + len(prompt_rows)]
    k = seq.request.sampling.prompt_logprobs or 0
    seq.prompt_logprobs += sampler.token_logprobs(prompt_rows, targets, k)
    return rows[-1:] if samples else None
