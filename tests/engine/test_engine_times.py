"""A traced request's phase times (``Request.traced`` -> ``RequestOutput.times``): the
engine stamps when it queued, first scheduled and first sampled for the request, and
only its finished deltas carry them; an untraced request's deltas carry none."""

from __future__ import annotations

import time

import pytest

from tessera.workers.api import FinishReason, Request, SamplingParams
from tests.helpers import run_engine

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _request(engine, request_id: str, sampling=GREEDY, traced=True) -> Request:
    ids = tuple(engine.tokenizer("The weather today is").input_ids)
    return Request(request_id, ids, sampling, traced=traced)


def test_finished_delta_carries_the_phases_in_order(make_engine):
    engine = make_engine()
    before = time.time_ns()
    engine.submit(_request(engine, "t"))
    engine.submit(_request(engine, "u", traced=False))
    outputs = run_engine(engine)
    after = time.time_ns()
    *running, last = outputs["t"]
    assert last.finished and all(delta.times is None for delta in running)
    times = last.times
    assert before <= times.arrived_ns <= times.scheduled_ns <= times.first_token_ns
    assert times.first_token_ns <= times.finished_ns <= after
    assert all(delta.times is None for delta in outputs["u"])


def test_a_queued_request_is_scheduled_after_the_one_before_it_finished(make_engine):
    engine = make_engine(max_num_seqs=1)
    engine.submit(_request(engine, "first"))
    engine.submit(_request(engine, "second"))
    outputs = run_engine(engine)
    first, second = outputs["first"][-1].times, outputs["second"][-1].times
    assert second.arrived_ns < first.finished_ns <= second.scheduled_ns


def test_forks_share_the_request_phases_and_end_on_their_own(make_engine):
    engine = make_engine()
    sampling = SamplingParams(max_tokens=5, temperature=1.0, n=2, seed=7, ignore_eos=True)
    engine.submit(_request(engine, "n", sampling))
    finished = [delta for delta in run_engine(engine)["n"] if delta.finished]
    assert sorted(delta.index for delta in finished) == [0, 1]
    a, b = (delta.times for delta in finished)
    assert (a.arrived_ns, a.scheduled_ns, a.first_token_ns) == (
        b.arrived_ns,
        b.scheduled_ns,
        b.first_token_ns,
    )
    assert a.first_token_ns <= min(a.finished_ns, b.finished_ns)


def test_an_abort_before_scheduling_has_no_phase_times(make_engine):
    engine = make_engine()
    engine.submit(_request(engine, "a"))
    engine.abort("a")
    (last,) = run_engine(engine)["a"]
    assert last.finish_reason is FinishReason.ABORT
    times = last.times  # queued, never scheduled
    assert times.scheduled_ns is None and times.first_token_ns is None
    assert times.arrived_ns <= times.finished_ns


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_tokens=5, temperature=0, beam_width=2, n=2),
        SamplingParams(max_tokens=5, temperature=1.0, best_of=3, n=2, seed=5, ignore_eos=True),
    ],
    ids=["beam_search", "best_of"],
)
def test_whole_outputs_carry_the_phases_too(make_engine, sampling):
    engine = make_engine()
    engine.submit(_request(engine, "w", sampling))
    outputs = run_engine(engine)["w"]
    assert len(outputs) == 2 and all(delta.finished for delta in outputs)
    for delta in outputs:
        times = delta.times
        assert times.arrived_ns <= times.scheduled_ns <= times.first_token_ns
        assert times.first_token_ns < times.finished_ns  # decoding took the steps after it
