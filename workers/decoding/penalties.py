"""Penalties and suppression on a step's logits rows, in place: the repetition penalty
(Hugging Face: over prompt + output tokens), then frequency and presence penalties
(OpenAI: over output tokens only), then suppression (-inf).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tessera.workers.api import SamplingParams
from tessera.workers.decoding.sampling_row import SamplingRow


def _penalties(params: SamplingParams) -> tuple[float, float, float]:
    return (params.repetition_penalty, params.presence_penalty, params.frequency_penalty)


def has_penalties(params: SamplingParams) -> bool:
    # neutral values: repetition 1, presence and frequency 0 (checked per row and step)
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


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


def apply_penalties(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Penalties, then suppression, in place on contiguous float32 ``x`` [len(rows), V].

    Only the entries of tokens a sequence holds are touched, so the cost grows with
    sequence length, not with batch size times vocabulary.
    """
    device, vocab, flat = x.device, x.shape[1], x.view(-1)
    pen = [j for j, row in enumerate(rows) if has_penalties(row.params)]
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
