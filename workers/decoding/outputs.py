"""Build the ``RequestOutput`` deltas the engine returns."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from tessera.workers.api import EngineTimes, FinishReason, Request, RequestOutput
from tessera.workers.decoding.beam import BeamHypothesis
from tessera.workers.engine.sequence import Sequence


def sequence_output(seq: Sequence, index: int | None = None) -> RequestOutput:
    """What ``seq`` produced since its last delta (and clear it); ``index`` overrides
    the output index (``best_of`` ranks children)."""
    params = seq.request.sampling
    # positional, in RequestOutput's field order: 0.2 us a delta (one per sequence and
    # step) against 0.5 with keywords
    output = RequestOutput(
        seq.request.request_id,  # request_id
        seq.pending_text,  # text
        tuple(seq.pending_token_ids),  # token_ids
        tuple(seq.pending_logprobs) if params.logprobs is not None else None,  # logprobs
        seq.finished,  # finished
        seq.finish_reason,  # finish_reason
        seq.num_prompt_tokens,  # prompt_tokens
        seq.num_output_tokens,  # completion_tokens
        seq.stop_reason,  # stop_reason
        seq.index if index is None else index,  # index
        seq.cumulative_logprob if params.num_samples > 1 else None,  # cumulative_logprob
        None,  # score (beam search's)
        seq.seed,  # seed
        tuple(seq.pending_sets) if params.parallel_tokens is not None else None,  # sets
        seq.spec.stats() if seq.spec is not None else None,  # speculative
        None if seq.prompt_logprobs is None else _take_prompt_logprobs(seq),  # prompt_logprobs
        None if seq.clock is None else seq.clock.times(seq),  # times (traced requests)
    )
    seq.pending_text = ""
    seq.pending_token_ids = []
    if seq.pending_logprobs:  # (each step would build two lists nothing fills, else)
        seq.pending_logprobs = []
    if seq.pending_sets:
        seq.pending_sets = []
    return output


def _take_prompt_logprobs(seq: Sequence) -> tuple | None:
    """The prompt's logprobs once all are computed (sent once: the first delta)."""
    done = seq.prompt_logprobs
    if done is None or len(done) < seq.num_prompt_tokens:
        return None
    seq.prompt_logprobs = None
    return tuple(done)


def beam_outputs(
    request: Request,
    beams: Seq[BeamHypothesis],
    end_token_ids: tuple[int, ...],
    tokenizer,
    times: EngineTimes | None = None,
) -> list[RequestOutput]:
    """The best beams, whole, best first (``times``: a traced request's phases)."""
    params = request.sampling
    outputs = []
    for index, beam in enumerate(beams):
        ended = bool(beam.token_ids) and beam.token_ids[-1] in end_token_ids
        text = tokenizer.decode(
            list(beam.token_ids), skip_special_tokens=params.skip_special_tokens
        )
        outputs.append(
            RequestOutput(
                request_id=request.request_id,
                text=text,
                token_ids=beam.token_ids,
                finished=True,
                finish_reason=FinishReason.STOP if ended else FinishReason.LENGTH,
                prompt_tokens=len(request.prompt_token_ids),
                completion_tokens=len(beam.token_ids),
                stop_reason=beam.token_ids[-1] if ended else None,
                index=index,
                cumulative_logprob=beam.cumulative_logprob,
                score=beam.score,
                times=times,
            )
        )
    return outputs


def aborted_outputs(request: Request, indices: Seq[int] | None = None) -> list[RequestOutput]:
    """An empty final delta (``finish_reason`` abort) for each of ``indices``, by
    default every output of the request."""
    return [
        RequestOutput(
            request_id=request.request_id,
            text="",
            token_ids=(),
            finished=True,
            finish_reason=FinishReason.ABORT,
            prompt_tokens=len(request.prompt_token_ids),
            index=index,
        )
        for index in (range(request.sampling.n) if indices is None else indices)
    ]
