"""Resuming a request from the tokens another worker generated (the failover path).

The whole stream of a resumed request, spliced after what the first worker sent, must
equal the stream of a request that ran undisturbed: same tokens, same text, no text
sent twice, the same finish.
"""

from __future__ import annotations

import pytest

from tessera.workers.api import InvalidRequestError, Resume, SamplingParams
from tests.helpers import run_engine, text_of, tokens_of

PROMPT = "Once upon a time, a sailor"

CASES = {
    "greedy": SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=11),
    "penalties": SamplingParams(
        max_tokens=24,
        temperature=0.8,
        seed=3,
        ignore_eos=True,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
    ),
    "stop string": SamplingParams(max_tokens=40, temperature=0, stop=(" to the",)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("cut", [1, 7])
def test_resumed_stream_continues_the_undisturbed_one(make_engine, name, cut):
    params = CASES[name]
    engine = make_engine()
    engine.add_request("whole", PROMPT, params)
    whole = run_engine(engine)["whole"]
    tokens = tokens_of(whole)
    assert len(tokens) > cut, "the undisturbed run must outlast the cut"
    if params.stop:
        assert whole[-1].stop_reason == params.stop[0], "the stop string must end the run"

    # The first worker sent `cut` tokens, then died; a fresh engine goes on from there.
    sent = []
    for delta in whole:
        if len(tokens_of(sent)) + len(delta.token_ids) > cut:
            break
        sent.append(delta)
    done = tokens_of(sent)
    resumed_engine = make_engine()
    resumed_engine.add_request("again", PROMPT, params, resume=Resume(tuple(done)))
    rest = run_engine(resumed_engine)["again"]

    assert done + tokens_of(rest) == tokens
    assert text_of(sent) + text_of(rest) == text_of(whole)
    assert rest[-1].finish_reason == whole[-1].finish_reason
    assert rest[-1].completion_tokens == whole[-1].completion_tokens
    if params.seed is not None:
        assert rest[-1].seed == whole[-1].seed


def test_resume_is_validated(make_engine):
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match="resume: only a request with one output"):
        engine.add_request("a", "Hi", SamplingParams(n=2, seed=1), resume=Resume((5,)))
    with pytest.raises(InvalidRequestError, match=r"resume: 3 generated tokens leave nothing"):
        engine.add_request("b", "Hi", SamplingParams(max_tokens=3), resume=Resume((5, 6, 7)))
    with pytest.raises(InvalidRequestError, match="resume: token id 99999 is out of the voc"):
        engine.add_request("c", "Hi", SamplingParams(max_tokens=3), resume=Resume((99999,)))
    with pytest.raises(InvalidRequestError, match="resume: must hold at least one"):
        Resume(())
    assert not engine.has_work()
