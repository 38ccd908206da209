"""Every SamplingParams check names its field, its limit and the value given."""

from __future__ import annotations

import math

import pytest

from tessera.workers.api import InvalidRequestError, Request, SamplingParams

CASES = [
    ({"temperature": -0.5}, "temperature", "must be between 0 and 100, got -0.5"),
    ({"temperature": math.nan}, "temperature", "must not be NaN"),
    ({"temperature": math.inf}, "temperature", "must be between 0 and 100, got inf"),
    ({"temperature": "hot"}, "temperature", "must be a number, got 'hot'"),
    ({"top_p": 0.0}, "top_p", "must be in (0, 1], got 0.0"),
    ({"top_p": 1.5}, "top_p", "must be in (0, 1], got 1.5"),
    ({"top_p": math.nan}, "top_p", "must not be NaN"),
    ({"top_k": -2}, "top_k", "got -2"),
    ({"top_k": 1.5}, "top_k", "must be an integer, got 1.5"),
    ({"min_p": 1.5}, "min_p", "must be in [0, 1], got 1.5"),
    ({"max_tokens": 0}, "max_tokens", "must be >= 1, got 0"),
    ({"max_tokens": True}, "max_tokens", "must be an integer, got True"),
    (
        {"min_tokens": 20, "max_tokens": 10},
        "min_tokens",
        "must be between 0 and max_tokens (10), got 20",
    ),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "must be in (0, 10], got 0.0"),
    ({"presence_penalty": 2.5}, "presence_penalty", "must be in [-2, 2], got 2.5"),
    ({"frequency_penalty": -3}, "frequency_penalty", "must be in [-2, 2], got -3"),
    ({"seed": -1}, "seed", "must be in [0, 2**63), got -1"),
    ({"stop": "abc"}, "stop", "must be a tuple of strings"),
    ({"stop": ("",)}, "stop", "must not be empty"),
    ({"stop_token_ids": (-5,)}, "stop_token_ids", "must be >= 0, got -5"),
    ({"logprobs": 21}, "logprobs", "must be in [0, 20], got 21"),
]


@pytest.mark.parametrize(("kwargs", "field", "message"), CASES)
def test_invalid_sampling_params(kwargs, field, message):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert message in str(info.value)
    assert str(info.value).startswith(f"{field}: ")


def test_valid_defaults_and_greedy():
    assert not SamplingParams().greedy
    assert SamplingParams(temperature=0).greedy
    SamplingParams(top_k=0, top_p=1.0, min_p=0.0, logprobs=0, seed=2**63 - 1)


def test_request_checks():
    with pytest.raises(InvalidRequestError, match="prompt: must not be empty"):
        Request("r", ())
    with pytest.raises(InvalidRequestError, match="request_id: must be a non-empty string"):
        Request("", (1,))
