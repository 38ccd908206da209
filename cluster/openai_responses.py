"""The fields of OpenAI's response objects, from the engine's outputs: a choice's
``finish_reason``, ``parallel_tokens`` (its sets in order) and ``speculative`` (its
counters), and a response's ``usage``. The choices and envelopes they go into are built
in ``tessera.cluster.http_answers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tessera.workers.api import FinishReason, ParallelSet, RequestOutput, SpeculativeStats


def finish_reason(output: RequestOutput) -> str | None:
    if not output.finished or output.finish_reason is None:
        return None
    if output.finish_reason is FinishReason.ABORT:
        return "abort"
    return output.finish_reason.value


def parallel_sets(sets: Sequence[ParallelSet]) -> list[dict[str, Any]]:
    """A choice's ``parallel_tokens``: each set's position, token ids, token texts and
    probabilities."""
    return [
        {
            "position": s.position,
            "token_ids": list(s.token_ids),
            "tokens": list(s.tokens),
            "probs": list(s.probs),
        }
        for s in sets
    ]


def speculative_stats(stats: SpeculativeStats) -> dict[str, Any]:
    """A choice's ``speculative``: its draft tokens proposed and accepted, and steps."""
    return {
        "proposed": stats.proposed,
        "accepted": stats.accepted,
        "acceptance_rate": stats.acceptance_rate,
        "steps": stats.steps,
        "tokens": stats.tokens,
        "mean_tokens_per_step": stats.mean_tokens_per_step,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
