"""Invalid requests are refused at the engine's entry, and never disturb the others."""

from __future__ import annotations

import pytest

from tessera.workers.api import InvalidRequestError, SamplingParams
from tessera.workers.config import EngineConfig
from tests.helpers import run_engine, tokens_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(smollm2):
    from tessera.workers.engine.engine import Engine

    return Engine(EngineConfig(num_kv_blocks=64, max_model_len=512), loaded=smollm2)


@pytest.mark.parametrize(
    ("prompt", "params", "field", "message"),
    [
        ("", SamplingParams(), "prompt", "must not be empty"),
        ([], SamplingParams(), "prompt", "must not be empty"),
        (
            [5, 49152],
            SamplingParams(),
            "prompt",
            "token id 49152 is out of the vocabulary [0, 49152)",
        ),
        ([5, -1], SamplingParams(), "prompt", "token id -1 is out of the vocabulary"),
        ([5, "x"], SamplingParams(), "prompt", "token ids must be integers, got 'x'"),
        (
            [5] * 500,
            SamplingParams(max_tokens=13),
            "max_tokens",
            "prompt (500 tokens) + max_tokens (13) = 513 exceeds the model's context length "
            "of 512 tokens",
        ),
        (
            "hello",
            SamplingParams(stop_token_ids=(60000,)),
            "stop_token_ids",
            "token id 60000 is out of the vocabulary",
        ),
    ],
)
def test_invalid_prompt(engine, prompt, params, field, message):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", prompt, params)
    assert info.value.field == field
    assert message in str(info.value)
    assert not engine.has_work()


def test_request_larger_than_the_pool(smollm2):
    from tessera.workers.engine.engine import Engine

    engine = Engine(EngineConfig(num_kv_blocks=4, block_size=16), loaded=smollm2)
    with pytest.raises(
        InvalidRequestError,
        match=r"max_tokens: prompt \+ max_tokens = 70 tokens "
        r"needs 5 KV blocks, but the KV pool has only 4",
    ):
        engine.add_request("big", [5] * 60, SamplingParams(max_tokens=10))


def test_duplicate_request_id(engine):
    engine.add_request("dup", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="request_id: 'dup' is already in use"):
        engine.add_request("dup", "hello", SamplingParams(max_tokens=2))
    run_engine(engine)
    engine.add_request("dup", "hello", SamplingParams(max_tokens=2))  # free again once done
    run_engine(engine)


def test_bad_requests_do_not_disturb_a_running_one(engine):
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.add_request("alone", "The capital of France is", greedy)
    alone = tokens_of(run_engine(engine)["alone"])
    engine.add_request("good", "The capital of France is", greedy)
    first = engine.step()
    for bad in ("", [10**9]):
        with pytest.raises(InvalidRequestError):
            engine.add_request("bad", bad, greedy)
    outputs = run_engine(engine)
    assert tokens_of(first + outputs["good"]) == alone
    assert set(outputs) == {"good"}


def test_invalid_engine_config():
    with pytest.raises(ValueError, match="block_size: must be a positive integer, got 0"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="dtype: must be one of"):
        EngineConfig(dtype="int3")
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=-1)
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        EngineConfig(kv_cache_memory_fraction=0)
    with pytest.raises(ValueError, match="device"):
        EngineConfig(device="tpu")


def test_kv_memory_larger_than_the_machine(smollm2):
    from tessera.workers.engine.engine import Engine

    with pytest.raises(ValueError, match="kv_cache_memory: .* bytes asked, only .* available"):
        Engine(EngineConfig(kv_cache_memory=2**50), loaded=smollm2)


def test_unknown_model_path():
    from tessera.workers.model.loader import load_model

    with pytest.raises(FileNotFoundError, match="model: path '/no/such/model' does not exist"):
        load_model("/no/such/model")
