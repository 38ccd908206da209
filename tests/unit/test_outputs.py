"""``sequence_output`` against ``RequestOutput``'s constructor with keywords: it passes
the fields by position, so every value must land in the field it is meant for."""

from __future__ import annotations

import dataclasses

import pytest

from tessera.workers.api import (
    FinishReason,
    ParallelSet,
    ParallelTokensParams,
    Request,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from tessera.workers.decoding.outputs import sequence_output
from tessera.workers.engine.sequence import Sequence


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, logprobs=1, parallel_tokens=ParallelTokensParams(0.2, 2)),
        SamplingParams(n=2, temperature=0.7, logprobs=1),
    ],
    ids=["parallel-tokens", "n=2"],
)
def test_every_field_lands_where_the_constructor_puts_it(params):
    request = Request("req-1", (5, 6, 7), params)
    seq = Sequence(
        request, seed=99, token_ids=[5, 6, 7, 8, 9], detokenizer=None, stop_matcher=None, index=1
    )
    seq.finish_reason, seq.stop_reason = FinishReason.STOP, 9
    seq.cumulative_logprob = -1.5
    seq.pending_text, seq.pending_token_ids = "ab", [8, 9]
    seq.pending_logprobs = [TokenLogprob(8, -0.5, ()), TokenLogprob(9, -1.0, ())]
    seq.pending_sets = [ParallelSet(3, (8,), ("a",), (0.9,))]
    seq.prompt_logprobs = [None, TokenLogprob(6, -2.0, ()), TokenLogprob(7, -3.0, ())]
    expected = RequestOutput(
        request_id="req-1",
        text="ab",
        token_ids=(8, 9),
        logprobs=tuple(seq.pending_logprobs),
        finished=True,
        finish_reason=FinishReason.STOP,
        prompt_tokens=3,
        completion_tokens=2,
        stop_reason=9,
        index=1,
        cumulative_logprob=-1.5 if params.n == 2 else None,
        seed=99,
        parallel_sets=tuple(seq.pending_sets) if params.parallel_tokens else None,
        prompt_logprobs=tuple(seq.prompt_logprobs),
    )
    output = sequence_output(seq)
    for field in dataclasses.fields(RequestOutput):
        assert getattr(output, field.name) == getattr(expected, field.name), field.name
    assert output == expected
    # the delta is taken: the next one starts empty, prompt logprobs are sent once
    assert (seq.pending_text, seq.pending_token_ids, seq.prompt_logprobs) == ("", [], None)
    assert sequence_output(seq, index=0) == dataclasses.replace(
        expected,
        text="",
        token_ids=(),
        logprobs=(),
        parallel_sets=() if params.parallel_tokens else None,
        prompt_logprobs=None,
        index=0,
    )
