"""Beam search inside the engine, step for step the algorithm of ``transformers``.

The engine runs a group's beams as ordinary sequences in the continuous batch; after
each step it hands this class the beams' next-token log-probabilities and gets back,
for each beam of the next step, which beam it continues and with which token. The
engine then re-points block tables (shared up to the divergence, copy-on-write after
it) instead of copying sequences.

The scoring follows ``transformers``' ``GenerationMixin._beam_search`` (v4.50+), with
the same float32 operations in the same order so ties break the same way:

- each step takes the top ``max(2, 1 + #eos) * width`` candidates over all beams by
  cumulative log-probability;
- candidates ending in an end token, or reaching ``max_tokens``, are finished; those
  among the top ``width`` become hypotheses scored ``logprob_sum / length **
  length_penalty`` (length counts generated tokens, the end token included), kept if
  they beat the worst of the best ``width`` so far;
- the best ``width`` unfinished candidates run on;
- ``early_stopping``: ``True`` stops once ``width`` hypotheses exist; ``False`` stops
  when the best running beam, scored at its current length, cannot beat the worst
  hypothesis; ``"never"`` scores it at ``max_tokens`` instead (when
  ``length_penalty > 0``), the canonical beam search.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NEG = -1.0e9  # transformers' "impossible" score


@dataclass(frozen=True, slots=True)
class BeamHypothesis:
    token_ids: tuple[int, ...]  # generated tokens, the end token included
    score: float  # cumulative logprob / len(token_ids) ** length_penalty
    cumulative_logprob: float


class BeamSearch:
    def __init__(
        self,
        width: int,
        length_penalty: float,
        early_stopping: bool | str,
        max_tokens: int,
        end_token_ids: tuple[int, ...],
    ) -> None:
        self.width = width
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.max_tokens = max_tokens
        self.end_token_ids = torch.tensor(end_token_ids, dtype=torch.long)
        self.num_candidates = max(2, 1 + len(end_token_ids)) * width
        self.running_scores = torch.full((1, width), _NEG)
        self.running_scores[0, 0] = 0.0
        self.finished_scores = torch.full((1, width), _NEG)
        self.finished_flags = torch.zeros((1, width), dtype=torch.bool)
        self.finished: list[BeamHypothesis | None] = [None] * width
        self.can_improve = torch.ones((1, 1), dtype=torch.bool)
        self.done = False

    def step(
        self, log_probs: torch.Tensor, outputs: list[tuple[int, ...]]
    ) -> list[tuple[int, int]]:
        """Advance one token. ``log_probs`` is ``[R, V]`` float32 for the ``R`` running
        beams (1 before the first step) and ``outputs`` their generated tokens so far.

        Returns ``(parent, token)`` for each beam of the next step, best first; sets
        ``done`` when the search is over (the engine then reads ``best``)."""
        width = self.width
        first = log_probs.shape[0] == 1
        if first:  # transformers starts with `width` copies of the prompt
            log_probs = log_probs.expand(width, -1)
            outputs = outputs * width
        vocab = log_probs.shape[1]
        generated = len(outputs[0])
        scores = (log_probs + self.running_scores[0, :, None]).reshape(1, -1)
        top_scores, top_index = torch.topk(scores, k=self.num_candidates)
        parents = top_index // vocab
        tokens = top_index % vocab
        hits = torch.isin(tokens, self.end_token_ids) | (generated + 1 >= self.max_tokens)

        running = top_scores + hits.to(torch.float32) * _NEG
        keep = torch.topk(running, k=width)[1]
        self.running_scores = torch.take_along_dim(running, keep, dim=1)

        self._update_finished(top_scores, parents, tokens, hits, outputs, generated)
        self._update_can_improve(generated + 1)
        all_finished = bool(self.finished_flags.all())
        self.done = not (
            bool(self.can_improve.any())
            and not (all_finished and self.early_stopping is True)
            and not bool(hits.all())
        )
        parent_list, token_list = parents[0].tolist(), tokens[0].tolist()
        return [(0 if first else parent_list[j], token_list[j]) for j in keep[0].tolist()]

    def _update_finished(self, top_scores, parents, tokens, hits, outputs, generated) -> None:
        width = self.width
        top_mask = torch.zeros_like(hits)
        top_mask[:, :width] = True
        just_finished = hits & top_mask
        candidate = top_scores / ((generated + 1) ** self.length_penalty)
        full = torch.all(self.finished_flags, dim=-1, keepdim=True) & (self.early_stopping is True)
        candidate += full.to(torch.float32) * _NEG
        candidate += (~self.can_improve).to(torch.float32) * _NEG
        candidate += (~just_finished) * _NEG
        merged = torch.cat((self.finished_scores, candidate), dim=1)
        merged_flags = torch.cat((self.finished_flags, just_finished), dim=1)
        best = torch.topk(merged, k=width)[1]
        self.finished_scores = torch.take_along_dim(merged, best, dim=1)
        self.finished_flags = torch.take_along_dim(merged_flags, best, dim=1)
        old = self.finished
        self.finished = []
        for m, score in zip(best[0].tolist(), self.finished_scores[0].tolist(), strict=True):
            if m < width:
                self.finished.append(old[m])
                continue
            c = m - width
            parent = int(parents[0, c])
            self.finished.append(
                BeamHypothesis(
                    outputs[parent] + (int(tokens[0, c]),), score, float(top_scores[0, c])
                )
            )

    def _update_can_improve(self, generated: int) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_tokens
        else:
            best_length = generated
        best_running = self.running_scores[:, :1] / (best_length**self.length_penalty)
        worst_finished = torch.where(
            self.finished_flags,
            torch.min(self.finished_scores, dim=1, keepdim=True)[0],
            _NEG,
        )
        self.can_improve = self.can_improve & torch.any(
            best_running > worst_finished, dim=-1, keepdim=True
        )

    def best(self, n: int) -> list[BeamHypothesis]:
        """The ``n`` best finished hypotheses, best first (fewer only if fewer than ``n``
        ever finished, which the max_tokens cut-off makes impossible)."""
        flags = self.finished_flags[0].tolist()
        return [h for h, done in zip(self.finished[:n], flags, strict=False) if done]
