"""The OpenAI response objects of both endpoints: each choice, the envelope around the
choices (a whole response, or one streamed chunk), and their fields.

Completions and chat differ only in names: the ``object`` of a response and of a chunk,
and the key of a choice's output (completions: ``text``; chat: ``message``, or ``delta``
when streamed). A choice of a request that speculated carries ``speculative`` (its
counters); one of a ``parallel_tokens`` request carries ``parallel_tokens``, its sets in
order.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any

from tessera.workers.api import FinishReason, ParallelSet, RequestOutput, SpeculativeStats

if typing.TYPE_CHECKING:
    from tessera.cluster.front_end import Choice, Job

#: Per endpoint (``Job.kind``), whole and streamed: a response's ``object``...
_OBJECT = {
    "completion": ("text_completion", "text_completion"),
    "chat": ("chat.completion", "chat.completion.chunk"),
}
#: ...and the key of a choice's output.
_OUTPUT = {"completion": ("text", "text"), "chat": ("message", "delta")}


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


def choice_extras(choice: Choice, delta: RequestOutput | None = None) -> dict:
    """A choice's ``parallel_tokens`` and ``speculative`` fields, only where the
    request asked for them: a streamed ``delta``'s own sets, or (None) all of them."""
    out: dict = {}
    sets = choice.parallel_sets if delta is None else delta.parallel_sets
    if sets is not None:
        out["parallel_tokens"] = parallel_sets(sets)
    if choice.speculative is not None and (delta is None or delta.finished):
        out["speculative"] = speculative_stats(choice.speculative)
    return out


def choice_entry(
    kind: str,
    index: int,
    output: Any,
    logprobs: Any,
    finish: str | None,
    *,
    streamed: bool = False,
    extras: dict | None = None,
    prompt_logprobs: list | None = None,
) -> dict[str, Any]:
    """One entry of ``choices`` of endpoint ``kind``: ``index``, the output under its
    key, ``logprobs``, ``finish_reason``, then the ``extras`` (``choice_extras``).
    vLLM's ``prompt_logprobs`` (given: asked for) comes last in a whole choice, and
    before ``finish_reason`` in a streamed one (a choice's first chunk)."""
    entry = {"index": index, _OUTPUT[kind][streamed]: output, "logprobs": logprobs}
    if streamed and prompt_logprobs is not None:
        entry["prompt_logprobs"] = prompt_logprobs
    entry["finish_reason"] = finish
    if extras:
        entry |= extras
    if not streamed and prompt_logprobs is not None:
        entry["prompt_logprobs"] = prompt_logprobs
    return entry


def envelope(job: Job, choices: list[dict], streamed: bool = False, final: bool = False) -> dict:
    """The object around ``choices``: a whole response, or a streamed chunk. A whole
    response has ``usage``; streamed chunks have it only when the request asked
    (``stream_options.include_usage``): null, but in the ``final`` chunk, which has no
    choices and ends the stream."""
    out = {
        "id": job.request_id,
        "object": _OBJECT[job.kind][streamed],
        "created": job.created,
        "model": job.model,
        "choices": choices,
    }
    if not streamed:
        out["usage"] = usage(job.prompt_tokens, job.completion_tokens)
    elif job.include_usage:
        out["usage"] = usage(job.prompt_tokens, job.completion_tokens) if final else None
    return out
