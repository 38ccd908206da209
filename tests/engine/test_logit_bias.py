"""``logit_bias`` (OpenAI's): added to the logits before sampling, checked against
transformers' logits for the same prompt."""

from __future__ import annotations

import pytest
import torch

from tessera.workers.api import InvalidRequestError, SamplingParams
from tests.helpers import run_engine, tokens_of

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def test_a_bias_moves_greedy_to_the_runner_up_or_forces_a_token(make_engine, hf_reference):
    engine = make_engine()
    ids = engine.tokenizer(PROMPT).input_ids
    with torch.no_grad():
        logits = hf_reference.model(torch.tensor([ids])).logits[0, -1].float()
    best, runner_up = logits.topk(2).indices.tolist()
    forced = 1234
    cases = {
        "banned": ((best, -100.0),),  # the best is out: the runner-up wins
        "forced": ((forced, 100.0),),
    }
    for rid, bias in cases.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0, logit_bias=bias))
    out = run_engine(engine)
    assert tokens_of(out["banned"]) == [runner_up]
    assert tokens_of(out["forced"]) == [forced]


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        (((1, 101.0),), "biases in [-100, 100], got 1: 101.0"),
        (((-1, 1.0),), "token ids must be >= 0"),
        (tuple((i, 1.0) for i in range(301)), "at most 300 tokens, got 301"),
    ],
)
def test_bad_biases_are_refused_naming_the_field(bias, message):
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(logit_bias=bias)
    assert caught.value.field == "logit_bias"
    assert message in caught.value.message
